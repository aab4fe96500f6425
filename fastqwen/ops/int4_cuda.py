"""int4 weight streaming for up to 16 rows of x in CUDA C++ (cuda/int4_gemv.cu): decode's tensor-core GEMV.

Why a CUDA kernel beside the Triton one (ops/gemv.py): at one row the Triton kernel reads the 27B's int4 weights at
~58% of the H200's read ceiling, and with its arithmetic removed its loads alone reach only ~72-76% of the copy
bandwidth (docs/DESIGN-NOTES.md, 2026-12-03/04): its occupancy (18-25%) and the loads it can keep in flight bound
it, which no launch config, layout or TMA ring changed. The register kernel feeds the tensor cores here (each lane
issues its 16-byte weight loads for BATCH groups, and the scales, before it decodes any of them and before the PDL
wait); a ring kernel (a persistent grid whose producer warp streamed the tiles into a shared-memory ring by bulk
copies) was 1.4-1.5x slower on an H200 and removed (2026-12-05). Two candidates on the register kernel's warps: the
stream kernel (`stream=True`: one resident wave, every block the same share; STREAM_HELD groups a warp copied into
shared memory before the PDL wait and, STREAM_EARLY, the next kernel let launch at its start: the weight stream run
through the gaps between a step's kernels) and the async kernel (`copies=True`: each warp's groups through
ASYNC_STAGES slots of its own in shared memory by cp.async, ASYNC_STAGES - 1 groups in flight during each decode, at
the registers of one group). And one on its math: FOLD, the zero taken out of the decode (int4_gemv_fold).

The kernel is built on first use with the CUDA toolkit's nvcc (ops/cuda_build.py: cached by source and GPU
architecture under $FASTQWEN_CACHE or ~/.cache/fastqwen) and called through ctypes on torch's current stream
(CUDA-graph capture records it like any launch). optimize's kernels={"int4": "cuda"} (the default "auto" on sm_90+
where nvcc is found: a 27B int4 step 2.65× faster than Triton's on an H100, level on an H200; its GEMVs there 2.4-3×
faster than Triton's at 2-16 rows) routes QuantLinear's int4 products of up to MAX_ROWS rows here (decode, MTP's and
DFlash's verify, small batches; the kernel decodes the weight once for all of them, as one or two blocks of mma's 8
columns); `int4_gemv` is the registered op, `reference` its plain torch twin (also what runs off CUDA).
"""

import functools

import torch

from . import cuda_build
from .gemv import INT4, STEP, dequantized

SOURCE = cuda_build.SOURCES / "int4_gemv.cu"
TILE_ROWS = 16
TARGET_BLOCKS = 4096  # splits are added until the grid has about this many blocks (~30 a multiprocessor)
BATCH = 2  # groups whose weight loads a warp issues before it decodes them (2, 4 or 8: the kernel's instances)
# (BATCH 2 unpipelined was the fastest instance on every 27B layer, TARGET_BLOCKS 4096 on gate | up, within 3%
# elsewhere: H100, 2026-12-05, docs/BENCHMARKS.md)
PIPELINED = False  # the next batch's loads in flight while a batch decodes (an instance with BATCH 2 only)
MIN_BLOCKS = 4  # blocks a multiprocessor must hold (4: 71 registers, 7 fit; 8: ptxas keeps it to 63, 8 fit)
CHAINS = 1  # a group's 8 MMAs as one dependent chain (1) or lo and hi apart (2: two chains of 4)
# (MIN_BLOCKS 8 and CHAINS 2: instances of BATCH 2 unpipelined at up to 8 rows only)
FOLD = False  # the folded kernel (a candidate) in place of BATCH 2 unpipelined, MIN_BLOCKS 4, CHAINS 1 for bf16 x
# up to 8 rows: the zero out of the decode (sum (128 + q) x - (128 + z) sum x; 287 SASS instructions a 2-group loop
# against 333, 72 registers), relative error a few 1e-6 against ~1e-7
STREAM_BLOCKS_PER_SM = (7, 4)  # the stream kernel's grid a multiprocessor, one / two column blocks (as fit)
STREAM_HELD = 0  # the stream kernel's groups a warp copies into shared memory before the PDL wait (0 or 6)
STREAM_EARLY = False  # the stream kernel lets the next kernel launch at its start (its grid is one wave)
# (both on: a 9B int4 step 3152 µs against the register kernel's 2560, one H100, 2026-12-05; which of the two
# or the stream kernel itself costs it is not yet known: docs/DESIGN-NOTES.md)
ASYNC_STAGES = 3  # the async kernel's one-group slots a warp (3 or 6): STAGES - 1 groups in flight during a decode
MAX_SPLITS = 8  # (≤ 8 partials for the caller to add into the consumer's kernel: gemv.add_splits)
MAX_ROWS = 16  # rows of x a launch takes: one or two blocks of mma.m16n8k16's 8 B columns (a DFlash verify)
CHOICE = "kernels['int4']='cuda'"


