"""Each op's torch path against an independent formulation (transformers' own code where it has one)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import fresh
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from fastqwen.moe import routed_moe, weighted_sum
from fastqwen.ops.attention import apply_rope, attend_cache, attend_prefix, rope_cos_sin, write_kv
from fastqwen.ops.conv import conv_step
from fastqwen.ops.gdn import gdn_chunk, gdn_recurrent
from fastqwen.ops.norm import gated_rms_norm, rms_norm


def gdn_inputs(B=2, T=70, H=2, HV=4, K=16, V=8):
    return dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, HV, V),
                a=torch.randn(B, T, HV), b=torch.randn(B, T, HV), A_log=torch.rand(HV).log(),
                dt_bias=torch.randn(HV))


@pytest.mark.parametrize("op", [gdn_recurrent, gdn_chunk])
def test_gdn_matches_transformers_chunked_rule_with_state_carry(op):
    x = gdn_inputs()
    g = -x["A_log"].exp() * F.softplus(x["a"] + x["dt_bias"])
    h0 = torch.randn(2, 4, 16, 8)
    ref_o, ref_s = hf.torch_chunk_gated_delta_rule(
        x["q"], x["k"], x["v"], g=g, beta=x["b"].sigmoid(), initial_state=h0.clone(), output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    state = h0.clone()
    o1 = op(**{n: t[:, :33] if t.dim() > 1 else t for n, t in x.items()}, state=state)
    o2 = op(**{n: t[:, 33:] if t.dim() > 1 else t for n, t in x.items()}, state=state)
    torch.testing.assert_close(torch.cat([o1, o2], 1), ref_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, ref_s, atol=1e-5, rtol=1e-5)


def test_conv_in_pieces_equals_one_causal_conv():
    x, w = torch.randn(2, 20, 12), torch.randn(12, 4)
    ref = F.silu(F.conv1d(x.transpose(1, 2), w[:, None], padding=3, groups=12)[..., :20]).transpose(1, 2)
    state, pieces = torch.zeros(2, 12, 3), []
    for a, b in [(0, 7), (7, 8), (8, 9), (9, 20)]:
        out, state = conv_step(x[:, a:b], w, state)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, 1), ref)
    torch.testing.assert_close(state, x[:, -3:].transpose(1, 2))


def test_norms_match_transformers_modules():
    x = torch.randn(3, 5, 32)
    n = hf.Qwen3_5RMSNorm(32, eps=1e-6)
    torch.nn.init.normal_(n.weight)
    torch.testing.assert_close(rms_norm(x, n.weight, 1e-6), n(x))
    g = hf.Qwen3_5RMSNormGated(32, eps=1e-6)
    torch.nn.init.normal_(g.weight)
    z = torch.randn(3, 5, 32)
    torch.testing.assert_close(gated_rms_norm(x, z, g.weight, 1e-6), g(x, z))


def test_attention_over_cache_per_row_positions():
    """Rows at different positions each see exactly their own prefix; explicit softmax as reference."""
    B, Hq, Hkv, S, D = 2, 4, 2, 16, 8
    k_cache, v_cache = torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    q, k, v = torch.randn(B, Hq, 3, D), torch.randn(B, Hkv, 3, D), torch.randn(B, Hkv, 3, D)
    positions = torch.tensor([[4, 5, 6], [10, 11, 12]])
    write_kv(k_cache, v_cache, k, v, positions)
    out = attend_cache(q, k_cache, v_cache, positions, scale=D**-0.5)
    for b in range(B):
        for t in range(3):
            p = int(positions[b, t])
            keys = k_cache[b, :, : p + 1].repeat_interleave(2, 0)
            vals = v_cache[b, :, : p + 1].repeat_interleave(2, 0)
            w = (q[b, :, t, None] @ keys.transpose(-1, -2) * D**-0.5).softmax(-1)
            torch.testing.assert_close(out[b, :, t], (w @ vals)[:, 0])
    assert torch.equal(k_cache[1, :, 11], k[1, :, 1])


@pytest.mark.parametrize("T", [1, 5, 12])
def test_prefix_attention_is_cached_attention_at_the_last_positions(T):
    """A later prefill chunk: the last T of S cached positions, grouped queries, against attend_cache."""
    B, Hq, Hkv, S, D = 2, 4, 2, 12, 8
    k, v, q = torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hq, T, D)
    positions = torch.arange(S - T, S).expand(B, -1)
    torch.testing.assert_close(attend_prefix(q, k, v, D**-0.5), attend_cache(q, k, v, positions, D**-0.5))


def test_rope_matches_transformers():
    """apply_rope (one pointwise expression over the head, the passed dims times 1 plus a product with 0) gives
    transformers' rotate-and-concatenate bit for bit, in fp32 and bf16 (partial rotary: the tiny model rotates
    a quarter of its dims)."""
    model = fresh("tiny")
    rot = model.model.rotary_emb
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 4, 5, 32).to(dtype)
        cos, sin = rot(x, pos)
        ref, _ = hf.apply_rotary_pos_emb(x, x, cos, sin)
        ours = apply_rope(x, *rope_cos_sin(pos, rot.inv_freq, rot.attention_scaling, x.dtype))
        assert cos.shape[-1] < x.shape[-1] and ours.dtype == dtype
        torch.testing.assert_close(ours, ref, rtol=0, atol=0)


def test_weighted_sum_is_the_sum_over_experts_of_weighted_outputs():
    """moe.weighted_sum: Σⱼ wⱼ · outⱼ as adds (they fold into the next kernel on a GPU), the result of
    (out * w[..., None]).sum(1): exactly on values whose sums are exact, within fp32 order otherwise."""
    out = torch.randint(-64, 64, (3, 9, 40)).float() / 8
    w = torch.randint(0, 16, (3, 9)).float() / 16
    assert torch.equal(weighted_sum(out, w), (out * w[..., None]).sum(1))
    ob, wb = out.bfloat16(), w.bfloat16()  # products rounded to bf16, summed in fp32, rounded once
    assert torch.equal(weighted_sum(ob, wb), (ob * wb[..., None]).sum(1))
    out, w = torch.randn(2, 9, 64), torch.rand(2, 9)
    torch.testing.assert_close(weighted_sum(out, w), (out * w[..., None]).sum(1), rtol=1e-6, atol=1e-6)


def test_routed_moe_matches_transformers_block():
    model = fresh("tiny-moe")
    block = model.model.layers[0].mlp
    h = torch.randn(3, 2, 64)
    torch.testing.assert_close(routed_moe(block, h), block(h), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["split", "transposed"])
@pytest.mark.parametrize("op", [gdn_recurrent, gdn_chunk, "verify", "replay"])
def test_gdn_custom_ops_pass_opcheck_on_strided_inputs(op, layout):
    """Fake (meta) kernels must agree with the real ones, also for the strided views the model passes: split
    views of the projection, or of the conv's [B, C, T] buffer transposed (the layout inductor produces)."""
    from fastqwen.ops.gdn import gdn_replay, gdn_verify

    C = 2 * 2 * 16 + 4 * 8
    qkv = torch.randn(2, 3, C) if layout == "split" else torch.randn(2, C, 3).transpose(1, 2)
    q, k, v = torch.split(qkv, [32, 32, 32], dim=-1)
    q, k, v = q.view(2, 3, 2, 16), k.view(2, 3, 2, 16), v.view(2, 3, 4, 8)
    a, b, state = torch.randn(2, 3, 4), torch.randn(2, 3, 4), torch.randn(2, 4, 16, 8)
    A_log, dt_bias = torch.rand(4).log(), torch.randn(4)
    if op == "replay":
        torch.library.opcheck(gdn_replay, (k, v, torch.randn(2, 3, 4).clamp(max=0), torch.rand(2, 3, 4), state))
        return
    fn, args = op, (q, k, v, a, b, A_log, dt_bias, state)
    if op == "verify":  # (the conv's packed output, as gdn_decode)
        fn, args = gdn_verify, (qkv, 2, 16, a, b, A_log, dt_bias, state)
    torch.library.opcheck(fn, args)
    # opcheck does not compare strides; inductor trusts the fake's, so they must match the real output's
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = fn(*(mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args))
    assert fake.stride() == fn(*args).stride()


