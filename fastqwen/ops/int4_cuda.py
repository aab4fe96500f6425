"""int4 weight streaming for up to 16 rows of x in CUDA C++ (cuda/int4_gemv.cu): decode's tensor-core GEMV.

Why a CUDA kernel beside the Triton one (ops/gemv.py): at one row the Triton kernel reads the 27B's int4 weights
at ~58% of the H200's read ceiling, and with its arithmetic removed its loads alone reach only ~72-76% of the
copy bandwidth (docs/DESIGN-NOTES.md, 2026-12-03/04): its occupancy (18-25%) and the loads it can keep in
flight bound it, which no launch config, layout or TMA ring changed. Here each lane issues its 16-byte weight
loads for BATCH groups (and the scales) before it decodes any of them and before the PDL wait, at 96 registers
(5 blocks of 4 warps a multiprocessor).

The kernel is built on first use with the CUDA toolkit's nvcc (`build`, cached by source and GPU architecture
under $FASTQWEN_CACHE or ~/.cache/fastqwen) and called through ctypes on torch's current stream (CUDA-graph
capture records it like any launch). optimize's kernels={"int4": "cuda"} routes QuantLinear's int4 products
of up to MAX_ROWS rows here (decode, MTP's and DFlash's verify, small batches; the kernel decodes the weight
once for all of them, as one or two blocks of mma's 8 columns); `int4_gemv` is the registered op, `reference`
its plain torch twin (also what runs off CUDA).
"""

import ctypes
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess

import torch

from .gemv import INT4, STEP, dequantized

SOURCE = pathlib.Path(__file__).with_name("cuda") / "int4_gemv.cu"
TILE_ROWS = 16
TARGET_BLOCKS = 2048  # splits are added until the grid has about this many blocks (~15 a multiprocessor)
BATCH = 4  # groups whose weight loads a warp issues before it decodes them (2, 4 or 8: the kernel's instances)
PIPELINED = False  # the next batch's loads in flight while a batch decodes (an instance with BATCH 2 only)
MAX_SPLITS = 8  # inductor unrolls the caller's sum of ≤ 8 partials into the consumer (gemv.wq_linear)
MAX_ROWS = 16  # rows of x a launch takes: one or two blocks of mma.m16n8k16's 8 B columns (a DFlash verify)


def nvcc() -> str | None:
    """The path of the CUDA toolkit's compiler, or None: $CUDA_HOME/bin/nvcc, nvcc on PATH, /usr/local/cuda."""
    for candidate in (os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc"), shutil.which("nvcc"),
                      "/usr/local/cuda/bin/nvcc"):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def build_command(compiler: str, arch: str, out: pathlib.Path) -> list[str]:
    """nvcc's arguments for the shared library of SOURCE for compute capability `arch` ("90": sm_90)."""
    return [compiler, "-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-shared",
            "-Xcompiler", "-fPIC", "-o", str(out), str(SOURCE)]


@functools.lru_cache(maxsize=None)
def build(arch: str) -> ctypes.CDLL:
    """The kernel's shared library for compute capability `arch` (e.g. "90"), compiled once per source and
    architecture (kept in the cache directory: later processes load it), loaded with ctypes. Raises RuntimeError
    naming the fix where nvcc is missing or fails."""
    compiler = nvcc()
    if compiler is None:
        raise RuntimeError("kernels['int4']='cuda' compiles fastqwen/ops/cuda/int4_gemv.cu with nvcc, which was not "
                           "found ($CUDA_HOME/bin, PATH, /usr/local/cuda/bin): install the CUDA toolkit or keep "
                           "kernels['int4']='triton'")
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(build_command("nvcc", arch, pathlib.Path())).encode())
    cache = pathlib.Path(os.environ.get("FASTQWEN_CACHE", pathlib.Path.home() / ".cache" / "fastqwen")) / "cuda"
    lib = cache / f"int4_gemv-sm{arch}-{digest.hexdigest()[:16]}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        done = subprocess.run(build_command(compiler, arch, tmp), capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"nvcc failed to build {SOURCE.name} for sm_{arch}:\n{done.stderr[-3000:]}")
        os.replace(tmp, lib)  # (atomic: a concurrent process sees the whole library or none)
    dll = ctypes.CDLL(str(lib))
    dll.fastqwen_int4_gemv.restype = ctypes.c_int
    dll.fastqwen_int4_gemv.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 10 + [ctypes.c_void_p]
    return dll