def library(arch: str):
    """The kernel's entry point for compute capability `arch` (cuda_build.entry: built on first use)."""
    return cuda_build.entry("int4_gemv", arch, CHOICE, pointers=5, ints=18)


def variant(rows: int, bf16: bool = True) -> tuple[int, bool, int, int, bool]:
    """(BATCH, PIPELINED, MIN_BLOCKS, CHAINS, FOLD) of the kernel instance for `rows` rows of x: the module's, but
    for 9 … 16 rows (two column blocks) BATCH ≤ 4 unpipelined (the instances that do not spill), MIN_BLOCKS 8 /
    CHAINS 2 only with BATCH 2 unpipelined at up to 8 rows (else 4 and 1), and FOLD only there too, for bf16 x, at
    MIN_BLOCKS 4 and CHAINS 1 (the folded kernel's one instance)."""
    if rows > 8:
        return min(BATCH, 4), False, 4, 1, False
    tuned = BATCH == 2 and not PIPELINED
    min_blocks, chains = (MIN_BLOCKS, CHAINS) if tuned else (4, 1)
    return BATCH, PIPELINED, min_blocks, chains, FOLD and tuned and bf16 and (min_blocks, chains) == (4, 1)


def plan(N: int, K: int, one_split: bool = False) -> tuple[int, int]:
    """(splits, groups of 128 columns a split) for an [N, K] weight (cuda_build.split_plan)."""
    return cuda_build.split_plan(N // TILE_ROWS, K // STEP, one_split, TARGET_BLOCKS, MAX_SPLITS)


def stream_pieces(N: int, K: int, blocks: int) -> torch.Tensor:
    """[N/16, K/128] int16: the slot of out each strip's group goes to in the stream kernel on `blocks` (≤ N/16 ·
    K/128) blocks. The U strip-major units (strip, group) are dealt as [b U / B, (b + 1) U / B), so block b holds
    unit u iff b = ((u + 1) B - 1) // U, and a strip's piece in block b goes to slot b - the block of its first
    group (cuda/int4_gemv.cu stream_block)."""
    G, strips = K // STEP, N // TILE_ROWS
    U = strips * G
    block = ((torch.arange(U, dtype=torch.int64) + 1) * blocks - 1).div(U, rounding_mode="floor").view(strips, G)
    return (block - block[:, :1]).to(torch.int16)


@functools.cache
def stream_slots(N: int, K: int, blocks: int) -> int:
    """Slots of out the stream kernel needs: the most pieces of one strip, stream_pieces' largest slot + 1, in
    plain integers (the op's fake implementation calls it under torch.compile's fake tensors; cuda/int4_gemv.cu
    stream_slots, which the entry point checks the caller's against, is the same loop)."""
    G, U = K // STEP, N // TILE_ROWS * (K // STEP)
    return max(((s + 1) * G * blocks - 1) // U - ((s * G + 1) * blocks - 1) // U + 1 for s in range(N // TILE_ROWS))


def stream_blocks(N: int, K: int, sms: int, rows: int) -> int:
    """The stream kernel's grid for x of `rows` rows on `sms` multiprocessors: STREAM_BLOCKS_PER_SM each, but
    each block at least ceil(G / (MAX_SPLITS - 1)) units, so that no strip has more than MAX_SPLITS pieces."""
    G = K // STEP
    return min(sms * STREAM_BLOCKS_PER_SM[rows > 8], N // TILE_ROWS * G // -(-G // (MAX_SPLITS - 1)))


def stream_plan(x: torch.Tensor, N: int, K: int) -> tuple[int, int]:
    """(blocks, slots) of the stream kernel for x's rows on its GPU."""
    blocks = stream_blocks(N, K, torch.cuda.get_device_properties(x.device).multi_processor_count, x.shape[0])
    return blocks, stream_slots(N, K, blocks)


def takes(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> bool:
    """Whether the kernel takes these operands: 1 … MAX_ROWS rows of bf16 or fp16 x [M, K], codes tiled (4-D,
    tile_int4), scale fp16 and zero uint8 group-major (QuantLinear's layout)."""
    N = scale.shape[0]
    return (x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and w.dim() == 4 and w.dtype == torch.uint8 and w.shape[0] * TILE_ROWS == N
            and w.shape[2:] == (TILE_ROWS, STEP // 2) and scale.dtype == torch.float16 and zero.dtype == torch.uint8
            and x.shape[-1] == w.shape[1] * STEP and all(  # (n, g) at g · N + n
                t.stride(0) == 1 and (t.shape[1] == 1 or t.stride(1) == N) for t in (scale, zero)))


def reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, out_features: int,
              splits: int) -> torch.Tensor:
    """The kernel's output in plain torch: fp32 [splits, M, out_features] for x [M, K], split s the product over
    the groups [s · per, (s + 1) · per) of K (per = plan's groups a split: ceil(K / 128 / splits))."""
    W = dequantized(INT4, w, scale, zero)
    per = -(-(W.shape[1] // STEP) // splits) * STEP
    xf = x.float().reshape(x.shape[0], -1)
    return torch.stack([xf[:, k:k + per] @ W[:, k:k + per].t() for k in range(0, W.shape[1], per)])


def stream_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, out_features: int,
                     blocks: int) -> torch.Tensor:
    """The stream kernel's output in plain torch: fp32 [slots, M, out_features], slot k of strip s the product
    over the groups stream_pieces puts there (zeros where the strip has fewer pieces)."""
    W = dequantized(INT4, w, scale, zero)
    slot = stream_pieces(out_features, W.shape[1], blocks).to(W.device)
    slot = slot.repeat_interleave(TILE_ROWS, 0).repeat_interleave(STEP, 1)
    xf = x.float().reshape(x.shape[0], -1)
    return torch.stack([xf @ torch.where(slot == k, W, 0).t() for k in range(int(slot.max()) + 1)])


def _splits(x: torch.Tensor, out_features: int, one_split: bool, stream: bool) -> tuple[int, int, int]:
    """(splits, groups a split, stream kernel blocks or 0) of a launch: the stream kernel's slots where it is
    asked for (on CUDA, more than one split allowed), else plan's."""
    if stream and x.is_cuda and not one_split:
        blocks, slots = stream_plan(x, out_features, x.shape[-1])
        return slots, 0, blocks
    return (*plan(out_features, x.shape[-1], one_split), 0)


def _launch(x, w, scale, zero, out_features, pdl, one_split, loads_only, stream=False,
            copies=False) -> torch.Tensor:
    """int4_gemv's body; loads_only: the chosen kernel's probe (`loads_only`; the register kernel's is its BATCH 2
    instance)."""
    copies = copies and not stream
    splits, per, blocks = _splits(x, out_features, one_split, stream)
    if not x.is_cuda:
        return reference(x, w, scale, zero, out_features, splits)
    if not takes(x, w, scale, zero):
        raise ValueError(f"int4_gemv takes 1 … {MAX_ROWS} bf16/fp16 rows of x, codes tiled [N/16, K/128, 16, 64] "
                         "uint8 and group-major fp16 scale / uint8 zero (QuantLinear's layout)")
    if copies and any(t.data_ptr() % 16 for t in (w, scale, zero)):
        raise ValueError("int4_gemv's async kernel copies the codes, scales and zeros in 16-byte pieces: they must "
                         "start 16-byte aligned (a view at an odd offset: pass a copy)")
    x = cuda_build.aligned(x)
    bf16 = x.dtype == torch.bfloat16
    batch, pipelined, min_blocks, chains, fold = (2, False, 4, 1, False) if loads_only else variant(x.shape[0], bf16)
    out = torch.empty(splits, x.shape[0], out_features, device=x.device, dtype=torch.float32)
    err = library(cuda_build.device_arch(x.device, CHOICE))(
        x.data_ptr(), w.data_ptr(), scale.data_ptr(), zero.data_ptr(), out.data_ptr(), x.shape[0], out_features,
        x.shape[-1], splits, per, batch, pipelined, min_blocks, chains, fold, loads_only, blocks,
        STREAM_HELD if blocks else 0, int(STREAM_EARLY and blocks > 0), ASYNC_STAGES if copies else 0,
        bf16, pdl, x.device.index,
        torch.cuda.current_stream(x.device).cuda_stream)
    if err:
        kernel = (f"stream, {blocks} blocks, {splits} slots, STREAM_HELD {STREAM_HELD}" if blocks else
                  f"async, ASYNC_STAGES {ASYNC_STAGES}" if copies else
                  f"BATCH {batch}, PIPELINED {pipelined}, MIN_BLOCKS {min_blocks}, CHAINS {chains}, FOLD {fold}")
        raise RuntimeError(f"int4_gemv launch failed: CUDA error {err} ({kernel})")
    return out


@torch.library.custom_op("fastqwen::int4_gemv", mutates_args=())
def int4_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, out_features: int,
              pdl: bool = False, one_split: bool = False, stream: bool = False,
              copies: bool = False) -> torch.Tensor:
    """x [M ≤ 16, K] (bf16 / fp16) · Wᵀ for an int4 weight in QuantLinear's layout (`takes`) as split-K partial sums
    fp32 [splits, M, out_features] (plan(out_features, K, one_split)); their sum over dim 0 is the product. pdl:
    launch with programmatic dependent launch; stream: the stream kernel (its [slots, M, out_features] pieces:
    stream_plan; off CUDA and with one_split as without); copies: the async kernel (each warp's weights through its
    own shared-memory slots by cp.async; the register kernel's partials, bit for bit). The CUDA kernel on CUDA
    tensors, `reference` elsewhere."""
    return _launch(x, w, scale, zero, out_features, pdl, one_split, False, stream, copies)


@int4_gemv.register_fake
def _(x, w, scale, zero, out_features, pdl=False, one_split=False, stream=False, copies=False):
    splits = _splits(x, out_features, one_split, stream)[0]
    return x.new_empty(splits, x.shape[0], out_features, dtype=torch.float32)


PROBES = ("register", "async")  # the kernels with a loads-only probe


def loads_only(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, out_features: int,
               kernel: str = "register") -> torch.Tensor:
    """A probe, for timing only (scripts/gemv_times.py --cuda-loads-only): the kernel loading every weight, scale
    and zero as it does and decoding nothing, so its time is its load path's own — "register": the register kernel's
    BATCH 2 instance, "async": the async kernel at ASYNC_STAGES (both up to 8 rows, and at as many blocks a
    multiprocessor as the kernel they probe). Returns zeros [splits, M, out_features]. CUDA tensors only."""
    if kernel not in PROBES:
        raise ValueError(f"loads_only probes one of {PROBES}, not {kernel!r}")
    if not x.is_cuda:
        raise ValueError("loads_only times the CUDA kernels: it takes CUDA tensors")
    return _launch(x, w, scale, zero, out_features, False, False, True, copies=kernel == "async")
