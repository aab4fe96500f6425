"""Causal depthwise conv1d (+ silu) over new tokens with a rolling window of previous inputs.

The kernel is 4 wide, so the conv is written as W shifted multiply-adds: inductor fuses them with the silu
into one kernel, and the same code serves prefill (T = prompt), decode (T = 1) and speculative verify
(T = block). `conv_decode` is one decode position as one kernel of ours: the window advanced in place, the
projection's split-K partials summed as it loads them. `verify_prologue` is a GDN layer's speculative verify from
its input projection to the recurrence (the conv and the gates, with the commit's replay inputs stored) as one.
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
    def _channel_taps(w_ptr, C, W: tl.constexpr, WP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """A program's BLOCK channels c (mask m), the tap index j [1, WP] and the weights [BLOCK, WP] in fp32
        (the weight [C, W] contiguous), loaded before the PDL wait, which follows (PDL)."""
        c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = c < C
        j = tl.arange(0, WP)[None, :]
        w = tl.load(w_ptr + c[:, None] * W + j, mask=m[:, None] & (j < W)).to(tl.float32)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        return c, m, j, w

    @triton.jit
    def _conv_decode_kernel(x_ptr, w_ptr, win_ptr, out_ptr, C, x_split, x_row, win_row, S: tl.constexpr,
                            W: tl.constexpr, WP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """A program: BLOCK channels of one row, as [BLOCK, WP] tiles of taps (WP = W rounded up to a power of
        2; the weight [C, W] contiguous). x = Σ of S partials (fp32, in order) rounded to the window's dtype; out = silu(Σⱼ window[j]·w[j] +
        x·w[W-1]) in fp32, added tap by tap, rounded once; then the window shifts left by one and takes x (each
        thread rewrites only its own channels, after reading them). PDL: the weights load before the wait."""
        c, m, j, w = _channel_taps(w_ptr, C, W, WP, BLOCK, PDL)
        row = tl.program_id(1)
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


@torch.library.custom_op("fastqwen::verify_prologue",
                         mutates_args=("replay_x", "replay_qkv", "replay_g", "replay_beta"))
def verify_prologue(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, window: torch.Tensor,
                    A_log: torch.Tensor, dt_bias: torch.Tensor, replay_x: torch.Tensor, replay_qkv: torch.Tensor,
                    replay_g: torch.Tensor, replay_beta: torch.Tensor,
                    pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GDN layer's speculative verify between its input projection and the recurrence, with every input the
    commit replays stored. x [B, T, C], a, b [B, T, HV] in window's dtype, or the projection's split-K partials
    [S, B, T, ·] fp32 (summed in order and rounded to window's dtype, as the projection's outputs would be),
    weight [C, W], window [B, C, W-1] (read only: the commit advances it), A_log, dt_bias [HV], replay_x and
    replay_qkv [B, block, C], replay_g and replay_beta [B, block, HV] fp32 (block ≥ T: the cache's replay slices
    of this layer). Returns (silu(conv) [B, T, C], a, b [B, T, HV]), contiguous in window's dtype; writes x and
    that output into the first T positions of replay_x and replay_qkv, the gates g = -exp(A_log)·softplus(a +
    dt_bias) and beta = sigmoid(b) into replay_g and replay_beta, zeros after T (the commit masks them). On CUDA
    one kernel of ours (where a compiled verify had inductor launch ~6: x's partials summed into the window, the
    conv with its replay write, x's replay write, -exp(A_log), g and beta with their replay writes); the taps in
    fp32 as conv_decode's; pdl: with programmatic dependent launch."""
    return _verify_prologue_reference(x, a, b, weight, window, A_log, dt_bias, replay_x, replay_qkv, replay_g,
                                      replay_beta)


