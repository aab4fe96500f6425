"""The split-KV decode attention kernel on the H200 at the 27B attention shape, against attend_cache in fp32,
with the keys past each row's last query poisoned (the kernel must not read them)."""

import pytest
import torch
from conftest import rel_err

from fastqwen.ops.attention import attend_cache
from fastqwen.ops.decode_attention import attend_cache_split


@pytest.mark.parametrize("B,T,S", [(1, 1, 4096), (3, 16, 4096), (2, 1, 32768)])
def test_split_kv_matches_fp32_reference_and_skips_unused_keys(B, T, S):
    torch.manual_seed(0)
    Hq, Hkv, D = 24, 4, 256
    q = torch.randn(B, Hq, T, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    last = torch.randint(T, S - 1, (B,), device="cuda")
    pos = last[:, None] - T + 1 + torch.arange(T, device="cuda")
    ref = attend_cache(q.float(), k.float(), v.float(), pos, D ** -0.5)
    for b in range(B):
        k[b, :, int(last[b]) + 1:] = float("nan")
        v[b, :, int(last[b]) + 1:] = float("nan")
    out = attend_cache_split(q, k, v, pos, D ** -0.5)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("tables", [False, True])
@pytest.mark.parametrize("model,B,T,S", [("27b", 1, 1, 5), ("27b", 1, 16, 5), ("27b", 3, 4, 1), ("35b", 1, 1, 8),
                                         ("35b", 2, 1, 0)])
def test_attention_prep_kernel_matches_prepare(model, B, T, S, tables):
    """kernels={"attn_glue": "fused"}: the fused kernel against prepare (eager torch on the GPU) at the 27B's heads
    (24 q, 4 kv of 256, 64 rotated) and the 35B-A3B's (16 q, 2 kv), S split-K partials (0: bf16 outputs), decode,
    verify and batch rows at distinct positions, with PDL, cos and sin at the positions or as tables of every
    position (the model's): q, k within a bf16 ulp of the reference (eager's roundings, FP fusion off; the sums of
    squares may round apart) and over 99% equal; v exactly; the caches untouched elsewhere (NaN-poisoned)."""
    from fastqwen.ops.attention import rope_cos_sin
    from fastqwen.ops.attention_prep import attention_prep, prepare

    torch.manual_seed(0)
    Hq, Hkv, D, R, seq = (24, 4, 256, 64, 4096) if model == "27b" else (16, 2, 256, 64, 4096)
    parts = [torch.randn(max(S, 1), B, T, n + 8, device="cuda")[..., 8:] for n in (Hq * 2 * D, Hkv * D, Hkv * D)]
    ins = [x[0].bfloat16() for x in parts] if S == 0 else parts
    positions = torch.randint(0, seq - T, (B, 1), device="cuda") + torch.arange(T, device="cuda")
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, R, 2, device="cuda").float() / R))
    cos, sin = rope_cos_sin(positions, inv_freq, 1.0, torch.bfloat16)
    qw, kw = (torch.randn(D, device="cuda") * 0.1).bfloat16(), (torch.randn(D, device="cuda") * 0.1).bfloat16()
    caches = torch.full((2, B, Hkv, seq, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    want_caches = caches.clone()
    want = prepare(*ins, qw, kw, 1e-6, 1e-6, cos, sin, positions, *want_caches)[0]
    if tables:  # (rows of every position, as the model's: the same values at the positions)
        cos, sin = (t[0] for t in rope_cos_sin(torch.arange(seq, device="cuda")[None], inv_freq, 1.0, torch.bfloat16))
    got = attention_prep(*ins, qw, kw, 1e-6, 1e-6, cos, sin, positions, *caches, pdl=True)
    torch.cuda.synchronize()
    assert torch.equal(caches.isnan(), want_caches.isnan())
    assert torch.equal(caches[1].nan_to_num(), want_caches[1].nan_to_num())
    for a, b in ((got, want), (caches[0].nan_to_num(), want_caches[0].nan_to_num())):
        # a bf16 ulp of the value, or of the head's largest where the rope's two products cancel (the sums of
        # squares round apart from torch's now and then)
        a, b = a.float(), b.float()
        assert ((a - b).abs() <= 2 ** -7 * b.abs() + 2 ** -8 * b.abs().amax(-1, keepdim=True)).all()
        assert (a == b).float().mean() > 0.99


@pytest.mark.parametrize("Hq,Hkv,B,T,S,n", [(24, 4, 1, 1, 5, 512), (24, 4, 1, 16, 5, 512), (24, 4, 3, 1, 5, 3000),
                                            (16, 2, 1, 1, 8, 512), (16, 2, 2, 4, 0, 100)])
def test_merge_gated_kernel_matches_merge_gated(Hq, Hkv, B, T, S, n):
    """kernels={"attn_glue": "fused"}: the split-KV kernel with skip_empty (splits past every row's keys leave o
    unwritten: poisoned with NaN here) and the merge kernel with PDL against merge_gated over the full partials
    (eager torch on the GPU) at the 27B's and the 35B-A3B's heads, S gate partials (0: a bf16 output), decode,
    verify and batch rows: within a bf16 ulp (eager's roundings; the weighted sum's order differs) and nearly all
    equal; and within 1e-2 of the fp32 attention times the gate."""
    from fastqwen.ops.decode_attention import merge_gated, merge_gated_op, split_kv_partials

    torch.manual_seed(0)
    D, seq = 256, 4096
    q = torch.randn(B, Hq, T, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, seq, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    pos = (n - T + torch.arange(T, device="cuda"))[None].expand(B, -1) - torch.arange(B, device="cuda")[:, None]
    parts = torch.randn(max(S, 1), B, T, Hq * 2 * D + 8, device="cuda")[..., 8:]
    gate = parts[0].bfloat16() if S == 0 else parts
    o, lse = split_kv_partials(q, k, v, pos, D ** -0.5)
    want = merge_gated(o, lse, q, gate)
    o.fill_(float("nan"))
    del o, lse  # (the caching allocator hands the NaN-filled block to o_skip: its unwritten splits stay NaN)
    o_skip, lse_skip = split_kv_partials(q, k, v, pos, D ** -0.5, skip_empty=True)
    got = merge_gated_op(o_skip, lse_skip, q, gate, pdl=True)
    torch.cuda.synchronize()
    assert not got.isnan().any() and got.shape == (B, T, Hq * D)
    assert ((got.float() - want.float()).abs() <= 2 ** -7 * want.float().abs() + 1e-6).all()
    assert (got == want).float().mean() > 0.99
    g = (parts.sum(0) if S else parts[0].bfloat16().float()).reshape(B, T, Hq, 2 * D)[..., D:].reshape(B, T, -1)
    ref = attend_cache(q.float(), k.float(), v.float(), pos, D ** -0.5).transpose(1, 2).reshape(B, T, -1)
    assert rel_err(got, ref * torch.sigmoid(g)) < 1e-2
