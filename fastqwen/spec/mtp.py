"""The checkpoint's own MTP (multi-token prediction) head as a drafter.

Qwen3.5 checkpoints ship one extra full-attention decoder layer under `mtp.*`, which transformers drops at
load. It predicts token t+2 from token t+1 and the target's final (post-norm) hidden state h_t:

    m_t = norm(layer(fc(cat[norm_e(embed(x_{t+1})), norm_h(h_t)])))  at position t,   logits = lm_head(m_t)

and drafts k tokens recursively by feeding m back as the next h. It has its own KV cache, which must hold
the entries of the true sequence: after prefill, the prompt's positions; after each speculative round, the
verified block's positions, recomputed from the target's hidden states (`observe`), since the drafting pass
wrote them from its own guesses.
"""

import copy
import json
from pathlib import Path

import torch
from torch import nn

from ..cache import HybridCache
from ..model import text_model
from ..ops.attention import rope_cos_sin
from ..ops.norm import rms_norm
from ..sampling import argmax_last, filtered_probs, sample_probs


def checkpoint_source(model) -> str:
    """The path (or hub id) the model was loaded from, "" for one built from a config."""
    return getattr(model, "name_or_path", "") or model.config._name_or_path or ""


def read_mtp_tensors(path) -> dict:
    """The MTP head of a safetensors checkpoint (a directory with or without an index, or one file) in full
    precision with fused experts, keyed without the `mtp.` prefix."""
    tensors = {key[len("mtp."):]: t for key, t in stored_mtp_tensors(path).items()}
    if not tensors:
        raise ValueError(f"{path} has no mtp.* tensors: this checkpoint ships no MTP head; use a checkpoint "
                         f"that has one (draft=...) or another speculate option")
    return _fuse_experts(_dequantize_fp8(tensors))


def stored_mtp_tensors(path) -> dict:
    """The `mtp.*` tensors of a safetensors checkpoint as stored (fp8 ones with their scales), under their
    names; {} when it has none."""
    from safetensors import safe_open

    root = Path(path)
    if root.is_file():
        files = [root]
    elif root.is_dir():
        index = root / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({root / f for key, f in weight_map.items() if key.startswith("mtp.")})
        else:
            files = sorted(root.glob("*.safetensors"))
    else:
        raise FileNotFoundError(f"MTP weights: {path} is neither a checkpoint directory nor a safetensors file; "
                                f"pass draft=<local checkpoint directory>")
    tensors = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            tensors.update({key: fh.get_tensor(key) for key in fh.keys() if key.startswith("mtp.")})
    return tensors


