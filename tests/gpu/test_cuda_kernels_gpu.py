"""The CUDA C++ few-row kernels (ops/int4_cuda.py, ops/fp8_cuda.py; built with nvcc on first use) on the GPU:
their split-K partials against the plain torch references at the 27B's and 35B-A3B's layer shapes, bf16 and fp16
x, one row and 2 … 16, with and without programmatic dependent launch, every output written, every instance;
replayed in a CUDA graph; int4's stream kernel against its own torch twin (int4_cuda.stream_reference: its
pieces, not plan's splits); and a compiled decode step under kernels={"int4" | "fp8_weight": "cuda"},
{"int4": "cuda-stream" | "cuda-async"} against the Triton
kernel's; the async kernel bit for bit against the register kernel at every slot count."""

import functools

import pytest
import torch
from conftest import COMPILE, poison_allocator, rel_err

from fastqwen.ops import fp8_cuda, int4_cuda
from fastqwen.ops.gemv import INT4, stored_operands
from fastqwen.quant.formats import quantize_fp8_rows

# 27B: MLP gate|up, down, attention q+gate+k+v, GDN qkv+z+b+a, out/o, lm_head; 35B-A3B: GDN qkv+z+b+a, o,
# shared expert gate|up
SHAPES = [(34816, 5120), (5120, 17408), (14336, 5120), (16480, 5120), (5120, 6144), (248320, 5120),
          (12352, 2048), (2048, 4096), (1024, 2048)]


class Kernel:
    @classmethod
    def expected(cls, x, ops, N, one_split=False):
        """The reference partials in the kernel's own split of K (its module's plan)."""
        return cls.reference(x, ops, N, cls.module.plan(N, x.shape[-1], one_split)[0])


class Int4(Kernel):
    module, op, choice, stored = int4_cuda, "int4", "cuda", "int4"

    @staticmethod
    def operands(w):
        return stored_operands(INT4, w)

    @staticmethod
    def call(x, ops, N, pdl=False, one_split=False):
        return int4_cuda.int4_gemv(x, *ops, N, pdl, one_split)

    @staticmethod
    def reference(x, ops, N, splits):
        return int4_cuda.reference(x, *ops, N, splits)


class Int4Stream(Int4):
    choice = "cuda-stream"

    @staticmethod
    def call(x, ops, N, pdl=False, one_split=False):
        return int4_cuda.int4_gemv(x, *ops, N, pdl, one_split, True)

    @classmethod
    def expected(cls, x, ops, N, one_split=False):
        if one_split:
            return cls.reference(x, ops, N, 1)
        return int4_cuda.stream_reference(x, *ops, N, int4_cuda.stream_plan(x, N, x.shape[-1])[0])


class Int4Async(Int4):
    choice = "cuda-async"

    @staticmethod
    def call(x, ops, N, pdl=False, one_split=False):
        return int4_cuda.int4_gemv(x, *ops, N, pdl, one_split, False, True)


class Fp8(Kernel):
    module, op, choice, stored = fp8_cuda, "fp8_weight", "cuda", "fp8-weight"

    @staticmethod
    def operands(w):
        return quantize_fp8_rows(w)

    @staticmethod
    def call(x, ops, N, pdl=False, one_split=False):
        return fp8_cuda.fp8_gemv(x, *ops, pdl, one_split)

    @staticmethod
    def reference(x, ops, N, splits):
        return fp8_cuda.reference(x, *ops, splits)


KERNELS = {"int4": Int4, "int4-stream": Int4Stream, "int4-async": Int4Async, "fp8-weight": Fp8}


def weight(scheme: str, N: int, K: int) -> tuple:
    """The stored operands of a random [N, K] weight for `scheme`'s kernel (made once a session and format: the
    lm_head's take seconds)."""
    return _stored(KERNELS[KERNELS[scheme].stored], N, K)  # (int4's kernels share the weights)


@functools.cache
def _stored(kernel, N: int, K: int) -> tuple:
    torch.manual_seed(N + K)
    return kernel.operands(torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02)


