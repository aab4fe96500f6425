"""A full-attention layer's inputs for a few positions: q/k RMSNorm, partial rope and the KV-cache write.

`prepare` is the plain torch reference (the model's path by default): the projections' outputs q | gate
[B, T, Hq·2D] (each head's q then its output gate), k and v [B, T, Hkv·D], or their split-K partials
[S, B, T, n] fp32 (summed in split order and rounded to the activations' dtype, as gemv.add_splits and the
projection's output would be), give q normed and rotated [B, Hq, T, D], and k normed and rotated and v
written into the caches [B, Hkv, S_max, D] at positions [B, T]. In a compiled decode step inductor writes that
as five kernels on a GPU (q's and k's sums of squares, q's and k's norm + rope, k's and v's cache writes:
1.1-1.6 µs each, 6.5 µs an attention layer in a 16-layer 27B int4 profile on an H100, 2026-12-05).

`attention_prep` (kernels={"attn_glue": "fused"}) is the same as one kernel of ours: a program a (row,
position, head) of the Hq + 2·Hkv heads, eager's roundings (the sum to the activations' dtype, the norm's
output, each product of the rope and their sum: bf16 arithmetic as PyTorch's eager ops round it), with
programmatic dependent launch (the norm weights load before the wait).
"""

import torch

from .attention import apply_rope, write_kv
from .norm import rms_norm

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs the reference
    triton = None


