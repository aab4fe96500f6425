"""MoE routing of few tokens in one launch: top-k experts of each token's router logits and their weights.

`route(logits [N, E (+1)], k, shared)` → (weights [N, k (+1)] fp32, experts [N, k (+1)] int32); the logits may
also be the router matmul's split-K partials [S, N, E (+1)] fp32 with the dtype the logits would have had
(`logit_dtype`): the kernel sums and rounds them as it loads them, so no launch of their own sits between the
router matmul and the routing (one of ~23 launches a 35B-A3B decode layer, whose step is bound by its
launches' latency). As transformers
routes Qwen3.5 MoE: softmax over the E experts, the k largest, renormalised to sum to 1, which is a softmax
over the k selected logits (the full denominator cancels), so the kernel never exponentiates the other E − k.
With `shared`, logits column E is the shared expert's gate (moe.stack_shared_expert): it is appended as
expert E with weight sigmoid(logit). The eager path (softmax, topk, renormalise, cat) is a handful of
kernels, aten's topk among them; at decode on 35B-A3B that is ~5 launches in each of 40 layers for a
[1, 256] row. The Triton kernel (one program a token, k rounds of argmax) is one launch; `reference` is
the torch definition, and what runs off CUDA. Ties: the lower expert index first (torch.topk's order on
ties is unspecified; router logits tie with probability ~0). `packed` (a candidate): each round one max over
(logit, index) packed into an int64, in one warp (shuffles only), instead of a max and then a min over the
indices holding it across 4 warps (shared memory and a barrier each): 8 reductions a token instead of 16.
`router_route(x [1, H], router [E (+1), H], k, shared)` is one token's router matmul and routing in one
launch (a decode step's; kernels route "fused", the default): programs of 16 router rows × 256 columns write
the logits' split-K partials, and the last of them to count itself in routes them as the packed kernel does,
so the routing costs no launch of its own and no wait for one; with PDL the router's weights are loaded
before the wait.
"""

import torch

from .gemv import tile_counts

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs the reference
    triton = None


