"""Load pre-quantized Qwen3.5 checkpoints into QuantLinear layers without dequantizing.

Supported `quantization_config`s: Qwen's FP8 (`quant_method: fp8`, `weight_block_size: [128, 128]`: fp8
`weight` + `weight_scale_inv`, kept as they are), GPTQ (`quant_method: gptq`, 4 bits, act-order or not,
"gptq" or "gptq_v2" format) and AWQ (`quant_method: awq`, 4 bits, GEMM layout), converted exactly to our int4
layout. Nothing is fetched from a hub: transformers' own loaders for these formats want kernels from there.
"""

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from .formats import pack_int4
from .gptq import from_awq, from_gptq
from .linear import QuantLinear


def _read_safetensors(root: Path) -> dict:
    from safetensors import safe_open

    index = root / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else None
    paths = [root / f for f in files] if files else sorted(root.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"{root} holds no safetensors files")
    tensors = {}
    for p in paths:
        with safe_open(str(p), framework="pt") as fh:
            for key in fh.keys():
                tensors[key] = fh.get_tensor(key)
    return tensors


def _check_config(qc: dict) -> str:
    method = qc.get("quant_method")
    if method == "fp8":
        if list(qc.get("weight_block_size") or []) != [128, 128]:
            raise ValueError(f"FP8 checkpoint with weight_block_size={qc.get('weight_block_size')}: only "
                             f"[128, 128] block scales are supported")
    elif method in ("gptq", "awq"):
        if qc.get("bits", 4) != 4:
            raise ValueError(f"{method} checkpoint with bits={qc.get('bits')}: only 4-bit is supported")
        if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
            raise ValueError(f"AWQ version {qc.get('version')!r}: only the GEMM layout is supported")
        if method == "gptq" and qc.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {qc.get('checkpoint_format')!r} is not supported")
    else:
        raise ValueError(f"unsupported quantization_config quant_method={method!r}; supported: fp8 (128×128 "
                         f"blocks), gptq (4-bit), awq (4-bit GEMM)")
    return method


def _quant_linear(method: str, qc: dict, t: dict, prefix: str, shape) -> QuantLinear:
    """The QuantLinear of module `prefix` from its checkpoint tensors `t` (keys without the prefix)."""
    out_features, in_features = shape
    if method == "fp8":
        return QuantLinear("fp8", in_features, out_features,
                           {"qweight": t["weight"], "scale_inv": t["weight_scale_inv"].float()}, t.get("bias"))
    group = qc.get("group_size", 128)
    group = in_features if group in (-1, None) else group
    if method == "gptq":
        g_idx = t.get("g_idx", torch.arange(in_features, dtype=torch.int32) // group)
        offset = 1 if qc.get("checkpoint_format", "gptq") == "gptq" else 0
        codes, scale, zero, perm = from_gptq(t["qweight"], t["qzeros"], t["scales"], g_idx, group=group,
                                             zero_offset=offset)
    else:
        codes, scale, zero, perm = from_awq(t["qweight"], t["qzeros"], t["scales"], group=group)
    tensors = {"qweight": pack_int4(codes), "scale": scale, "zero": zero}
    if perm is not None:
        tensors["perm"] = perm
    return QuantLinear("int4", in_features, out_features, tensors, t.get("bias"), group)


def from_pretrained(path, *, dtype=torch.bfloat16, device="cpu"):
    """A Qwen3.5 model from a pre-quantized checkpoint directory, quantized layers kept quantized.

    Pass the result to fastqwen.optimize as any other model.
    """
    root = Path(path)
    config = AutoConfig.from_pretrained(root)
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        raise ValueError(f"{path} has no quantization_config; load it with transformers' from_pretrained")
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = _check_config(qc)
    del config.quantization_config
    tensors = _read_safetensors(root)
    marker = "weight_scale_inv" if method == "fp8" else "qweight"
    quantized = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith("." + marker)})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for prefix in quantized:
        parent_name, _, name = prefix.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, name)
        own = {k[len(prefix) + 1:]: tensors.pop(k) for k in list(tensors) if k.startswith(prefix + ".")}
        layer = _quant_linear(method, qc, own, prefix, (linear.out_features, linear.in_features))
        setattr(parent, name, layer.to(device))
    plain = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items() if not k.startswith("mtp.")}
    missing, unexpected = model.load_state_dict(plain, strict=False, assign=True)
    done = set(quantized)
    missing = [m for m in missing if not m.endswith("inv_freq") and m.rsplit(".", 1)[0] not in done]
    if missing or unexpected:
        raise ValueError(f"{path} does not match its config: missing {missing[:6]}, unexpected {unexpected[:6]}")
    for module in model.modules():  # rotary tables are not in checkpoints: rebuild them off the meta device
        if module.__class__.__name__.endswith("RotaryEmbedding"):
            fresh = type(module)(module.config)
            module.inv_freq, module.original_inv_freq = fresh.inv_freq, fresh.original_inv_freq
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise ValueError(f"{path}: no values for {still_meta[:6]}")
    model.to(device)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.name_or_path = str(root)
    return model.eval()