def test_packed_decode_op_equals_the_recurrence_on_its_parts():
    """gdn_decode (batch 1, one position) from the conv's packed output gives gdn_recurrent's output and state
    on the unpacked q, k, v, with a and b views of a wider projection, and with z and a norm weight the gated
    RMSNorm of that output; with a and b as split-K partials, the output on their rounded sums; its fake kernel
    agrees (opcheck)."""
    from fastqwen.ops.gdn import gdn_decode, unpack_qkv

    H, HV, K, V = 2, 4, 16, 8
    qkv, proj = torch.randn(1, 1, 2 * H * K + HV * V), torch.randn(1, 1, 2 * HV + 3)
    a, b = proj[..., 3:3 + HV], proj[..., 3 + HV:]
    A_log, dt_bias, h0 = torch.rand(HV).log(), torch.randn(HV), torch.randn(1, HV, K, V)
    q, k, v = unpack_qkv(qkv, H, K, HV)
    assert (q.shape, k.shape, v.shape) == ((1, 1, H, K), (1, 1, H, K), (1, 1, HV, V))
    assert torch.equal(torch.cat([q.flatten(), k.flatten(), v.flatten()]), qkv.flatten())
    ref_state, state = h0.clone(), h0.clone()
    ref = gdn_recurrent(q.contiguous(), k.contiguous(), v.contiguous(), a.contiguous(), b.contiguous(), A_log,
                        dt_bias, ref_state)
    assert torch.equal(gdn_decode(qkv, H, K, a, b, A_log, dt_bias, state), ref)
    assert torch.equal(state, ref_state)
    torch.library.opcheck(gdn_decode, (qkv, H, K, a, b, A_log, dt_bias, h0.clone()))
    # with the gated RMSNorm (kernels={"gdn_norm": "fused"}): the recurrence's output through norm.gated_rms_norm
    from fastqwen.ops.norm import gated_rms_norm

    z, w = torch.randn(1, 1, HV * V), torch.rand(V) + 0.5
    normed = gdn_decode(qkv, H, K, a, b, A_log, dt_bias, h0.clone(), False, False, z, w, 1e-6)
    assert torch.equal(normed, gated_rms_norm(ref, z.reshape(ref.shape), w, 1e-6))
    torch.library.opcheck(gdn_decode, (qkv, H, K, a, b, A_log, dt_bias, h0.clone(), False, False, z, w, 1e-6))
    # a and b as the projection's split-K partials [S, B, T, HV] fp32: summed, rounded to qkv's dtype
    parts = torch.randn(3, 1, 1, 2 * HV + 3)
    pa, pb = parts[..., 3:3 + HV], parts[..., 3 + HV:]
    for dtype in (torch.float32, torch.bfloat16):
        x16 = qkv.to(dtype)
        summed = gdn_decode(x16, H, K, pa.sum(0).to(dtype), pb.sum(0).to(dtype), A_log, dt_bias, h0.clone())
        assert torch.equal(gdn_decode(x16, H, K, pa, pb, A_log, dt_bias, h0.clone()), summed)
        torch.library.opcheck(gdn_decode, (x16, H, K, pa, pb, A_log, dt_bias, h0.clone()))


