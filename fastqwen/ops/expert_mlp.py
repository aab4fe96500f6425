"""Routed experts' whole gated MLP in one launch: y[p] = (silu(x[t]·W1[e]ᵀ gate) · (x[t]·W1[e]ᵀ up)) · W2[e]ᵀ for
each (token, expert) pair p, the experts' weights read in place (bf16, or fp8 e4m3 with per-row scales).

`expert_mlp(x [T, H], exp [P] int32, fmt, w1 [E, 2I, H], s1, w2 [E, H, I], s2, act_dtype)` → y [P, H] fp32; the
pairs are token-major, P / T a token (pair p reads x row p // (P / T)), as a MoE decode step lays them out.
The activation is rounded to act_dtype before the down projection, as the two-launch path
(ops/gemv.py expert_gemv + expert_swiglu_gemv) and the reference do.

Why one launch: a 35B-A3B decode step's expert launches stream 28 MB a layer (fp8) in ~13 µs, half the
bandwidth, because each is short and the down launch cannot start its loads before the gate | up launch has
ended. Here both kinds of tile are programs of one grid: gate | up tiles (BLOCK_N rows of W1, all of H) write
their outputs h [P, 2I] fp32 and count themselves in on their pair (`ready[p]`, release); down tiles (BLOCK_N
rows of W2) load their first step of weights *before* they wait for their pair's gate | up tiles (acquire), then
read h, compute silu(gate)·up and finish. So the down weights stream while the gate | up tiles still run.
Tiles are handed out by a ticket counter in program start order, every gate | up ticket before any down
ticket: a down tile waits only on tiles that some running program holds, so the wait always ends, however
many programs the GPU holds at once. The counters (ticket, finished down tiles, ready[P]) live in
ops/gemv.py's tile_counts buffer and are zero again when the launch ends (the last ticket resets the ticket
counter, the last down tile the others): a CUDA graph replays it as is. The fp8 kernel holds 128 registers a
thread (4 programs an SM; a down tile sums each step at once rather than keeping a BLOCK_N × 512 fp32
accumulator, which took 230). `reference` is the plain torch definition, and what runs off CUDA.

Measured (one H200, 2026-12-03; docs/BENCHMARKS.md, scripts/bench_expert_mlp.py): 40 layers of 9 cold
35B-A3B experts in a CUDA graph, fp8-weight 17.03 µs a layer against 20.19 µs for the two launches and the
sum of their partials, a launch the step does not have (16:4:4 16.86 and 32:3:4 16.89 within noise of CONFIG),
bf16 22.32 against 22.37 (21.53 at 32:3:4). The
35B-A3B fp8-weight decode step (fp8 lm_head) with it: 2000, 2012 and 1989 µs in three processes, against
1921–1978 µs with the separate activation, so it is a candidate (kernels={"expert_act": "mlp"}), not a default.
Launched with PDL (its programs pulling the stacked shared expert into L2 before the wait; 2026-12-03) it
took 2011 and 1975 µs against the default's 1917 and 1918: no better, so that variant was removed.
"""

import torch

from .gemv import BF16, FP8_ROW, STEP, expert_reference, tile_counts

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs the reference
    triton = None

KERNEL_FORMATS = (BF16, FP8_ROW)  # decoded by conversion, one scale a row at most
# (BLOCK_N rows of W1 or W2 a tile, the gate | up loop's pipeline stages, warps a program): the M = 1 sweep's tile for
# every 35B-A3B expert shape; the one-launch sweep (scripts/bench_expert_mlp.py --configs) found none faster by more
# than 1% on fp8 (module docstring)
CONFIG = (32, 4, 4)


def reference(x, exp, fmt: int, w1, s1, w2, s2, act_dtype: torch.dtype) -> torch.Tensor:
    """The plain torch definition: fp32 [P, H], the activation rounded to act_dtype."""
    gate, up = expert_reference(x, None, exp, fmt, w1, s1, None, w1.shape[1]).chunk(2, dim=-1)
    act = (torch.nn.functional.silu(gate) * up).to(act_dtype)
    return expert_reference(act, None, exp, fmt, w2, s2, None, w2.shape[1])