def summed(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An input as `prepare` reads it: split-K partials [S, B, T, n] (one more dim than an output) summed in
    split order in fp32 and rounded to dtype; an output [B, T, n] as it is."""
    if x.dim() == 4:
        total = x[0].float()
        for part in x[1:]:
            total = total + part.float()
        return total.to(dtype)
    return x


def prepare(q_in, k_in, v_in, q_weight, k_weight, q_eps: float, k_eps: float, cos, sin, positions, k_cache,
            v_cache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [B, H, T, D] in cos's dtype (the activations'), q and k normed and rotated, k and v also stored
    into k_cache / v_cache [B, Hkv, S_max, D] at positions [B, T]. q_in: the q | gate projection [B, T, Hq·2D]
    (head h's q at columns 2D·h … 2D·h + D − 1), k_in / v_in [B, T, Hkv·D], each an output or its split-K
    partials [S, B, T, n]; cos, sin [B, T, R] (R ≤ D rotated dims); the norms zero-centred (1 + w)."""
    dtype = cos.dtype
    q, k, v = (summed(x, dtype) for x in (q_in, k_in, v_in))
    B, T = q.shape[:2]
    D = k_cache.shape[-1]
    q = rms_norm(q.reshape(B, T, -1, 2 * D)[..., :D], q_weight, q_eps).transpose(1, 2)
    k = rms_norm(k.reshape(B, T, -1, D), k_weight, k_eps).transpose(1, 2)
    v = v.reshape(B, T, -1, D).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    write_kv(k_cache, v_cache, k, v, positions)
    return q, k, v


@torch.library.custom_op("fastqwen::step_positions", mutates_args=())
def step_positions(lengths: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """A step's positions [B, T] = lengths [B] + offsets [T], as a buffer of their own (one add). Written inline
    (lengths[:, None] + arange) they are an unrealized input to each op of ours that reads them, and inductor
    copies such an input into a new buffer for every op (ExternKernel.require_strides): two launches an
    attention layer of a verify, 32 on the 27B. An op's output is realized once."""
    return lengths[:, None] + offsets


@step_positions.register_fake
def _(lengths, offsets):
    return lengths.new_empty(lengths.shape[0], offsets.shape[0])


@torch.library.custom_op("fastqwen::attention_prep", mutates_args=("k_cache", "v_cache"))
def attention_prep(q_in: torch.Tensor, k_in: torch.Tensor, v_in: torch.Tensor, q_weight: torch.Tensor,
                   k_weight: torch.Tensor, q_eps: float, k_eps: float, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   pdl: bool = False) -> torch.Tensor:
    """`prepare`'s q (contiguous) as a registered op; on CUDA one kernel of ours. pdl: launched with
    programmatic dependent launch."""
    return prepare(q_in, k_in, v_in, q_weight, k_weight, q_eps, k_eps, cos, sin, positions, k_cache,
                   v_cache)[0].contiguous()


@attention_prep.register_fake
def _(q_in, k_in, v_in, q_weight, k_weight, q_eps, k_eps, cos, sin, positions, k_cache, v_cache, pdl=False):
    B, T = positions.shape
    D = k_cache.shape[-1]
    return cos.new_empty(B, q_in.shape[-1] // (2 * D), T, D)


if triton is not None:

    @triton.jit
    def _load_summed(ptr, split, offs, mask, S: tl.constexpr, DTYPE: tl.constexpr):
        """Σ of S partials at ptr + offs (split apart) in fp32, in split order, rounded to DTYPE (an output: S
        = 1 in DTYPE, exact)."""
        x = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
        for s in tl.static_range(1, S):
            x += tl.load(ptr + s * split + offs, mask=mask, other=0.0).to(tl.float32)
        return x.to(DTYPE).to(tl.float32)

    @triton.jit
    def _normed_rotated(ptr, split, base, w, wp, eps, c, s, d, perm, mask, S: tl.constexpr, D: tl.constexpr,
                        DTYPE: tl.constexpr):
        """rms_norm then apply_rope of one head at ptr + base (+ d), in eager's roundings: the norm's fp32
        (x·r)·(1 + w) rounded once; then x·c and x[perm]·s each rounded, and their sum (c, s: cos then 1s,
        ±sin then 0s, in DTYPE; w, wp: the norm weight at d and at perm, fp32)."""
        x = _load_summed(ptr, split, base + d, mask, S, DTYPE)
        xp = _load_summed(ptr, split, base + perm, mask, S, DTYPE)  # (the rotate-half partner: same row, same r)
        r = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(x * x, 0), D) + eps))  # (IEEE, as torch on the CPU)
        y = (x * r * (1.0 + w)).to(DTYPE).to(tl.float32)
        yp = (xp * r * (1.0 + wp)).to(DTYPE).to(tl.float32)
        return ((y * c).to(DTYPE).to(tl.float32) + (yp * s).to(DTYPE).to(tl.float32)).to(DTYPE)

    @triton.jit
    def _prep_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, out_ptr,
                     q_eps, k_eps, q_split, q_row, q_pos, k_split, k_row, k_pos, v_split, v_row, v_pos,
                     cs_row, cs_pos, p_row, p_pos, c_row, c_head, c_seq, SEQ,
                     T: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                     R: tl.constexpr, SQ: tl.constexpr, SK: tl.constexpr, SV: tl.constexpr, PDL: tl.constexpr):
        """Program (b·T + t, h): h < HQ a q head (out [B, HQ, T, D] contiguous), then the HKV k heads (into
        kc at the row's position), then the HKV v heads (vc). Caches [B, HKV, SEQ, D] at strides (c_row,
        c_head, c_seq), 1; inputs at (split, row, position) strides, heads contiguous; cos, sin [B, T, R]
        contiguous in the last dim. A position outside 0 … SEQ − 1 writes nothing."""
        bt, h = tl.program_id(0), tl.program_id(1)
        b, t = bt // T, bt % T
        d = tl.arange(0, BD)
        mask = d < D
        half = R // 2
        perm = tl.where(d < half, d + half, tl.where(d < R, d - half, d))
        if h < HQ:  # the norm weight (a module's own) before the wait; a v head loads k's, unused
            w_ptr = qw_ptr
        else:
            w_ptr = kw_ptr
        w = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + perm, mask=mask, other=0.0).to(tl.float32)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        DTYPE: tl.constexpr = out_ptr.dtype.element_ty
        rot = d < R
        c = tl.load(cos_ptr + b * cs_row + t * cs_pos + d, mask=rot, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + b * cs_row + t * cs_pos + d, mask=rot, other=0.0).to(tl.float32)
        s = tl.where(d < half, -s, s)
        pos = tl.load(pos_ptr + b * p_row + t * p_pos)
        ok = mask & (pos >= 0) & (pos < SEQ)
        if h < HQ:
            yq = _normed_rotated(q_ptr, q_split, b * q_row + t * q_pos + h * 2 * D, w, wp, q_eps, c, s, d, perm, mask,
                                SQ, D, DTYPE)
            tl.store(out_ptr + ((b * HQ + h) * T + t) * D + d, yq, mask=mask)
        elif h < HQ + HKV:
            hk = h - HQ
            yk = _normed_rotated(k_ptr, k_split, b * k_row + t * k_pos + hk * D, w, wp, k_eps, c, s, d, perm, mask,
                                SK, D, DTYPE)
            tl.store(kc_ptr + b * c_row + hk * c_head + pos * c_seq + d, yk.to(kc_ptr.dtype.element_ty), mask=ok)
        else:
            hv = h - HQ - HKV
            yv = _load_summed(v_ptr, v_split, b * v_row + t * v_pos + hv * D + d, mask, SV, DTYPE)
            tl.store(vc_ptr + b * c_row + hv * c_head + pos * c_seq + d, yv.to(vc_ptr.dtype.element_ty), mask=ok)