# decode's configuration (bf16 x, PDL) at every shape; fp16 x, no PDL and one split at the two largest MLP ones
CONFIGS = ([(N, K, torch.bfloat16, True, False) for N, K in SHAPES] +
           [(N, K, dtype, pdl, one) for N, K in SHAPES[:2] for dtype, pdl, one in (
               (torch.float16, True, False), (torch.bfloat16, False, False), (torch.bfloat16, True, True))])


@pytest.mark.parametrize("scheme", KERNELS)
@pytest.mark.parametrize("N,K,dtype,pdl,one_split", CONFIGS)
def test_partials_match_the_reference_at_real_shapes(scheme, N, K, dtype, pdl, one_split):
    kernel = KERNELS[scheme]
    ops = weight(scheme, N, K)
    x = torch.randn(1, K, device="cuda", dtype=dtype)
    want = kernel.expected(x, ops, N, one_split)
    poison_allocator(tuple(want.shape), dtype=torch.float32)
    got = kernel.call(x, ops, N, pdl, one_split)
    assert got.shape == want.shape and not got.isnan().any(), "an output left unwritten"
    err = rel_err(got, want)
    assert err < 1e-5, f"{scheme} {N}x{K} {dtype} pdl={pdl} one_split={one_split}: {err:.2e}"


@pytest.mark.parametrize("scheme", KERNELS)
@pytest.mark.parametrize("M", [2, 3, 4, 8, 13, 16])
@pytest.mark.parametrize("N,K", [(34816, 5120), (5120, 17408), (16480, 5120)])
def test_rows_of_a_verify_block_or_batch_match_the_reference(scheme, M, N, K):
    kernel, ops = KERNELS[scheme], weight(scheme, N, K)
    torch.manual_seed(M)
    x = (torch.randn(M, K, device="cuda") * torch.logspace(-3, 3, M, device="cuda")[:, None]).to(torch.bfloat16)
    want = kernel.expected(x, ops, N)
    poison_allocator(tuple(want.shape), dtype=torch.float32)
    got = kernel.call(x, ops, N, True)
    assert got.shape == want.shape and not got.isnan().any(), "an output left unwritten"
    for m in range(M):  # (rows 10^6 apart in scale: each against its own)
        assert rel_err(got[:, m], want[:, m]) < 1e-5, (scheme, M, m, rel_err(got[:, m], want[:, m]))


@pytest.mark.parametrize("scheme,batch,pipelined", [("int4", 2, False), ("int4", 2, True), ("int4", 4, False),
                                                    ("int4", 8, False), ("fp8-weight", 2, False),
                                                    ("fp8-weight", 4, False), ("fp8-weight", 8, False)])
@pytest.mark.parametrize("N,K", [(34816, 5120), (5120, 17408), (2048, 4096)])
def test_every_instance_matches_the_reference(scheme, batch, pipelined, N, K, monkeypatch):
    """Each BATCH (and int4's PIPELINED) instance, the ones gemv_times.py sweeps, bf16 and fp16 x, 1 and 11
    rows, with PDL."""
    kernel = KERNELS[scheme]
    monkeypatch.setattr(kernel.module, "BATCH", batch)
    if scheme == "int4":
        monkeypatch.setattr(int4_cuda, "PIPELINED", pipelined)
    ops = weight(scheme, N, K)
    for dtype in (torch.bfloat16, torch.float16):
        for M in (1, 11):
            x = torch.randn(M, K, device="cuda", dtype=dtype)
            got = kernel.call(x, ops, N, True)
            assert rel_err(got, kernel.reference(x, ops, N, got.shape[0])) < 1e-5, (scheme, batch, pipelined, M)


