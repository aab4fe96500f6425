"""Causal depthwise conv1d (+ silu) over new tokens with a rolling window of previous inputs.

The kernel is 4 wide, so the conv is written as W shifted multiply-adds: inductor fuses them with the silu
into one kernel, and the same code serves prefill (T = prompt), decode (T = 1) and speculative verify
(T = block). `conv_decode` is one decode position as one kernel of ours: the window advanced in place, the
projection's split-K partials summed as it loads them.
"""

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs the reference
    triton = None


def conv_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(conv(x)) for new inputs x [B, T, C] with depthwise weight [C, W], and the window after x.

    state [B, C, W-1] holds the W-1 inputs before x (zeros for a fresh sequence). Returns the output [B, T, C]
    and the last W-1 inputs of cat(state, x) [B, C, W-1], both in x.dtype and from one read of state, which is
    left as it is: the caller stores the window (HybridCache.write; a speculative verify leaves it to
    `commit_window`). Storing it in place here would make the read and the write two uses of state, which
    inductor may order write-first and then cannot reinplace.
    """
    width = weight.shape[-1]
    seq = x.shape[1]
    window = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, C, W-1+T]
    w = weight.to(x.dtype)
    out = window[:, :, 0:seq] * w[:, 0:1]
    for j in range(1, width):
        out = out + window[:, :, j : j + seq] * w[:, j : j + 1]
    return F.silu(out).transpose(1, 2), window[:, :, seq:]


def commit_window(state: torch.Tensor, x: torch.Tensor, keep: torch.Tensor) -> None:
    """Advance windows state [..., B, C, W-1] past the first keep[b] of the T inputs x [..., B, T, C]
    (0 ≤ keep ≤ T), in place; leading dims (stacked layers) share keep.

    The new window is the W-1 inputs ending at input keep[b]-1 of cat(state, x); keep 0 leaves it as is.
    """
    width_1 = state.shape[-1]
    window = torch.cat([state, x.transpose(-1, -2).to(state.dtype)], dim=-1)  # [..., B, C, W-1+T]
    idx = keep[:, None] + torch.arange(width_1, device=keep.device)  # [B, W-1]
    state.copy_(window.gather(-1, idx[:, None, :].expand(*window.shape[:-1], width_1)))


def _summed_input(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """conv_decode's x as the conv reads it: split-K partials [S, B, 1, C] summed (fp32) and rounded to dtype;
    an input [B, 1, C] as it is."""
    return x.float().sum(0).to(dtype) if x.dim() == 4 else x


@torch.library.custom_op("fastqwen::conv_decode", mutates_args=("window",))
def conv_decode(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """conv_step at one decode position with the window advanced in place: x [B, 1, C] in window's dtype, or
    the input projection's split-K partials [S, B, 1, C] fp32 (summed and rounded to window's dtype, as the
    projection's output would be; ops/gemv.py wq_linear), weight [C, W], window [B, C, W-1] (the cache's
    layer view). Returns silu(conv) [B, 1, C] in window's dtype. On CUDA one kernel of ours, the taps in fp32
    (where a compiled step had inductor launch three: the new window, its write into the cache, the output);
    pdl: with programmatic dependent launch (the weights load before the wait)."""
    out, new = conv_step(_summed_input(x, window.dtype), weight, window)
    window.copy_(new)
    return out.contiguous()


@conv_decode.register_fake
def _(x, weight, window, pdl=False):
    return window.new_empty(window.shape[0], 1, window.shape[1])


if triton is not None:

    @triton.jit
    def _conv_decode_kernel(x_ptr, w_ptr, win_ptr, out_ptr, C, x_split, x_row, win_row, S: tl.constexpr,
                            W: tl.constexpr, WP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """A program: BLOCK channels of one row, as [BLOCK, WP] tiles of taps (WP = W rounded up to a power of
        2; the weight [C, W] contiguous). x = Σ of S partials (fp32, in order) rounded to the window's dtype; out = silu(Σⱼ window[j]·w[j] +
        x·w[W-1]) in fp32, added tap by tap, rounded once; then the window shifts left by one and takes x (each
        thread rewrites only its own channels, after reading them). PDL: the weights load before the wait."""
        c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        row = tl.program_id(1)
        m = c < C
        j = tl.arange(0, WP)[None, :]
        w = tl.load(w_ptr + c[:, None] * W + j, mask=m[:, None] & (j < W)).to(tl.float32)  # [BLOCK, WP]
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        xs = tl.load(x_ptr + row * x_row + c, mask=m).to(tl.float32)
        for s in tl.static_range(1, S):
            xs += tl.load(x_ptr + s * x_split + row * x_row + c, mask=m).to(tl.float32)
        xq = xs.to(win_ptr.dtype.element_ty)
        wins = win_ptr + row * win_row + c[:, None] * (W - 1) + j
        taps = tl.where(j == W - 1, xq[:, None], tl.load(wins, mask=m[:, None] & (j < W - 1))).to(tl.float32)
        acc = tl.zeros([BLOCK], tl.float32)
        for t in tl.static_range(W):  # (in conv_step's order; picking a column out adds zeros: exact)
            acc += tl.sum(tl.where(j == t, taps * w, 0.0), 1)
        out = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + row * C + c, out.to(out_ptr.dtype.element_ty), mask=m)
        shifted = tl.where(j == W - 2, xq[:, None], tl.load(wins + 1, mask=m[:, None] & (j < W - 2)))
        tl.store(wins, shifted, mask=m[:, None] & (j < W - 1))


CONV_BLOCK = 256  # channels a program: 32–40 programs a row at Qwen3.5's 8192–10240 channels


@conv_decode.register_kernel("cuda")
def _conv_decode_cuda(x, weight, window, pdl=False):
    B, C, W1 = window.shape
    if triton is None or window.stride(2) != 1 or window.stride(1) != W1 or not weight.is_contiguous() or (
            x.stride(-1) != 1):
        out, new = conv_step(_summed_input(x, window.dtype), weight, window)
        window.copy_(new)
        return out.contiguous()
    parts = x if x.dim() == 4 else x[None]
    out = window.new_empty(B, 1, C)
    _conv_decode_kernel[(triton.cdiv(C, CONV_BLOCK), B)](
        parts, weight, window, out, C, parts.stride(0), parts.stride(1), window.stride(0),
        S=parts.shape[0], W=W1 + 1, WP=triton.next_power_of_2(W1 + 1), BLOCK=CONV_BLOCK, PDL=pdl, num_warps=2,
        launch_pdl=pdl)
    return out
