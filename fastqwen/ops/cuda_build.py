"""Building and loading fastqwen's CUDA C++ kernels (ops/cuda/*.cu) with the CUDA toolkit's nvcc.

Each source is compiled once per source text and GPU architecture into a shared library under $FASTQWEN_CACHE
or ~/.cache/fastqwen/cuda (or the temporary directory where that cannot be made; later processes load it), and loaded with ctypes; its extern "C" entry point takes
raw pointers and torch's current stream, so CUDA-graph capture records the launch like any other. The
libraries link their own CUDA runtime: each entry point makes the tensors' GPU its runtime's current device.
"""

import ctypes
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile

import torch

SOURCES = pathlib.Path(__file__).with_name("cuda")


def nvcc() -> str | None:
    """The path of the CUDA toolkit's compiler, or None: $CUDA_HOME/bin/nvcc, nvcc on PATH, /usr/local/cuda."""
    for candidate in (os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc"), shutil.which("nvcc"),
                      "/usr/local/cuda/bin/nvcc"):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def build_command(compiler: str, source: pathlib.Path, arch: str, out: pathlib.Path) -> list[str]:
    """nvcc's arguments for the shared library of `source` for compute capability `arch` ("90": sm_90)."""
    return [compiler, "-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-shared",
            "-Xcompiler", "-fPIC", "-o", str(out), str(source)]


@functools.lru_cache(maxsize=None)
def build(name: str, arch: str, choice: str) -> ctypes.CDLL:
    """The shared library of ops/cuda/<name>.cu for compute capability `arch` (e.g. "90"), compiled once per
    source and architecture, loaded with ctypes. `choice` names the kernels option that asked for it, for the
    error raised (RuntimeError, naming the fix) where nvcc is missing or fails."""
    source = SOURCES / f"{name}.cu"
    compiler = nvcc()
    if compiler is None:
        raise RuntimeError(f"{choice} compiles fastqwen/ops/cuda/{source.name} with nvcc, which was not found "
                           f"($CUDA_HOME/bin, PATH, /usr/local/cuda/bin): install the CUDA toolkit or choose the "
                           f"Triton kernel")
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(SOURCES.glob("*.cuh")))  # (+ headers)
    digest = hashlib.sha256(text + " ".join(build_command("nvcc", source, arch, pathlib.Path())).encode()).hexdigest()
    digest = digest[:16]
    cache = pathlib.Path(os.environ.get("FASTQWEN_CACHE", pathlib.Path.home() / ".cache" / "fastqwen")) / "cuda"
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:  # (a read-only home: the system's temporary directory)
        cache = pathlib.Path(tempfile.gettempdir()) / "fastqwen-cuda"
        cache.mkdir(parents=True, exist_ok=True)
    lib = cache / f"{name}-sm{arch}-{digest}.so"
    if not lib.exists():
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        done = subprocess.run(build_command(compiler, source, arch, tmp), capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"nvcc failed to build {source.name} for sm_{arch}:\n{done.stderr[-3000:]}")
        os.replace(tmp, lib)  # (atomic: a concurrent process sees the whole library or none)
    return ctypes.CDLL(str(lib))


def entry(name: str, arch: str, choice: str, pointers: int, ints: int):
    """The extern "C" entry point fastqwen_<name> of build(name, arch, choice), typed: `pointers` pointer
    arguments, then `ints` ints, then the stream; it returns a cudaError_t."""
    fn = getattr(build(name, arch, choice), f"fastqwen_{name}")
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * pointers + [ctypes.c_int] * ints + [ctypes.c_void_p]
    return fn


def device_arch(device: torch.device, choice: str) -> str:
    """The compute capability of a CUDA device as nvcc names it ("90"); sm_90 or later is needed (the kernels'
    griddepcontrol.wait). `choice` names the kernels option, for the error."""
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        raise RuntimeError(f"{choice} needs compute capability 9.0 or later (Hopper); this GPU has {major}.{minor}: "
                           f"choose the Triton kernel")
    return f"{major}{minor}"


def split_plan(strips: int, steps: int, one_split: bool, target_blocks: int, max_splits: int) -> tuple[int, int]:
    """(splits, steps a split) for a grid of `strips` 16-row strips over `steps` K steps (a group, a chunk): the
    fewest splits (≤ max_splits, each ≥ 4 steps: one a warp of the block) that give the grid about
    target_blocks blocks, every split nonempty; one_split: a single split (the whole product in one partial, for
    a consumer that cannot fold the sum)."""
    splits = 1 if one_split else max(1, min(max_splits, steps // 4, -(-target_blocks // strips)))
    per = -(-steps // splits)
    return -(-steps // per), per


def aligned(x: torch.Tensor) -> torch.Tensor:
    """x contiguous and 16-byte aligned (the kernels load x 16 bytes at a time; a view at an odd offset, as a
    slice of a fused output can be, is copied)."""
    x = x.contiguous()
    return x.clone() if x.data_ptr() % 16 else x