@pytest.mark.parametrize("min_blocks,chains", [(8, 1), (4, 2), (8, 2)])
@pytest.mark.parametrize("N,K", [(34816, 5120), (5120, 17408), (5120, 6144)])
def test_int4_occupancy_and_chain_instances_match_the_reference(min_blocks, chains, N, K, monkeypatch):
    """int4's BATCH 2 instances for 8 blocks a multiprocessor and / or two MMA chains (up to 8 rows; 11 rows
    take the plain instance), bf16 and fp16 x, with PDL."""
    monkeypatch.setattr(int4_cuda, "MIN_BLOCKS", min_blocks)
    monkeypatch.setattr(int4_cuda, "CHAINS", chains)
    kernel, ops = KERNELS["int4"], weight("int4", N, K)
    for dtype in (torch.bfloat16, torch.float16):
        for M in (1, 5, 11):
            x = torch.randn(M, K, device="cuda", dtype=dtype)
            got = kernel.call(x, ops, N, True)
            assert rel_err(got, kernel.reference(x, ops, N, got.shape[0])) < 1e-5, (min_blocks, chains, M)


@pytest.mark.parametrize("N,K", [(34816, 5120), (5120, 17408), (14336, 5120), (16480, 5120), (5120, 6144),
                                 (12352, 2048)])
def test_int4_folded_kernel_matches_the_reference(N, K, monkeypatch):
    """int4_cuda.FOLD (bf16 x, up to 8 rows; fp16 x and 11 rows keep the plain instance): within a relative 3e-5
    of the reference, the plain kernel's ~1e-7 widened by its fp32 sums of (128 + q) x, ~128 times the result's
    size (a few 1e-6 seen when the fold was first built, session 44); with PDL, one split and the plan's, every
    output written (NaN-poisoned), the same in a CUDA graph replayed on a new x."""
    monkeypatch.setattr(int4_cuda, "FOLD", True)
    kernel, ops = KERNELS["int4"], weight("int4", N, K)
    for dtype, M, one_split in ((torch.bfloat16, 1, False), (torch.bfloat16, 3, True), (torch.bfloat16, 8, False),
                                (torch.float16, 5, False), (torch.bfloat16, 11, False)):
        x = torch.randn(M, K, device="cuda", dtype=dtype)
        want = kernel.expected(x, ops, N, one_split)
        poison_allocator(tuple(want.shape), dtype=torch.float32)
        got = kernel.call(x, ops, N, True, one_split)
        bound = 3e-5 if dtype == torch.bfloat16 and M <= 8 else 1e-5
        assert got.shape == want.shape and rel_err(got, want) < bound, (N, K, M, one_split, rel_err(got, want))
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = kernel.call(x, ops, N, True)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert rel_err(got, kernel.expected(x, ops, N)) < 3e-5


@pytest.mark.parametrize("stages", [3, 6])
@pytest.mark.parametrize("N,K", [(34816, 5120), (5120, 17408), (12352, 2048), (5120, 6144)])
def test_async_kernel_gives_the_register_kernels_partials_bit_for_bit(stages, N, K, monkeypatch):
    """The async kernel's warps take the register kernel's groups in the same order and sum them alike: the same
    bits, at 3 and 6 slots a warp, splits with warps of 1 … many groups (12352x2048: 6 groups a split, so some
    warps have 1 and copy past nothing), one split, bf16 and fp16 x, 1 to 16 rows."""
    monkeypatch.setattr(int4_cuda, "ASYNC_STAGES", stages)
    kernel, ops = KERNELS["int4"], weight("int4", N, K)
    for dtype, M, one_split in ((torch.bfloat16, 1, False), (torch.float16, 5, False), (torch.bfloat16, 11, True),
                                (torch.bfloat16, 16, False)):
        x = torch.randn(M, K, device="cuda", dtype=dtype)
        want = kernel.call(x, ops, N, True, one_split)
        poison_allocator(tuple(want.shape), dtype=torch.float32)
        got = KERNELS["int4-async"].call(x, ops, N, True, one_split)
        assert torch.equal(got, want), (stages, N, K, M, one_split, rel_err(got, want))