def _dequantize_fp8(tensors: dict) -> dict:
    """An FP8 checkpoint's head in full precision: e4m3 `weight` × `weight_scale_inv` per 128×128 block (Qwen's),
    or × `weight_scale` per row, tensor or 128×128 block (compressed-tensors'). The head is read like a bf16 one,
    and optimize's draft_quant quantizes it again if asked."""
    from ..quant.formats import FP8, dequantize_fp8_block

    if any(k.endswith(".weight_packed") for k in tensors):
        raise ValueError("the MTP head is stored in int4 (compressed-tensors' weight_packed), which its reader does not "
                         "take: use a checkpoint whose mtp.* tensors are bf16 or fp8 (draft=...), then "
                         "optimize(..., draft_quant='int4') to quantize the head")
    for key in [k for k in tensors if k.endswith((".weight_scale_inv", ".weight_scale"))]:
        weight = key.rsplit(".", 1)[0] + ".weight"
        q, scale = tensors[weight], tensors.pop(key).float()
        N, K = q.shape
        if key.endswith("_inv") or tuple(scale.shape) == (-(-N // 128), -(-K // 128)) and scale.numel() > 1:
            tensors[weight] = dequantize_fp8_block(q, scale)
        elif q.dtype == FP8 and (scale.numel() == 1 or tuple(scale.shape) == (N, 1)):
            tensors[weight] = q.float() * scale.reshape(-1, 1)
        else:
            raise ValueError(f"mtp.{key} of shape {list(scale.shape)} scales no fp8 weight [{N}, {K}] "
                             f"({q.dtype}) by row, tensor or 128×128 block: the checkpoint's MTP head is damaged")
    return tensors


def _fuse_experts(tensors: dict) -> dict:
    """Per-expert `…experts.{e}.{gate,up,down}_proj.weight` → transformers' fused 3-D `gate_up_proj`, `down_proj`."""
    prefixes = sorted({k.split(".experts.")[0] for k in tensors if ".experts." in k and k.split(".experts.")[1][0].isdigit()})
    for prefix in prefixes:
        experts = sorted({int(k.split(".experts.")[1].split(".")[0]) for k in tensors if k.startswith(prefix + ".experts.")})
        take = lambda e, name: tensors.pop(f"{prefix}.experts.{e}.{name}.weight")  # noqa: E731
        tensors[f"{prefix}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([take(e, "gate_proj"), take(e, "up_proj")]) for e in experts])
        tensors[f"{prefix}.experts.down_proj"] = torch.stack([take(e, "down_proj") for e in experts])
    return tensors


class MTPHead(nn.Module):
    """fc, pre-fc norms, one decoder layer of the target's own class (full attention), final norm."""

    def __init__(self, model, tensors: dict):
        super().__init__()
        text = text_model(model)
        cfg = text.config
        H = cfg.hidden_size
        if "fc.weight" not in tensors or tuple(tensors["fc.weight"].shape) != (H, 2 * H):
            shape = tuple(tensors["fc.weight"].shape) if "fc.weight" in tensors else None
            raise ValueError(f"MTP head does not fit the target: mtp.fc.weight is {shape}, expected {(H, 2 * H)} "
                             f"(target hidden size {H}); is the draft from another model size?")
        if "full_attention" not in cfg.layer_types:  # (the head's layer is built as the target's attention layer)
            raise ValueError("speculate='mtp' needs a target with a full-attention layer (its MTP head is one, built "
                             "from the target's class); this model's layer_types has none: speculate without MTP")
        self.attn_layer = cfg.layer_types.index("full_attention")
        norm_cls, layer_cls = type(text.norm), type(text.layers[self.attn_layer])
        emb = model.get_input_embeddings().weight
        with torch.device(emb.device):
            self.fc = nn.Linear(2 * H, H, bias=False)
            self.pre_fc_norm_embedding = norm_cls(H, eps=cfg.rms_norm_eps)
            self.pre_fc_norm_hidden = norm_cls(H, eps=cfg.rms_norm_eps)
            self.layers = nn.ModuleList([layer_cls(cfg, self.attn_layer)])
            self.norm = norm_cls(H, eps=cfg.rms_norm_eps)
        self.to(emb.dtype)
        try:
            missing, unexpected = self.load_state_dict(tensors, strict=False)
        except RuntimeError as err:  # (a tensor of another shape than the target's config gives the head)
            raise ValueError(f"MTP head's tensors do not match the target's config: {err}") from err
        if missing or unexpected:
            raise ValueError(f"MTP head does not fit the target: missing {missing[:6]}, unexpected {unexpected[:6]}")


class MTPProposer:
    """Drafts k tokens a round with an MTPHead; see the module docstring for its KV cache bookkeeping."""

    features = "final"

    def __init__(self, engine, head: MTPHead, lm_head=None):
        """lm_head: the module that turns draft states into logits (default: the target's own; a quantized
        copy reads fewer bytes per draft step, and the target's verify keeps the output exact)."""
        self.head = head
        self.lm_head = lm_head if lm_head is not None else engine.forward.lm_head
        for layer in head.layers:  # fused projections (and a stacked shared expert) like the target's layers
            engine.forward.prepare_layer(layer)
        cfg = copy.deepcopy(engine.model.config.get_text_config())
        cfg.layer_types = ["full_attention"]
        B, dev = engine.max_batch_size, engine.device
        self.cache = HybridCache(cfg, B, engine.max_seq_len, engine.dtype, dev)
        self.pos = torch.zeros(B, dtype=torch.long, device=dev)  # position of the next drafting step
        self.last_hidden = torch.zeros(B, cfg.hidden_size, dtype=engine.dtype, device=dev)
        for buf in (self.pos, self.last_hidden):
            torch._dynamo.mark_static_address(buf)

    def run(self, engine, tokens, hidden, positions, rows=slice(None), past=None):
        """MTP over tokens [n, T] (x_{t+1}) and hidden [n, T, H] (h_t) at positions [n, T]; writes its KV cache
        rows `rows` and returns m [n, T, H]. past: None in a round (attention over the cache, per-row
        positions); in prefill, the number of positions the rows hold before these T (all rows alike)."""
        head, fw = self.head, engine.forward
        eps = fw.eps
        x = head.fc(torch.cat([rms_norm(fw.embed(tokens), head.pre_fc_norm_embedding.weight, eps),
                               rms_norm(hidden, head.pre_fc_norm_hidden.weight, eps)], dim=-1))
        layer = head.layers[0]
        cos, sin = rope_cos_sin(positions, fw.inv_freq, fw.rope_scaling, x.dtype)
        k_cache, v_cache = self.cache.attention(0)
        h = rms_norm(x, layer.input_layernorm.weight, eps)
        mode, past = ("decode", 0) if past is None else ("prefill", past)
        x = x + fw._attention(layer.self_attn, h, cos, sin, positions, k_cache[rows], v_cache[rows], mode, past)
        h = rms_norm(x, layer.post_attention_layernorm.weight, eps)
        x = x + fw._mlp(layer.mlp, h, "prefill" if tokens.shape[1] > 16 else "decode")
        return rms_norm(x, head.norm.weight, eps)

    def prefill(self, engine, first_row, tokens, hidden, start=0) -> None:
        """A prompt chunk: tokens [n, T] and the target's hidden [n, T, H] at positions start … start+T-1. MTP
        position t pairs x_{t+1} with h_t, so a later chunk begins with the previous chunk's last h."""
        n, T = tokens.shape
        rows = slice(first_row, first_row + n)
        if start == 0:
            tokens, pairs = tokens[:, 1:], hidden[:, :-1]
        else:
            pairs = torch.cat([self.last_hidden[rows, None], hidden[:, :-1]], dim=1)
        first = max(start - 1, 0)
        if tokens.shape[1]:
            positions = torch.arange(first, first + tokens.shape[1], device=tokens.device).expand(n, -1)
            self.run(engine, tokens, pairs, positions, rows, past=first)
        self.pos[rows] = start + T - 1
        self.last_hidden[rows] = hidden[:, -1]

    def start(self, engine) -> None:
        pass

    def propose(self, engine, k: int, do_sample: bool):
        s = engine.state
        token, h = s["tokens"], self.last_hidden
        drafts, probs = [], []
        for i in range(k):
            h = self.run(engine, token[:, None], h[:, None], (self.pos + i)[:, None])[:, 0]
            logits = self.lm_head(h).float()
            if do_sample:
                q = filtered_probs(logits, s["temperature"], s["top_k"], s["top_p"], s["min_p"])
                token = sample_probs(q)
                probs.append(q)
            else:
                token = argmax_last(logits)
            drafts.append(token)
        return torch.stack(drafts, dim=1), (torch.stack(probs, dim=1) if do_sample else None)

    def observe(self, engine, tokens, hidden, start, keep) -> None:
        positions = start[:, None] + torch.arange(tokens.shape[1], device=start.device)
        self.run(engine, tokens, hidden, positions)
        last = (keep - 1).clamp(min=0)
        advanced = keep > 0
        self.pos.copy_(torch.where(advanced, start + last, self.pos))
        self.last_hidden.copy_(torch.where(advanced[:, None], hidden[torch.arange(len(last)), last], self.last_hidden))