_UNROLLED = """
import torch
from fastqwen.ops.gdn import _block, _unrolled, gates, gdn_reference, gdn_verify, recurrence, unpack_qkv
torch.manual_seed(0)
B, T, H, HV, K, V = 2, 5, 2, 4, 32, 32
q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
v, a, b = torch.randn(B, T, HV, V), torch.randn(B, T, HV), torch.randn(B, T, HV)
A_log, dt_bias = torch.rand(HV).log(), torch.randn(HV)
h0 = torch.randn(B, HV, K, V) * 0.1
worst = 0.0
def err(x, y):
    global worst
    e = ((x - y).norm() / y.norm()).item()
    worst = max(worst, e)
    assert e < 1e-5, e
ref_state = h0.clone()
ref = gdn_reference(q, k, v, a, b, A_log, dt_bias, ref_state)
state = h0.clone()  # decode / gdn_recurrent: outputs, state in place
err(_unrolled(q, k, v, a, b, state, state, True, A_log, dt_bias, block_v=8), ref)
err(state, ref_state)
from fastqwen.ops.norm import gated_rms_norm  # decode with the gated RMSNorm fused (the last program of each head)
z = torch.randn(B, T, HV * V + 7)[..., 3:3 + HV * V]  # (a view of a wider projection's output)
for w in (torch.rand(V) + 0.5, (torch.rand(V) + 0.5).bfloat16()):  # twice: the counts are back at 0 after a launch
    state = h0.clone()
    err(_unrolled(q, k, v, a, b, state, state, True, A_log, dt_bias, block_v=8, norm=(z, w, 1e-6)),
        gated_rms_norm(ref, z.reshape(ref.shape), w, 1e-6))
    err(state, ref_state)
state, bf = h0.clone(), lambda t: t.bfloat16()  # bf16 activations: o rounds before the norm, w·ô before the gate
o16 = _unrolled(bf(q), bf(k), bf(v), a, b, state, state, True, A_log, dt_bias, block_v=8, norm=(bf(z), bf(w), 1e-6))
ref16 = gated_rms_norm(gdn_reference(bf(q), bf(k), bf(v), a, b, A_log, dt_bias, h0.clone()), bf(z).reshape(ref.shape), bf(w), 1e-6)
assert o16.dtype == torch.bfloat16 and ((o16.float() - ref16.float()).norm() / ref16.float().norm()) < 1e-2
# decode with a and b as a fused projection's split-K partials (views of its fp32 [S, B, T, N]): summed and
# rounded to q's dtype, the same walk bit for bit as on the rounded sums. Sums exact in bf16 (multiples of 1/16
# below 12): the interpreter rounds fp32 to bf16 toward zero, the GPU to nearest even (cvt.rn: test_unrolled_
# gdn_kernel_walks_in_registers_on_sm90, and tests/gpu)
parts = torch.randint(-64, 64, (3, B, T, 2 * HV + 5)) / 16
pa, pb = parts[..., 5 + HV:], parts[..., 5:5 + HV]
seq_sum = lambda p: sum(p[1:], p[0])
for S in (3, 1):
    for qkv_dtype in (torch.bfloat16, torch.float32):
        qd, kd, vd = (t.to(qkv_dtype) for t in (q, k, v))
        state, ref_state = h0.clone(), h0.clone()
        got = _unrolled(qd, kd, vd, pa[:S], pb[:S], state, state, True, A_log, dt_bias, block_v=8)
        ra, rb = seq_sum(pa[:S]).to(qkv_dtype), seq_sum(pb[:S]).to(qkv_dtype)
        want = _unrolled(qd, kd, vd, ra, rb, ref_state, ref_state, True, A_log, dt_bias, block_v=8)
        assert torch.equal(got, want) and torch.equal(state, ref_state), (S, qkv_dtype)
    state = h0.clone()
    got = _unrolled(bf(q), bf(k), bf(v), pa[:S], pb[:S], state, state, True, A_log, dt_bias, block_v=8,
                    norm=(bf(z), bf(w), 1e-6))
    want = _unrolled(bf(q), bf(k), bf(v), seq_sum(pa[:S]).bfloat16(), seq_sum(pb[:S]).bfloat16(), h0.clone(), None,
                     True, A_log, dt_bias, block_v=8, norm=(bf(z), bf(w), 1e-6))
    assert torch.equal(got, want), S
state = h0.clone()  # verify: outputs only, the state untouched
err(_unrolled(q, k, v, a, b, state, None, True, A_log, dt_bias, block_v=16), ref)
assert torch.equal(state, h0)
proj = torch.randn(B, T, 3 * HV + 5)  # verify with a, b read in place from a fused projection's output
proj[..., 3:3 + HV], proj[..., 3 + 2 * HV:3 + 3 * HV] = b, a
err(_unrolled(q, k, v, proj[..., 3 + 2 * HV:3 + 3 * HV], proj[..., 3:3 + HV], state, None, True, A_log, dt_bias), ref)
qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], -1)  # q, k, v read in place from the conv's packed
pq, pk, pv = unpack_qkv(qkv, H, K, HV)                           # output (views: rows, positions apart)
assert not pq.is_contiguous() and pv.data_ptr() == qkv.data_ptr() + 2 * H * K * qkv.element_size()
err(_unrolled(pq, pk, pv, a, b, state, None, True, A_log, dt_bias), ref)
err(gdn_verify(qkv, H, K, a, b, A_log, dt_bias, state, unrolled=True), ref)  # the op's CPU path: reference
err(_block(q, k, v, a, b, state, A_log, dt_bias), ref)  # the block solve (T = 5 of a 16-row tile)
err(_block(pq, pk, pv, proj[..., 3 + 2 * HV:3 + 3 * HV], proj[..., 3:3 + HV], state, A_log, dt_bias, block_k=32), ref)
assert torch.equal(state, h0)
# the substitution where it is ill-conditioned: nearly parallel keys, beta → 1, no decay (a → −∞), 16 positions
k16 = torch.randn(1, 1, H, K).expand(1, 16, H, K) + 0.01 * torch.randn(1, 16, H, K)
q16, v16 = torch.randn(1, 16, H, K), torch.randn(1, 16, HV, V)
a16, b16 = torch.full((1, 16, HV), -30.0), torch.full((1, 16, HV), 8.0)
err(_block(q16, k16, v16, a16, b16, h0[:1], A_log, dt_bias), gdn_reference(q16, k16, v16, a16, b16, A_log, dt_bias, h0[:1].clone()))
g, beta = gates(a, b, A_log, dt_bias)  # replay: explicit gates, state only
keep = torch.tensor([3, 0])
mask = (torch.arange(T)[None] < keep[:, None]).float()[..., None]
state, ref_state = h0.clone(), h0.clone()
stash = torch.zeros(2, B, T + 3, HV)  # (gates as the first T positions of a longer stash, rows further apart)
stash[0, :, :T], stash[1, :, :T] = g * mask, beta * mask
assert _unrolled(k, k, v, stash[0, :, :T], stash[1, :, :T], state, state, False, write_o=False) is None
recurrence(k, k, v, g * mask, beta * mask, ref_state)
err(state, ref_state)
state = h0.clone()  # the commit's replay: k and v read in place from the packed stash
assert _unrolled(pk, pk, pv, stash[0, :, :T], stash[1, :, :T], state, state, False, write_o=False) is None
err(state, ref_state)
print("worst relative error", worst)
"""