def device_arch(device: torch.device) -> str:
    """The compute capability of a CUDA device as nvcc names it ("90"); sm_90 or later is needed (the kernel's
    griddepcontrol.wait)."""
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        raise RuntimeError(f"kernels['int4']='cuda' needs compute capability 9.0 or later (Hopper); this GPU has "
                           f"{major}.{minor}: keep kernels['int4']='triton'")
    return f"{major}{minor}"


def variant(rows: int) -> tuple[int, bool]:
    """(BATCH, PIPELINED) of the kernel instance for `rows` rows of x: the module's, but for 9 … 16 rows (two
    column blocks) BATCH ≤ 4 unpipelined (the instances that do not spill)."""
    return (BATCH, PIPELINED) if rows <= 8 else (min(BATCH, 4), False)


def plan(N: int, K: int, one_split: bool = False) -> tuple[int, int]:
    """(splits, groups a split) for an [N, K] weight: the fewest splits (≤ MAX_SPLITS, each ≥ 4 groups: one a
    warp) that give the grid about TARGET_BLOCKS blocks of one 16-row strip each; every split nonempty.
    one_split: a single split (the whole product in one partial, for a consumer that cannot fold the sum)."""
    groups, strips = K // STEP, N // TILE_ROWS
    splits = 1 if one_split else max(1, min(MAX_SPLITS, groups // 4, -(-TARGET_BLOCKS // strips)))
    per = -(-groups // splits)
    return -(-groups // per), per


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


@torch.library.custom_op("fastqwen::int4_gemv", mutates_args=())
def int4_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, out_features: int,
              pdl: bool = False, one_split: bool = False) -> torch.Tensor:
    """x [M ≤ 16, K] (bf16 / fp16) · Wᵀ for an int4 weight in QuantLinear's layout (`takes`) as split-K partial
    sums fp32 [splits, M, out_features] (plan(out_features, K, one_split)); their sum over dim 0 is the product. pdl:
    launch with programmatic dependent launch. The CUDA kernel on CUDA tensors, `reference` elsewhere."""
    splits, per = plan(out_features, x.shape[-1], one_split)
    if not x.is_cuda:
        return reference(x, w, scale, zero, out_features, splits)
    if not takes(x, w, scale, zero):
        raise ValueError(f"int4_gemv takes 1 … {MAX_ROWS} bf16/fp16 rows of x, codes tiled [N/16, K/128, 16, 64] "
                         "uint8 and group-major fp16 scale / uint8 zero (QuantLinear's layout)")
    x = x.contiguous()
    if x.data_ptr() % 16:  # (a view at an odd offset: the kernel loads x 16 bytes at a time)
        x = x.clone()
    batch, pipelined = variant(x.shape[0])
    out = torch.empty(splits, x.shape[0], out_features, device=x.device, dtype=torch.float32)
    err = build(device_arch(x.device)).fastqwen_int4_gemv(
        x.data_ptr(), w.data_ptr(), scale.data_ptr(), zero.data_ptr(), out.data_ptr(), x.shape[0], out_features,
        x.shape[-1], splits, per, batch, pipelined, x.dtype == torch.bfloat16, pdl, x.device.index,
        torch.cuda.current_stream(x.device).cuda_stream)
    if err:
        raise RuntimeError(f"int4_gemv launch failed: CUDA error {err} (BATCH {batch}, PIPELINED {pipelined})")
    return out


@int4_gemv.register_fake
def _(x, w, scale, zero, out_features, pdl=False, one_split=False):
    return x.new_empty(plan(out_features, x.shape[-1], one_split)[0], x.shape[0], out_features, dtype=torch.float32)
