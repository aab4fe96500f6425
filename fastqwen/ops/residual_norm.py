"""A block's output added into the residual stream and the next RMSNorm, across programs
(kernels={"residual_norm": "kernel"}, a candidate).

In a compiled decode step inductor writes `x = x + y; h = rms_norm(x, w)` (y: the o / out or down projection's
split-K partials) as one reduction kernel with one program a row: at one row a single program reads the 8
partials of 5120 fp32 (160 KB) and the residual, 3.9 µs a launch, two a layer (27B int4, 16-layer profile, H100,
2026-12-06). `residual_norm` spreads that read over P programs of BLOCK columns: each sums its columns' partials
in split order in fp32, rounds to x's dtype (the projection's output), adds the residual (rounded again: the new
residual, stored) and stores its rows' sums of squares; an atomic count (acquire-release: their stores are
visible to whoever counts last) names the last program, which adds the P sums in a fixed order and writes the
normalised rows (reading the new residual back, 10 KB a row). No program waits for another, so no co-residency
is needed; the count is reset by the last program, so CUDA graph replays start from zero. Rows: at most
MAX_ROWS (decode, an MTP verify), which model.py keeps to; more take the reference. Its first form, whose last
program walked the row in 256-column blocks (an L2 round trip each), took 10.1 µs a launch on an H100; the last
program now takes a row at once (not yet timed; docs/DESIGN-NOTES.md).
"""

import torch

from .attention_prep import summed
from .norm import rms_norm

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs the reference
    triton = None

BLOCK = 256  # columns a program (the 27B's 5120: 20 programs)
MAX_ROWS = 4  # (the last program normalises every row alone: a verify of 16 keeps inductor's kernel)
SCRATCH = 4096  # fp32 sums of squares a device holds: programs × rows (padded to a power of 2)
_scratch: dict = {}  # device → (sums of squares, the count): one for every launch, which run one after another


def reference(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y, rms_norm(x + y)) for the residual x [B, T, N] and y the block's output [B, T, N] in x's dtype or
    its split-K partials [S, B, T, N] fp32 (summed in split order, rounded to x's dtype), as model.py's plain
    walk computes them."""
    x = x + summed(y, x.dtype)
    return x, rms_norm(x, weight, eps)


@torch.library.custom_op("fastqwen::residual_norm", mutates_args=())
def residual_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float,
                  pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference`'s (new residual, normalised rows), both [B, T, N] contiguous in x's dtype. pdl: launched with
    programmatic dependent launch."""
    return tuple(t.contiguous() for t in reference(x, y, weight, eps))


@residual_norm.register_fake
def _(x, y, weight, eps, pdl=False):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


def reserve(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The device's scratch (sums of squares, count), allocated and zeroed on first use: call it before a CUDA
    graph is captured (the Forward does), so the capture records no allocation or memset."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # (one key a GPU: x.device has its index)
    if device not in _scratch:
        _scratch[device] = (torch.zeros(SCRATCH, device=device), torch.zeros(1, device=device, dtype=torch.int32))
    return _scratch[device]


if triton is not None:

    @triton.jit
    def _residual_norm_kernel(x_ptr, y_ptr, w_ptr, x_out, h_out, ss_ptr, count_ptr, eps, y_split, R, N,
                              RB: tl.constexpr, BLOCK: tl.constexpr, P: tl.constexpr, PB: tl.constexpr,
                              NB: tl.constexpr, S: tl.constexpr, PDL: tl.constexpr):
        """Program p of P: columns [p·BLOCK, (p + 1)·BLOCK) of R ≤ RB rows. x, y's partials (S of them, y_split
        apart; S = 1 with y in x's dtype) and the outputs [R, N] contiguous; ss_ptr [P, RB] fp32 and count_ptr
        int32 (zero) the device's scratch; NB ≥ N a power of 2 (the last program takes a row at once)."""
        p = tl.program_id(0)
        rows = tl.arange(0, RB)[:, None]
        cols = p * BLOCK + tl.arange(0, BLOCK)[None, :]
        ok = (rows < R) & (cols < N)
        at = rows * N + cols
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        DTYPE: tl.constexpr = x_out.dtype.element_ty
        y = tl.load(y_ptr + at, mask=ok, other=0.0).to(tl.float32)
        for s in tl.static_range(1, S):
            y += tl.load(y_ptr + s * y_split + at, mask=ok, other=0.0)
        x = (tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32) + y.to(DTYPE).to(tl.float32)).to(DTYPE)
        tl.store(x_out + at, x, mask=ok)
        xf = x.to(tl.float32)
        tl.store(ss_ptr + p * RB + tl.arange(0, RB), tl.sum(xf * xf, 1))
        if tl.atomic_add(count_ptr, 1, sem="acq_rel") == P - 1:  # the last program: every store above is seen
            tl.store(count_ptr, 0)
            parts = tl.arange(0, PB)
            row = tl.arange(0, NB)
            w1 = 1.0 + tl.load(w_ptr + row, mask=row < N, other=0.0).to(tl.float32)
            for r in tl.static_range(RB):  # (one row a round, all its loads at once: a loop over column blocks
                if r < R:                  # paid an L2 round trip a block, 10.1 µs a launch on an H100)
                    ss = tl.load(ss_ptr + parts * RB + r, mask=parts < P, other=0.0, cache_modifier=".cg")
                    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(ss, 0), N.to(tl.float32)) + eps))  # (IEEE)
                    xn = tl.load(x_out + r * N + row, mask=row < N, other=0.0, cache_modifier=".cg").to(tl.float32)
                    tl.store(h_out + r * N + row, ((xn * rstd) * w1).to(DTYPE), mask=row < N)


@residual_norm.register_kernel("cuda")
def _residual_norm_cuda(x, y, weight, eps, pdl=False):
    N = x.shape[-1]
    R = x.numel() // N
    parts = y if y.dim() == x.dim() + 1 else y[None]
    P, RB = -(-N // BLOCK), 1 << (R - 1).bit_length()
    if (triton is None or R > MAX_ROWS or P * RB > SCRATCH or not x.is_contiguous()
            or not parts[0].is_contiguous() or not weight.is_contiguous()):
        return tuple(t.contiguous() for t in reference(x, y, weight, eps))
    ss, count = reserve(x.device)
    x_out, h_out = torch.empty_like(x), torch.empty_like(x)
    _residual_norm_kernel[(P,)](
        x, parts, weight, x_out, h_out, ss, count, eps, parts.stride(0), R, N, RB=RB, BLOCK=BLOCK, P=P,
        PB=triton.next_power_of_2(P), NB=triton.next_power_of_2(N), S=parts.shape[0], PDL=pdl, num_warps=8,
        launch_pdl=pdl)
    return x_out, h_out