def _verify_prologue_reference(x, a, b, weight, window, A_log, dt_bias, replay_x, replay_qkv, replay_g, replay_beta):
    """verify_prologue in plain torch (conv_step, ops/gdn.py gates, then the replay writes)."""
    from .gdn import gates

    xs, a, b = (_summed_input(t, window.dtype) for t in (x, a, b))
    out, _ = conv_step(xs, weight, window)
    g, beta = gates(a, b, A_log, dt_bias)
    T = xs.shape[1]
    for replay, value in ((replay_x, xs), (replay_qkv, out), (replay_g, g), (replay_beta, beta)):
        replay.zero_()
        replay[:, :T].copy_(value)
    return out.contiguous(), a.clone(memory_format=torch.contiguous_format), b.clone(
        memory_format=torch.contiguous_format)  # (clones: an op's outputs may not alias its inputs)


@verify_prologue.register_fake
def _(x, a, b, weight, window, A_log, dt_bias, replay_x, replay_qkv, replay_g, replay_beta, pdl=False):
    B, T, HV = window.shape[0], x.shape[-2], a.shape[-1]
    return window.new_empty(B, T, window.shape[1]), window.new_empty(B, T, HV), window.new_empty(B, T, HV)


if triton is not None:

    @triton.jit
    def _verify_prologue_kernel(x_ptr, ab_ptrs, w_ptr, win_ptr, A_log_ptr, dt_bias_ptr, out_ptr, a_out_ptr,
                                b_out_ptr, rx_ptr, rq_ptr, rg_ptr, rb_ptr, C, HV, x_split, x_row, x_pos, a_split,
                                a_row, a_pos, b_off, win_row, r_row, rg_row, S: tl.constexpr, T: tl.constexpr, W: tl.constexpr,
                                WP: tl.constexpr, BLOCK: tl.constexpr, HVP: tl.constexpr, PDL: tl.constexpr):
        """A program: BLOCK channels of one row at one position t of the replay block (the weight [C, W]
        contiguous, [BLOCK, WP] tiles of taps, WP = W rounded up to a power of 2); the positions run in parallel.
        Input p: the Σ of S partials (fp32, in order) rounded to the window's dtype; p < 0 reads the window's
        column W - 1 + p. t < T: the output silu(Σₖ input[t + k - (W-1)]·w[k]) in fp32, added tap by tap as
        conv_decode's, rounded once, stored to out and to replay qkv; input t stored to replay x. t ≥ T: both
        replays zero. The first program of a position also takes its HV gates: a and b summed and rounded the
        same way (b at b_off elements past a, with a's strides), stored to a_out and b_out [B, T, HV],
        g = -exp(A_log)·softplus(a + dt_bias) and beta = sigmoid(b) in fp32 to the replays (zeros for t ≥ T).
        PDL: the conv weights load before the wait (the window too is written by earlier kernels)."""
        c, m, j, w = _channel_taps(w_ptr, C, W, WP, BLOCK, PDL)
        t = tl.program_id(1)
        row = tl.program_id(2)
        live = t < T
        taps = tl.zeros([BLOCK, WP], tl.float32)
        for k in tl.static_range(W):
            p = t + k - (W - 1)
            own = m & live & (p >= 0)
            xs = tl.load(x_ptr + row * x_row + p * x_pos + c, mask=own).to(tl.float32)
            for s in tl.static_range(1, S):
                xs += tl.load(x_ptr + s * x_split + row * x_row + p * x_pos + c, mask=own).to(tl.float32)
            xq = xs.to(rx_ptr.dtype.element_ty)
            old = tl.load(win_ptr + row * win_row + c * (W - 1) + (W - 1 + p), mask=m & live & (p < 0))
            xk = tl.where(p >= 0, xq, old).to(tl.float32)
            taps = tl.where(j == k, xk[:, None], taps)
            if k == W - 1:
                tl.store(rx_ptr + row * r_row + t * C + c, tl.where(live, xq, 0.0).to(rx_ptr.dtype.element_ty),
                         mask=m)
        acc = tl.zeros([BLOCK], tl.float32)
        for k in tl.static_range(W):  # (conv_step's order, as conv_decode)
            acc += tl.sum(tl.where(j == k, taps * w, 0.0), 1)
        outq = (acc / (1.0 + tl.exp(-acc))).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + (row * T + t) * C + c, outq, mask=m & live)
        tl.store(rq_ptr + row * r_row + t * C + c, tl.where(live, outq, 0.0).to(rq_ptr.dtype.element_ty), mask=m)
        if tl.program_id(0) == 0:
            hv = tl.arange(0, HVP)
            hm = hv < HV
            A = -tl.exp(tl.load(A_log_ptr + hv, mask=hm).to(tl.float32))
            bias = tl.load(dt_bias_ptr + hv, mask=hm).to(tl.float32)
            at = ab_ptrs + row * a_row + t * a_pos + hv
            ga = tl.load(at, mask=hm & live).to(tl.float32)
            gb = tl.load(at + b_off, mask=hm & live).to(tl.float32)
            for s in tl.static_range(1, S):
                ga += tl.load(at + s * a_split, mask=hm & live).to(tl.float32)
                gb += tl.load(at + s * a_split + b_off, mask=hm & live).to(tl.float32)
            aq, bq = ga.to(a_out_ptr.dtype.element_ty), gb.to(b_out_ptr.dtype.element_ty)
            tl.store(a_out_ptr + (row * T + t) * HV + hv, aq, mask=hm & live)
            tl.store(b_out_ptr + (row * T + t) * HV + hv, bq, mask=hm & live)
            xa = aq.to(tl.float32) + bias  # softplus as torch's: x past 20 is x, else log1p(exp(x)), where
            e = tl.exp(tl.minimum(xa, 20.0))  # log1p(e) = log(u)·e / (u - 1) at u = 1 + e rounded (exact to a few
            u = 1.0 + e  # ulps where log(u) alone loses e's digits), e itself where u rounds to 1
            g = A * tl.where(xa > 20.0, xa, tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0))))
            beta = 1.0 / (1.0 + tl.exp(-bq.to(tl.float32)))
            tl.store(rg_ptr + row * rg_row + t * HV + hv, tl.where(live, g, 0.0), mask=hm)
            tl.store(rb_ptr + row * rg_row + t * HV + hv, tl.where(live, beta, 0.0), mask=hm)