if triton is not None:

    @triton.jit
    def _wait_for(cnt, target):
        """Until the count at cnt reaches target (an acquire load by one thread, then a barrier: the program's
        later reads see what the counted programs wrote before they counted themselves in)."""
        while tl.atomic_add(cnt, 0, sem="acquire", scope="gpu") < target:
            pass

    @triton.jit
    def _activation(h_row, k, I, ACT_DTYPE: tl.constexpr):
        """Columns k of silu(gate)·up rounded to ACT_DTYPE, from a pair's gate | up outputs h_row [2I] fp32 (read
        from L2, .cg: other SMs wrote them)."""
        g = tl.load(h_row + k, cache_modifier=".cg")
        u = tl.load(h_row + I + k, cache_modifier=".cg")
        return (g / (1.0 + tl.exp(-g)) * u).to(ACT_DTYPE).to(tl.float32)

    @triton.jit
    def _gate_up_tile(x_row, w1_ptr, s1_ptr, h_ptr, ready_ptr, p, e, blk, H, I, w1_estride, s1_estride,
                      FMT: tl.constexpr, BLOCK_N: tl.constexpr, BK1: tl.constexpr, STAGES: tl.constexpr):
        """Rows blk · BLOCK_N … of pair p's gate | up product x_row · W1[e]ᵀ over all of H into h [P, 2I] fp32,
        then count the tile in on ready[p] (release, after a barrier behind every thread's stores)."""
        n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < 2 * I
        w_rows = w1_ptr + e * w1_estride + n[:, None] * H
        acc = tl.zeros((BLOCK_N, BK1), tl.float32)
        for k0 in tl.range(0, H, BK1, num_stages=STAGES):
            k = k0 + tl.arange(0, BK1)
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0).to(tl.float32)
            acc += w * tl.load(x_row + k).to(tl.float32)[None, :]
        g = tl.sum(acc, axis=1)
        if FMT == 0:
            g = g * tl.load(s1_ptr + e * s1_estride + n, mask=n_ok, other=0.0)
        tl.store(h_ptr + p * 2 * I + n, g, mask=n_ok)
        tl.debug_barrier()
        tl.atomic_add(ready_ptr + p, 1, sem="release", scope="gpu")

    @triton.jit
    def _down_tile(w2_ptr, s2_ptr, h_ptr, y_ptr, ready_ptr, p, e, blk, H, I, w2_estride, s2_estride,
                   FMT: tl.constexpr, BLOCK_N: tl.constexpr, BK2: tl.constexpr, ACT_DTYPE: tl.constexpr):
        """Rows blk · BLOCK_N … of pair p's down product silu(gate)·up · W2[e]ᵀ over all of I into y [P, H]:
        the first BK2 columns of weights are loaded before the wait for the pair's gate | up tiles."""
        n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < H
        w_rows = w2_ptr + e * w2_estride + n[:, None] * I
        k = tl.arange(0, BK2)
        w_first = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0)  # issued before the wait
        _wait_for(ready_ptr + p, tl.cdiv(2 * I, BLOCK_N))
        h_row = h_ptr + p * 2 * I
        # (each step summed at once: an accumulator of BLOCK_N × BK2 fp32 would hold 128 registers a thread)
        y = tl.sum(w_first.to(tl.float32) * _activation(h_row, k, I, ACT_DTYPE)[None, :], axis=1)
        for k0 in tl.range(BK2, I, BK2):
            w = tl.load(w_rows + k0 + k[None, :], mask=n_ok[:, None], other=0.0).to(tl.float32)
            y += tl.sum(w * _activation(h_row, k0 + k, I, ACT_DTYPE)[None, :], axis=1)
        if FMT == 0:
            y = y * tl.load(s2_ptr + e * s2_estride + n, mask=n_ok, other=0.0)
        tl.store(y_ptr + p * H + n, y, mask=n_ok)

    @triton.jit
    def _finish(cnt_ptr, P, last):
        """Count a finished down tile in (cnt[1]); the last one (`last` finished before it) sets the counts back
        to 0 for the next launch (every other tile is past its wait by then)."""
        tl.debug_barrier()  # every thread past its reads before the count
        if tl.atomic_add(cnt_ptr + 1, 1, sem="acq_rel", scope="gpu") == last:
            q = tl.arange(0, 128)
            for q0 in range(0, P, 128):
                tl.store(cnt_ptr + 2 + q0 + q, 0, mask=q0 + q < P)
            tl.store(cnt_ptr + 1, 0)

    @triton.jit
    def _expert_mlp_kernel(x_ptr, exp_ptr, w1_ptr, s1_ptr, w2_ptr, s2_ptr, h_ptr, y_ptr, cnt_ptr, P, H, I,
                           per_row, w1_estride, w2_estride, s1_estride, s2_estride, FMT: tl.constexpr,
                           BLOCK_N: tl.constexpr, BK1: tl.constexpr, BK2: tl.constexpr, STAGES: tl.constexpr,
                           ACT_DTYPE: tl.constexpr):
        """One tile a program, by ticket: gate | up tiles first (P · ⌈2I / BLOCK_N⌉), then down tiles
        (P · ⌈H / BLOCK_N⌉). cnt: [0] the ticket, [1] finished down tiles, [2 + p] pair p's finished gate | up
        tiles. BK1 | H, BK2 | I."""
        up_tiles = tl.cdiv(2 * I, BLOCK_N)
        down_tiles = tl.cdiv(H, BLOCK_N)
        first = P * up_tiles  # the first down ticket
        t = tl.atomic_add(cnt_ptr, 1)
        if t == first + P * down_tiles - 1:  # the last ticket: every program has taken its own
            tl.atomic_xchg(cnt_ptr, 0)
        if t < first:
            p = t // up_tiles
            e = tl.load(exp_ptr + p).to(tl.int64)
            _gate_up_tile(x_ptr + (p // per_row).to(tl.int64) * H, w1_ptr, s1_ptr, h_ptr, cnt_ptr + 2, p, e,
                          t % up_tiles, H, I, w1_estride, s1_estride, FMT, BLOCK_N, BK1, STAGES)
        else:
            p = (t - first) // down_tiles
            e = tl.load(exp_ptr + p).to(tl.int64)
            _down_tile(w2_ptr, s2_ptr, h_ptr, y_ptr, cnt_ptr + 2, p, e, (t - first) % down_tiles, H, I, w2_estride,
                       s2_estride, FMT, BLOCK_N, BK2, ACT_DTYPE)
            _finish(cnt_ptr, P, P * down_tiles - 1)


_TL_DTYPES = {} if triton is None else {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
                                        torch.float32: tl.float32}


def _step(n: int) -> int:
    """The widest of 512, 256, 128 columns dividing n."""
    return next(s for s in (512, 256, STEP) if n % s == 0)


def _check(x, exp, fmt: int, w1, s1, w2, s2, act_dtype: torch.dtype) -> None:
    """What the kernels take: fmt in KERNEL_FORMATS, H and I multiples of 128, P / T pairs a token, each expert's
    weight contiguous, fp8-weight's scales one a row ([E, N], rows adjacent), a 16-bit or fp32 activation."""
    T, H = x.shape
    P, E, I = exp.shape[0], w1.shape[0], w2.shape[-1]
    if (fmt not in KERNEL_FORMATS or H % STEP or I % STEP or tuple(w1.shape) != (E, 2 * I, H)
            or tuple(w2.shape) != (E, H, I)):
        raise ValueError(f"the one-launch expert MLP takes bf16 or fp8-weight experts w1 [E, 2I, H], w2 [E, H, I] "
                         f"with H and I multiples of {STEP}; got format {fmt}, w1 {tuple(w1.shape)}, "
                         f"w2 {tuple(w2.shape)}")
    if P % max(T, 1) or act_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"expert_mlp needs P / T pairs a token and a 16-bit or fp32 activation dtype; got {P} pairs, "
                         f"{T} rows, {act_dtype}")
    if not (w1[0].is_contiguous() and w2[0].is_contiguous()) or fmt == FP8_ROW and (
            s1.shape != w1.shape[:2] or s2.shape != w2.shape[:2] or s1.stride(1) != 1 or s2.stride(1) != 1):
        raise ValueError(f"expert_mlp needs each expert's weight contiguous and fp8-weight's scales one a row, "
                         f"[E, N] with rows adjacent; got scales {None if s1 is None else tuple(s1.shape)} and "
                         f"{None if s2 is None else tuple(s2.shape)}")


