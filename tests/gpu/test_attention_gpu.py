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
