"""fp8-weight streaming for up to 16 rows of x in CUDA C++ (cuda/fp8_gemv.cu): the tensor-core GEMV of the "fp8-weight"
scheme (e4m3 codes, one fp32 scale a row) at decode, verify and small batches.

Why beside the Triton kernel (ops/gemv.py): it reads the 27B's fp8 weights at ~83% of the H200's read ceiling, and
the fp8-weight ≥ 150 tok/s bar needs them at the ceiling with the rest of the step hidden (docs/DESIGN-NOTES.md).
This kernel is int4_cuda's frame for e4m3: each lane's 16-byte loads of rows l/4 and l/4 + 8 are the mma.m16n8k16 A
operand (e4m3 pairs to f16 by one cvt, to bf16 through fp32 for bf16 x: exact), the weight and scale loads of the
first batch issued before the PDL wait (a ring kernel fed by a producer warp's bulk copies was 1.35-1.9x slower on
an H200 and removed, 2026-12-05). optimize's kernels={"fp8_weight": "cuda"} routes QuantLinear's fp8-weight products
of up to MAX_ROWS rows here; `fp8_gemv` is the registered op, `reference` its plain torch twin (also what runs off
CUDA); the library is built by ops/cuda_build.py.
"""

import torch

from . import cuda_build

CHUNK = 64  # columns of a step: 16 bytes a lane of each of its two rows
TILE_ROWS = 16
TARGET_BLOCKS = 2048  # splits are added until the grid has about this many blocks (~15 a multiprocessor)
MAX_SPLITS = 8  # (≤ 8 partials for the caller to add into the consumer's kernel: gemv.add_splits)
MAX_ROWS = 16  # rows of x a launch takes: one or two blocks of mma.m16n8k16's 8 B columns
BATCH = 4  # chunks whose weight loads a warp issues before it decodes them (2, 4 or 8; 2 or 4 past 8 rows)
CHOICE = "kernels['fp8_weight']='cuda'"


def library(arch: str):
    """The kernel's entry point for compute capability `arch` (cuda_build.entry: built on first use)."""
    return cuda_build.entry("fp8_gemv", arch, CHOICE, pointers=4, ints=9)


def plan(N: int, K: int, one_split: bool = False) -> tuple[int, int]:
    """(splits, chunks of 64 columns a split) for an [N, K] weight (cuda_build.split_plan)."""
    return cuda_build.split_plan(N // TILE_ROWS, K // CHUNK, one_split, TARGET_BLOCKS, MAX_SPLITS)


def takes(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether the kernel takes these operands: 1 … MAX_ROWS rows of bf16 or fp16 x [M, K], e4m3 codes [N, K]
    row-major (N % 16 == 0, K % 64 == 0), an fp32 scale [N] (QuantLinear's fp8-weight layout)."""
    return (x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and w.dim() == 2 and w.dtype == torch.float8_e4m3fn and w.is_contiguous() and w.shape[0] % TILE_ROWS == 0
            and w.shape[1] % CHUNK == 0 and x.shape[1] == w.shape[1] and scale.dtype == torch.float32
            and scale.shape == (w.shape[0],) and scale.is_contiguous())


def reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, splits: int) -> torch.Tensor:
    """The kernel's output in plain torch: fp32 [splits, M, N] for x [M, K], split s the product over the
    chunks [s · per, (s + 1) · per) of K (per = ceil(K / 64 / splits) chunks)."""
    W = w.float() * scale.float()[:, None]
    per = -(-(W.shape[1] // CHUNK) // splits) * CHUNK
    xf = x.float().reshape(x.shape[0], -1)
    return torch.stack([xf[:, k:k + per] @ W[:, k:k + per].t() for k in range(0, W.shape[1], per)])


def _launch(x, w, scale, pdl, one_split) -> torch.Tensor:
    """fp8_gemv's body."""
    N, K = w.shape
    splits, per = plan(N, K, one_split)
    if not x.is_cuda:
        return reference(x, w, scale, splits)
    if not takes(x, w, scale):
        raise ValueError(f"fp8_gemv takes 1 … {MAX_ROWS} bf16/fp16 rows of x, e4m3 codes [N, K] (N % 16, K % 64 "
                         "zero) and an fp32 scale [N] (QuantLinear's fp8-weight layout)")
    x = cuda_build.aligned(x)
    batch = BATCH if x.shape[0] <= 8 else min(BATCH, 4)
    out = torch.empty(splits, x.shape[0], N, device=x.device, dtype=torch.float32)
    err = library(cuda_build.device_arch(x.device, CHOICE))(
        x.data_ptr(), w.data_ptr(), scale.data_ptr(), out.data_ptr(), x.shape[0], N, K, splits, per, batch,
        x.dtype == torch.bfloat16, pdl, x.device.index,
        torch.cuda.current_stream(x.device).cuda_stream)
    if err:
        raise RuntimeError(f"fp8_gemv launch failed: CUDA error {err} (BATCH {batch})")
    return out


@torch.library.custom_op("fastqwen::fp8_gemv", mutates_args=())
def fp8_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, pdl: bool = False,
             one_split: bool = False) -> torch.Tensor:
    """x [M ≤ 16, K] (bf16 / fp16) · (scale · w)ᵀ for e4m3 codes w [N, K] as split-K partial sums fp32
    [splits, M, N] (plan(N, K, one_split)); their sum over dim 0 is the product. pdl: launch with programmatic
    dependent launch. The CUDA kernel on CUDA tensors, `reference` elsewhere."""
    return _launch(x, w, scale, pdl, one_split)


@fp8_gemv.register_fake
def _(x, w, scale, pdl=False, one_split=False):
    return x.new_empty(plan(*w.shape, one_split)[0], x.shape[0], w.shape[0], dtype=torch.float32)

