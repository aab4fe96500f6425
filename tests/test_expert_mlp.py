"""The one-launch routed expert MLP (fastqwen/ops/expert_mlp.py) against its torch reference.

The kernel runs here in Triton's CPU interpreter (one program after another, so every down tile finds its
pair's gate | up tiles done; the waits themselves run on the GPU: tests/gpu) and is compiled for sm90 to pin
its ordering; tests/gpu/test_ops_gpu.py and test_quant_gpu.py run it on the 35B-A3B shapes.
"""

import pytest
import torch
from conftest import run_in_triton_interpreter

from fastqwen.ops.expert_mlp import expert_mlp, reference
from fastqwen.ops.gemv import BF16, FP8_ROW, INT4, stored_operands

_INTERPRETED = """
import torch
from fastqwen.ops import expert_mlp as em
from fastqwen.ops.gemv import BF16, FP8_ROW, stored_operands, tile_counts

def experts(fmt, E, N, K, seed):
    g = torch.Generator().manual_seed(seed)
    parts = [stored_operands(fmt, torch.randn(N, K, generator=g) * 0.05) for _ in range(E)]
    return torch.stack([p[0] for p in parts]), None if fmt == BF16 else torch.stack([p[1] for p in parts])

def check(fmt):
    torch.manual_seed(0)
    # H 384: 128-column gate | up steps (BK1); I 384: three down steps of 128 (BK2); T tokens of k pairs each, one
    # expert twice in the first token
    for E, H, I, T, k in ((5, 256, 128, 2, 3), (4, 384, 384, 3, 3)):
        w1, s1 = experts(fmt, E, 2 * I, H, 1)
        w2, s2 = experts(fmt, E, H, I, 2)
        x = torch.randn(T, H).bfloat16()
        exp = torch.randint(0, E, (T * k,), dtype=torch.int32)
        exp[1] = exp[0]
        for act in (torch.float32, torch.bfloat16):
            y = em.launch(x, exp, fmt, w1, s1, w2, s2, act)
            ref = em.reference(x, exp, fmt, w1, s1, w2, s2, act)
            err = ((y - ref).norm() / ref.norm()).item()
            # fp32: the same sums up to their order; bf16: the interpreter truncates fp32 -> bf16 where the GPU
            # rounds to nearest (a few activations one bf16 step apart)
            assert err < (1e-6 if act == torch.float32 else 2e-2), (fmt, H, I, act, err)
            assert not tile_counts(x.device, 1)[:2 + T * k].any(), "a count left nonzero"
        # another launch config (BLOCK_N 16, 2 stages, 2 warps): the same products
        y = em.launch(x, exp, fmt, w1, s1, w2, s2, torch.float32, (16, 2, 2))
        ref = em.reference(x, exp, fmt, w1, s1, w2, s2, torch.float32)
        assert ((y - ref).norm() / ref.norm()).item() < 1e-6, (fmt, H, I, "config")
"""


def test_kernel_matches_reference_in_the_interpreter():
    """Every pair's output equals the reference (fp32 activation: to fp32 rounding), across two shapes (one
    down step and several), a repeated expert, bf16 and fp8-weight experts; the counters are all zero after."""
    scripts = [_INTERPRETED + f"check({fmt})\nprint('expert mlp ok')\n" for fmt in ("BF16", "FP8_ROW")]
    for out in run_in_triton_interpreter(*scripts):  # (a format a process, both at once)
        assert "expert mlp ok" in out


