"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, llm-compressor's output) ↔ our layouts, exactly.

float-quantized (fp8 e4m3 `weight` × `weight_scale`, the scale multiplying like Qwen's `weight_scale_inv`):
strategy "channel" (scale [N, 1]) and "tensor" ([1]) become fp8-weight (one scale a row: the tensor's repeated),
"block" 128×128 ([⌈N/128⌉, ⌈K/128⌉]) becomes fp8. Activations are not rounded for fp8-weight (weight-only; a
checkpoint's dynamic per-token fp8 inputs run in the model dtype), and per 128 columns for fp8, as its group-128
inputs are.
pack-quantized (int4, W4A16): `weight_packed` int32 [N, ⌈K/8⌉] holds q + 8 (q in −8…7) of column 8w + j in
nibble j of word w; `weight_scale` [N, G] (group 128 or any dividing K; "channel": G = 1); symmetric: w =
q · scale, so our zero is 8; asymmetric: `weight_zero_point` int32 [⌈N/8⌉, G] packs zp + 8 of row 8r + j in
nibble j (older writers: int8 [N, G] unpacked), w = (q − zp) · scale, so our zero is zp + 8 and our codes are the
stored nibbles (a zero point stored under a symmetric config counts too, as in compressed-tensors' dequantize);
`weight_g_idx` [K] (act-order) the group of each column, as GPTQ's g_idx. `weight_shape` = [N, K].
"""

import warnings

import torch

from .formats import FP8, INT4_SCALE
from .gptq import _nibbles, _pack_nibbles, group_order

_FP8_FORMATS = ("float-quantized", "naive-quantized")


def weight_args(qc: dict) -> dict:
    """The checkpoint's one weights scheme (config_groups' `weights`), checked: a ValueError naming what we do not
    load. Returns it with `scheme` (fp8-weight, fp8 or int4) and `format` added."""
    groups = qc.get("config_groups") or {}
    schemes = [g.get("weights") for g in groups.values() if g.get("weights")]
    if not schemes:
        raise ValueError("compressed-tensors checkpoint without quantized weights in its config_groups")
    if any(s != schemes[0] for s in schemes):
        raise ValueError(f"compressed-tensors checkpoint with {len(schemes)} different weight schemes "
                         f"(mixed precision): one scheme for every layer is supported")
    args, fmt = dict(schemes[0]), next(iter(groups.values())).get("format") or qc.get("format")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise ValueError(f"compressed-tensors checkpoint in status {qc.get('quantization_status')!r}: only compressed "
                         f"checkpoints (as llm-compressor saves them) are supported")
    if qc.get("sparsity_config") or qc.get("kv_cache_scheme"):
        raise ValueError("compressed-tensors checkpoint with a sparsity_config or kv_cache_scheme: neither is "
                         "supported; load a dense checkpoint with the KV cache unquantized")
    kind, bits, group = args.get("type"), args.get("num_bits"), args.get("group_size")
    strategy = args.get("strategy") or {None: "tensor", -1: "channel"}.get(group, "group")  # (older configs: none)
    fp8 = kind == "float" and bits == 8 and fmt in _FP8_FORMATS
    if fp8 and strategy in ("channel", "tensor"):
        scheme = "fp8-weight"
    elif fp8 and strategy == "block" and list(args.get("block_structure") or []) == [128, 128]:
        scheme = "fp8"
    elif kind == "int" and bits == 4 and strategy in ("group", "channel") and fmt == "pack-quantized":
        scheme = "int4"
        if strategy == "group" and (not isinstance(group, int) or isinstance(group, bool) or group < 1):
            raise ValueError(f"compressed-tensors int4 group strategy with group_size={group!r}: expected a "
                             f"positive int; fix its config.json")
    else:
        raise ValueError(f"compressed-tensors weights {kind} {bits}-bit, strategy {strategy!r}"
                         f"{', block ' + str(args.get('block_structure')) if strategy == 'block' else ''}, format "
                         f"{fmt!r}: supported are fp8 (float-quantized, channel, tensor or 128×128 block) and int4 "
                         f"(pack-quantized, group or channel); load the bf16 checkpoint and optimize(model, quant=...)")
    if args.get("dynamic"):
        raise ValueError("compressed-tensors checkpoint with dynamic weight scales: no scales are stored to load")
    return {**args, "strategy": strategy, "scheme": scheme, "format": fmt}


def check_config(qc: dict) -> None:
    """weight_args' checks, once a checkpoint; static input scales (not read) warn."""
    weight_args(qc)
    inputs = [g.get("input_activations") or {} for g in qc["config_groups"].values()]
    if any(i and not i.get("dynamic", False) for i in inputs):
        warnings.warn("compressed-tensors checkpoint with static input activations: its input_scale tensors are "
                      "ignored; activations run unrounded (fp8-weight, int4) or rounded per 128 columns (fp8)",
                      stacklevel=4)


def stored_names(args: dict) -> tuple:
    """The tensors each quantized layer stores under `args` (weight_args): the zero point where asymmetric."""
    if args["scheme"] != "int4":
        return "weight", "weight_scale"
    return ("weight_packed", "weight_scale", "weight_shape") + (() if args.get("symmetric", True) else
                                                                ("weight_zero_point",))


def to_ours(args: dict, t: dict, shape) -> tuple:
    """(scheme, tensors, group) of one layer [N, K] = `shape` from its checkpoint tensors `t` (keys without the
    module prefix): fp8's and fp8-weight's stored layout; int4's codes [N, K] (in stored column order), scale
    and zero [N, K / group] and perm [K] where act-ordered, as gptq.from_gptq gives them. A ValueError where the
    tensors do not fit."""
    N, K = shape
    scale = t["weight_scale"].float()
    if args["scheme"] == "fp8":
        return "fp8", {"qweight": t["weight"], "scale_inv": scale}, 128
    if args["scheme"] == "fp8-weight":
        if scale.numel() not in (1, N):
            raise ValueError(f"weight_scale of shape {list(scale.shape)}: expected [{N}, 1] (channel) or [1] (tensor)")
        return "fp8-weight", {"qweight": t["weight"], "scale": scale.reshape(-1).expand(N).contiguous()}, 128
    if t["weight_shape"].tolist() != [N, K]:
        raise ValueError(f"weight_shape {t['weight_shape'].tolist()} is not the layer's [{N}, {K}]")
    packed, G = t["weight_packed"], scale.shape[-1]
    if tuple(packed.shape) != (N, -(-K // 8)) or packed.dtype != torch.int32 or tuple(scale.shape) != (N, G) or K % G:
        raise ValueError(f"weight_packed {list(packed.shape)} ({packed.dtype}) and weight_scale {list(scale.shape)} do "
                         f"not fit [{N}, {K}]: expected int32 [{N}, {-(-K // 8)}] and [{N}, groups dividing {K}]")
    group = K // G
    if G != (1 if args["strategy"] == "channel" else K // args["group_size"]):
        raise ValueError(f"weight_scale {list(scale.shape)} does not give {args['strategy']} groups of "
                         f"{args.get('group_size') if args['strategy'] == 'group' else K} columns over in_features {K}")
    codes = _nibbles(packed).reshape(N, -1)[:, :K]
    if "weight_zero_point" not in t:  # (symmetric)
        zero = torch.full((N, G), 8.0)
    else:
        zp = t["weight_zero_point"]
        if zp.dtype == torch.int32 and tuple(zp.shape) == (-(-N // 8), G):
            zero = _nibbles(zp).permute(0, 2, 1).reshape(-1, G)[:N].float()
        elif zp.dtype == torch.int8 and tuple(zp.shape) == (N, G):  # (compressed-tensors ≤ 0.9.3: unpacked, signed)
            zero = zp.float() + 8
        else:
            raise ValueError(f"weight_zero_point {list(zp.shape)} ({zp.dtype}) fits neither the packed int32 "
                             f"[{-(-N // 8)}, {G}] nor the unpacked int8 [{N}, {G}]")
    perm = None
    if "weight_g_idx" in t:
        perm = group_order(t["weight_g_idx"], K, group)
        codes = codes[:, perm] if perm is not None else codes
    if not torch.equal(scale.to(INT4_SCALE).float(), scale):
        warnings.warn("int4 scales of this checkpoint that fp16 (the kernels' scale format) does not hold exactly are "
                      "rounded to the nearest fp16: within 2^-11 relative in fp16's normal range, 3e-8 absolute "
                      "below it (6.1e-5)", stacklevel=4)
    tensors = {"codes": codes.contiguous(), "scale": scale, "zero": zero}
    return "int4", {**tensors, **({"perm": perm} if perm is not None else {})}, group


def _config(weights: dict, fmt: str, ignore: list) -> dict:
    """A quantization_config of one weights scheme on every Linear but `ignore`'s, weight-only."""
    weights = {"symmetric": True, "dynamic": False, "group_size": None, "block_structure": None, "actorder": None,
               "observer": "minmax", "observer_kwargs": {}, **weights}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None}},
            "ignore": ignore, "kv_cache_scheme": None, "sparsity_config": {}, "global_compression_ratio": None}


def fp8_rows_config(ignore: list) -> dict:
    """The quantization_config of fp8-weight layers written as compressed-tensors' FP8 channel scheme (what
    llm-compressor's FP8_DYNAMIC writes, less the dynamic per-token input rounding, which fp8-weight does not do);
    `ignore`: the Linear modules left unquantized."""
    return _config({"num_bits": 8, "type": "float", "strategy": "channel"}, "float-quantized", ignore)


def int4_config(group: int, act_order: bool, ignore: list) -> dict:
    """The quantization_config of int4 layers written as compressed-tensors' asymmetric W4A16 (pack-quantized):
    `group` columns a group, -1 for one a row ("channel"); act_order: the layers carry weight_g_idx."""
    strategy = {"strategy": "channel"} if group == -1 else {"strategy": "group", "group_size": group}
    return _config({"num_bits": 4, "type": "int", "symmetric": False, **strategy,
                    "actorder": "group" if act_order else None}, "pack-quantized", ignore)


def int4_tensors(codes, scale, zero, perm, group: int) -> dict:
    """to_ours' inverse for int4: {weight_packed, weight_scale (fp16: ours, exactly), weight_zero_point,
    weight_shape, and weight_g_idx where perm is given} of codes [N, K] (stored column order: original column
    perm[j] at j), scale and zero [N, K / group] (zero = zp + 8, integers 0…15). N and K multiples of 8."""
    N, K = codes.shape
    if N % 8 or K % 8 or zero.min() < 0 or zero.max() > 15:
        raise ValueError(f"compressed-tensors packs 8 codes an int32 and stores zero points in 4 bits: N={N} and "
                         f"K={K} must be multiples of 8 and zeros 0…15; got zeros {zero.min().item():g}…"
                         f"{zero.max().item():g} (a GPTQ checkpoint's zero of 16 has no such form: save it as GPTQ)")
    order = torch.arange(K, device=codes.device) if perm is None else perm.long()
    original = torch.empty_like(codes).index_copy_(1, order, codes)
    zp = zero.round().to(torch.int32).t().reshape(-1, N // 8, 8)  # [G, N/8, 8]: 8 rows a word
    t = {"weight_packed": _pack_nibbles(original.reshape(N, K // 8, 8)), "weight_scale": scale.to(INT4_SCALE),
         "weight_zero_point": _pack_nibbles(zp).t().contiguous(), "weight_shape": torch.tensor([N, K])}
    if perm is not None:
        t["weight_g_idx"] = torch.empty(K, dtype=torch.int32, device=codes.device).index_copy_(
            0, order, (torch.arange(K, device=codes.device) // group).to(torch.int32))
    return t


def fp8_rows_tensors(qweight: torch.Tensor, scale: torch.Tensor) -> dict:
    """fp8-weight's stored qweight [N, K] e4m3 and scale [N] as compressed-tensors' `weight` and `weight_scale`
    [N, 1] (fp32: our scales, exactly)."""
    assert qweight.dtype == FP8
    return {"weight": qweight, "weight_scale": scale.float()[:, None]}

