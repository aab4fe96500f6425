"""MoE routing of few tokens in one launch: top-k experts of each token's router logits and their weights.

`route(logits [N, E (+1)], k, shared)` → (weights [N, k (+1)] fp32, experts [N, k (+1)] int32). As transformers
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
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs the reference
    triton = None


def reference(logits: torch.Tensor, k: int, shared: bool):
    """(weights fp32 [N, k (+1)], experts int32 [N, k (+1)]): transformers' routing in plain torch."""
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
    def _route_kernel(logits_ptr, w_ptr, e_ptr, stride, E: tl.constexpr, K: tl.constexpr, SHARED: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
                      PACKED: tl.constexpr = False):
        """One token: k rounds of (max, its lowest index, mask it out); weights = softmax over the k maxima.
        PDL (launched with launch_pdl): wait for the previous kernel (the logits are its output) first. PACKED:
        a round is one max over _ordered_key."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0)
        e = tl.arange(0, BLOCK_E)
        logit = tl.load(logits_ptr + row * stride + e, mask=e < E, other=-float("inf")).to(tl.float32)
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
            g = tl.load(logits_ptr + row * stride + E).to(tl.float32)
            tl.store(w_ptr + out + K, 1.0 / (1.0 + tl.exp(-g)))
            tl.store(e_ptr + out + K, E)


def launch(logits: torch.Tensor, k: int, shared: bool, pdl: bool = False, packed: bool = False):
    """The Triton kernel (any device Triton runs on, its CPU interpreter included); same contract as route.
    pdl: launch with programmatic dependent launch (Hopper+); packed: the one-warp packed-key rounds."""
    logits = logits.contiguous()
    N, E = logits.shape[0], logits.shape[1] - shared
    weights = torch.empty(N, k + shared, dtype=torch.float32, device=logits.device)
    experts = torch.empty(N, k + shared, dtype=torch.int32, device=logits.device)
    if N:
        _route_kernel[(N,)](logits, weights, experts, logits.stride(0), E=E, K=k, SHARED=shared,
                            BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(k), PDL=pdl,
                            PACKED=packed, num_warps=1 if packed else 4, launch_pdl=pdl)
    return weights, experts


@torch.library.custom_op("fastqwen::route", mutates_args=())
def route(logits: torch.Tensor, k: int, shared: bool, pdl: bool = False,
          packed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E (+1 with shared)] → (weights fp32, experts int32) [N, k (+1)]; see the module docstring.
    The kernel on CUDA (pdl: with programmatic dependent launch; packed: its packed-key rounds), the reference
    elsewhere."""
    if logits.is_cuda and triton is not None:
        return launch(logits, k, shared, pdl, packed)
    return reference(logits, k, shared)


@route.register_fake
def _(logits, k, shared, pdl=False, packed=False):
    N = logits.shape[0]
    return (logits.new_empty(N, k + shared, dtype=torch.float32),
            logits.new_empty(N, k + shared, dtype=torch.int32))
