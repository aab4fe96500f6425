"""The CUDA int4 few-row kernel (ops/int4_cuda.py, built with nvcc on first use) on the GPU: its split-K partials
against the plain torch reference at the 27B's and 35B-A3B's layer shapes, bf16 and fp16 x, one row and 2 … 16,
with and without programmatic dependent launch, every output written; replayed in a CUDA graph; and a compiled
int4 decode step under kernels={"int4": "cuda"} against the Triton kernel's."""

import pytest
import torch
from conftest import COMPILE, poison_allocator, rel_err

from fastqwen.ops import int4_cuda
from fastqwen.ops.gemv import INT4, stored_operands

# 27B: MLP gate|up, down, attention q+gate+k+v, GDN qkv+z+b+a, out/o, lm_head; 35B-A3B: GDN qkv+z+b+a, o,
# shared expert gate|up
SHAPES = [(34816, 5120), (5120, 17408), (14336, 5120), (16480, 5120), (5120, 6144), (248320, 5120),
          (12352, 2048), (2048, 4096), (1024, 2048)]


@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pdl,one_split", [(False, False), (True, False), (True, True)])
def test_partials_match_the_reference_at_real_shapes(N, K, dtype, pdl, one_split):
    torch.manual_seed(N + K)
    q, s, z = stored_operands(INT4, torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02)
    x = torch.randn(1, K, device="cuda", dtype=dtype)
    splits, _ = int4_cuda.plan(N, K, one_split)
    want = int4_cuda.reference(x, q, s, z, N, splits)
    poison_allocator((splits, 1, N), dtype=torch.float32)
    got = int4_cuda.int4_gemv(x, q, s, z, N, pdl, one_split)
    assert got.shape == want.shape and not got.isnan().any(), "an output left unwritten"
    assert rel_err(got, want) < 1e-5, f"{N}x{K} {dtype} pdl={pdl} one_split={one_split}: {rel_err(got, want):.2e}"


@pytest.mark.parametrize("M", [2, 3, 4, 8, 13, 16])
@pytest.mark.parametrize("N,K", [(34816, 5120), (5120, 17408), (16480, 5120)])
def test_rows_of_a_verify_block_or_batch_match_the_reference(M, N, K):
    torch.manual_seed(M)
    q, s, z = stored_operands(INT4, torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16) * torch.logspace(-3, 3, M, device="cuda")[:, None]
    splits, _ = int4_cuda.plan(N, K)
    poison_allocator((splits, M, N), dtype=torch.float32)
    got = int4_cuda.int4_gemv(x, q, s, z, N, True)
    want = int4_cuda.reference(x, q, s, z, N, splits)
    assert got.shape == (splits, M, N) and not got.isnan().any(), "an output left unwritten"
    for m in range(M):  # (rows 10^6 apart in scale: each against its own)
        assert rel_err(got[:, m], want[:, m]) < 1e-5, (M, m, rel_err(got[:, m], want[:, m]))


@pytest.mark.parametrize("batch,pipelined", [(2, False), (2, True), (4, False), (8, False)])
@pytest.mark.parametrize("N,K", [(34816, 5120), (5120, 17408), (2048, 4096)])
def test_every_instance_matches_the_reference(batch, pipelined, N, K, monkeypatch):
    """Each BATCH / PIPELINED instance (the ones gemv_times.py sweeps), bf16 and fp16 x, with PDL."""
    monkeypatch.setattr(int4_cuda, "BATCH", batch)
    monkeypatch.setattr(int4_cuda, "PIPELINED", pipelined)
    torch.manual_seed(1)
    q, s, z = stored_operands(INT4, torch.randn(N, K, device="cuda", dtype=torch.bfloat16))
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(1, K, device="cuda", dtype=dtype)
        got = int4_cuda.int4_gemv(x, q, s, z, N, True)
        assert rel_err(got, int4_cuda.reference(x, q, s, z, N, got.shape[0])) < 1e-5, (batch, pipelined, dtype)


def test_x_at_an_unaligned_offset_is_taken():
    """x a view 2 elements into its storage (not 16-byte aligned, as a slice of a fused output can be)."""
    N, K = 2048, 4096
    q, s, z = stored_operands(INT4, torch.randn(N, K, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(K + 2, device="cuda", dtype=torch.bfloat16)[2:].view(1, K)
    assert x.data_ptr() % 16
    got = int4_cuda.int4_gemv(x, q, s, z, N)
    assert rel_err(got, int4_cuda.reference(x, q, s, z, N, got.shape[0])) < 1e-5


def test_a_graph_replays_the_kernel_on_new_inputs():
    N, K = 5120, 17408
    q, s, z = stored_operands(INT4, torch.randn(N, K, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    int4_cuda.int4_gemv(x, q, s, z, N, True)  # (loads the module before the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = int4_cuda.int4_gemv(x, q, s, z, N, True).sum(0)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert rel_err(y, int4_cuda.reference(x, q, s, z, N, 1)[0]) < 1e-5


@torch.no_grad()
def test_compiled_int4_decode_step_gives_the_triton_kernels_logits():
    """A 2-layer 27B-shaped model quantized to int4 (lm_head too), optimized with each int4 kernel (CUDA graphs,
    PDL): after the same prefill, three compiled one-row decode steps (warm-up, record, replay) give the same
    logits up to the summation order of their fp32 partial sums."""
    import fastqwen
    from fastqwen import presets
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = presets.build("qwen3.5-27b", dtype=torch.bfloat16, device="cuda", layers=2)
    ids = torch.randint(model.config.vocab_size, (1, 16), device="cuda")
    tok = torch.randint(model.config.vocab_size, (1, 1), device="cuda")
    logits = {}
    for kernel in ("triton", "cuda"):
        fastqwen.optimize(model, max_seq_len=64, quant="int4", quant_lm_head=True, compile_options=COMPILE,
                          kernels={"int4": kernel})
        e = model._fastqwen
        model.generate(ids, max_new_tokens=1)  # (the prefill: the same reference path for both)
        counters.clear()
        with torch.compiler.config.patch(cache_key_tag=e.cache_tag):
            step = e.compile(lambda: e.forward.step(tok))
            logits[kernel] = [step().clone() for _ in range(3)]
        assert counters["inductor"]["cudagraph_skips"] == 0
        model.__dict__.pop("_fastqwen"), model.__dict__.pop("generate")
        torch._dynamo.reset()
    for a, b in zip(logits["cuda"], logits["triton"]):
        assert rel_err(a, b) < 1e-2, rel_err(a, b)
