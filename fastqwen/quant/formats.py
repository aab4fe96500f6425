"""Weight formats, as plain torch: the references every kernel is tested against.

fp8-block: e4m3 weight [N, K] and fp32 scale_inv [⌈N/bn⌉, ⌈K/bk⌉], w ≈ q · scale_inv[block] (Qwen's FP8
    checkpoints store exactly this as `weight` + `weight_scale_inv`, blocks 128×128).
fp8-row: e4m3 weight [N, K] and fp32 scale [N].
int4: codes [N, K] uint8 in 0…15, scale [N, K/g] fp16 and zero [N, K/g] uint8 (an integer: INT4_SCALE,
    INT4_ZERO): w ≈ (q − zero) · scale per group of g consecutive input columns; an optional input permutation
    `perm` (act-order checkpoints) means the stored columns are the original columns perm[0], perm[1], …
    Groups of a multiple of 128 columns are stored as 128-column groups (`int4_kernel_groups`: each scale and
    zero repeated, exact), the group the weight-streaming kernels take; the stored group is K / scale's columns.
    QuantLinear stores the codes packed two a byte (`pack_int4`: low nibble = even column), so a step reads half
    a byte per weight and 3 bytes per group of its row (0.52 bytes a weight at g = 128; fp32 scale and zero
    were 8 bytes, 0.56).
"""

import torch