_UNROLLED_SM90 = """
import inspect
import re
from sm90 import compile_sm90, count, cuobjdump, stack_bytes
from fastqwen.ops import gdn

ptrs = ("q_ptr", "k_ptr", "v_ptr", "a_ptr", "b_ptr", "A_log_ptr", "dt_bias_ptr", "h0_ptr", "ht_ptr", "o_ptr")
sig = {**{p: "*bf16" for p in ptrs}, "A_log_ptr": "*fp32", "dt_bias_ptr": "*fp32", "h0_ptr": "*fp32",
       "ht_ptr": "*fp32", "scale": "fp32", **{f"{t}_{d}": "i32" for t in "qkvab" for d in ("row", "pos")}}
bv = inspect.signature(gdn._unrolled).parameters["block_v"].default  # the launch's tile, one warp per 8 columns
def compiled(T, verify, pdl=False):  # a DFlash verify or a commit's replay, 27B shape
    consts = dict(T=T, TP=16, H=16, HV=48, K=128, V=128, BV=bv, GATE_IN=verify, WRITE_O=verify,
                  WRITE_STATE=not verify, PDL=pdl, S_AB=1)
    return compile_sm90(gdn._unrolled_kernel, {**sig, **({} if verify else {"a_ptr": "*fp32", "b_ptr": "*fp32"})},
                        consts, (*ptrs, *(f"{t}_{d}" for t in "qkvab" for d in ("row", "pos"))),
                        num_warps=max(1, bv // 8))

for T, verify in ((16, True), (16, False)):
    kernel = compiled(T, verify)
    sass = cuobjdump(kernel, "-sass")
    assert stack_bytes(kernel) == 0 and count(sass, "LDS") == 0, (T, verify, "the walk spills or goes through shared memory")
    # programmatic dependent launch: only the state tile (and the gate parameters) load before the wait
    code = compiled(T, verify, pdl=True).asm["ptx"]
    wait = code.index("griddepcontrol.wait")
    before = len(re.findall(r"ld\\.global", code[:wait]))
    assert 0 < before <= 32 + 2, (verify, before, "inputs read before the wait")  # [128, 8] fp32 tile: 32 a thread
# decode with a and b as the projection's 3 split-K partials (fp32), rounded to bf16: the two extra loads each
plain = compiled(1, True)
summing = compile_sm90(gdn._unrolled_kernel, {**sig, "a_ptr": "*fp32", "b_ptr": "*fp32", "a_split": "i32",
                                              "b_split": "i32"},
                       dict(T=1, TP=1, H=16, HV=48, K=128, V=128, BV=bv, GATE_IN=True, WRITE_O=True,
                            WRITE_STATE=True, PDL=False, S_AB=3, ROUND_AB=True),
                       (*ptrs, *(f"{t}_{d}" for t in "qkvab" for d in ("row", "pos"))),
                       num_warps=max(1, bv // 8))
loads = lambda k: len(re.findall(r"ld\\.global", k.asm["ptx"]))
assert stack_bytes(summing) == 0 and loads(summing) == loads(plain) + 4, (loads(summing), loads(plain))
assert "cvt.rn.bf16.f32" in summing.asm["ptx"], "the sums are not rounded to bf16"
print("ok")
"""


_BLOCK_SM90 = """
from sm90 import compile_sm90, count, cuobjdump, stack_bytes
from fastqwen.ops import gdn

ptrs = ("q_ptr", "k_ptr", "v_ptr", "a_ptr", "b_ptr", "A_log_ptr", "dt_bias_ptr", "h0_ptr", "o_ptr")
sig = {**{p: "*bf16" for p in ptrs}, "A_log_ptr": "*fp32", "dt_bias_ptr": "*fp32", "h0_ptr": "*fp32",
       "scale": "fp32", **{f"{t}_{d}": "i32" for t in "qkvab" for d in ("row", "pos")}}
bv, warps, bk, stages = gdn.BLOCK_TILE
consts = dict(T=16, TP=16, H=16, HV=48, K=128, V=128, BV=bv, BK=bk, STAGES=stages, PDL=False)
kernel = compile_sm90(gdn._block_kernel, sig, consts, ptrs, num_warps=warps, num_stages=stages)
sass = cuobjdump(kernel, "-sass")
assert stack_bytes(kernel) == 0, "the block solve spills"
assert count(sass, "HMMA") > 0, "its dots are not on the tensor cores"
print("ok")
"""


def test_block_gdn_kernel_solves_on_tensor_cores_without_spilling_on_sm90():
    """kernels={"gdn": "block"}: the verify's block solve compiled for Hopper at its launch tile and the 27B
    verify shape: the dots (tf32x3) run as tensor-core HMMA and nothing spills (a tile of all K at once did)."""
    from conftest import run_in_triton_interpreter

    assert run_in_triton_interpreter(_BLOCK_SM90, interpret=False).strip().endswith("ok")