_SM90 = """
import re
import triton.language as tl
from sm90 import compile_sm90, cuobjdump, stack_bytes
from fastqwen.ops.expert_mlp import _expert_mlp_kernel

for fmt, w in ((0, "*fp8e4nv"), (3, "*bf16")):
    sig = dict(x_ptr="*bf16", exp_ptr="*i32", w1_ptr=w, s1_ptr="*fp32", w2_ptr=w, s2_ptr="*fp32", h_ptr="*fp32",
               y_ptr="*fp32", cnt_ptr="*i32", P="i32", H="i32", I="i32", per_row="i32", w1_estride="i32",
               w2_estride="i32", s1_estride="i32", s2_estride="i32")
    consts = dict(FMT=fmt, BLOCK_N=32, BK1=256, BK2=512, STAGES=4, ACT_DTYPE=tl.bfloat16)
    kernel = compile_sm90(_expert_mlp_kernel, sig, consts, ("x_ptr", "w1_ptr", "w2_ptr", "h_ptr", "y_ptr", "H", "I",
                                                            "w1_estride", "w2_estride"), num_stages=4)
    code = kernel.asm["ptx"]
    if fmt == 0:  # no spill, 128 registers a thread at most: 4 programs an SM, so that the waiting down tiles
        # leave room for the gate | up tiles beside them (a BLOCK_N x 512 fp32 down accumulator took 230)
        assert stack_bytes(kernel) == 0
        assert int(re.search(r"REG:(\\d+)", cuobjdump(kernel, "-res-usage")).group(1)) <= 128
    wait = code.index("ld.global.gpu.acquire")  # the down tile's wait for its pair's gate | up tiles
    release = code.index("atom.global.gpu.release.add")  # a gate | up tile counting itself in
    ticket = code.index("atom.global.gpu.acq_rel.add")
    # one thread takes the ticket, counts in and waits (predicated); the count after a barrier behind the stores
    for at in (ticket, release, wait):
        assert code[code.rfind("\\n", 0, at):at].strip().startswith("@%p"), code[at - 40:at + 40]
    assert code.rfind("bar.sync", 0, release) > code.rfind("st.global", 0, release) > 0, "count before stores"
    # the down tile's first weight step loaded before it waits, the gate | up outputs (h) read from L2 after
    first_w = [m.start() for m in re.finditer(r"ld\\.global\\.v4", code) if m.start() > release]
    assert first_w and min(first_w) < wait, "the down weights are loaded after the wait"
    h_reads = [m.start() for m in re.finditer(r"ld\\.global\\.cg", code)]
    assert h_reads and min(h_reads) > wait, "h read before the wait"
print("ok")
"""


def test_kernel_loads_down_weights_before_it_waits_and_counts_after_its_stores():
    """Compiled for sm90 here (no GPU): one thread takes the ticket, counts a finished gate | up tile in (release,
    after a barrier behind the tile's stores) and waits (acquire); a down tile issues its first weight loads
    before that wait and reads the gate | up outputs only after it, from L2 (.cg); the fp8 kernel neither spills
    nor takes more than 128 registers a thread."""
    assert run_in_triton_interpreter(_SM90, interpret=False).strip().endswith("ok")


def test_op_runs_its_reference_on_cpu_and_refuses_what_the_kernel_cannot_take():
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(3, 256, 128, generator=g).bfloat16()
    w2 = torch.randn(3, 128, 128, generator=g).bfloat16()
    x = torch.randn(2, 128).bfloat16()
    exp = torch.tensor([0, 2, 1, 1], dtype=torch.int32)
    assert torch.equal(expert_mlp(x, exp, BF16, w1, None, w2, None, torch.bfloat16),
                       reference(x, exp, BF16, w1, None, w2, None, torch.bfloat16))
    torch.library.opcheck(expert_mlp, (x, exp, BF16, w1, None, w2, None, torch.bfloat16),
                          test_utils=("test_faketensor", "test_autograd_registration"))
    from fastqwen.ops.expert_mlp import launch

    q, s, z = stored_operands(INT4, torch.randn(256, 128, generator=g))
    with pytest.raises(ValueError, match="bf16 or fp8-weight experts"):
        launch(x, exp, INT4, q[None], s[None], w2, None, torch.bfloat16)
    with pytest.raises(ValueError, match="P / T pairs a token"):
        launch(x, exp[:3], BF16, w1, None, w2, None, torch.bfloat16)
    with pytest.raises(ValueError, match=r"config is \(BLOCK_N in 16, 32, 64, 128"):
        launch(x, exp, BF16, w1, None, w2, None, torch.bfloat16, (48, 4, 4))
    with pytest.raises(ValueError, match="each expert's weight contiguous"):
        launch(x, exp, BF16, w1.transpose(1, 2).contiguous().transpose(1, 2), None, w2, None, torch.bfloat16)