@pytest.mark.parametrize("N,K", [(34816, 5120), (5120, 17408), (12352, 2048), (5120, 6144), (248320, 5120)])
def test_stream_kernel_holding_groups_gives_the_same_partials_bit_for_bit(N, K, monkeypatch):
    """The stream kernel with STREAM_HELD groups a warp copied into shared memory before the wait (and its early
    trigger) decodes the same groups in the same order as without: the same bits, where a block's first piece
    gives a warp more groups than it holds and fewer (12352x2048: 16 groups a strip), bf16 and fp16 x, 1 to 16
    rows."""
    kernel, ops = KERNELS["int4-stream"], weight("int4-stream", N, K)
    for dtype, M in ((torch.bfloat16, 1), (torch.float16, 3), (torch.bfloat16, 9), (torch.bfloat16, 16)):
        x = torch.randn(M, K, device="cuda", dtype=dtype)
        monkeypatch.setattr(int4_cuda, "STREAM_HELD", 0)
        monkeypatch.setattr(int4_cuda, "STREAM_EARLY", False)
        want = kernel.call(x, ops, N, True)
        monkeypatch.setattr(int4_cuda, "STREAM_HELD", 6)
        monkeypatch.setattr(int4_cuda, "STREAM_EARLY", True)
        poison_allocator(tuple(want.shape), dtype=torch.float32)
        got = kernel.call(x, ops, N, True)
        assert torch.equal(got, want), (N, K, M, dtype, rel_err(got, want))


