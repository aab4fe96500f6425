"""MoE routing in one launch (fastqwen/ops/router.py) against its torch definition: transformers' softmax,
top-k and renormalisation, with the stacked shared expert's gate appended."""

import torch
from conftest import run_in_triton_interpreter

from fastqwen.ops.router import fused_reference, reference, route, router_route, summed


def test_reference_is_transformers_routing():
    torch.manual_seed(0)
    logits = torch.randn(4, 9)  # 8 experts and the shared gate
    w, e = reference(logits, 2, True)
    probs = torch.softmax(logits[:, :8], -1)
    top = probs.topk(2, -1)
    assert torch.equal(e[:, :2], top.indices.int()) and (e[:, 2] == 8).all()
    assert torch.allclose(w[:, :2], top.values / top.values.sum(-1, keepdim=True))
    assert torch.allclose(w[:, 2], torch.sigmoid(logits[:, 8]))
    w, e = reference(logits[:, :8], 3, False)
    assert w.shape == e.shape == (4, 3) and torch.allclose(w.sum(-1), torch.ones(4))


def test_registered_op_passes_opcheck_on_cpu():
    logits = torch.randn(3, 17)
    parts = torch.randn(4, 3, 17)  # a router matmul's split-K partials
    for args in ((logits, 4, True), (parts, 4, True, False, False, torch.bfloat16)):
        torch.library.opcheck(route, args,
                              test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))
    assert all(torch.equal(a, b) for a, b in zip(route(logits, 4, True), reference(logits, 4, True)))


def test_partials_route_as_their_sum_rounded_to_the_logits_dtype():
    """Split-K partials [S, N, E (+1)] route as the logits the summed matmul gives in the activations' dtype:
    summed in fp32, then rounded (bf16 here: values apart by less than its spacing tie after rounding)."""
    torch.manual_seed(0)
    parts = torch.randn(4, 5, 33)
    logits = parts.sum(0).bfloat16()
    for shared in (False, True):
        got, want = reference(parts, 3, shared, torch.bfloat16), reference(logits, 3, shared)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert torch.equal(route(parts, 3, shared, False, False, torch.bfloat16)[1], want[1])
    # 16-bit partials without a logit dtype: rounded to theirs; fp32 logits with one: rounded to it
    assert torch.equal(summed(parts.bfloat16()), parts.bfloat16().float().sum(0).bfloat16())
    assert torch.equal(summed(parts[0], torch.bfloat16), parts[0].bfloat16())
    # one partial in the logits' dtype already (F.linear's product): used as it is
    assert all(torch.equal(a, b) for a, b in zip(reference(logits[None], 3, True, torch.bfloat16),
                                                 reference(logits, 3, True)))


