"""The persistent int4 MLP kernel (ops/int4_mlp.py with ops/cuda/int4_mlp.cu) off the GPU: its reference against
the quantized MLP it replaces, its argument checks (Python and the library's), and its build for sm_90 (no spill at
7 blocks a multiprocessor, the waits and counts it was written to have). tests/gpu/test_int4_mlp_gpu.py runs it."""

import pytest
import torch
import torch.nn.functional as F

from fastqwen.ops import cuda_build, int4_mlp
from fastqwen.quant.linear import QuantLinear
from test_cuda_kernels import NVCC, _build_sm90, _loops, _sass_functions, _sass_ops


def quantized_mlp(K: int, I: int, N: int, seed: int = 0):
    """(gate | up, down) int4 QuantLinears of a random MLP: the fused [2I, K] gate | up and the [N, I] down."""
    torch.manual_seed(seed)
    gate_up = torch.nn.Linear(K, 2 * I, bias=False)
    down = torch.nn.Linear(I, N, bias=False)
    return QuantLinear.from_linear(gate_up, "int4"), QuantLinear.from_linear(down, "int4")


@pytest.mark.parametrize("K,I,N,chunks", [(256, 512, 128, 4), (384, 1024, 64, 2), (128, 256, 32, 1),
                                          (256, 2048, 48, 16)])