def summed(logits: torch.Tensor, logit_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Logits [N, E (+1)] from route's input: logits, or partials [S, N, E (+1)] summed in fp32, rounded to
    logit_dtype (None: kept in the input's dtype), as the kernel reads them."""
    if logit_dtype is None or logit_dtype == logits.dtype:
        return logits if logits.dim() == 2 else logits.float().sum(0).to(logits.dtype)
    return (logits if logits.dim() == 2 else logits.float().sum(0)).to(logit_dtype)


def reference(logits: torch.Tensor, k: int, shared: bool, logit_dtype: torch.dtype | None = None):
    """(weights fp32 [N, k (+1)], experts int32 [N, k (+1)]): transformers' routing in plain torch."""
    logits = summed(logits, logit_dtype)
    E = logits.shape[1] - shared
    probs = torch.softmax(logits[:, :E].float(), dim=-1)
    weights, experts = torch.topk(probs, k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    experts = experts.int()
    if shared:
        weights = torch.cat([weights, torch.sigmoid(logits[:, E:].float())], dim=1)
        experts = torch.cat([experts, torch.full_like(experts[:, :1], E)], dim=1)
    return weights, experts


if triton is not None:

    @triton.jit
    def _ordered_key(logit, e, BLOCK_E: tl.constexpr):
        """int64 keys whose order is (logit, then the lower index) order: the fp32 bits made monotonic as int32
        (negative values' magnitude bits flipped; -0 first made +0 so that it ties with +0) in the high word,
        BLOCK_E - 1 - e in the low one."""
        bits = tl.where(logit == 0.0, 0.0, logit).to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        return (ordered.to(tl.int64) << 32) | (BLOCK_E - 1 - e).to(tl.int64)

    @triton.jit
    def _key_logit(key):
        """The logit of an _ordered_key (the transform is its own inverse)."""
        ordered = (key >> 32).to(tl.int32)
        return (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)

    @triton.jit
    def _rounded(logit, ROUND: tl.constexpr):
        """fp32 logits rounded through bf16 (ROUND 1) or fp16 (ROUND 2), or unchanged (0)."""
        if ROUND == 1:
            logit = logit.to(tl.bfloat16).to(tl.float32)
        elif ROUND == 2:
            logit = logit.to(tl.float16).to(tl.float32)
        return logit

    @triton.jit
    def _route_kernel(logits_ptr, w_ptr, e_ptr, stride, split_stride, E: tl.constexpr, K: tl.constexpr,
                      SHARED: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
                      PACKED: tl.constexpr = False, S: tl.constexpr = 1, ROUND: tl.constexpr = 0):
        """One token: k rounds of (max, its lowest index, mask it out); weights = softmax over the k maxima.
        PDL (launched with launch_pdl): wait for the previous kernel (the logits are its output) first. PACKED:
        a round is one max over _ordered_key. S: the logits are the sum of S partials, split_stride apart,
        rounded through bf16 (ROUND 1) or fp16 (ROUND 2) or not (0)."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        _route_row(logits_ptr, w_ptr, e_ptr, tl.program_id(0), stride, split_stride, E, K, SHARED, BLOCK_E, BLOCK_K,
                   PACKED, S, ROUND)

    @triton.jit
    def _load_logit(src, CG: tl.constexpr):
        """fp32 of logits (or partials) at src; CG: read from L2 (.cg), where other programs of the launch wrote
        them."""
        if CG:
            return tl.load(src, cache_modifier=".cg").to(tl.float32)
        return tl.load(src).to(tl.float32)

    @triton.jit
    def _route_row(logits_ptr, w_ptr, e_ptr, row, stride, split_stride, E: tl.constexpr, K: tl.constexpr,
                   SHARED: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PACKED: tl.constexpr,
                   S: tl.constexpr, ROUND: tl.constexpr, CG: tl.constexpr = 0):
        """_route_kernel's routing of token `row` (also the last tile's work in _router_route_kernel; CG: the
        logits' partials are read from L2)."""
        e = tl.arange(0, BLOCK_E)
        logit = tl.zeros((BLOCK_E,), tl.float32)
        for s in tl.static_range(S):
            logit += _load_logit(logits_ptr + s * split_stride + row * stride + tl.minimum(e, E - 1), CG)
        logit = tl.where(e < E, _rounded(logit, ROUND), -float("inf"))
        j = tl.arange(0, BLOCK_K)
        top = tl.full((BLOCK_K,), -float("inf"), tl.float32)
        idx = tl.zeros((BLOCK_K,), tl.int32)
        if PACKED:
            key = _ordered_key(logit, e, BLOCK_E)
            for i in tl.static_range(K):
                best = tl.max(key, axis=0)
                at = (BLOCK_E - 1 - (best & 0xFFFFFFFF)).to(tl.int32)
                top = tl.where(j == i, _key_logit(best), top)
                idx = tl.where(j == i, at, idx)
                key = tl.where(e == at, -9223372036854775807 - 1, key)
        else:
            for i in tl.static_range(K):
                best = tl.max(logit, axis=0)
                at = tl.min(tl.where(logit == best, e, BLOCK_E), axis=0)  # the lowest index holding the max
                top = tl.where(j == i, best, top)
                idx = tl.where(j == i, at, idx)
                logit = tl.where(e == at, -float("inf"), logit)
        p = tl.exp(top - tl.max(top, axis=0))  # exp(-inf) = 0 past k
        out = row * (K + SHARED)
        tl.store(w_ptr + out + j, p / tl.sum(p, axis=0), mask=j < K)
        tl.store(e_ptr + out + j, idx, mask=j < K)
        if SHARED:
            g = _load_logit(logits_ptr + row * stride + E, CG)
            for s in tl.static_range(1, S):
                g += _load_logit(logits_ptr + s * split_stride + row * stride + E, CG)
            g = _rounded(g, ROUND)
            tl.store(w_ptr + out + K, 1.0 / (1.0 + tl.exp(-g)))
            tl.store(e_ptr + out + K, E)

    @triton.jit
    def _router_route_kernel(x_ptr, r_ptr, lp_ptr, w_ptr, e_ptr, cnt_ptr, H, E: tl.constexpr, K: tl.constexpr,
                             SHARED: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RN: tl.constexpr,
                             RK: tl.constexpr, S: tl.constexpr, ROUND: tl.constexpr, PDL: tl.constexpr):
        """One token's router matmul and routing: program t computes RN router rows over RK columns (split
        t % S of H = S · RK) into the partials lp [S, E + SHARED] fp32, then counts itself in (cnt[0], acq_rel,
        after a barrier behind every thread's stores); the last to count routes them (_route_row, packed rounds)
        and sets the count back to 0. PDL: the router's weights are loaded before the wait (they are constants),
        x after it."""
        t = tl.program_id(0)
        split = t % S
        n = (t // S) * RN + tl.arange(0, RN)
        n_ok = n < E + SHARED
        k = split * RK + tl.arange(0, RK)
        w = tl.load(r_ptr + n[:, None] * H + k[None, :], mask=n_ok[:, None], other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        logit = tl.sum(w.to(tl.float32) * tl.load(x_ptr + k).to(tl.float32)[None, :], axis=1)
        tl.store(lp_ptr + split * (E + SHARED) + n, logit, mask=n_ok)
        tl.debug_barrier()  # every thread's partials stored before the count
        if tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
            _route_row(lp_ptr, w_ptr, e_ptr, 0, 0, E + SHARED, E, K, SHARED, BLOCK_E, BLOCK_K, True, S, ROUND, True)
            tl.store(cnt_ptr, 0)


_ROUND = {None: 0, torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def launch(logits: torch.Tensor, k: int, shared: bool, pdl: bool = False, packed: bool = False,
           logit_dtype: torch.dtype | None = None):
    """The Triton kernel (any device Triton runs on, its CPU interpreter included); same contract as route.
    pdl: launch with programmatic dependent launch (Hopper+); packed: the one-warp packed-key rounds."""
    parts = logits.contiguous() if logits.dim() == 3 else logits.contiguous()[None]
    S, N, E = parts.shape[0], parts.shape[1], parts.shape[2] - shared
    target = logit_dtype or parts.dtype  # (summed) the logits' dtype: one partial in it is read as it is
    rounding = None if S == 1 and parts.dtype == target else target
    if rounding not in _ROUND:
        raise ValueError(f"router logits in {rounding}: the kernel rounds to bf16, fp16 or fp32")
    weights = torch.empty(N, k + shared, dtype=torch.float32, device=logits.device)
    experts = torch.empty(N, k + shared, dtype=torch.int32, device=logits.device)
    if N:
        _route_kernel[(N,)](parts, weights, experts, parts.stride(1), parts.stride(0), E=E, K=k, SHARED=shared,
                            BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(k), PDL=pdl,
                            PACKED=packed, S=S, ROUND=_ROUND[rounding], num_warps=1 if packed else 4,
                            launch_pdl=pdl)
    return weights, experts


# (RN router rows, RK columns, warps) a program of the fused router matmul and routing: 16 × 256 bf16 in two warps
# (32 registers of weights a thread), 136 programs at 35B-A3B's 257 × 2048 router. Swept on one H200
# (scripts/bench_expert_mlp.py --tables router, 40 cold routers, µs a layer without / with PDL): 16:256:2
# 4.96 / 4.01, 8:256:1 4.90 / 4.27, 8:512:2 6.00 / 3.83, 16:512:4 4.77 / 4.03; the two launches 5.21 / 4.53
FUSED_CONFIG = (16, 256, 2)


def fused_reference(x: torch.Tensor, router: torch.Tensor, k: int, shared: bool):
    """router_route in plain torch: the logits x · routerᵀ summed in fp32, rounded to x's dtype, routed."""
    return reference(x.float() @ router.float().t(), k, shared, x.dtype)


def fused_launch(x: torch.Tensor, router: torch.Tensor, k: int, shared: bool, pdl: bool = False,
                 config: tuple = FUSED_CONFIG):
    """The kernel (_router_route_kernel) for one token x [1, H] and a contiguous router [E (+1), H] in x's dtype,
    H a multiple of RK (config as FUSED_CONFIG)."""
    rn, rk, warps = config
    (T, H), (rows, width) = x.shape, router.shape
    if T != 1 or width != H or H % rk or router.dtype != x.dtype or x.dtype not in _ROUND or not router.is_contiguous():
        raise ValueError(f"router_route routes one token x [1, H] with a contiguous router [E (+1), H] in x's 16-bit "
                         f"or fp32 dtype, H a multiple of {rk}; got x {tuple(x.shape)} {x.dtype}, router "
                         f"{tuple(router.shape)} {router.dtype}")
    E, S = rows - shared, H // rk
    parts = torch.empty(S, rows, dtype=torch.float32, device=x.device)
    weights = torch.empty(1, k + shared, dtype=torch.float32, device=x.device)
    experts = torch.empty(1, k + shared, dtype=torch.int32, device=x.device)
    _router_route_kernel[(triton.cdiv(rows, rn) * S,)](
        x.contiguous(), router, parts, weights, experts, tile_counts(x.device, 1), H, E=E, K=k, SHARED=shared,
        BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(k), RN=rn, RK=rk, S=S,
        ROUND=_ROUND[x.dtype], PDL=pdl, num_warps=warps, launch_pdl=pdl)
    return weights, experts


@torch.library.custom_op("fastqwen::router_route", mutates_args=())
def router_route(x: torch.Tensor, router: torch.Tensor, k: int, shared: bool,
                 pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's router matmul and routing in one launch on CUDA (pdl: with programmatic dependent launch, the
    router's weights loaded before the wait): x [1, H], router [E (+1 with shared), H] → (weights fp32, experts
    int32) [1, k (+1)], as `route` computes them from the rounded logits; the reference elsewhere."""
    if x.is_cuda and triton is not None:
        return fused_launch(x, router, k, shared, pdl)
    return fused_reference(x, router, k, shared)


@router_route.register_fake
def _(x, router, k, shared, pdl=False):
    return x.new_empty(1, k + shared, dtype=torch.float32), x.new_empty(1, k + shared, dtype=torch.int32)


@torch.library.custom_op("fastqwen::route", mutates_args=())
def route(logits: torch.Tensor, k: int, shared: bool, pdl: bool = False, packed: bool = False,
          logit_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E (+1 with shared)], or split-K partials [S, N, E (+1)] of logits in logit_dtype →
    (weights fp32, experts int32) [N, k (+1)]; see the module docstring. The kernel on CUDA (pdl: with
    programmatic dependent launch; packed: its packed-key rounds), the reference elsewhere."""
    if logits.is_cuda and triton is not None:
        return launch(logits, k, shared, pdl, packed, logit_dtype)
    return reference(logits, k, shared, logit_dtype)


@route.register_fake
def _(logits, k, shared, pdl=False, packed=False, logit_dtype=None):
    N = logits.shape[-2]
    return (logits.new_empty(N, k + shared, dtype=torch.float32),
            logits.new_empty(N, k + shared, dtype=torch.int32))