@verify_prologue.register_kernel("cuda")
def _verify_prologue_cuda(x, a, b, weight, window, A_log, dt_bias, replay_x, replay_qkv, replay_g, replay_beta,
                          pdl=False):
    B, C, W1 = window.shape
    parts, a_parts, b_parts = (t if t.dim() == 4 else t[None] for t in (x, a, b))
    S, T, HV = parts.shape[0], parts.shape[2], a.shape[-1]
    b_off = b_parts.data_ptr() - a_parts.data_ptr()
    if triton is None or window.stride(2) != 1 or window.stride(1) != W1 or not weight.is_contiguous() or (
            parts.stride(-1) != 1) or replay_x.stride() != replay_qkv.stride() or replay_x.stride(2) != 1 or (
            replay_x.stride(1) != C) or replay_g.stride() != replay_beta.stride() or replay_g.stride(2) != 1 or (
            replay_g.stride(1) != HV) or a_parts.shape[0] != S or b_parts.shape[0] != S or (
            a_parts.stride() != b_parts.stride()) or a_parts.stride(-1) != 1 or a.dtype != b.dtype or (
            b_off % a.element_size()):
        return _verify_prologue_reference(x, a, b, weight, window, A_log, dt_bias, replay_x, replay_qkv, replay_g,
                                          replay_beta)
    out = window.new_empty(B, T, C)
    a_out, b_out = window.new_empty(B, T, HV), window.new_empty(B, T, HV)
    _verify_prologue_kernel[(triton.cdiv(C, CONV_BLOCK), replay_x.shape[1], B)](
        parts, a_parts, weight, window, A_log, dt_bias, out, a_out, b_out, replay_x, replay_qkv, replay_g, replay_beta,
        C, HV, parts.stride(0), parts.stride(1), parts.stride(2), a_parts.stride(0), a_parts.stride(1),
        a_parts.stride(2), b_off // a.element_size(), window.stride(0), replay_x.stride(0), replay_g.stride(0), S=S, T=T, W=W1 + 1,
        WP=triton.next_power_of_2(W1 + 1), BLOCK=CONV_BLOCK, HVP=triton.next_power_of_2(HV), PDL=pdl, num_warps=2,
        launch_pdl=pdl)
    return out, a_out, b_out


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