def test_unrolled_gdn_kernel_walks_in_registers_on_sm90():
    """The unrolled kernel compiled for Hopper (no GPU needed) at the 27B verify and replay shapes: its launch
    tile keeps the 16-position walk in one warp's registers, no spill and no shared-memory reduction (16
    columns on 2 warps took ~140 barriers); the decode that sums a's and b's split-K partials loads only them
    more and rounds to bf16."""
    from conftest import run_in_triton_interpreter

    assert run_in_triton_interpreter(_UNROLLED_SM90, interpret=False).strip().endswith("ok")


def test_unrolled_gdn_kernel_matches_the_reference_in_the_triton_interpreter():
    """kernels={"gdn": "unrolled"}: decode (state in place), verify (state untouched) and masked replay; and
    kernels={"gdn": "block"}'s verify, also where its substitution is ill-conditioned."""
    from conftest import run_in_triton_interpreter

    assert "worst relative error" in run_in_triton_interpreter(_UNROLLED)


def test_conv_decode_is_conv_step_with_the_window_advanced_in_place():
    """conv_decode (kernels={"conv": "fused"}) on x [B, 1, C] or on the projection's split-K partials [S, B, 1,
    C] fp32 (summed, rounded to the window's dtype): conv_step's output, and the window conv_step returns written
    into the cache's layer view (a strided view of the stacked buffer); its fake kernel agrees (opcheck)."""
    from fastqwen.ops.conv import conv_decode

    B, C, W = 2, 24, 4
    w = torch.randn(C, 1, W)[:, 0]  # (the conv1d weight's [C, W] view)
    for dtype in (torch.float32, torch.bfloat16):
        stacked = torch.randn(3, B, C, W - 1).to(dtype)
        parts = torch.randn(3, B, 1, C + 5)[..., 5:]
        for x in (parts[0].to(dtype), parts):
            want_out, want_window = conv_step(x.float().sum(0).to(dtype) if x.dim() == 4 else x, w.to(dtype),
                                              stacked[1].clone())
            window = stacked.clone()
            out = conv_decode(x, w.to(dtype), window[1])
            assert out.shape == (B, 1, C) and out.dtype == dtype
            assert torch.equal(out, want_out) and torch.equal(window[1], want_window), (dtype, x.dim())
            assert torch.equal(window[0], stacked[0]) and torch.equal(window[2], stacked[2])
            torch.library.opcheck(conv_decode, (x, w.to(dtype), stacked.clone()[1]))


_CONV_DECODE = """
import torch
from fastqwen.ops.conv import _conv_decode_cuda, conv_step
torch.manual_seed(0)
B, C, W = 2, 600, 4  # (C not a multiple of the block: the masked tail)
w = torch.randn(C, 1, W)[:, 0]
# sums exact in bf16 (multiples of 1/16 below 12): the interpreter rounds fp32 to bf16 toward zero
parts = (torch.randint(-64, 64, (3, B, 1, C + 8)) / 16)[..., 8:]
for dtype in (torch.float32, torch.bfloat16):
    stacked = torch.randn(3, B, C, W - 1).to(dtype)
    for x in (parts[0].to(dtype), parts[:1], parts):
        xs = x.float().sum(0).to(dtype) if x.dim() == 4 else x
        # (the taps in fp32, rounded once)
        want_out, want_window = conv_step(xs.float(), w.to(dtype).float(), stacked[1].float())
        window = stacked.clone()
        out = _conv_decode_cuda(x, w.to(dtype), window[1], pdl=False)
        tol = 0 if dtype == torch.float32 else 1e-2
        assert ((out.float() - want_out).abs() <= tol * want_out.abs() + 1e-6).all(), (dtype, x.dim())
        assert torch.equal(window[1].float(), want_window), (dtype, x.dim())  # shifted copies and x: exact
        assert torch.equal(window[0], stacked[0]) and torch.equal(window[2], stacked[2])
print("ok")
"""


_CONV_DECODE_SM90 = """
import re
from sm90 import compile_sm90, stack_bytes
from fastqwen.ops import conv

sig = {"x_ptr": "*fp32", "w_ptr": "*bf16", "win_ptr": "*bf16", "out_ptr": "*bf16", "C": "i32", "x_split": "i32",
       "x_row": "i32", "win_row": "i32"}
kernel = compile_sm90(conv._conv_decode_kernel, sig, dict(S=3, W=4, WP=4, BLOCK=conv.CONV_BLOCK, PDL=True),
                      ("x_ptr", "w_ptr", "win_ptr", "out_ptr"), num_warps=2)
code = kernel.asm["ptx"]
assert stack_bytes(kernel) == 0
wait = code.index("griddepcontrol.wait")
before = re.findall(r"ld\\.global[^;]*", code[:wait])  # the weights, 4 bf16 taps a channel: one 8-byte load each
assert before and all(ld.startswith("ld.global.v2.b32") for ld in before), before
assert "cvt.rn.bf16.f32" in code, "x is not rounded to bf16 to nearest even"
print("ok")
"""


def test_conv_decode_kernel_matches_the_reference_in_the_triton_interpreter():
    """The fused conv's kernel: fp32 exactly conv_step, bf16 within one rounding of its fp32 taps; the window
    advanced in the layer's view only; x as an input, one partial or three."""
    from conftest import run_in_triton_interpreter

    assert run_in_triton_interpreter(_CONV_DECODE).strip().endswith("ok")


def test_conv_decode_kernel_compiles_for_sm90_and_waits_before_reading_activations():
    """Compiled for Hopper with programmatic dependent launch: no spill; only the weights (a channel's taps in
    one vector load) load before griddepcontrol.wait, nothing the previous kernels write (partials, window);
    x rounds to bf16 to nearest even."""
    from conftest import run_in_triton_interpreter

    assert run_in_triton_interpreter(_CONV_DECODE_SM90, interpret=False).strip().endswith("ok")