def _strides(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int]:
    """(x, split stride, row stride, position stride, splits) of an input [S, B, T, n] or [B, T, n] whose
    last dim is contiguous."""
    parts = x if x.dim() == 4 else x[None]
    return parts, parts.stride(0), parts.stride(1), parts.stride(2), parts.shape[0]


@attention_prep.register_kernel("cuda")
def _attention_prep_cuda(q_in, k_in, v_in, q_weight, k_weight, q_eps, k_eps, cos, sin, positions, k_cache,
                         v_cache, pdl=False):
    B, T = positions.shape
    Hkv, seq, D = k_cache.shape[1:]
    R = cos.shape[-1]
    inputs = (q_in, k_in, v_in, cos, sin, q_weight, k_weight)
    if triton is None or any(x.stride(-1) != 1 for x in inputs) or k_cache.stride() != v_cache.stride() or (
            k_cache.stride(-1) != 1 or R % 2 or R > D):
        return prepare(q_in, k_in, v_in, q_weight, k_weight, q_eps, k_eps, cos, sin, positions, k_cache,
                       v_cache)[0].contiguous()
    (q, q_split, q_row, q_pos, sq), (k, k_split, k_row, k_pos, sk), (v, v_split, v_row, v_pos, sv) = (
        _strides(x) for x in (q_in, k_in, v_in))
    Hq = q_in.shape[-1] // (2 * D)
    out = cos.new_empty(B, Hq, T, D)
    # without FP fusion: with it the rope's x·c + x[perm]·s compiled to one bf16 FMA (x·c not rounded first), and
    # 4.4% of q's values came out a bf16 ulp off eager's on an H100 (2026-12-05)
    _prep_kernel[(B * T, Hq + 2 * Hkv)](
        q, k, v, q_weight, k_weight, cos, sin, positions, k_cache, v_cache, out, q_eps, k_eps,
        q_split, q_row, q_pos, k_split, k_row, k_pos, v_split, v_row, v_pos, cos.stride(0), cos.stride(1),
        positions.stride(0), positions.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), seq,
        T=T, HQ=Hq, HKV=Hkv, D=D, BD=triton.next_power_of_2(D), R=R, SQ=sq, SK=sk, SV=sv, PDL=pdl,
        num_warps=2, launch_pdl=pdl, enable_fp_fusion=False)
    return out
