"""Named Qwen3.5 shapes and a random-init model builder.

No weights can be downloaded in tests or benchmarks, so every model here is random-init from a config:
tiny shapes for CPU tests (both layer types, a few layers) and the exact shapes of released checkpoints for
GPU benchmarks. Weights are never zero: HF initialises RMSNorm weights (the `1 + w` form) and some gates to
zeros, which would hide bugs in those paths, so `build` perturbs them.
"""

import torch
from transformers import (
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)

_ROPE = {
    "rope_type": "default",
    "rope_theta": 10_000_000.0,
    "partial_rotary_factor": 0.25,
    "mrope_section": [11, 11, 10],
    "mrope_interleaved": True,
}

_TINY = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    max_position_embeddings=4096,
    initializer_range=0.2,  # peaked logits: greedy comparisons do not sit on ties
)

_PRESETS = {
    "tiny": (Qwen3_5TextConfig, dict(_TINY, intermediate_size=128)),
    "tiny-moe": (
        Qwen3_5MoeTextConfig,
        dict(_TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=32),  # equal, as in Qwen3.5-35B-A3B (512 and 512)
    ),
    # Qwen/Qwen3.5-9B text model: the transformers defaults are its shape.
    "qwen3.5-9b": (Qwen3_5TextConfig, dict()),
    "qwen3.5-27b": (
        Qwen3_5TextConfig,
        dict(hidden_size=5120, num_hidden_layers=64, intermediate_size=17408, num_attention_heads=24,
             num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
             linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320),
    ),
    # Qwen/Qwen3.5-35B-A3B text model: the transformers defaults are its shape.
    "qwen3.5-35b-a3b": (Qwen3_5MoeTextConfig, dict()),
}

NAMES = tuple(_PRESETS)


def config(name: str):
    """The HF text config of preset `name` (see NAMES)."""
    if name not in _PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(NAMES)}")
    cls, kw = _PRESETS[name]
    return cls(rope_parameters=dict(_ROPE), tie_word_embeddings=False, **kw)


@torch.no_grad()
def build(name: str, *, dtype=torch.bfloat16, device="cpu", seed: int = 0, layers: int | None = None, **overrides):
    """A random-init `Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM` of preset `name`, in eval mode. layers: keep
    only the first `layers` decoder layers (the same shapes and layer pattern in a shorter stack: a profile's
    per-layer costs in a fraction of the compile time); overrides: config fields set over the preset's (e.g.
    moe_intermediate_size=128)."""
    cfg = config(name)
    for key, value in overrides.items():
        if not hasattr(cfg, key):
            raise ValueError(f"{type(cfg).__name__} has no field {key!r}")
        setattr(cfg, key, value)
    if layers is not None:
        if not 1 <= layers <= cfg.num_hidden_layers:
            raise ValueError(f"layers must be in 1 … {cfg.num_hidden_layers} for {name!r}; got {layers}")
        cfg.num_hidden_layers, cfg.layer_types = layers, cfg.layer_types[:layers]
    cls = Qwen3_5MoeForCausalLM if isinstance(cfg, Qwen3_5MoeTextConfig) else Qwen3_5ForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls._from_config(cfg, dtype=dtype)
    perturb_zero_init(model, std=0.1 if cfg.hidden_size <= 256 else 0.02)
    return model.eval()


@torch.no_grad()
def perturb_zero_init(model, std: float) -> None:
    """Give every all-zero parameter (RMSNorm `1 + w` weights, routers) random values of scale `std`."""
    for p in model.parameters():
        if not p.is_floating_point():
            continue
        if not p.detach().abs().amax().item():
            p.normal_(0.0, std)


