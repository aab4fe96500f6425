"""int4 weight streaming for up to 16 rows of x in CUDA C++ (cuda/int4_gemv.cu): decode's tensor-core GEMV.

Why a CUDA kernel beside the Triton one (ops/gemv.py): at one row the Triton kernel reads the 27B's int4 weights at
~58% of the H200's read ceiling, and with its arithmetic removed its loads alone reach only ~72-76% of the copy
bandwidth (docs/DESIGN-NOTES.md, 2026-12-03/04): its occupancy (18-25%) and the loads it can keep in flight bound
it, which no launch config, layout or TMA ring changed. The register kernel feeds the tensor cores here (each lane
issues its 16-byte weight loads for BATCH groups, and the scales, before it decodes any of them and before the PDL
wait). The folded kernel (FOLD, the default for bf16 x up to 8 rows) takes the zero out of the decode
(int4_gemv_fold): a 27B int4 step 1.027x faster on an H100. Past 8 rows (a DFlash verify) PAIR
gives each block two strips, so each load of x serves both (int4_gemv_pair). Removed after measuring slower
(2026-12-05/06): a staged-x kernel (x in shared memory once a block: fewer instructions, yet 0.8-2 µs a 27B layer
slower on an H200), a ring kernel (a producer warp feeding a shared-memory ring by bulk copies; 1.4-1.5x slower on an
H200), a stream kernel
(one resident wave, even shares; a 9B step 1.23x slower), an async kernel (cp.async slots a warp; 5-14% slower) and
instances at 8 blocks an SM or with two MMA chains: the kernel is bound by its own load → decode → MMA latency, not by
HBM (with its weights resident in L2 it reads no faster; H100, docs/DESIGN-NOTES.md).

The kernel is built on first use with the CUDA toolkit's nvcc (ops/cuda_build.py: cached by source and GPU
architecture under $FASTQWEN_CACHE or ~/.cache/fastqwen) and called through ctypes on torch's current stream
(CUDA-graph capture records it like any launch). optimize's kernels={"int4": "cuda"} (the default "auto" on sm_90+
where nvcc is found: a 27B int4 step 2.65× faster than Triton's on an H100, level on an H200; its GEMVs there 2.4-3×
faster than Triton's at 2-16 rows) routes QuantLinear's int4 products of up to MAX_ROWS rows here (decode, MTP's and
DFlash's verify, small batches; the kernel decodes the weight once for all of them, as one or two blocks of mma's 8
columns); `int4_gemv` is the registered op, `reference` its plain torch twin (also what runs off CUDA).
"""

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
FOLD = 1  # the folded kernel in place of BATCH 2 unpipelined for bf16 x up to 8 rows: the zero out of the decode
# (sum (128 + q) x - (128 + z) sum x; 287 SASS instructions a 2-group loop against 333, 72 registers), relative
# error a few 1e-6 against ~1e-7; a 27B int4 step 6997 µs against 7185 (one H100, 2026-12-05). 0: off; 2 and 3
# (candidates): the folded kernel with rotating loads over 2 and 3 slots, each slot's registers taking the next
# batch's group as soon as its group is decoded (int4_gemv_fold's SLOTS: the same bits; 71 registers, 7 blocks an SM,
# and 80, 6). Aimed at the H200, where the fold reads at 3.52 TB/s and its loads alone at 4.20; on an H100, where the
# two read alike, 2 took a 27B int4 step 0.984x as fast as 1 (2026-12-07); 3 is not yet timed
PAIR = True  # 9 … 16 rows by int4_gemv_pair (two strips a block: each load of x serves both, where past 8 rows x's
# loads outweigh the weights'), where N % 32 == 0; the same bits as the one-strip instance at one split. At 16 rows
# on an H100 (2026-12-06) 6-30% faster on every 27B shape (gate | up 50.4 vs 64.6 µs, lm_head 317.1 vs 449.9), a
# 27B int4 verify of 16 positions on 16 layers 3089 µs against 3569
MAX_SPLITS = 8  # (≤ 8 partials for the caller to add into the consumer's kernel: gemv.add_splits)
MAX_ROWS = 16  # rows of x a launch takes: one or two blocks of mma.m16n8k16's 8 B columns (a DFlash verify)
CHOICE = "kernels['int4']='cuda'"


def library(arch: str):
    """The kernel's entry point for compute capability `arch` (cuda_build.entry: built on first use)."""
    return cuda_build.entry("int4_gemv", arch, CHOICE, pointers=5, ints=13)