def test_a_dependent_launched_at_the_stream_kernels_start_reads_its_whole_output(monkeypatch):
    """The stream kernel's early trigger (STREAM_EARLY, with groups held) lets the next kernel launch while it
    runs: a PDL-launched copy of its output (griddepcontrol.wait first, as every kernel of a step does) must still
    read all of it, every launch of a row of them."""
    monkeypatch.setattr(int4_cuda, "STREAM_HELD", 6)
    monkeypatch.setattr(int4_cuda, "STREAM_EARLY", True)
    import triton
    import triton.language as tl

    @triton.jit
    def copy_after_wait(src, out, n, BLOCK: tl.constexpr):
        tl.extra.cuda.gdc_wait()
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out + i, tl.load(src + i, mask=i < n), mask=i < n)

    kernel, (N, K) = KERNELS["int4-stream"], (34816, 5120)
    ops = weight("int4-stream", N, K)
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    want = kernel.call(x, ops, N, True)
    for _ in range(3):
        got = torch.full_like(want, float("nan"))
        partials = kernel.call(x, ops, N, True)
        copy_after_wait[(-(-want.numel() // 1024),)](partials, got, want.numel(), BLOCK=1024, launch_pdl=True)
        assert torch.equal(got, want)


def _late_writer():
    """A Triton kernel that lets the next kernel launch at once (PDL's trigger as its first act), then spins for
    `spins` dependent steps and only then writes out = src: a dependent GEMV that read x before its PDL wait would
    read the NaNs put there before."""
    import triton
    import triton.language as tl

    @triton.jit
    def late_copy(src, out, n, spins, BLOCK: tl.constexpr):
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # (out's NaN fill, the kernel before, done)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(src + i, mask=i < n)
        acc = tl.full([BLOCK], 1.0, tl.float32)
        for _ in range(spins):
            acc = acc * 1.0000001 + 1e-7  # (stays in (1, 2): the store below depends on it)
        tl.store(out + i, tl.where(acc < 0.0, acc, v.to(tl.float32)).to(out.dtype.element_ty), mask=i < n)

    return late_copy


@pytest.mark.parametrize("probe", int4_cuda.PROBES)
def test_loads_only_probes_run_and_write_zeros(probe):
    """gemv_times.py's probes of the int4 kernels' load paths (the register and async kernels'): the same grid,
    every output written (zeros)."""
    N, K = 5120, 17408
    ops = weight("int4", N, K)
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    poison_allocator((int4_cuda.plan(N, K)[0], 1, N), dtype=torch.float32)
    got = int4_cuda.loads_only(x, *ops, N, probe)
    assert got.shape == (int4_cuda.plan(N, K)[0], 1, N) and not got.any() and not got.isnan().any()


@pytest.mark.parametrize("scheme", KERNELS)
def test_x_written_late_by_a_kernel_that_triggers_early_is_waited_for(scheme):
    """The previous kernel triggers the dependent launch first and writes x ~100 µs later: the GEMV, launched
    with PDL, starts streaming its weights meanwhile and must still read the new x, not the NaNs x held."""
    kernel, (N, K) = KERNELS[scheme], (5120, 17408)
    ops = weight(scheme, N, K)
    src = torch.randn(2, K, device="cuda", dtype=torch.bfloat16)
    x = torch.full_like(src, float("nan"))
    late_copy, block = _late_writer(), 1024
    want = kernel.expected(src, ops, N)
    for _ in range(2):
        x.fill_(float("nan"))
        late_copy[(-(-src.numel() // block),)](src, x, src.numel(), 20000, BLOCK=block, launch_pdl=True)
        got = kernel.call(x, ops, N, True)
        assert not got.isnan().any() and rel_err(got, want) < 1e-5, scheme


@pytest.mark.parametrize("scheme", KERNELS)
def test_x_at_an_unaligned_offset_is_taken(scheme):
    """x a view 2 elements into its storage (not 16-byte aligned, as a slice of a fused output can be)."""
    kernel, (N, K) = KERNELS[scheme], (2048, 4096)
    ops = weight(scheme, N, K)
    x = torch.randn(K + 2, device="cuda", dtype=torch.bfloat16)[2:].view(1, K)
    assert x.data_ptr() % 16
    got = kernel.call(x, ops, N)
    assert rel_err(got, kernel.expected(x, ops, N)) < 1e-5


@pytest.mark.parametrize("scheme", KERNELS)
def test_a_graph_replays_the_kernel_on_new_inputs(scheme):
    kernel, (N, K) = KERNELS[scheme], (5120, 17408)
    ops = weight(scheme, N, K)
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    kernel.call(x, ops, N, True)  # (loads the module before the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = kernel.call(x, ops, N, True).sum(0)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert rel_err(y, kernel.reference(x, ops, N, 1)[0]) < 1e-5


@pytest.mark.parametrize("scheme", KERNELS)
@torch.no_grad()
def test_compiled_decode_step_gives_the_triton_kernels_logits(scheme):
    """A 1-layer 27B-shaped model (a GDN layer) quantized, lm_head too, optimized with each kernel of the scheme
    (CUDA graphs, PDL): after the same prefill, three compiled one-row decode steps (warm-up, record, replay) give the
    same logits up to the summation order of their fp32 partial sums."""
    import fastqwen
    from fastqwen import presets
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = presets.build("qwen3.5-27b", dtype=torch.bfloat16, device="cuda", layers=1)
    ids = torch.randint(model.config.vocab_size, (1, 16), device="cuda")
    tok = torch.randint(model.config.vocab_size, (1, 1), device="cuda")
    logits = {}
    kernel = KERNELS[scheme]
    for choice in ("triton", kernel.choice):
        fastqwen.optimize(model, max_seq_len=64, quant=kernel.stored, quant_lm_head=True, compile_options=COMPILE,
                          kernels={kernel.op: choice})
        e = model._fastqwen
        model.generate(ids, max_new_tokens=1)  # (the prefill: the same reference path for both)
        counters.clear()
        with torch.compiler.config.patch(cache_key_tag=e.cache_tag):
            step = e.compile(lambda: e.forward.step(tok))
            logits[choice] = [step().clone() for _ in range(3)]
        assert counters["inductor"]["cudagraph_skips"] == 0
        model.__dict__.pop("_fastqwen"), model.__dict__.pop("generate")
        torch._dynamo.reset()
    for a, b in zip(logits[kernel.choice], logits["triton"]):
        assert rel_err(a, b) < 1e-2, rel_err(a, b)