def test_reference_is_the_quantized_mlp_split_by_chunks_of_h(K, I, N, chunks):
    """The partials sum to down(bf16(silu(gate) · up)) with gate and up the dequantized weights' fp32 products
    rounded to bf16, chunk c that product over h's columns of chunk c alone; and to the QuantLinears' own forward
    within bf16's rounding."""
    gate_up, down = quantized_mlp(K, I, N, seed=K + I)
    x = torch.randn(1, K, dtype=torch.bfloat16)
    parts = int4_mlp.int4_mlp(x, gate_up, down, chunks)
    assert parts.shape == (chunks, 1, N) and parts.dtype == torch.float32
    gate, up = (x.float() @ gate_up.dequantized().t()).to(torch.bfloat16).float().split(I, -1)  # (the GEMVs' bf16)
    h = (F.silu(gate) * up).to(torch.bfloat16).float()
    W = down.dequantized()
    assert torch.allclose(parts.sum(0), h @ W.t(), rtol=1e-4, atol=1e-4)
    width = I // chunks
    for c in range(chunks):
        assert torch.allclose(parts[c], h[:, c * width:(c + 1) * width] @ W[:, c * width:(c + 1) * width].t(),
                              rtol=1e-4, atol=1e-4)
    gate, up = gate_up(x).split(I, -1)  # (the layers' own forward, bf16 throughout)
    want = down((F.silu(gate.float()) * up.float()).to(torch.bfloat16)).float()
    assert torch.allclose(parts.sum(0), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_bad_inputs_get_errors_that_name_the_fix():
    gate_up, down = quantized_mlp(256, 512, 128)
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    for args, match in (((x.float(), gate_up, down, 4), "one bf16 row of 256"),
                        ((x.expand(2, -1), gate_up, down, 4), "one bf16 row"),
                        ((x[:, :128], gate_up, down, 4), "one bf16 row"),
                        ((x, torch.nn.Linear(256, 1024, bias=False), down, 4), "gate_up must be an int4 QuantLinear"),
                        ((x, gate_up, QuantLinear.from_linear(torch.nn.Linear(512, 128), "int4"), 4),
                         "down must be an int4 QuantLinear .*bias-free"),
                        ((x, QuantLinear.from_linear(torch.nn.Linear(256, 512, bias=False), "fp8-weight"), down, 4),
                         "gate_up must be an int4"),
                        ((x, quantized_mlp(256, 256, 128)[0], down, 4), "fused gate \\| up of 1024 rows"),
                        ((x, gate_up, down, 3), "whole groups of 128"), ((x, gate_up, down, 0), "chunks must be"),
                        ((x, gate_up, down, 32), "chunks must be 1 … 16")):
        with pytest.raises(ValueError, match=match):
            int4_mlp.int4_mlp(*args)
    down.register_buffer("perm", torch.arange(512))
    with pytest.raises(ValueError, match="without act-order"):
        int4_mlp.int4_mlp(x, gate_up, down, 4)


@NVCC
def test_library_refuses_shapes_out_of_range_before_touching_the_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTQWEN_CACHE", str(tmp_path))
    cuda_build.build.cache_clear()
    try:
        fn = cuda_build.entry("int4_mlp", "90", int4_mlp.CHOICE, pointers=10, ints=7)
        call = lambda I=512, K=256, N=128, C=4, blocks=8: fn(*[0] * 10, I, K, N, C, blocks, 1, 0, None)  # noqa: E731
        for bad in ({"I": 520}, {"I": 0}, {"K": 200}, {"N": 40}, {"C": 0}, {"C": 3}, {"C": 8}, {"blocks": 0}):
            assert call(**bad) == 1, bad  # (C 8: chunks of 64 columns, not whole groups)
        if not torch.cuda.is_available():
            assert call() not in (0, 1)  # (no GPU: the runtime's error, not a crash)
    finally:
        cuda_build.build.cache_clear()


@NVCC
def test_kernel_builds_for_sm90_at_seven_blocks_without_spills_and_waits_as_written(tmp_path):
    """One kernel, ≤ 72 registers (7 blocks of 128 threads a multiprocessor, the folded GEMV's occupancy), no local
    memory; in its SASS the first weight loads come before the PDL wait and no atomic or store does, the down tasks'
    wait is a loop of acquire loads with a nanosleep, the arrival counts and tickets are atomics, and the tensor-core
    MMAs sit in the task loops."""
    report, lib = _build_sm90("int4_mlp", tmp_path)
    used = [line.split("Used ")[1] for line in report.splitlines() if "Used " in line]
    assert len(used) == 1 and int(used[0].split()[0]) <= 72, report
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report
    (kernel,) = _sass_functions(lib, "int4_mlp")
    ops = _sass_ops(kernel)
    assert not {"LDL", "STL"} & set(ops), "local memory"
    count = lambda prefix, ops=ops: sum(o.startswith(prefix) for o in ops)  # noqa: E731
    assert count("HMMA.16816.F32.BF16") == 64  # (16 a group, two groups a batch: the pair tasks' walk, down's)
    assert count("ATOMG.E.ADD.S32.STRONG.GPU") == 2 and count("MEMBAR.SC") == 0  # (arrivals, blocks out: acq_rel)
    assert count("ATOMG.E.ADD.STRONG.GPU") == 2  # (the tickets, taken in either loop)
    first_wait = ops.index("ACQBULK")  # (griddepcontrol.wait: PDL)
    assert "LDG.E.NA.128" in ops[:first_wait], "the first weight loads are issued before the PDL wait"
    assert not any(o.startswith(("ATOMG", "STG")) for o in ops[:first_wait]), "no atomic or store before the PDL wait"
    a, b = min(((a, b) for a, b in _loops(kernel) if "NANOSLEEP" in ops[a:b + 1]), key=lambda loop: loop[1] - loop[0])
    spin = ops[a:b + 1]  # (the innermost loop that sleeps: the wait)
    assert len(spin) < 8 and "LDG.E.STRONG.GPU" in spin and "CCTL.IVALL" in spin, spin  # (an acquire load)
    outer = [(c, d) for c, d in _loops(kernel) if c < a and b < d and "HMMA.16816.F32.BF16" in ops[c:d + 1]]
    c, _ = min(outer, key=lambda loop: loop[1] - loop[0])  # (the down tasks' loop)
    assert "LDG.E.NA.128" in ops[c:a], "a down task's first weight loads are issued before its wait"
