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


_MERGE_GATED = """
import torch
from fastqwen.ops.attention import attend_cache
from fastqwen.ops.decode_attention import _merge_gated_cuda, merge_gated, split_kv_partials
torch.manual_seed(0)
B, Hkv, G, S, D = 2, 2, 3, 300, 64
for T, splits, dtype, SG in ((1, 12, torch.float32, 0), (4, 7, torch.float32, 3), (1, 12, torch.bfloat16, 1)):
    q = torch.randn(B, Hkv * G, T, D)  # (fp32: the interpreter's dots; the merge takes its dtype from q_out)
    k, v = torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    q_out = q.to(dtype)
    pos = torch.tensor([5, 140])[:, None] + torch.arange(T)  # row 0's keys fill one split of the 12: the rest empty
    # gates exact in bf16 (multiples of 1/16): Triton's interpreter rounds fp32 to bf16 toward zero
    parts = (torch.randint(-40, 40, (max(SG, 1), B, T, Hkv * G * 2 * D + 8)) / 16)[..., 8:]
    gate = parts[0].to(dtype) if SG == 0 else parts
    o, lse = split_kv_partials(q, k, v, pos, D ** -0.5, splits=splits)
    want = merge_gated(o, lse, q_out, gate)
    o_skip, lse_skip = split_kv_partials(q, k, v, pos, D ** -0.5, splits=splits, skip_empty=True)
    assert torch.equal(lse_skip[..., :G * T], lse[..., :G * T])  # (rows past G·T: the programs' padding, unwritten)
    empty = (lse[..., :G * T] == float("-inf")).all(-1)  # [B, Hkv, SPLITS]: splits past every row's keys
    assert empty.any() and (~empty).any()
    o_skip[empty] = float("nan")  # (not written with skip_empty; the merge must not read them)
    got = _merge_gated_cuda(o_skip, lse_skip, q_out, gate)
    assert got.shape == (B, T, Hkv * G * D) and got.dtype == dtype and not got.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert ((got.float() - want.float()).abs() <= tol * want.float().abs() + tol).all(), (T, splits)
    ref = attend_cache(q, k, v, pos, D ** -0.5)  # and the attention itself
    gated = ref.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(
        (parts.sum(0) if SG else parts[0]).reshape(B, T, -1, 2 * D)[..., D:].reshape(B, T, -1))
    assert ((got.float() - gated).norm() / gated.norm()).item() < (1e-5 if dtype == torch.float32 else 1e-2)
print("ok")
"""

_MERGE_GATED_SM90 = """
import re
from sm90 import compile_sm90, stack_bytes
from fastqwen.ops import decode_attention as da

sig = {"o_ptr": "*fp32", "lse_ptr": "*fp32", "g_ptr": "*fp32", "out_ptr": "*bf16", **{n: "i32" for n in (
    "so_b", "so_h", "so_s", "so_r", "sl_b", "sl_h", "sl_s", "g_split", "g_row", "g_pos")}}
for T in (1, 16):  # the 27B: 4 KV heads of 6 q heads of 256; 64 splits; 5 gate partials
    kernel = compile_sm90(da._merge_kernel, sig, dict(T=T, G=6, HKV=4, D=256, BD=256, SPLITS=64, BS=64, SG=5,
                                                      CHUNK=da.MERGE_CHUNK, PDL=True),
                          ("o_ptr", "lse_ptr", "g_ptr", "out_ptr"), num_warps=4)
    code = kernel.asm["ptx"]
    assert stack_bytes(kernel) == 0
    assert not re.findall(r"ld\\.global", code[:code.index("griddepcontrol.wait")])  # (all it reads is written
print("ok")                                                                          # by the kernels before it)
"""


def test_merge_gated_kernel_reads_only_splits_holding_keys_in_the_triton_interpreter():
    """kernels={"attn_glue": "fused"}: split_kv_partials with skip_empty leaves the o of splits past every row's
    keys unwritten (lse as before), and the merge kernel, which skips splits of lse -inf, gives merge_gated's
    output over them (poisoned with NaN): fp32 within rounding, bf16 within the interpreter's rounding; gates as
    outputs, one partial or three; decode and a 4-position verify; and the gated attention itself."""
    assert run_in_triton_interpreter(_MERGE_GATED).strip().endswith("ok")


def test_merge_gated_kernel_compiles_for_sm90_and_waits_before_any_load():
    assert run_in_triton_interpreter(_MERGE_GATED_SM90, interpret=False).strip().endswith("ok")


@pytest.mark.parametrize("S", [0, 2])
def test_merge_gated_op_is_merge_gated_and_its_fake_agrees(S):
    """The registered merge (its CPU path) against merge_gated over the CPU partials op's one split: attend_cache
    times sigmoid(gate), from a gate output or its split-K partials; opcheck checks its fake."""
    from fastqwen.ops.decode_attention import merge_gated_op

    q, k, v = torch.randn(2, 4, 3, 32), torch.randn(2, 2, 50, 32), torch.randn(2, 2, 50, 32)
    pos = torch.tensor([3, 40])[:, None] + torch.arange(3)
    parts = torch.randn(max(S, 1), 2, 3, 4 * 64)
    gate = parts[0] if S == 0 else parts
    o, lse = split_kv_partials_op(q, k, v, pos, 0.2, True)
    got = merge_gated_op(o, lse, q, gate)
    ref = attend_cache(q, k, v, pos, 0.2).transpose(1, 2).reshape(2, 3, -1)
    g = parts.sum(0) if S else parts[0]
    torch.testing.assert_close(got, ref * torch.sigmoid(g.reshape(2, 3, 4, 64)[..., 32:].reshape(2, 3, -1)))
    torch.library.opcheck(merge_gated_op, (o, lse, q, gate))