def launch(x, exp, fmt: int, w1, s1, w2, s2, act_dtype: torch.dtype, config: tuple = CONFIG) -> torch.Tensor:
    """The kernel (_expert_mlp_kernel): fp32 y [P, H]; `_check` says what it takes; `config` (BLOCK_N, stages,
    warps) as CONFIG."""
    _check(x, exp, fmt, w1, s1, w2, s2, act_dtype)
    block_n, stages, warps = config
    if block_n not in (16, 32, 64, 128) or not 1 <= stages <= 6 or warps not in (1, 2, 4, 8):
        raise ValueError(f"expert_mlp's config is (BLOCK_N in 16, 32, 64, 128; stages 1 … 6; warps 1, 2, 4 or 8); "
                         f"got {config}")
    (T, H), P, I = x.shape, exp.shape[0], w2.shape[-1]
    y = torch.empty(P, H, dtype=torch.float32, device=x.device)
    if P == 0:
        return y
    h = torch.empty(P, 2 * I, dtype=torch.float32, device=x.device)
    tiles = P * (triton.cdiv(2 * I, block_n) + triton.cdiv(H, block_n))
    cnt = tile_counts(x.device, 2 + P)
    s1 = w1 if s1 is None else s1  # (BF16 reads no scale; any pointer does)
    s2 = w2 if s2 is None else s2
    _expert_mlp_kernel[(tiles,)](x, exp, w1, s1, w2, s2, h, y, cnt, P, H, I, P // T, w1.stride(0), w2.stride(0),
                                 s1.stride(0), s2.stride(0),
                                 FMT=fmt, BLOCK_N=block_n, BK1=256 if H % 256 == 0 else STEP, BK2=_step(I),
                                 STAGES=stages, ACT_DTYPE=_TL_DTYPES[act_dtype], num_warps=warps)
    return y


@torch.library.custom_op("fastqwen::expert_mlp", mutates_args=())
def expert_mlp(x: torch.Tensor, exp: torch.Tensor, fmt: int, w1: torch.Tensor, s1: torch.Tensor | None,
               w2: torch.Tensor, s2: torch.Tensor | None, act_dtype: torch.dtype) -> torch.Tensor:
    """Routed experts' gated MLP, gate | up, silu(gate)·up in act_dtype and down, in one launch on CUDA (see the
    module docstring), the reference elsewhere: x [T, H], token-major pairs exp [P] int32 → fp32 [P, H]."""
    if x.is_cuda and triton is not None:
        return launch(x.contiguous(), exp, fmt, w1, s1, w2, s2, act_dtype)
    return reference(x, exp, fmt, w1, s1, w2, s2, act_dtype)


@expert_mlp.register_fake
def _(x, exp, fmt, w1, s1, w2, s2, act_dtype):
    return x.new_empty(exp.shape[0], w2.shape[1], dtype=torch.float32)

