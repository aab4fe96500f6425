"""The CUDA C++ few-row kernels (ops/int4_cuda.py, ops/fp8_cuda.py; built with nvcc on first use) on the GPU:
their split-K partials against the plain torch references at the 27B's and 35B-A3B's layer shapes, bf16 and fp16
x, one row and 2 … 16, with and without programmatic dependent launch, every output written, every instance (int4's
folded kernel and the plain one it stands in for); replayed in a CUDA graph; and a compiled
decode step under kernels={"int4" | "fp8_weight": "cuda"} against the Triton kernel's."""

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

    @staticmethod
    def bound(x):
        """The relative error allowed: the folded kernel's (bf16 x up to 8 rows, int4_cuda.FOLD) 3e-5, its fp32 sums
        of (128 + q) x ~128 times the result's size (a few 1e-6 measured, 2026-12-05); else 1e-5."""
        return 3e-5 if int4_cuda.variant(x.shape[0], x.dtype == torch.bfloat16)[2] else 1e-5


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

    @staticmethod
    def bound(x):
        return 1e-5


KERNELS = {"int4": Int4, "fp8-weight": Fp8}


def weight(scheme: str, N: int, K: int) -> tuple:
    """The stored operands of a random [N, K] weight for `scheme`'s kernel (made once a session and format: the
    lm_head's take seconds)."""
    return _stored(KERNELS[scheme], N, K)


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
    assert err < kernel.bound(x), f"{scheme} {N}x{K} {dtype} pdl={pdl} one_split={one_split}: {err:.2e}"


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
        assert rel_err(got[:, m], want[:, m]) < kernel.bound(x), (scheme, M, m, rel_err(got[:, m], want[:, m]))


@pytest.mark.parametrize("scheme,batch,pipelined", [("int4", 2, False), ("int4", 2, True), ("int4", 4, False),
                                                    ("int4", 8, False), ("fp8-weight", 2, False),
                                                    ("fp8-weight", 4, False), ("fp8-weight", 8, False)])
@pytest.mark.parametrize("N,K", [(34816, 5120), (5120, 17408), (2048, 4096)])
def test_every_instance_matches_the_reference(scheme, batch, pipelined, N, K, monkeypatch):
    """Each BATCH (and int4's PIPELINED) instance, the ones gemv_times.py sweeps, bf16 and fp16 x, 1 and 11
    rows, with PDL; int4's unfolded (FOLD off: the fold has a test of its own)."""
    kernel = KERNELS[scheme]
    monkeypatch.setattr(kernel.module, "BATCH", batch)
    if scheme == "int4":
        monkeypatch.setattr(int4_cuda, "PIPELINED", pipelined)
        monkeypatch.setattr(int4_cuda, "FOLD", False)
    ops = weight(scheme, N, K)
    for dtype in (torch.bfloat16, torch.float16):
        for M in (1, 11):
            x = torch.randn(M, K, device="cuda", dtype=dtype)
            got = kernel.call(x, ops, N, True)
            assert rel_err(got, kernel.reference(x, ops, N, got.shape[0])) < 1e-5, (scheme, batch, pipelined, M)


