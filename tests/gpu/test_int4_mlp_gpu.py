"""The persistent int4 MLP kernel (ops/int4_mlp.py, a candidate) on the GPU: its partials against the plain torch
reference at the 27B's and 9B's MLP shapes, 1 to 16 chunks, all resident blocks or a few (many tasks a block),
with and without programmatic dependent launch;
every output written (NaN-poisoned memory); launched again and again, and replayed in a CUDA graph on new inputs
(the counts it resets); the counts left zero."""

import pytest
import torch
from conftest import poison_allocator, rel_err

from fastqwen import bench
from fastqwen.ops import int4_mlp
from fastqwen.quant.linear import QuantLinear

SHAPES = {"27b": (5120, 17408, 5120), "9b": (4096, 12288, 4096)}  # (K, I, N)


def mlp(K, I, N, seed=0):
    torch.manual_seed(seed)
    with torch.device("cuda"):
        gate_up = torch.nn.Linear(K, 2 * I, bias=False, dtype=torch.bfloat16)
        down = torch.nn.Linear(I, N, bias=False, dtype=torch.bfloat16)
    return QuantLinear.from_linear(gate_up, "int4"), QuantLinear.from_linear(down, "int4")


def close(got, want):
    """Within the bf16 rounding of gate, up and h, which a different fp32 summation order can move by one ulp."""
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < 2e-3, rel_err(got, want)
    assert rel_err(got.sum(0), want.sum(0)) < 2e-3


@pytest.mark.parametrize("shape,chunks,cap,pdl", [("27b", 4, 0, False), ("27b", 8, 0, True), ("27b", 1, 0, False),
                                              ("27b", 4, 132, True), ("9b", 4, 0, True), ("9b", 16, 0, False),
                                              ("9b", 8, 200, False)])
def test_partials_match_the_reference(shape, chunks, cap, pdl):
    K, I, N = SHAPES[shape]
    gate_up, down = mlp(K, I, N)
    assert bench._on_cuda(gate_up)  # (what graph_seconds times as a CUDA graph)
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    poison_allocator((I,), (chunks, 1, N), dtype=torch.float32)
    got = int4_mlp.int4_mlp(x, gate_up, down, chunks, cap, pdl)
    close(got, int4_mlp.reference(x, *int4_mlp.weights(gate_up), *int4_mlp.weights(down), chunks))
    assert int(int4_mlp.reserve(x.device).abs().sum()) == 0, "the counts are left zero"


def test_repeated_launches_and_graph_replays_on_new_inputs():
    K, I, N = SHAPES["9b"]
    gate_up, down = mlp(K, I, N, seed=1)
    xs = [torch.randn(1, K, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    want = [int4_mlp.reference(x, *int4_mlp.weights(gate_up), *int4_mlp.weights(down), 4) for x in xs]
    for x, w in zip(xs * 3, want * 3):  # (back to back: each launch starts from the counts the last one reset)
        close(int4_mlp.int4_mlp(x, gate_up, down, 4), w)
    static = xs[0].clone()
    int4_mlp.int4_mlp(static, gate_up, down, 4)  # (built and the counts reserved before capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int4_mlp.int4_mlp(static, gate_up, down, 4)
    for x, w in zip(xs[::-1] * 2, want[::-1] * 2):
        static.copy_(x)
        graph.replay()
        close(out, w)
    torch.cuda.synchronize()
    assert int(int4_mlp.reserve(static.device).abs().sum()) == 0
