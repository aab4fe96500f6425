"""Attention of Qwen3.5's full-attention layers over a static KV cache.

Rows have their own lengths, and the cache holds only real tokens (no padding), so a query at position p of
row b sees exactly the keys at positions 0..p of that row. On CUDA scaled_dot_product_attention dispatches
to a fused kernel; the CPU path is the same call.
"""

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype):
    """cos, sin [B, T, R] for integer positions [B, T] (R = 2·len(inv_freq): partial rotary dims)."""
    freqs = positions[..., None].float() * inv_freq.float()
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first R dims of x [B, H, T, D] by cos/sin [B, T, R] (rotate-half convention; the other dims
    pass): x·c + x[perm]·s over all D, c = cos then 1s, s = (−sin[:R/2], sin[R/2:]) then 0s, perm swapping the
    rotated halves. The same values as rotating x[..., :R] and concatenating x[..., R:] (x·1 and a product with 0
    are exact), but one pointwise expression: inductor fuses it with the q/k norm before it instead of writing
    the two parts of a cat (a kernel each) after a kernel for the norm's reduction."""
    rot, D = cos.shape[-1], x.shape[-1]
    half = rot // 2
    d = torch.arange(D, device=x.device)
    perm = torch.where(d < half, d + half, torch.where(d < rot, d - half, d))
    c = F.pad(cos, (0, D - rot), value=1.0)[:, None]
    s = F.pad(sin, (0, D - rot), value=0.0)[:, None] * torch.where(d < half, -1.0, 1.0).to(sin.dtype)
    return x * c + x[..., perm] * s


def write_kv(k_cache, v_cache, k, v, positions) -> None:
    """Store k, v [B, Hkv, T, D] at per-row positions [B, T] of caches [B, Hkv, S, D]."""
    rows = torch.arange(k.shape[0], device=k.device)[:, None]
    k_cache[rows, :, positions] = k.transpose(1, 2).to(k_cache.dtype)
    v_cache[rows, :, positions] = v.transpose(1, 2).to(v_cache.dtype)


def attend_cache(q, k_cache, v_cache, positions, scale: float) -> torch.Tensor:
    """Causal attention of q [B, Hq, T, D] at positions [B, T] over the cached keys 0..position of its row."""
    keys = torch.arange(k_cache.shape[2], device=q.device)
    mask = keys[None, None, :] <= positions[:, :, None]  # [B, T, S]
    return F.scaled_dot_product_attention(
        q, k_cache, v_cache, attn_mask=mask[:, None], scale=scale, enable_gqa=True
    )


def attend_causal(q, k, v, scale: float) -> torch.Tensor:
    """Causal self-attention of a fresh sequence: q [B, Hq, T, D], k, v [B, Hkv, T, D]."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)


def attend_prefix(q, k, v, scale: float) -> torch.Tensor:
    """Causal attention of the last T of S positions: q [B, Hq, T, D] over keys k, v [B, Hkv, S, D] (the cache
    up to and including these T), query t seeing keys 0 … S−T+t. A prompt's later prefill chunks: the mask is
    lower-right causal (torch's CausalBias), so on CUDA the flash kernel runs without building it, and in
    16-bit it takes the grouped heads as they are. Elsewhere the heads are expanded to Hq first: the
    memory-efficient fallback (e.g. fp32) does not take grouped queries (the copy is 2·B·Hq·S·D elements:
    26 GB for 8 rows of 128K on 27B)."""
    B, Hkv, S, D = k.shape
    group = q.shape[1] // Hkv
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and D <= 256:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], S), scale=scale,
                                              enable_gqa=True)
    if group > 1:
        k = k[:, :, None].expand(B, Hkv, group, S, D).reshape(B, Hkv * group, S, D)
        v = v[:, :, None].expand(B, Hkv, group, S, v.shape[-1]).reshape(B, Hkv * group, S, v.shape[-1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], S), scale=scale)
