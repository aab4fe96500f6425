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


@pytest.mark.parametrize("model,B,T,S", [("27b", 1, 1, 5), ("27b", 1, 16, 5), ("27b", 3, 4, 1), ("35b", 1, 1, 8),
                                         ("35b", 2, 1, 0)])
def test_attention_prep_kernel_matches_prepare(model, B, T, S):
    """kernels={"attn_prep": "fused"}: the fused kernel against prepare (eager torch on the GPU) at the 27B's heads
    (24 q, 4 kv of 256, 64 rotated) and the 35B-A3B's (16 q, 2 kv), S split-K partials (0: bf16 outputs), decode,
    verify and batch rows at distinct positions, with PDL: q, k within a bf16 ulp of the reference (eager's
    roundings; the sums of squares may round apart) and nearly all equal; v exactly; the caches untouched elsewhere
    (NaN-poisoned)."""
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
    got = attention_prep(*ins, qw, kw, 1e-6, 1e-6, cos, sin, positions, *caches, pdl=True)
    torch.cuda.synchronize()
    assert torch.equal(caches.isnan(), want_caches.isnan())
    assert torch.equal(caches[1].nan_to_num(), want_caches[1].nan_to_num())
    for a, b in ((got, want), (caches[0].nan_to_num(), want_caches[0].nan_to_num())):
        assert ((a.float() - b.float()).abs() <= 2 ** -7 * b.float().abs() + 1e-6).all()
        assert (a == b).float().mean() > 0.99