_INTERPRETED = """
import torch
from fastqwen.ops.router import launch, reference
torch.manual_seed(0)
# 35B-A3B's 256 experts top-8, the tiny preset's 8 top-2, a count that is not a power of 2; bf16 logits too
for packed in (False, True):  # (packed: one max over (logit, index) keys a round)
    for N, E, k, dtype in ((3, 256, 8, torch.float32), (5, 8, 2, torch.float32), (2, 60, 5, torch.bfloat16)):
        for shared in (False, True):
            # distinct values (a bf16 tie would leave the reference's order to torch.topk): a shuffled ramp
            logits = torch.stack([torch.randperm(E + shared) * 0.05 - 3 for _ in range(N)]).to(dtype)
            w, e = launch(logits, k, shared, packed=packed)
            rw, re = reference(logits, k, shared)
            assert torch.equal(e, re), (packed, N, E, k, shared, e, re)
            assert torch.allclose(w, rw, atol=1e-6), (packed, N, E, k, shared, (w - rw).abs().max())
    # split-K partials: summed in the kernel, rounded to bf16 (sums of multiples of 1/16 below 8: exact in bf16,
    # the interpreter's truncating conversion and the GPU's rounding agree), fp32 partials of an fp32 model
    for N, E, k in ((3, 256, 8), (2, 60, 5)):
        for shared in (False, True):
            for S, dtype in ((1, torch.bfloat16), (4, torch.bfloat16), (3, torch.float32), (3, None)):
                logits = torch.stack([torch.randperm(E + shared) for _ in range(N)]).float() / 64
                parts = torch.randint(-8, 9, (S, N, E + shared)).float() / 16
                parts[0] += logits - parts.sum(0)
                if dtype is None:  # bf16 partials, each exact in bf16 (their sum too), rounded to bf16
                    parts = torch.stack([logits, torch.full_like(logits, 0.5), torch.full_like(logits, -0.5)])
                    parts = parts.bfloat16()
                w, e = launch(parts, k, shared, packed=packed, logit_dtype=dtype)
                rw, re = reference(parts, k, shared, dtype)
                assert torch.equal(e, re), (packed, N, E, k, shared, S)
                assert torch.allclose(w, rw, atol=1e-6), (packed, N, E, k, shared, S)
    rounded = torch.tensor([[[1.0, 1.0 + 2 ** -10, 0.5, 0.25]]])  # 1 + 2^-10 is 1.0 in bf16: a tie, index 0 first
    assert launch(rounded, 2, False, packed=packed, logit_dtype=torch.bfloat16)[1].tolist() == [[0, 1]], packed
    assert launch(rounded, 2, False, packed=packed, logit_dtype=torch.float32)[1].tolist() == [[1, 0]], packed
    logits = torch.zeros(1, 8)
    logits[0, [2, 5]] = 1.0  # a tie: the lower index first
    w, e = launch(logits, 2, False, packed=packed)
    assert e.tolist() == [[2, 5]] and torch.allclose(w, torch.full((1, 2), 0.5)), packed
    # all negative, -0.0 tying +0.0 (lower index first), a subnormal above both zeros, -inf never chosen first
    logits = torch.tensor([[-3.0, -0.0, -1e-3, 0.0, -float("inf"), 1e-40, -2.5, -7.0]])
    w, e = launch(logits, 4, False, packed=packed)
    assert e.tolist() == [[5, 1, 3, 2]], (packed, e)
    assert torch.allclose(w, reference(logits, 4, False)[0])  # (torch.topk may order the tied zeros either way)
print("router ok")
"""




_SM90 = """
import re
from sm90 import compile_sm90
from fastqwen.ops.router import _route_kernel

sig = dict(logits_ptr="*bf16", w_ptr="*fp32", e_ptr="*i32", stride="i32", split_stride="i32")
for pdl, packed, S in ((False, False, 1), (True, False, 4), (False, True, 1), (True, True, 16)):
    consts = dict(E=256, K=8, SHARED=True, BLOCK_E=256, BLOCK_K=8, PDL=pdl, PACKED=packed, S=S, ROUND=int(S > 1))
    sig["logits_ptr"] = "*fp32" if S > 1 else "*bf16"
    kernel = compile_sm90(_route_kernel, sig, consts, ("logits_ptr", "stride", "split_stride"),
                          num_warps=1 if packed else 4)
    code = kernel.asm["ptx"]
    if packed:  # one warp: the reductions are shuffles, with no barrier between them
        assert "bar.sync" not in code and "barrier" not in code and code.count("shfl.sync") > 0, "a barrier"
    if pdl:  # the logits are the previous kernel's output: no read before the wait
        wait = code.index("griddepcontrol.wait")
        assert min(m.start() for m in re.finditer(r"ld\\.global", code)) > wait, "a read before the wait"
        assert "griddepcontrol.launch_dependents" in code
    else:
        assert "griddepcontrol" not in code
print("ok")
"""




def test_fused_router_op_passes_opcheck_and_routes_the_rounded_logits_on_cpu():
    """router_route off CUDA is its reference: the logits x · routerᵀ summed in fp32, rounded to x's dtype,
    routed as `route` routes them."""
    torch.manual_seed(0)
    x, router = torch.randn(1, 64, dtype=torch.bfloat16), torch.randn(17, 64, dtype=torch.bfloat16)
    torch.library.opcheck(router_route, (x, router, 4, True),
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))
    want = reference((x.float() @ router.float().t()).bfloat16(), 4, True)
    assert all(torch.equal(a, b) for a, b in zip(router_route(x, router, 4, True), want))