def test_conv_verify_is_conv_step_with_the_replay_inputs_stored():
    """conv_verify (kernels={"conv": "fused-verify"}) on x [B, T, C] or the projection's split-K partials [S, B, T,
    C] fp32: conv_step's output, the window untouched, x (summed, rounded) and the output in the first T positions
    of the layer's replay_x and replay_qkv views (strided views of stacked buffers), zeros after them, the other
    layers' untouched; its fake kernel agrees (opcheck)."""
    from fastqwen.ops.conv import conv_verify

    B, C, W, T, block = 2, 24, 4, 3, 5
    w = torch.randn(C, 1, W)[:, 0]
    for dtype in (torch.float32, torch.bfloat16):
        window = torch.randn(B, C, W - 1).to(dtype)
        parts = torch.randn(3, B, T, C + 5)[..., 5:]
        for x in (parts[0].to(dtype), parts):
            xs = x.float().sum(0).to(dtype) if x.dim() == 4 else x
            want_out, _ = conv_step(xs, w.to(dtype), window)
            stacked = [torch.randn(3, B, block, C).to(dtype) for _ in range(2)]
            rx, rq = (t.clone() for t in stacked)
            before = window.clone()
            out = conv_verify(x, w.to(dtype), window, rx[1], rq[1])
            assert out.shape == (B, T, C) and out.dtype == dtype and out.is_contiguous()
            assert torch.equal(out, want_out) and torch.equal(window, before), (dtype, x.dim())
            assert torch.equal(rx[1, :, :T], xs) and torch.equal(rq[1, :, :T], want_out)
            assert not rx[1, :, T:].any() and not rq[1, :, T:].any()
            for got, orig in zip((rx, rq), stacked):
                assert torch.equal(got[0], orig[0]) and torch.equal(got[2], orig[2])
            torch.library.opcheck(conv_verify, (x, w.to(dtype), window, rx.clone()[1], rq.clone()[1]))


_CONV_VERIFY = """
import torch
from fastqwen.ops.conv import _conv_verify_cuda, conv_step
torch.manual_seed(0)
B, C, W, block = 2, 600, 4, 6  # (C not a multiple of the block: the masked tail)
w = torch.randn(C, 1, W)[:, 0]
for T in (1, 4):
    # sums exact in bf16 (multiples of 1/16 below 12): the interpreter rounds fp32 to bf16 toward zero
    parts = (torch.randint(-64, 64, (3, B, T, C + 8)) / 16)[..., 8:]
    for dtype in (torch.float32, torch.bfloat16):
        window = torch.randn(B, C, W - 1).to(dtype)
        for x in (parts[0].to(dtype), parts[:1], parts):
            xs = x.float().sum(0).to(dtype) if x.dim() == 4 else x
            want_out, _ = conv_step(xs.float(), w.to(dtype).float(), window.float())  # (fp32 taps, one rounding)
            rx, rq = (torch.full((3, B, block, C), 7.0).to(dtype) for _ in range(2))
            before = window.clone()
            out = _conv_verify_cuda(x, w.to(dtype), window, rx[1], rq[1], pdl=False)
            tol = 0 if dtype == torch.float32 else 1e-2
            assert out.shape == (B, T, C) and torch.equal(window, before)
            assert ((out.float() - want_out).abs() <= tol * want_out.abs() + 1e-6).all(), (T, dtype, x.dim())
            assert torch.equal(rq[1, :, :T], out) and torch.equal(rx[1, :, :T].float(), xs.float())
            assert not rx[1, :, T:].any() and not rq[1, :, T:].any()
            assert (rx[0] == 7).all() and (rq[2] == 7).all()
print("ok")
"""


_CONV_VERIFY_SM90 = """
import re
from sm90 import compile_sm90, stack_bytes
from fastqwen.ops import conv

sig = {"x_ptr": "*fp32", "w_ptr": "*bf16", "win_ptr": "*bf16", "out_ptr": "*bf16", "rx_ptr": "*bf16", "rq_ptr": "*bf16",
       "C": "i32", "x_split": "i32", "x_row": "i32", "x_pos": "i32", "win_row": "i32", "r_row": "i32"}
kernel = compile_sm90(conv._conv_verify_kernel, sig,
                      dict(S=3, T=16, W=4, WP=4, BLOCK=conv.CONV_BLOCK, PDL=True),
                      ("x_ptr", "w_ptr", "win_ptr", "out_ptr", "rx_ptr", "rq_ptr"), num_warps=2)
code = kernel.asm["ptx"]
assert stack_bytes(kernel) == 0
wait = code.index("griddepcontrol.wait")
before = re.findall(r"ld\\.global[^;]*", code[:wait])  # the weights only: 4 bf16 taps a channel, one 8-byte load
assert before and all(ld.startswith("ld.global.v2.b32") for ld in before), before
print("ok")
"""


def test_conv_verify_kernel_compiles_for_sm90_and_waits_before_reading_the_window():
    """Compiled for Hopper with programmatic dependent launch at a 16-position block: no spill; only the weights
    load before griddepcontrol.wait (the window, written by the commit, and x's partials after it)."""
    from conftest import run_in_triton_interpreter

    assert run_in_triton_interpreter(_CONV_VERIFY_SM90, interpret=False).strip().endswith("ok")


def test_conv_verify_kernel_matches_the_reference_in_the_triton_interpreter():
    """The verify conv's kernel: fp32 exactly conv_step, bf16 within one rounding of its fp32 taps, over 1 and 4
    positions; x as an input, one partial or three; the replays' first T positions written (x exactly), zeros
    after, the window and the other layers untouched."""
    from conftest import run_in_triton_interpreter

    assert run_in_triton_interpreter(_CONV_VERIFY).strip().endswith("ok")