def graph_error(kernel, x, ops, N) -> float:
    """The relative error of the kernel's PDL launch captured in a CUDA graph and replayed after x is overwritten
    (in place) with new values."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = kernel.call(x, ops, N, True)
    x.copy_(torch.randn_like(x))
    graph.replay()
    return rel_err(got, kernel.expected(x, ops, N))


@pytest.mark.parametrize("N,K", [(34816, 5120), (5120, 17408), (248320, 5120), (12352, 2048), (16480, 5120)])
def test_int4_pair_kernel_gives_the_one_strip_instances_bits(N, K, monkeypatch):
    """int4_cuda.PAIR (9 … 16 rows by int4_gemv_pair, two strips a block): at one split and at the split plan the
    same partials bit for bit as the one-strip instance, within 1e-5 of the reference, bf16 and fp16 x, 9 and 16
    rows, with PDL, every output written (NaN-poisoned); and in a CUDA graph replayed on new x."""
    kernel, ops = KERNELS["int4"], weight("int4", N, K)
    for dtype, M in ((torch.bfloat16, 16), (torch.float16, 9)):
        x = torch.randn(M, K, device="cuda", dtype=dtype)
        for one_split in (True, False):
            want = kernel.expected(x, ops, N, one_split)
            outs = []
            for pair in (False, True):
                monkeypatch.setattr(int4_cuda, "PAIR", pair)
                poison_allocator(tuple(want.shape), dtype=torch.float32)
                outs.append(kernel.call(x, ops, N, True, one_split))
                assert outs[-1].shape == want.shape and rel_err(outs[-1], want) < 1e-5, \
                    (N, K, M, one_split, pair, rel_err(outs[-1], want))
            assert torch.equal(outs[0], outs[1]), (N, K, M, one_split)
    assert graph_error(kernel, x, ops, N) < 1e-5


@pytest.mark.parametrize("N,K", [(34816, 5120), (5120, 17408), (14336, 5120), (16480, 5120), (5120, 6144),
                                 (12352, 2048)])
@pytest.mark.parametrize("fold", [1, 2, 3])
def test_int4_folded_kernel_matches_the_reference(N, K, fold, monkeypatch):
    """int4_cuda.FOLD (the default; bf16 x, up to 8 rows; fp16 x and 11 rows keep the plain instance): within a
    relative 3e-5 of the reference, the plain kernel's ~1e-7 widened by its fp32 sums of (128 + q) x, ~128 times the
    result's size (1.4e-6 to 3.9e-6 at the 27B's shapes, 2026-12-05); with PDL, one split and the plan's, every
    output written (NaN-poisoned), the same in a CUDA graph replayed on a new x. FOLD 2 and 3 (rotating loads over 2
    and 3 slots): the same bits as FOLD 1."""
    kernel, ops = KERNELS["int4"], weight("int4", N, K)
    for dtype, M, one_split in ((torch.bfloat16, 1, False), (torch.bfloat16, 3, True), (torch.bfloat16, 8, False),
                                (torch.float16, 5, False), (torch.bfloat16, 11, False)):
        x = torch.randn(M, K, device="cuda", dtype=dtype)
        want = kernel.expected(x, ops, N, one_split)
        monkeypatch.setattr(int4_cuda, "FOLD", 1)
        folded = kernel.call(x, ops, N, True, one_split)
        monkeypatch.setattr(int4_cuda, "FOLD", fold)
        poison_allocator(tuple(want.shape), dtype=torch.float32)
        got = kernel.call(x, ops, N, True, one_split)
        bound = 3e-5 if dtype == torch.bfloat16 and M <= 8 else 1e-5
        assert got.shape == want.shape and rel_err(got, want) < bound, (N, K, M, one_split, rel_err(got, want))
        assert torch.equal(got, folded), (N, K, M, one_split)
    assert graph_error(kernel, torch.randn(1, K, device="cuda", dtype=torch.bfloat16), ops, N) < 3e-5


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


def test_loads_only_probe_runs_and_writes_zeros():
    """gemv_times.py's probe of the int4 register kernel's load path: the same grid, every output written
    (zeros)."""
    N, K = 5120, 17408
    ops = weight("int4", N, K)
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    poison_allocator((int4_cuda.plan(N, K)[0], 1, N), dtype=torch.float32)
    got = int4_cuda.loads_only(x, *ops, N)
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
        assert not got.isnan().any() and rel_err(got, want) < kernel.bound(x), scheme


@pytest.mark.parametrize("scheme", KERNELS)
def test_x_at_an_unaligned_offset_is_taken(scheme):
    """x a view 2 elements into its storage (not 16-byte aligned, as a slice of a fused output can be)."""
    kernel, (N, K) = KERNELS[scheme], (2048, 4096)
    ops = weight(scheme, N, K)
    x = torch.randn(K + 2, device="cuda", dtype=torch.bfloat16)[2:].view(1, K)
    assert x.data_ptr() % 16
    got = kernel.call(x, ops, N)
    assert rel_err(got, kernel.expected(x, ops, N)) < kernel.bound(x)


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
        assert rel_err(y, kernel.reference(x, ops, N, 1)[0]) < kernel.bound(x)


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