def variant(rows: int, bf16: bool = True) -> tuple[int, bool, bool]:
    """(BATCH, PIPELINED, fold) of the kernel instance for `rows` rows of x: the module's, but for 9 … 16 rows (two
    column blocks) BATCH ≤ 4 unpipelined (the instances that do not spill), and FOLD (1, 2 or 3, else 0) only with
    BATCH 2 unpipelined at up to 8 rows of bf16 x (the folded kernel's instances)."""
    if rows > 8:
        return min(BATCH, 4), False, 0
    return BATCH, PIPELINED, int(FOLD) if bf16 and BATCH == 2 and not PIPELINED else 0


def paired(N: int, rows: int) -> bool:
    """Whether `rows` rows of x against an [N, K] weight take the pair kernel (PAIR with BATCH 2, 9 … 16 rows,
    N % 32 == 0)."""
    return PAIR and BATCH == 2 and rows > 8 and N % (2 * TILE_ROWS) == 0


def plan(N: int, K: int, one_split: bool = False) -> tuple[int, int]:
    """(splits, groups of 128 columns a split) for an [N, K] weight (cuda_build.split_plan over its 16-row strips:
    the pair kernel too, whose blocks take two strips each, so its grid has half the blocks; planned over its own
    blocks it took twice the splits and was 4-15% slower on 4 of the 27B's 6 layer shapes, equal on the rest:
    H100, 2026-12-06)."""
    return cuda_build.split_plan(N // TILE_ROWS, K // STEP, one_split, TARGET_BLOCKS, MAX_SPLITS)


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


def _launch(x, w, scale, zero, out_features, pdl, one_split, loads_only) -> torch.Tensor:
    """int4_gemv's body; loads_only: the register kernel's probe (its BATCH 2 instance's loads, nothing decoded)."""
    splits, per = plan(out_features, x.shape[-1], one_split)
    if not x.is_cuda:
        return reference(x, w, scale, zero, out_features, splits)
    if not takes(x, w, scale, zero):
        raise ValueError(f"int4_gemv takes 1 … {MAX_ROWS} bf16/fp16 rows of x, codes tiled [N/16, K/128, 16, 64] "
                         "uint8 and group-major fp16 scale / uint8 zero (QuantLinear's layout)")
    x = cuda_build.aligned(x)
    bf16 = x.dtype == torch.bfloat16
    batch, pipelined, fold = (2, False, False) if loads_only else variant(x.shape[0], bf16)
    out = torch.empty(splits, x.shape[0], out_features, device=x.device, dtype=torch.float32)
    err = library(cuda_build.device_arch(x.device, CHOICE))(
        x.data_ptr(), w.data_ptr(), scale.data_ptr(), zero.data_ptr(), out.data_ptr(), x.shape[0], out_features,
        x.shape[-1], splits, per, batch, pipelined, fold, loads_only, bf16,
        paired(out_features, x.shape[0]) and not loads_only, pdl, x.device.index,
        torch.cuda.current_stream(x.device).cuda_stream)
    if err:
        raise RuntimeError(f"int4_gemv launch failed: CUDA error {err} (BATCH {batch}, PIPELINED {pipelined}, "
                           f"FOLD {fold}, loads only {loads_only})")
    return out


@torch.library.custom_op("fastqwen::int4_gemv", mutates_args=())
def int4_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, out_features: int,
              pdl: bool = False, one_split: bool = False) -> torch.Tensor:
    """x [M ≤ 16, K] (bf16 / fp16) · Wᵀ for an int4 weight in QuantLinear's layout (`takes`) as split-K partial sums
    fp32 [splits, M, out_features] (plan(out_features, K, one_split)); their sum over dim 0 is the product. pdl:
    launch with programmatic dependent launch. The CUDA kernel on CUDA tensors, `reference` elsewhere."""
    return _launch(x, w, scale, zero, out_features, pdl, one_split, False)


@int4_gemv.register_fake
def _(x, w, scale, zero, out_features, pdl=False, one_split=False):
    splits = plan(out_features, x.shape[-1], one_split)[0]
    return x.new_empty(splits, x.shape[0], out_features, dtype=torch.float32)


def loads_only(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               out_features: int) -> torch.Tensor:
    """A probe, for timing only (scripts/gemv_times.py --cuda-loads-only): the register kernel's BATCH 2 instance
    loading every weight, scale and zero as it does and decoding nothing (up to 8 rows, at as many blocks a
    multiprocessor as the kernel), so its time is its load path's own. Returns zeros [splits, M, out_features].
    CUDA tensors only."""
    if not x.is_cuda:
        raise ValueError("loads_only times the CUDA kernels: it takes CUDA tensors")
    return _launch(x, w, scale, zero, out_features, False, False, True)