def _prep_inputs(B, T, Hq, Hkv, D, R, S, dtype, seed=0):
    """attention_prep's inputs: q | gate, k, v as S split-K partials [S, B, T, n] fp32 (views past 8 leading
    columns: strided like a fused projection's slices), or outputs [B, T, n] in dtype for S = 0; cos, sin of
    positions 2 … and 7 … (distinct a row); norm weights."""
    from fastqwen.ops.attention import rope_cos_sin

    g = torch.Generator().manual_seed(seed)
    # sums exact in bf16 (multiples of 1/16 below 8): Triton's interpreter rounds fp32 to bf16 toward zero
    parts = [(torch.randint(-40, 40, (max(S, 1), B, T, n + 8), generator=g) / 16)[..., 8:]
             for n in (Hq * 2 * D, Hkv * D, Hkv * D)]
    ins = [x[0].to(dtype) for x in parts] if S == 0 else parts
    positions = torch.arange(T)[None] + torch.tensor([2, 7][:B])[:, None]
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, R, 2).float() / R))
    cos, sin = rope_cos_sin(positions, inv_freq, 1.0, dtype)
    weights = [(torch.randn(D, generator=g) * 0.1).to(dtype) for _ in range(2)]
    return ins, weights, cos, sin, positions


def test_step_positions_are_lengths_plus_offsets_and_its_fake_agrees():
    """step_positions(lengths [B], offsets [T]) = lengths[:, None] + offsets, int64, contiguous [B, T]."""
    from fastqwen.ops.attention_prep import step_positions

    lengths, offsets = torch.tensor([0, 7, 123]), torch.arange(5)
    got = step_positions(lengths, offsets)
    assert torch.equal(got, torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11], [123, 124, 125, 126, 127]]))
    assert got.is_contiguous() and got.dtype == torch.int64
    torch.library.opcheck(step_positions, (lengths, offsets))


def test_attention_prep_is_the_separate_path_and_its_fake_agrees():
    """kernels={"attn_glue": "fused"}: the op (its CPU path) returns prepare's q, writes k and v where
    prepare does and nowhere else (caches poisoned with NaN), from outputs or split-K partials; opcheck checks
    its fake and its mutations of the cache views."""
    from fastqwen.ops.attention_prep import attention_prep, prepare

    B, T, Hq, Hkv, D, R, seq = 2, 3, 4, 2, 16, 8, 12
    for dtype in (torch.float32, torch.bfloat16):
        for S in (0, 1, 3):
            ins, (qw, kw), cos, sin, positions = _prep_inputs(B, T, Hq, Hkv, D, R, S, dtype)
            caches = torch.full((2, 3, B, Hkv, seq, D), float("nan"), dtype=dtype)  # (k, v) x 3 layers
            want_caches = caches.clone()
            q, k, v = prepare(*ins, qw, kw, 1e-6, 1e-6, cos, sin, positions, *want_caches[:, 1])
            got = attention_prep(*ins, qw, kw, 1e-6, 1e-6, cos, sin, positions, *caches[:, 1])
            assert got.shape == (B, Hq, T, D) and got.is_contiguous() and torch.equal(got, q), (dtype, S)
            assert torch.equal(caches.isnan(), want_caches.isnan()) and caches.isnan().sum() == caches.numel() - 2 * (
                B * Hkv * T * D)
            assert torch.equal(caches.nan_to_num(), want_caches.nan_to_num())
            assert torch.equal(want_caches[0, 1, 1, :, 7:10], k[1]), (dtype, S)  # row 1 at positions 7 … 9
            torch.library.opcheck(attention_prep, (*ins, qw, kw, 1e-6, 1e-6, cos, sin, positions,
                                                   *caches.clone()[:, 1]))


_ATTENTION_PREP = """
import torch
from test_ops import _prep_inputs
from fastqwen.ops.attention_prep import _attention_prep_cuda, prepare
B, T, Hq, Hkv, D, R, seq = 2, 3, 4, 2, 48, 16, 12  # (D not a power of 2: the masked tail)
for dtype in (torch.float32, torch.bfloat16):
    for S in (0, 1, 3):
        ins, (qw, kw), cos, sin, positions = _prep_inputs(B, T, Hq, Hkv, D, R, S, dtype)
        caches = torch.full((2, B, Hkv, seq, D), float("nan"), dtype=dtype)
        want_caches = caches.clone()
        want = prepare(*ins, qw, kw, 1e-6, 1e-6, cos, sin, positions, *want_caches)[0]
        got = _attention_prep_cuda(*ins, qw, kw, 1e-6, 1e-6, cos, sin, positions, *caches, pdl=False)
        # bf16: within the interpreter's rounding toward zero (eager's roundings: a bf16 ulp or two)
        tol = 1e-6 if dtype == torch.float32 else 2e-2
        for a, b in ((got, want), (caches.nan_to_num(), want_caches.nan_to_num())):
            assert ((a.float() - b.float()).abs() <= tol * b.float().abs() + tol).all(), (dtype, S)
        assert torch.equal(caches.isnan(), want_caches.isnan()), (dtype, S)  # written where prepare writes
        assert torch.equal(caches[1].nan_to_num(), want_caches[1].nan_to_num()), (dtype, S)  # v: exact
        assert got.shape == want.shape and got.is_contiguous()
print("ok")
"""


_ATTENTION_PREP_SM90 = """
import re
from sm90 import compile_sm90, stack_bytes
from fastqwen.ops import attention_prep as ap

ints = ("q_split", "q_row", "q_pos", "k_split", "k_row", "k_pos", "v_split", "v_row", "v_pos", "cs_row", "cs_pos",
        "p_row", "p_pos", "c_row", "c_head", "c_seq", "SEQ")
sig = {"q_ptr": "*fp32", "k_ptr": "*fp32", "v_ptr": "*fp32", "qw_ptr": "*bf16", "kw_ptr": "*bf16", "cos_ptr": "*bf16",
       "sin_ptr": "*bf16", "pos_ptr": "*i64", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "out_ptr": "*bf16",
       "q_eps": "fp32", "k_eps": "fp32", **{n: "i32" for n in ints}}
for T in (1, 16):  # the 27B's heads: 24 q, 4 kv, 256 dims, 64 rotated; 5 partials
    kernel = compile_sm90(ap._prep_kernel, sig, dict(T=T, HQ=24, HKV=4, D=256, BD=256, R=64, SQ=5, SK=5, SV=5,
                                                     PDL=True),
                          ("q_ptr", "k_ptr", "v_ptr", "qw_ptr", "kw_ptr", "kc_ptr", "vc_ptr", "out_ptr"), num_warps=2,
                          enable_fp_fusion=False)  # (as the launch: eager rounds x·c before adding x[perm]·s)
    code = kernel.asm["ptx"]
    assert stack_bytes(kernel) == 0 and "fma" not in code
    assert code.count("griddepcontrol.wait") == 1
    before = re.findall(r"ld\\.global[^;]*", code[:code.index("griddepcontrol.wait")])
    assert len(before) == 2, before  # the norm weight at d and at its rotate-half partner, nothing else
    assert "cvt.rn.bf16.f32" in code and "sqrt.rn.f32" in code and "div.rn.f32" in code
print("ok")
"""


