"""The split-KV decode attention kernel (fastqwen/ops/decode_attention.py) against attend_cache, in Triton's
CPU interpreter (conftest.run_in_triton_interpreter)."""

import pytest
import torch
from conftest import run_in_triton_interpreter

from fastqwen.ops.attention import attend_cache
from fastqwen.ops.decode_attention import attend_cache_split_op, split_kv_partials_op

_INTERPRETED = """
import torch
from fastqwen.ops.attention import attend_cache
from fastqwen.ops.decode_attention import attend_cache_split
torch.manual_seed(0)
B, Hkv, G, S, D = 3, 2, 3, 300, 64
for T in (1, 4, 16):  # 3, 12 and 48 query rows a KV head: 16-row, 16-row and two 32-row programs
    q = torch.randn(B, Hkv * G, T, D)
    k, v = torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    ends = torch.tensor([5, 140, 280])  # one short row, two long ones (the last query at most 295 < S)
    pos = ends[:, None] + torch.arange(T)
    if T == 4:  # int32 positions with a row stride of 8 (the kernel reads any integer dtype at any strides)
        pos = torch.zeros(B, 8, dtype=torch.int32)[:, :T].copy_(pos)
    ref = attend_cache(q, k, v, pos, D ** -0.5)
    for b in range(B):  # keys past a row's last query must never be read
        k[b, :, int(pos[b, -1]) + 1:] = float("nan")
        v[b, :, int(pos[b, -1]) + 1:] = float("nan")
    for splits in (1, 4, 7):
        out = attend_cache_split(q, k, v, pos, D ** -0.5, splits=splits)
        assert not out.isnan().any(), (T, splits)
        err = ((out - ref).norm() / ref.norm()).item()
        assert err < 1e-5, f"T={T} splits={splits}: relative error {err:.2e}"
print("ok")
"""


def test_split_kv_kernel_matches_attend_cache_and_reads_only_used_keys():
    assert run_in_triton_interpreter(_INTERPRETED).strip().endswith("ok")


@pytest.mark.parametrize("T", [1, 5])
def test_registered_op_is_the_reference_on_cpu(T):
    """The registered partials op (one split there) and its traced merge give attend_cache, eager and compiled;
    positions may be a broadcast view (the DFlash draft's block end)."""
    q, k, v = torch.randn(2, 4, T, 32), torch.randn(2, 2, 50, 32), torch.randn(2, 2, 50, 32)
    pos = torch.tensor([3, 40])[:, None].expand(-1, T) + torch.arange(T)
    torch.library.opcheck(split_kv_partials_op, (q, k, v, pos, 0.2))
    ref = attend_cache(q, k, v, pos, 0.2)
    assert torch.equal(attend_cache_split_op(q, k, v, pos, 0.2), ref)
    torch.testing.assert_close(torch.compile(attend_cache_split_op, fullgraph=True)(q, k, v, pos, 0.2), ref)