KERNEL_GROUP = 128  # the int4 group (and fp8 block) width the weight-streaming kernels step by
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def _blocks(t: torch.Tensor, block):
    """View [..., N, K] as [..., N/bn, bn, K/bk, bk] after zero-padding to whole blocks; returns (view, N, K)."""
    bn, bk = block
    N, K = t.shape[-2:]
    padded = torch.nn.functional.pad(t, (0, -K % bk, 0, -N % bn))
    return padded.view(*t.shape[:-2], padded.shape[-2] // bn, bn, padded.shape[-1] // bk, bk), N, K


def quantize_fp8_block(w: torch.Tensor, block=(128, 128)):
    """(q [N, K] e4m3, scale_inv [⌈N/bn⌉, ⌈K/bk⌉] fp32) with each block's amax mapped to the e4m3 maximum."""
    v, N, K = _blocks(w.float(), block)
    scale = (v.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (v / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(v.shape[0] * block[0], -1)[:N, :K].contiguous(), scale


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """q [..., N, K], scale_inv [..., ⌈N/bn⌉, ⌈K/bk⌉] → fp32 [..., N, K] (leading dims: a stack of experts)."""
    v, N, K = _blocks(q.float(), block)
    w = v * scale_inv.float()[..., :, None, :, None]
    return w.view(*q.shape[:-2], v.shape[-4] * block[0], -1)[..., :N, :K]


def quantize_fp8_rows(w: torch.Tensor):
    """(q [N, K] e4m3, scale [N] fp32), one scale per output row."""
    scale = (w.float().abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_fp8_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [..., N, K], scale [..., N] → fp32 [..., N, K]."""
    return q.float() * scale.float()[..., None]


INT4_SCALE, INT4_ZERO = torch.float16, torch.uint8  # int4's stored scale and zero dtypes (GPTQ's and AWQ's scales
# are fp16 too); the kernels read these two and no others


def int4_scale(scale: torch.Tensor, up: bool = False) -> torch.Tensor:
    """scale in INT4_SCALE, rounded to nearest (exact for GPTQ / AWQ's fp16 scales) or, with `up`, to the least
    fp16 not below it; a ValueError where a value leaves fp16's range (overflows, also by that round-up, or a
    nonzero scale flushes to 0), which would decode its group wrongly."""
    s = scale.to(INT4_SCALE)
    if s.is_meta:
        return s
    if up:
        s = (s.view(torch.int16) + (s.float() < scale).to(torch.int16)).view(INT4_SCALE)  # (the next fp16)
    bad = ~torch.isfinite(s) | ((s == 0) & (scale != 0))
    if bad.any():
        raise ValueError(f"int4 scales must lie in fp16's range ({2**-24:.3g} … 65504), the stored format; got "
                         f"{scale[bad].flatten()[0].item():.3g}: quantize this weight in a wider format (fp8-weight)")
    return s


def quantize_int4(w: torch.Tensor, group: int = 128):
    """(codes [N, K] uint8, scale [N, K/g] fp16, zero [N, K/g] uint8) asymmetric min/max per group (K % g == 0).
    The scale is rounded up to fp16 (never below the group's range / 15) and the codes are taken against it, so
    every weight is within half a step of its decoded value."""
    N, K = w.shape
    v = w.float().view(N, K // group, group)
    lo, hi = v.amin(-1).clamp(max=0), v.amax(-1).clamp(min=0)
    exact = ((hi - lo) / 15).clamp(min=2**-24)  # (fp16's least subnormal)
    scale = int4_scale(exact, up=True)
    s = scale.float()
    zero = (-lo / s).round().clamp(0, 15)
    q = (v / s[..., None] + zero[..., None]).round().clamp(0, 15)
    return q.view(N, K).to(torch.uint8), scale, zero.to(INT4_ZERO)


def int4_kernel_groups(scale: torch.Tensor, zero: torch.Tensor, group: int):
    """(scale, zero) [..., N, K/group] of groups of a multiple of KERNEL_GROUP columns as KERNEL_GROUP-column
    groups [..., N, K/KERNEL_GROUP]: group j's values repeated, so column k keeps group k // group's (exact);
    other groups are returned as they are."""
    if group % KERNEL_GROUP or group == KERNEL_GROUP:
        return scale, zero
    return tuple(v.repeat_interleave(group // KERNEL_GROUP, dim=-1) for v in (scale, zero))


def dequantize_int4(q, scale, zero, perm=None) -> torch.Tensor:
    """The weight [..., N, K] (codes q [..., N, K]; its group K / scale's columns) in the original column order
    (perm: 2-D q only)."""
    N, K = q.shape[-2:]
    group = K // scale.shape[-1]
    v = q.float().view(*q.shape[:-1], K // group, group)
    w = ((v - zero.float()[..., None]) * scale.float()[..., None]).view(q.shape)
    if perm is not None:
        w = torch.empty_like(w).index_copy_(1, perm, w)
    return w


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] (0…15, K even) → uint8 [N, K/2]: column 2j in the low nibble, 2j+1 in the high one."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., N, K/2] → codes [..., N, K] uint8 (inverse of pack_int4)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).view(*packed.shape[:-1], -1)


def fake_quantize_fp8_activations(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """x rounded as dynamic per-token, per-`group`-column fp8 quantization would (the "fp8" scheme's inputs)."""
    shape = x.shape
    K = shape[-1]
    v = torch.nn.functional.pad(x.float().reshape(-1, K), (0, -K % group))
    v = v.view(v.shape[0], -1, group)
    scale = (v.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return ((v / scale).to(FP8).float() * scale).view(v.shape[0], -1)[:, :K].reshape(shape).to(x.dtype)


def quantize_weight(w: torch.Tensor, scheme: str, group: int = 128) -> dict:
    """A weight [N, K] in `scheme`'s stored layout: {"qweight", and "scale_inv" | "scale" (+ "zero")}; int4
    quantized in groups of `group` columns, stored as int4_kernel_groups gives them."""
    if scheme == "fp8":
        q, s = quantize_fp8_block(w, (128, 128))
        return {"qweight": q, "scale_inv": s}
    if scheme == "fp8-weight":
        q, s = quantize_fp8_rows(w)
        return {"qweight": q, "scale": s}
    q, s, z = quantize_int4(w, group)
    s, z = int4_kernel_groups(s, z, group)
    return {"qweight": pack_int4(q), "scale": s, "zero": z}


TILE_ROWS = 16  # int4 weights are stored in tiles of 16 rows × 128 columns (one group, 64 bytes a row): 1 KB contiguous


def tile_int4(q: torch.Tensor, experts: bool = False) -> torch.Tensor:
    """Packed int4 codes [N, K/2] uint8 (with `experts`: [E, N, K/2]) in the layout the kernels stream fastest:
    [N/16, K/128, 16, 64] ([E, …]), each 16 rows × 128 columns one contiguous KB (a one-row step of the
    weight-streaming kernel, ops/gemv.py, then reads whole KBs: 10-18% faster on the 27B's layers than 64-byte
    pieces of rows 2.5 KB apart, the int4 lm_head 262 → 215 µs, H200 2026-12-02). Returned unchanged where N is no multiple of 16 or K of 128, or
    already tiled."""
    if q.dim() != 2 + experts or q.shape[-2] % TILE_ROWS or q.shape[-1] % 64:
        return q
    *lead, N, half = q.shape
    return q.reshape(*lead, N // TILE_ROWS, TILE_ROWS, half // 64, 64).transpose(-3, -2).contiguous()


def untile_int4(q: torch.Tensor) -> torch.Tensor:
    """tile_int4's inverse: packed codes [N, K/2] (from 4-D) or [E, N, K/2] (from 5-D) in row order; codes not
    tiled (2-D or 3-D) are returned as they are."""
    if q.dim() < 4:
        return q
    *lead, tiles, groups, rows, half = q.shape
    return q.transpose(-3, -2).reshape(*lead, tiles * rows, groups * half)


def dequantize_weight(scheme: str, t: dict) -> torch.Tensor:
    """The fp32 weight [N, K] of stored tensors `t` (as quantize_weight returns them, optionally "perm"), or
    [E, N, K] of a stack of them (QuantExperts)."""
    if scheme == "fp8":
        return dequantize_fp8_block(t["qweight"], t["scale_inv"], (128, 128))
    if scheme == "fp8-weight":
        return dequantize_fp8_rows(t["qweight"], t["scale"])
    return dequantize_int4(unpack_int4(untile_int4(t["qweight"])), t["scale"], t["zero"], t.get("perm"))