def test_attention_prep_kernel_matches_prepare_in_the_triton_interpreter():
    """The fused attention prep's kernel against prepare: fp32 within rounding, bf16 within the interpreter's
    rounding; k and v written at each row's positions only (NaN elsewhere), v exactly; from outputs, one partial
    or three; a head size not a power of 2."""
    from conftest import run_in_triton_interpreter

    assert run_in_triton_interpreter(_ATTENTION_PREP).strip().endswith("ok")


def test_attention_prep_kernel_compiles_for_sm90_and_waits_before_reading_activations():
    """Compiled for Hopper at the 27B's heads with programmatic dependent launch, decode and a 16-position
    verify, without FP fusion as launched: no spill, no FMA (fused, the rope's x·c + x[perm]·s became one bf16
    FMA, 1 ulp off eager's in 4.4% of q on an H100); only the norm weights load before griddepcontrol.wait; IEEE
    sqrt and division (torch's fp32 rsqrt on the CPU) and bf16 rounding to nearest even."""
    from conftest import run_in_triton_interpreter

    assert run_in_triton_interpreter(_ATTENTION_PREP_SM90, interpret=False).strip().endswith("ok")


def test_gated_norm_op_is_gated_rms_norm_and_its_fake_agrees():
    """kernels={"gdn_norm": "kernel"}: the op (its CPU path) is gated_rms_norm with z an output or its split-K
    partials (summed in fp32, rounded to o's dtype), contiguous; opcheck checks its fake."""
    from fastqwen.ops.gated_norm import gated_norm

    B, T, HV, V = 2, 3, 4, 16
    for dtype in (torch.float32, torch.bfloat16):
        o = torch.randn(B, T, HV, V).to(dtype)
        parts = torch.randn(3, B, T, HV * V + 8)[..., 8:]
        for z in (parts[0].to(dtype), parts[:1], parts):
            zs = z.float().sum(0).to(dtype) if z.dim() == 4 else z
            w = torch.randn(V).to(dtype)
            got = gated_norm(o, z, w, 1e-6)
            assert got.is_contiguous() and torch.equal(got, gated_rms_norm(o, zs.reshape(o.shape), w, 1e-6))
            torch.library.opcheck(gated_norm, (o, z, w, 1e-6))


_GATED_NORM = """
import torch
from fastqwen.ops.gated_norm import _gated_norm_cuda
from fastqwen.ops.norm import gated_rms_norm
torch.manual_seed(0)
B, T, HV, V = 2, 3, 4, 48  # (V not a power of 2: the masked tail)
# z exact in bf16 (multiples of 1/16 below 8): Triton's interpreter rounds fp32 to bf16 toward zero
parts = (torch.randint(-40, 40, (3, B, T, HV * V + 8)) / 16)[..., 8:]
for dtype in (torch.float32, torch.bfloat16):
    o = torch.randn(B, T, HV, V).to(dtype)
    for w in (torch.randn(V).to(dtype), torch.randn(V)):  # a 16-bit weight rounds w·ô, an fp32 one does not
        for z in (parts[0].to(dtype), parts[:1], parts):
            zs = z.float().sum(0).to(dtype) if z.dim() == 4 else z
            want = gated_rms_norm(o, zs.reshape(o.shape), w, 1e-6)
            got = _gated_norm_cuda(o, z, w, 1e-6, pdl=False)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
            assert ((got.float() - want.float()).abs() <= tol * want.float().abs() + tol).all(), (dtype, z.dim())
print("ok")
"""

_GATED_NORM_SM90 = """
import re
from sm90 import compile_sm90, stack_bytes
from fastqwen.ops import gated_norm as gn

sig = {"o_ptr": "*bf16", "z_ptr": "*fp32", "w_ptr": "*bf16", "out_ptr": "*bf16", "eps": "fp32", "z_split": "i32",
       "z_row": "i32", "z_pos": "i32"}
for T in (1, 16):  # the 27B's 48 value heads of 128; 4 partials (its GDN input projection's plan)
    kernel = compile_sm90(gn._gated_norm_kernel, sig, dict(T=T, HV=48, V=128, BV=128, SZ=4, ROUND_W=True, PDL=True),
                          ("o_ptr", "z_ptr", "w_ptr", "out_ptr"), num_warps=1)
    code = kernel.asm["ptx"]
    assert stack_bytes(kernel) == 0 and code.count("griddepcontrol.wait") == 1
    before = re.findall(r"ld\\.global[^;]*", code[:code.index("griddepcontrol.wait")])
    assert len(before) == 1, before  # the norm weight only
    assert "cvt.rn.bf16.f32" in code and "sqrt.rn.f32" in code
print("ok")
"""


def test_gated_norm_kernel_matches_gated_rms_norm_in_the_triton_interpreter_and_builds_for_sm90():
    """The gated norm's kernel: fp32 within rounding, bf16 within the interpreter's rounding, 16-bit and fp32
    weights, z an output, one partial or three, a head size not a power of 2; for Hopper at the 27B's heads with
    PDL: no spill, only the weight loads before griddepcontrol.wait, IEEE sqrt, bf16 to nearest even."""
    from conftest import run_in_triton_interpreter

    assert run_in_triton_interpreter(_GATED_NORM).strip().endswith("ok")
    assert run_in_triton_interpreter(_GATED_NORM_SM90, interpret=False).strip().endswith("ok")