@torch.no_grad()
def random_mtp_tensors(model, *, seed: int = 1, std: float = 0.2, per_expert: bool = True) -> dict:
    """Random `mtp.*` tensors for `model`'s shape, named and laid out as Qwen3.5 checkpoints store them
    (MoE experts per expert unless per_expert=False), on the model's device and dtype."""
    from .model import text_model

    text = text_model(model)
    cfg = text.config
    H = cfg.hidden_size
    idx = cfg.layer_types.index("full_attention")
    weight = model.get_input_embeddings().weight
    torch.manual_seed(seed)
    with torch.device(weight.device):
        layer = type(text.layers[idx])(cfg, idx).to(weight.dtype)
        out = {"mtp.fc.weight": torch.randn(H, 2 * H, dtype=weight.dtype) * std / 2}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            out[f"mtp.{name}.weight"] = torch.randn(H, dtype=weight.dtype) * std / 2
    for name, p in layer.state_dict().items():
        value = torch.randn_like(p) * std
        if per_expert and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            for e, w in enumerate(value):
                if name.endswith("gate_up_proj"):
                    gate, up = w.chunk(2)
                    out[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = gate.contiguous()
                    out[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = up.contiguous()
                else:
                    out[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = w.contiguous()
        else:
            out[f"mtp.layers.0.{name}"] = value
    return out


# DFlash draft shapes per target preset: the real z-lab ones (config.json of z-lab/Qwen3.5-{9B,27B}-DFlash:
# 5 layers, 32/8 heads of 128) for benchmarks with random weights, and small ones for the tiny targets.
_REAL_DRAFT = dict(layers=5, heads=(32, 8, 128), vocab_size=248320, mask_token_id=248070)
_TINY_DRAFT = dict(layers=2, heads=(4, 2, 16), vocab_size=512, mask_token_id=511, hidden_size=64,
                   intermediate_size=96, target_layer_ids=[0, 3])
DFLASH_DRAFTS = {
    "tiny": _TINY_DRAFT,
    "tiny-moe": _TINY_DRAFT,
    "qwen3.5-9b": dict(_REAL_DRAFT, hidden_size=4096, intermediate_size=12288, target_layer_ids=[1, 8, 15, 22, 29]),
    "qwen3.5-27b": dict(_REAL_DRAFT, hidden_size=5120, intermediate_size=17408,
                        target_layer_ids=[1, 16, 31, 46, 61]),
}


def dflash_config(name: str) -> dict:
    """config.json contents of a DFlash draft for target preset `name` (the real z-lab shape where one exists)."""
    if name not in DFLASH_DRAFTS:
        raise ValueError(f"no DFlash draft shape for {name!r}; known: {', '.join(DFLASH_DRAFTS)}")
    d = DFLASH_DRAFTS[name]
    heads, kv_heads, head_dim = d["heads"]
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": d["hidden_size"],
            "num_hidden_layers": d["layers"], "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": head_dim, "intermediate_size": d["intermediate_size"], "rms_norm_eps": 1e-6,
            "rope_theta": 10_000_000.0, "max_position_embeddings": 262144, "vocab_size": d["vocab_size"],
            "attention_bias": False, "tie_word_embeddings": False, "block_size": 16,
            "num_target_layers": config(name).num_hidden_layers,
            "dflash_config": {"mask_token_id": d["mask_token_id"], "target_layer_ids": d["target_layer_ids"]}}


@torch.no_grad()
def random_dflash_tensors(draft_config: dict, target_hidden: int, *, dtype, device, seed: int = 2) -> dict:
    """Random weights for a DFlash draft of `draft_config` (names as z-lab ships them), never zero."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    cfg = Qwen3Config(**{k: v for k, v in draft_config.items() if k not in ("architectures", "dflash_config")})
    H, n = cfg.hidden_size, len(draft_config["dflash_config"]["target_layer_ids"])
    with torch.device("meta"):
        shapes = {f"layers.{i}.{k}": v.shape for i in range(cfg.num_hidden_layers)
                  for k, v in Qwen3DecoderLayer(cfg, i).state_dict().items()}
    shapes.update({"fc.weight": (H, n * target_hidden), "hidden_norm.weight": (H,), "norm.weight": (H,)})
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen, device=device, dtype=dtype)
        out[name] = 1 + 0.1 * t if "norm" in name else 0.02 * t
    return out
