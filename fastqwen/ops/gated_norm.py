"""The GDN block's gated RMSNorm at decode and verify as one kernel of ours (kernels={"gdn_norm": "kernel"}).

norm.gated_rms_norm over the recurrence's o [B, T, HV, V] with gate z, the input projection's z slice: where
inductor writes it in a compiled int4 step on a GPU it takes two kernels, the per-head sums of squares and the
pointwise tail that also sums z's split-K partials (1.2 + 1.4 µs a GDN layer in a 16-layer 27B profile on an
H100, 2026-12-05). `gated_norm` is one launch: a program a (row, position, head) reads the head's V outputs and
z's partials (summed in split order in fp32 and rounded to o's dtype, as the projection's output would be),
with eager's roundings (ô in o's dtype, w·ô in it where w is 16-bit, the gated product in fp32 rounded once)
and programmatic dependent launch (the norm weight loads before the wait).
"""

import torch

from .attention_prep import summed
from .norm import gated_rms_norm

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs the reference
    triton = None


@torch.library.custom_op("fastqwen::gated_norm", mutates_args=())
def gated_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
               pdl: bool = False) -> torch.Tensor:
    """gated_rms_norm(o, z, weight, eps) for o [B, T, HV, V] and z [B, T, HV·V] in o's dtype or its split-K
    partials [S, B, T, HV·V] fp32; [B, T, HV, V] contiguous. pdl: launched with programmatic dependent launch."""
    return gated_rms_norm(o, summed(z, o.dtype).reshape(o.shape), weight, eps).contiguous()


@gated_norm.register_fake
def _(o, z, weight, eps, pdl=False):
    return torch.empty_like(o, memory_format=torch.contiguous_format)


if triton is not None:

    @triton.jit
    def _gated_norm_kernel(o_ptr, z_ptr, w_ptr, out_ptr, eps, z_split, z_row, z_pos, T: tl.constexpr,
                           HV: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, SZ: tl.constexpr,
                           ROUND_W: tl.constexpr, PDL: tl.constexpr):
        """Program (b·T + t, hv): o and out [B, T, HV, V] contiguous, z's SZ partials at (split, row,
        position) strides with the heads contiguous. ROUND_W: w is 16-bit, so w·ô rounds to o's dtype."""
        bt, hv = tl.program_id(0), tl.program_id(1)
        b, t = bt // T, bt % T
        d = tl.arange(0, BV)
        ok = d < V
        w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        DTYPE: tl.constexpr = out_ptr.dtype.element_ty
        at = (bt * HV + hv) * V + d
        x = tl.load(o_ptr + at, mask=ok, other=0.0).to(tl.float32)
        r = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(x * x, 0), V) + eps))  # (IEEE, as torch on the CPU)
        y = w * (x * r).to(DTYPE).to(tl.float32)
        if ROUND_W:
            y = y.to(DTYPE).to(tl.float32)
        zp = z_ptr + b * z_row + t * z_pos + hv * V + d
        z = tl.load(zp, mask=ok, other=0.0).to(tl.float32)
        for s in tl.static_range(1, SZ):
            z += tl.load(zp + s * z_split, mask=ok, other=0.0).to(tl.float32)
        z = z.to(DTYPE).to(tl.float32)
        tl.store(out_ptr + at, (y * (z / (1.0 + tl.exp(-z)))).to(DTYPE), mask=ok)


@gated_norm.register_kernel("cuda")
def _gated_norm_cuda(o, z, weight, eps, pdl=False):
    B, T, HV, V = o.shape
    if triton is None or not o.is_contiguous() or z.stride(-1) != 1 or not weight.is_contiguous():
        return gated_rms_norm(o, summed(z, o.dtype).reshape(o.shape), weight, eps).contiguous()
    parts = z if z.dim() == 4 else z[None]
    out = torch.empty_like(o)
    _gated_norm_kernel[(B * T, HV)](
        o, parts, weight, out, eps, parts.stride(0), parts.stride(1), parts.stride(2), T=T, HV=HV, V=V,
        BV=triton.next_power_of_2(V), SZ=parts.shape[0], ROUND_W=weight.dtype in (torch.bfloat16, torch.float16),
        PDL=pdl, num_warps=1, launch_pdl=pdl)
    return out