_FUSED = """
import torch
from fastqwen.ops.gemv import tile_counts
from fastqwen.ops.router import FUSED_CONFIG, fused_launch, fused_reference
torch.manual_seed(0)
# fp32: 35B-A3B's router (256 experts + the shared gate, H 2048, top 8) and an odd count, no rounding
for E, H, k in ((256, 2048, 8), (60, 512, 5)):
    for shared in (False, True):
        x, router = torch.randn(1, H), torch.randn(E + shared, H) / 8
        for config in (FUSED_CONFIG, (16, 512, 4)):
            w, e = fused_launch(x, router, k, shared, config=config)
            rw, re = fused_reference(x, router, k, shared)
            assert torch.equal(e, re), (E, shared, config, e, re)
            assert torch.allclose(w, rw, atol=1e-5), (E, shared, config, (w - rw).abs().max())
            assert tile_counts(x.device, 1)[0] == 0  # the count back at 0 for the next launch
# bf16, each logit the sum of two partials in different column splits, all exact in bf16 and distinct (the
# interpreter truncates where the GPU rounds): the logits' rounding is the reference's
E, H = 60, 512
x = torch.ones(1, H, dtype=torch.bfloat16)
levels = torch.randperm(E + 1)[:E + 1].float() / 16 - 2
router = torch.zeros(E + 1, H)
router[:, 3], router[:, 300] = levels / 2, levels / 2
w, e = fused_launch(x, router.bfloat16(), 5, True)
rw, re = fused_reference(x, router.bfloat16(), 5, True)
assert torch.equal(e, re) and torch.allclose(w, rw, atol=1e-6), (e, re)
for bad in ((torch.ones(2, H), router), (x, router), (x.float(), router[:, :500].contiguous()),
            (x.float(), router.t().contiguous().t())):
    try:
        fused_launch(*bad, 5, True)
    except ValueError as err:
        assert "router_route routes one token" in str(err)
    else:
        raise AssertionError("accepted")
print("fused router ok")
"""


def test_kernels_match_their_references_in_the_triton_interpreter():
    """The routing kernel (argmax and packed rounds, logits or split-K partials, ties, signed zeros) and one
    token's router matmul and routing in one launch (kernels route="fused": the experts and weights of the
    reference at 35B-A3B's router shape and another, at two tile configs, bf16 logits rounded as the reference
    rounds them; the arrival count 0 again after each launch; inputs it does not take refused). One
    interpreter process for both."""
    out = run_in_triton_interpreter(_INTERPRETED + _FUSED)
    assert "router ok" in out and "fused router ok" in out


_SM90_FUSED = """
import re
from sm90 import compile_sm90
from fastqwen.ops.router import FUSED_CONFIG, _router_route_kernel

rn, rk, warps = FUSED_CONFIG
sig = dict(x_ptr="*bf16", r_ptr="*bf16", lp_ptr="*fp32", w_ptr="*fp32", e_ptr="*i32", cnt_ptr="*i32", H="i32")
for pdl in (False, True):
    consts = dict(E=256, K=8, SHARED=True, BLOCK_E=256, BLOCK_K=8, RN=rn, RK=rk, S=2048 // rk, ROUND=1, PDL=pdl)
    kernel = compile_sm90(_router_route_kernel, sig, consts, ("x_ptr", "r_ptr", "lp_ptr", "H"), num_warps=warps)
    code = kernel.asm["ptx"]
    loads = [m.start() for m in re.finditer(r"ld\.global", code)]
    atomics = [m.start() for m in re.finditer(r"atom\.", code)]
    if pdl:  # the router's weights (constants) before the wait; x, and every count, after it
        wait = code.index("griddepcontrol.wait")
        assert min(loads) < wait < max(loads), "no weight load before the wait, or no x load after it"
        assert min(atomics) > wait, "a count before the wait"
    else:
        assert "griddepcontrol" not in code
    assert "bar.sync" in code[:min(atomics)], "no barrier between the partials' stores and the count"
print("ok")
"""


def test_kernels_order_their_reads_around_the_pdl_wait():
    """Compiled for sm90 here (no GPU). The routing kernel with PDL (kernels={"experts": "grouped-pdl"}) reads
    the logits only after griddepcontrol.wait; without it, no griddepcontrol at all; the packed variant in one
    warp has no barrier. The fused router with PDL reads its weights before the wait and x after it, and counts
    itself in only after the wait and after a barrier behind its stores."""
    out = run_in_triton_interpreter(_SM90 + _SM90_FUSED, interpret=False)
    assert [line for line in out.splitlines() if line.strip() == "ok"] == ["ok", "ok"], out
