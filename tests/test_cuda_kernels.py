"""The CUDA C++ few-row kernels (ops/int4_cuda.py with ops/cuda/int4_gemv.cu, ops/fp8_cuda.py with
ops/cuda/fp8_gemv.cu, built by ops/cuda_build.py) off the GPU: their references and split plans, the ops'
contracts, a bit-level emulation of what each lane loads, decodes and hands the tensor cores, the libraries'
argument checks, and their builds for sm_90 (registers, no spills, the loads and MMAs they were written to
issue). tests/gpu/test_cuda_kernels_gpu.py runs the kernels themselves."""

import os
import pathlib
import subprocess
import types

import pytest
import torch

from fastqwen.model import check_kernels
from fastqwen.ops import cuda_build, fp8_cuda, int4_cuda
from fastqwen.ops.gemv import INT4, STEP, dequantized, reference, stored_operands
from fastqwen.quant.formats import quantize_fp8_rows

NVCC = pytest.mark.skipif(cuda_build.nvcc() is None, reason="needs the CUDA toolkit's nvcc")


def fp8_operands(N: int, K: int, seed: int = 0):
    """(e4m3 codes [N, K], fp32 scale [N]) of a random weight, as QuantLinear stores fp8-weight."""
    torch.manual_seed(seed)
    return quantize_fp8_rows(torch.randn(N, K))


def test_plans_cover_every_step_once_in_nonempty_splits():
    for plan, step in ((int4_cuda.plan, STEP), (fp8_cuda.plan, fp8_cuda.CHUNK)):
        for N, K in ((34816, 5120), (5120, 17408), (5120, 6144), (248320, 5120), (16, 128), (48, 1024), (64, 512)):
            splits, per = plan(N, K)
            steps = K // step
            assert 1 <= splits <= 8 and (splits - 1) * per < steps <= splits * per, (N, K)
            assert splits == 1 or per >= 4, (N, K)  # a step for each of the block's 4 warps
    assert int4_cuda.plan(34816, 5120) == (2, 20) and int4_cuda.plan(5120, 17408) == (8, 17)
    assert int4_cuda.plan(5120, 17408, one_split=True) == (1, 136)
    assert fp8_cuda.plan(34816, 5120) == (1, 80) and fp8_cuda.plan(5120, 17408) == (7, 39)


def test_fake_implementation_gives_plans_splits_on_a_cuda_device():
    """What torch.compile traces on a GPU: under fake tensors on a CUDA device the op's output has plan's splits
    ([8, M, N] for the 27B down projection), one with one_split."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    N, K = 5120, 17408
    with FakeTensorMode():
        w = torch.empty(N // 16, K // STEP, 16, STEP // 2, dtype=torch.uint8, device="cuda")
        s = torch.empty(K // STEP, N, dtype=torch.float16, device="cuda").t()
        z = torch.empty(K // STEP, N, dtype=torch.uint8, device="cuda").t()
        for M in (1, 16):
            x = torch.empty(M, K, dtype=torch.bfloat16, device="cuda")
            assert int4_cuda.int4_gemv(x, w, s, z, N, True, False).shape == (8, M, N)
            assert int4_cuda.int4_gemv(x, w, s, z, N, True, True).shape == (1, M, N)


@pytest.mark.parametrize("N,K,M", [(64, 512, 1), (48, 1024, 3), (32, 128, 8), (16, 2048, 1), (64, 512, 16)])
def test_reference_partials_sum_to_the_product_split_by_step_ranges(N, K, M):
    """Each op's CPU reference: [splits, M, N], split i the product over its own steps of K alone."""
    torch.manual_seed(N + K)
    q, s, z = stored_operands(INT4, torch.randn(N, K))
    w8, s8 = fp8_operands(N, K)
    x = torch.randn(M, K, dtype=torch.bfloat16)
    for parts, plan, step, full in (
            (int4_cuda.int4_gemv(x, q, s, z, N), int4_cuda.plan, STEP, lambda x: reference(x, INT4, q, s, z, False, N)),
            (fp8_cuda.fp8_gemv(x, w8, s8), fp8_cuda.plan, fp8_cuda.CHUNK,
             lambda x: x @ (w8.float() * s8[:, None]).t())):
        splits, per = plan(N, K)
        assert parts.shape == (splits, M, N) and parts.dtype == torch.float32
        assert torch.allclose(parts.sum(0), full(x.float()), rtol=1e-5, atol=1e-4)
        cols = per * step
        for i in range(splits):
            xi = torch.zeros_like(x)
            xi[:, i * cols:(i + 1) * cols] = x[:, i * cols:(i + 1) * cols]
            assert torch.allclose(parts[i], full(xi.float()), rtol=1e-5, atol=1e-4)


def test_ops_pass_opcheck_and_take_only_their_layouts():
    q, s, z = stored_operands(INT4, torch.randn(48, 1024))
    w8, s8 = fp8_operands(48, 1024)
    x = torch.randn(1, 1024, dtype=torch.bfloat16)
    utils = ("test_faketensor", "test_aot_dispatch_dynamic")  # (test_schema: no e4m3 arithmetic on CPU)
    for one_split in (False, True):
        torch.library.opcheck(int4_cuda.int4_gemv, (x, q, s, z, 48, False, one_split),
                              test_utils=utils + ("test_schema",))
        torch.library.opcheck(fp8_cuda.fp8_gemv, (x, w8, s8, False, one_split), test_utils=utils)
    assert int4_cuda.int4_gemv(x, q, s, z, 48).shape[0] == 2 and fp8_cuda.fp8_gemv(x, w8, s8).shape[0] == 4
    assert int4_cuda.int4_gemv(x, q, s, z, 48, False, True).shape[0] == 1 == fp8_cuda.fp8_gemv(x, w8, s8, False,
                                                                                             True).shape[0]
    for rows in (x, x.half(), x.expand(16, -1)):
        assert int4_cuda.takes(rows, q, s, z) and fp8_cuda.takes(rows, w8, s8)
    with pytest.raises(ValueError, match="takes CUDA tensors"):  # (a timing probe: its output is zeros)
        int4_cuda.loads_only(x, q, s, z, 48)
    untiled, _, _ = stored_operands(INT4, torch.randn(48, 1024), tiled=False)
    for args in ((x.expand(17, -1), q, s, z), (x[0], q, s, z), (x.float(), q, s, z), (x, untiled, s, z),
                 (x, q, s.contiguous(), z), (x, q, s, z.contiguous()), (x[:, :512], q, s, z)):
        assert not int4_cuda.takes(*args)
    for args in ((x.expand(17, -1), w8, s8), (x.float(), w8, s8), (x, w8.t().contiguous().t(), s8),
                 (x, w8[:40], s8[:40]), (x[:, :1000], w8[:, :1000], s8), (x, w8, s8.double()), (x, w8, s8[:, None])):
        assert not fp8_cuda.takes(*args)


def test_kernel_choices_are_checked_and_a_missing_compiler_names_the_fix(monkeypatch):
    from fastqwen import presets

    cfg = presets.config("tiny")
    chosen = check_kernels({"int4": "cuda", "fp8_weight": "cuda"}, cfg, "cpu")
    assert (chosen["int4"], chosen["fp8_weight"]) == ("cuda", "cuda")
    assert (check_kernels(None, cfg, "cpu")["int4"], check_kernels(None, cfg, "cpu")["fp8_weight"]) == (
        "triton", "triton")  # (int4's "auto": the CUDA kernel only on a Hopper GPU with nvcc)
    for op, bad in (("int4", "cutlass"), ("int4", "cuda-ring"), ("int4", "cuda-stream"), ("int4", "cuda-async"),
                    ("fp8_weight", "cuda-ring"), ("fp8_weight", "ring")):
        with pytest.raises(ValueError, match="triton, cuda"):
            check_kernels({op: bad}, cfg, "cpu")
    monkeypatch.setattr(cuda_build, "nvcc", lambda: None)
    cuda_build.build.cache_clear()
    for module in (int4_cuda, fp8_cuda):
        with pytest.raises(RuntimeError, match=f"{module.CHOICE.replace('[', '.').replace(']', '.')} compiles .*"
                                               "install the CUDA toolkit or choose the Triton kernel"):
            module.library("90")
    cuda_build.build.cache_clear()


def test_int4_auto_takes_the_cuda_kernel_where_it_builds_and_else_warns_and_takes_triton(monkeypatch):
    """kernels['int4'] "auto" (the default): "cuda" where _cuda_kernels_build says a Hopper GPU and nvcc are here
    and the library builds; a build that fails warns, naming the error, and takes "triton"; "triton" where
    there is no such GPU or no nvcc (CPU here: the check itself)."""
    from fastqwen import model, presets

    cfg = presets.config("tiny")
    assert check_kernels({}, cfg, "cpu")["int4"] == "triton"
    monkeypatch.setattr(model, "_cuda_kernels_build", lambda device: True)
    monkeypatch.setattr(cuda_build, "device_arch", lambda device, choice: "90")
    monkeypatch.setattr(int4_cuda, "library", lambda arch: None)
    assert check_kernels({}, cfg, "cpu")["int4"] == "cuda"

    def fails(arch):
        raise RuntimeError("nvcc failed to build int4_gemv.cu for sm_90: …")

    monkeypatch.setattr(int4_cuda, "library", fails)
    with pytest.warns(UserWarning, match="takes the Triton kernel: the CUDA one did not build .nvcc failed"):
        assert check_kernels({}, cfg, "cpu")["int4"] == "triton"
    with pytest.raises(RuntimeError, match="nvcc failed"):  # (asked for by name: the error stands)
        check_kernels({"int4": "cuda", "launch": "serial"}, cfg, "cuda")


def _u32(words: torch.Tensor) -> list[int]:
    return [int(v) & 0xFFFFFFFF for v in words.tolist()]


def _halves(bits: int, dtype: torch.dtype) -> tuple[float, float]:
    """The two 16-bit floats of a 32-bit register (low half first)."""
    pair = torch.tensor([bits & 0xFFFF, bits >> 16], dtype=torch.int32).to(torch.int16)
    return tuple(pair.view(dtype).float().tolist())


def _mma(A: list, B: list) -> torch.Tensor:
    """mma.m16n8k16 from its lanes' fragments, as the PTX ISA lays them out: A[lane] four (lo, hi) pairs (a0 a1:
    row lane/4, k 2 (lane%4) + 0, 1; a2 a3: row + 8; a4 a5: k + 8; a6 a7: row + 8, k + 8), B[lane] two (b0 b1:
    k 2 (lane%4) + 0, 1 of column lane/4; b2 b3: k + 8). Returns the product [16, 8] in float64."""
    Am, Bm = torch.zeros(16, 16, dtype=torch.float64), torch.zeros(16, 8, dtype=torch.float64)
    for lane in range(32):
        r, c = lane // 4, 2 * (lane % 4)
        for reg, (row, k) in enumerate(((r, c), (r + 8, c), (r, c + 8), (r + 8, c + 8))):
            Am[row, k:k + 2] = torch.tensor(A[lane][reg], dtype=torch.float64)
        Bm[c:c + 2, r] = torch.tensor(B[lane][0], dtype=torch.float64)
        Bm[c + 8:c + 10, r] = torch.tensor(B[lane][1], dtype=torch.float64)
    return Am @ Bm


def _write_block(out, split: int, strip: int, sums: torch.Tensor, M: int, row_scale=None) -> None:
    """The kernels' epilogue: lane l's c0 … c3 of column block nb (strip rows l/4, l/4 + 8 against x rows
    8 nb + 2 (l%4), + 1), times the row's scale if given, summed over the block's warps into out[split]."""
    for lane in range(32):
        r, m = lane // 4, 2 * (lane % 4)
        for nb in range(sums.shape[2]):
            for value, (xrow, row) in zip(sums[:, lane, nb].sum(0), ((m, r), (m + 1, r), (m, r + 8), (m + 1, r + 8))):
                if 8 * nb + xrow < M:
                    out[split, 8 * nb + xrow, strip * 16 + row] = value


def emulate_int4(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, N: int) -> torch.Tensor:
    """cuda/int4_gemv.cu replayed lane by lane from the raw bits it loads: each lane's two 16-byte weight loads
    (uint4 lane and lane + 32 of a tile), the LOP3 / FMA decode of nibble pairs (j, j + 4) into 16-bit
    (q − zero) pairs, x's byte permutes (row 8 nb + lane/4, zero past M), the mma fragments, each group's sums
    times its scales, the warps' sums. Returns [splits, M, N] fp32."""
    dtype = x.dtype
    magic, neg_magic = (0x43004300, 0xC300) if dtype == torch.bfloat16 else (0x64006400, 0xE400)
    (M, K), G, NB = x.shape, x.shape[1] // STEP, 1 if x.shape[0] <= 8 else 2
    splits, per = int4_cuda.plan(N, K)
    xw = _u32(x.contiguous().view(torch.int32).view(-1))  # x as 32-bit words, two values each, row after row
    tiles = w.reshape(N // 16, G, 64, 16)  # 16-byte loads of each tile, in order
    out = torch.zeros(splits, M, N)

    def pair(u, j, negz):  # (lop3 then fma by 1 with −(magic + zero)): exact integers
        lo, hi = _halves(((u >> (4 * j)) & 0x000F000F) | magic, dtype)
        nlo, nhi = _halves(negz, dtype)
        return lo + nlo, hi + nhi

    lo_pair = lambda p, q: (p & 0xFFFF) | ((q & 0xFFFF) << 16)  # noqa: E731  (byte_perm 0x5410)
    hi_pair = lambda p, q: (p >> 16) | (q & 0xFFFF0000)  # noqa: E731  (byte_perm 0x7632)
    for strip in range(N // 16):
        for split in range(splits):
            sums = torch.zeros(4, 32, NB, 4)
            for warp in range(4):
                for g in range(split * per + warp, min(G, (split + 1) * per), 4):
                    lanes = []
                    for lane in range(32):
                        row_a = strip * 16 + lane // 4
                        xs = []
                        for nb in range(NB):  # x row 8 nb + lane/4 at the lane's 32 columns
                            xrow, word = nb * 8 + lane // 4, (nb * 8 + lane // 4) * K // 2 + (g * 16 + lane % 4 * 4) * 4
                            xs.append([xw[word + 4 * i:word + 4 * i + 4] if xrow < M else [0] * 4 for i in range(4)])
                        lanes.append((_u32(tiles[strip, g, lane].view(torch.int32)),
                                      _u32(tiles[strip, g, lane + 32].view(torch.int32)),
                                      (neg_magic | int(zero[row_a, g])) * 0x00010001,
                                      (neg_magic | int(zero[row_a + 8, g])) * 0x00010001, xs))
                    C = torch.zeros(NB, 16, 8, dtype=torch.float64)
                    for i in range(4):
                        for j0, j1 in ((0, 1), (2, 3)):
                            A = [(pair(a[i], j0, za), pair(b[i], j0, zb), pair(a[i], j1, za), pair(b[i], j1, zb))
                                 for a, b, za, zb, _ in lanes]
                            for nb in range(NB):
                                v = [xs[nb][i] for *_, xs in lanes]
                                pick = (0, 2) if j0 == 0 else (1, 3)
                                B = [(_halves(lo_pair(u[pick[0]], u[pick[1]]), dtype),
                                      _halves(hi_pair(u[pick[0]], u[pick[1]]), dtype)) for u in v]
                                C[nb] += _mma(A, B)
                    for lane in range(32):
                        r, c = lane // 4, 2 * (lane % 4)
                        sa, sb = float(scale[strip * 16 + r, g]), float(scale[strip * 16 + r + 8, g])
                        for nb, Cb in enumerate(C):
                            sums[warp, lane, nb] += torch.tensor(
                                [sa * Cb[r, c], sa * Cb[r, c + 1], sb * Cb[r + 8, c], sb * Cb[r + 8, c + 1]])
            _write_block(out, split, strip, sums, M)
    return out


def emulate_fp8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """cuda/fp8_gemv.cu replayed lane by lane from the raw bits it loads: each lane's 16 bytes of rows lane/4
    and lane/4 + 8 at columns 16 (lane%4) … of a 64-column chunk, word j's e4m3 pairs (bytes 0 1, 2 3) as the
    A operand's (k, k + 8) pairs, x row 8 nb + lane/4's consecutive pairs as B (zero past M), the mma fragments,
    fp32 sums over the split, times the row scale, the warps' sums. Returns [splits, M, N] fp32."""
    dtype = x.dtype
    (M, K), (N, _), NB = x.shape, w.shape, 1 if x.shape[0] <= 8 else 2
    chunks = K // fp8_cuda.CHUNK
    splits, per = fp8_cuda.plan(N, K)
    xw = _u32(x.contiguous().view(torch.int32).view(-1))
    codes = w.view(torch.uint8)
    e4m3 = lambda b: float(torch.tensor([b], dtype=torch.uint8).view(torch.float8_e4m3fn).float())  # noqa: E731
    out = torch.zeros(splits, M, N)
    for strip in range(N // 16):
        for split in range(splits):
            sums = torch.zeros(4, 32, NB, 4)
            for warp in range(4):
                C = torch.zeros(NB, 16, 8, dtype=torch.float64)
                for ch in range(split * per + warp, min(chunks, (split + 1) * per), 4):
                    col = ch * fp8_cuda.CHUNK
                    lanes = []
                    for lane in range(32):
                        row_a, cols = strip * 16 + lane // 4, col + 16 * (lane % 4)
                        xs = []
                        for nb in range(NB):  # x row 8 nb + lane/4 at the lane's 16 columns: 8 words
                            xrow, word = nb * 8 + lane // 4, (nb * 8 + lane // 4) * K // 2 + cols // 2
                            xs.append(xw[word:word + 8] if xrow < M else [0] * 8)
                        lanes.append((codes[row_a, cols:cols + 16].tolist(), codes[row_a + 8, cols:cols + 16].tolist(),
                                      xs))
                    for j in range(4):
                        A = [((e4m3(a[4 * j]), e4m3(a[4 * j + 1])), (e4m3(b[4 * j]), e4m3(b[4 * j + 1])),
                              (e4m3(a[4 * j + 2]), e4m3(a[4 * j + 3])), (e4m3(b[4 * j + 2]), e4m3(b[4 * j + 3])))
                             for a, b, _ in lanes]
                        for nb in range(NB):
                            B = [(_halves(xs[nb][2 * j], dtype), _halves(xs[nb][2 * j + 1], dtype)) for *_, xs in lanes]
                            C[nb] += _mma(A, B)
                for lane in range(32):
                    r, c = lane // 4, 2 * (lane % 4)
                    sa, sb = float(scale[strip * 16 + r]), float(scale[strip * 16 + r + 8])
                    for nb, Cb in enumerate(C):
                        sums[warp, lane, nb] += torch.tensor(
                            [sa * Cb[r, c], sa * Cb[r, c + 1], sb * Cb[r + 8, c], sb * Cb[r + 8, c + 1]])
            _write_block(out, split, strip, sums, M)
    return out


@pytest.mark.parametrize("dtype,M", [(torch.bfloat16, 1), (torch.float16, 1), (torch.bfloat16, 3),
                                     (torch.float16, 8), (torch.bfloat16, 13)])
def test_emulated_int4_lanes_give_the_reference_partials(dtype, M, monkeypatch):
    """Two strips, 6 groups in 2 splits of 3 (warps with a group and with none), zeros from 0 to 16 (GPTQ's
    range), 1, 3, 8 and 13 rows of x (13: two blocks of B columns, the second part empty)."""
    torch.manual_seed(3)
    N, K = 32, 768
    q, s, z = stored_operands(INT4, torch.randn(N, K))
    z = torch.randint(0, 17, (G := K // STEP, N), dtype=torch.uint8).t()  # (group-major, as stored)
    x = torch.randn(M, K).to(dtype)
    monkeypatch.setattr(int4_cuda, "plan", lambda N, K, one_split=False, rows=1: (2, 3))
    got, want = emulate_int4(x, q, s, z, N), int4_cuda.int4_gemv(x, q, s, z, N)
    assert G == 6 and got.shape == want.shape == (2, M, N)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4), (got - want).abs().max()


@pytest.mark.parametrize("dtype,M", [(torch.bfloat16, 1), (torch.float16, 2), (torch.bfloat16, 11)])
def test_emulated_fp8_lanes_give_the_reference_partials(dtype, M, monkeypatch):
    """Two strips, 6 chunks of 64 columns in 2 splits of 3, every e4m3 code's neighbourhood (subnormals too: the
    weight's spread), 1, 2 and 11 rows of x."""
    N, K = 32, 384
    w8, s8 = fp8_operands(N, K, seed=4)
    w8 = (w8.float() * torch.logspace(-4, 0, K)).to(torch.float8_e4m3fn)  # (columns down to e4m3's subnormals)
    x = torch.randn(M, K).to(dtype)
    monkeypatch.setattr(fp8_cuda, "plan", lambda N, K, one_split=False: (2, 3))
    got, want = emulate_fp8(x, w8, s8), fp8_cuda.fp8_gemv(x, w8, s8)
    assert got.shape == want.shape == (2, M, N)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4), (got - want).abs().max()


def _cuobjdump() -> str | None:
    site = os.environ.get("FASTQWEN_TRITON_SITE")
    tool = pathlib.Path(site or "/nonexistent") / "triton" / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(tool) if tool.exists() else None


def _sass_ops(kernel: str) -> list[str]:
    """The opcodes of one kernel's SASS listing, in order (a predicate's guard dropped)."""
    ops = [line.split(";")[0].split("*/")[-1].split() for line in kernel.splitlines() if "*/" in line and ";" in line]
    return [o[1] if o[0].startswith("@") else o[0] for o in ops if o]


def _loops(kernel: str) -> list[tuple[int, int]]:
    """(first, last) opcode indices (as _sass_ops counts them) of each loop of one kernel's SASS listing: a
    branch back to an earlier address, and its target."""
    lines = [line for line in kernel.splitlines()
             if "*/" in line and ";" in line and line.split(";")[0].split("*/")[-1].split()]
    at = {int(line.split("/*")[1].split("*/")[0], 16): i for i, line in enumerate(lines)}
    loops = []
    for i, line in enumerate(lines):
        code = line.split(";")[0].split("*/")[-1]
        if " BRA " in f" {code} " and "0x" in code:
            target = int(code.split("0x")[-1].split()[0].rstrip(","), 16)
            if target in at and at[target] < i:
                loops.append((at[target], i))
    return loops


def _build_sm90(name: str, tmp_path) -> tuple[str, str]:
    """(ptxas -v's report, the library's path) of ops/cuda/<name>.cu built for sm_90 as cuda_build builds it."""
    lib = tmp_path / f"{name}.so"
    cmd = cuda_build.build_command(cuda_build.nvcc(), cuda_build.SOURCES / f"{name}.cu", "90", lib)
    done = subprocess.run(cmd[:1] + ["-Xptxas", "-v"] + cmd[1:], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stderr, str(lib)


def _sass_functions(lib: str, kernel: str) -> list[str]:
    """The SASS listings of the library's instances of `kernel` (skips without Triton's cuobjdump)."""
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (Triton's, under $FASTQWEN_TRITON_SITE) to read the SASS")
    sass = subprocess.run([tool, "--dump-sass", lib], capture_output=True, text=True).stdout
    return [f for f in sass.split("Function : ")[1:] if kernel in f.split("\n")[0]]


def _template_args(mangled: str, kernel: str) -> list[int]:
    """The integer and bool template arguments of a mangled instance of `kernel`, in order
    (…int4_gemv_rowsILb1ELi2ELb0ELi1ELb0EE…: [1, 2, 0, 1, 0])."""
    return [int(a[2:]) for a in mangled.split(kernel + "I")[1].split("EE")[0].split("E")]


@NVCC
@pytest.mark.parametrize("name,instances", [("int4_gemv", 19), ("fp8_gemv", 10)])
def test_kernels_build_for_sm90_without_spills(name, instances, tmp_path):
    """nvcc -Xptxas -v for sm_90: every instance ≤ 128 registers (4 blocks of 128 threads a multiprocessor), no
    spills, static shared memory under the 48 KB limit."""
    report, _ = _build_sm90(name, tmp_path)
    used = [line.split("Used ")[1] for line in report.splitlines() if "Used " in line]
    assert len(used) == instances, report
    assert max(int(u.split()[0]) for u in used) <= 128, report
    assert max(int(u.split(" bytes smem")[0].split()[-1]) if "smem" in u else 0 for u in used) < 48 << 10, used
    spills = [line.strip() for line in report.splitlines() if "spill" in line]
    assert spills == ["0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"] * instances, spills


@NVCC
@pytest.mark.parametrize("name,kernel,instances", [("int4_gemv", "int4_gemv_rows", 14),
                                                   ("fp8_gemv", "fp8_gemv_rows", 10)])
def test_register_kernels_issue_their_first_loads_before_the_wait(name, kernel, instances, tmp_path):
    """In the SASS of each register-kernel instance (bf16 / fp16 x, each BATCH, pipelined, one or two blocks of
    8 x rows; int4's loads-only probe too), the first BATCH steps' 16-byte
    weight loads that skip L1, then the PDL wait, then x and the later batches; 8 MMAs an int4 group of 128
    columns, 4 an fp8 chunk of 64, for each block of 8 x rows."""
    functions = _sass_functions(_build_sm90(name, tmp_path)[1], kernel)
    assert len(functions) == instances
    for k in functions:
        args = _template_args(k.split("\n")[0], kernel)  # int4: dtype, BATCH, PIPE, NB, PROBE;
        # fp8: dtype, BATCH, NB
        batch, nb, pipe = args[1], args[3 if name == "int4_gemv" else 2], name == "int4_gemv" and args[2] == 1
        probe = name == "int4_gemv" and args[4] == 1  # (the loads-only probe: no x, no MMA)
        ops = _sass_ops(k)
        wait = ops.index("ACQBULK")  # griddepcontrol.wait
        weights = [i for i, o in enumerate(ops) if o == "LDG.E.NA.128"]
        xs = [i for i, o in enumerate(ops) if o == "LDG.E.128"]
        copies = 3 if pipe else 2  # (the first batch's loads, then the loop's)
        assert len(weights) == 2 * batch * copies, (batch, pipe, len(weights))
        assert weights[2 * batch - 1] < wait < min(xs + weights[2 * batch:]), (batch, pipe, weights, wait, xs)
        mmas = (8 if name == "int4_gemv" else 4) * nb * batch * (2 if pipe else 1)
        assert sum(o.startswith("HMMA.16816.F32") for o in ops) == (0 if probe else mmas)
        assert (len(xs) == 0) == probe


def test_pair_kernel_takes_9_to_16_rows_at_batch_2_and_the_strips_plan(monkeypatch):
    """int4_cuda.PAIR: 9 … 16 rows against an N % 32 == 0 weight take the pair kernel, at BATCH 2 only; up to 8
    rows, odd strips and other BATCHes the one-strip instance. Its split plan is the one-strip kernel's (over
    16-row strips), whatever the rows."""
    monkeypatch.setattr(int4_cuda, "PAIR", True)
    assert int4_cuda.paired(34816, 16) and int4_cuda.paired(5120, 9)
    assert not int4_cuda.paired(5136, 16) and not int4_cuda.paired(34816, 8)
    assert int4_cuda.plan(34816, 5120) == (2, 20) and int4_cuda.plan(5120, 17408) == (8, 17)
    monkeypatch.setattr(int4_cuda, "BATCH", 4)
    assert not int4_cuda.paired(34816, 16)


@NVCC
def test_pair_kernel_loads_both_strips_before_the_wait_and_x_once(tmp_path):
    """int4_gemv_pair (int4_cuda.PAIR), bf16 and fp16 x: both strips' first batch (2 groups each: eight 16-byte
    weight loads that skip L1) before the PDL wait, x after it; x's loads and byte permutes once a group (8 and 32,
    int4_gemv_rows' two-column-block instance's), its MMAs twice (16 a group a strip); both strips walked as
    pointers: at most 32 address instructions (IMAD, LEA, constant loads) in its 2-group loop (169 of 850 with
    indices recomputed at each load, 2026-12-06), and x loaded unconditionally (no registers cleared in the loop
    for rows past M)."""
    functions = _sass_functions(_build_sm90("int4_gemv", tmp_path)[1], "int4_gemv_pair")
    assert len(functions) == 2
    rows = [k for k in _sass_functions(_build_sm90("int4_gemv", tmp_path)[1], "int4_gemv_rows")
            if _template_args(k.split("\n")[0], "int4_gemv_rows") == [1, 2, 0, 2, 0]]
    x_permutes = lambda k: sum("PRMT" in line and ("0x5410" in line or "0x7632" in line)  # noqa: E731
                               for line in k.splitlines())
    for k in functions:
        ops = _sass_ops(k)
        wait = ops.index("ACQBULK")
        weights = [i for i, o in enumerate(ops) if o == "LDG.E.NA.128"]
        xs = [i for i, o in enumerate(ops) if o == "LDG.E.128"]
        assert len(weights) == 16 and weights[7] < wait < min(xs + weights[8:]), (weights, wait, xs)
        assert len(xs) == 16 and x_permutes(k) == x_permutes(rows[0]) == 64, (len(xs), x_permutes(k))
        assert sum(o.startswith("HMMA.16816.F32") for o in ops) == 64
        lo, hi = max(_loops(k), key=lambda loop: loop[1] - loop[0])
        assert sum(o.split(".")[0] in ("IMAD", "LEA", "LDC") for o in ops[lo:hi + 1]) <= 32, ops[lo:hi + 1]
        assert "CS2R" not in ops[lo:hi + 1]


@NVCC
def test_folded_kernel_keeps_the_register_kernels_loads_with_a_shorter_decode(tmp_path):
    """int4_gemv_fold (int4_cuda.FOLD, the default; bf16 x, one block of 8 x rows): the register kernel's first batch (2
    groups: four 16-byte weight loads that skip L1) before the PDL wait and x after it; 16 MMAs a group (8 of the
    codes, 8 of an all-ones A for the sums of x) and no bf16 pair arithmetic in the decode (the zero comes off
    after the MMAs); its loop over the batches ≤ 90% of the instructions of the register kernel's instance it
    stands in for (BATCH 2 unpipelined, bf16, one block of 8 x rows; 287 against 333 when written), in ≤ 72
    registers with no spill (7 blocks a multiprocessor, as the instance it replaces)."""
    report, lib = _build_sm90("int4_gemv", tmp_path)
    (fold,) = [k for k in _sass_functions(lib, "int4_gemv_fold")
               if _template_args(k.split("\n")[0], "int4_gemv_fold") == [1, 0]]
    (plain,) = [k for k in _sass_functions(lib, "int4_gemv_rows")
                if _template_args(k.split("\n")[0], "int4_gemv_rows") == [1, 2, 0, 1, 0]]
    ops = _sass_ops(fold)
    wait = ops.index("ACQBULK")
    weights = [i for i, o in enumerate(ops) if o == "LDG.E.NA.128"]
    xs = [i for i, o in enumerate(ops) if o == "LDG.E.128"]
    assert len(weights) == 8 and weights[3] < wait < min(xs + weights[4:]), (weights, wait, xs)
    assert sum(o == "HMMA.16816.F32.BF16" for o in ops) == 32 and "HADD2.BF16_V2" not in ops
    longest = lambda k: max(hi - lo + 1 for lo, hi in _loops(k))  # noqa: E731 (the loop over the batches)
    assert longest(fold) <= 0.9 * longest(plain), (longest(fold), longest(plain))
    line = next(r for e, r in zip([e for e in report.splitlines() if "Compiling entry function" in e],
                                  [r for r in report.splitlines() if "Used " in r]) if "int4_gemv_foldILi1ELi0E" in e)
    assert int(line.split("Used ")[1].split()[0]) <= 72, line


@NVCC
@pytest.mark.parametrize("slots,registers", [(2, 72), (3, 80)])
def test_rotating_fold_loads_the_next_batch_while_it_decodes(slots, registers, tmp_path):
    """int4_gemv_fold's rotating instances (int4_cuda.FOLD 2 and 3: SLOTS 2 and 3): the first batch's 2 SLOTS
    16-byte weight loads before the PDL wait, x after it; in the loop over the batches, each group's two weight
    loads for the next batch come after that group's x loads and MMAs have begun and before the next group's x
    loads (so the other slots' loads are in flight while one decodes), where the unrotated fold issues all four at
    the loop's top; 16 MMAs a group, a loop no longer a group than the fold's, and the registers of 7
    blocks a multiprocessor (72, as the fold) with 2 slots, of 6 (80) with 3."""
    report, lib = _build_sm90("int4_gemv", tmp_path)
    kinds = {tuple(_template_args(k.split("\n")[0], "int4_gemv_fold")): k for k in _sass_functions(lib, "int4_gemv_fold")}
    rotating, fold = kinds[(1, slots)], kinds[(1, 0)]

    def loop_marks(k):  # the loop's weight loads (W), x loads (x) and MMAs (m), in order
        ops = _sass_ops(k)
        lo, hi = max(_loops(k), key=lambda loop: loop[1] - loop[0])
        marks = {"LDG.E.NA.128": "W", "LDG.E.128": "x"}
        return "".join(marks.get(o, "m" if o.startswith("HMMA") else "") for o in ops[lo:hi + 1]), hi - lo + 1

    ops = _sass_ops(rotating)
    wait = ops.index("ACQBULK")
    weights = [i for i, o in enumerate(ops) if o == "LDG.E.NA.128"]
    xs = [i for i, o in enumerate(ops) if o == "LDG.E.128"]
    assert len(weights) == 4 * slots and weights[2 * slots - 1] < wait < min(xs + weights[2 * slots:]), (weights, wait)
    assert sum(o == "HMMA.16816.F32.BF16" for o in ops) == 16 * slots
    marks, length = loop_marks(rotating)
    assert marks.replace("m", "") == "xxxxWW" * slots and marks.index("W") > marks.index("m"), marks
    assert loop_marks(fold)[0].replace("m", "").startswith("WWWW") and length / slots <= loop_marks(fold)[1] / 2, marks
    used = [r for e, r in zip([e for e in report.splitlines() if "Compiling entry function" in e],
                              [r for r in report.splitlines() if "Used " in r]) if f"int4_gemv_foldILi1ELi{slots}E" in e]
    assert len(used) == 1 and int(used[0].split("Used ")[1].split()[0]) <= registers, used  # (spills: above)


def test_the_launch_asks_the_library_for_the_fold_up_to_8_bf16_rows(monkeypatch):
    """int4_cuda._launch passes the entry point fold 1 (the folded kernel) for 1 … 8 rows of bf16 x and 0 past 8
    rows or for fp16 x. The fold argument reaching the library is spied on (CPU: a fake x on "CUDA", a fake
    library and output; a split plan of one split of 40 groups, as the 27B's lm_head)."""
    sent = []
    monkeypatch.setattr(int4_cuda, "library", lambda arch: lambda *a: sent.append(a[12]) or 0)
    monkeypatch.setattr(int4_cuda, "plan", lambda N, K, one_split=False, rows=1: (1, 40))
    monkeypatch.setattr(int4_cuda, "takes", lambda *a: True)
    monkeypatch.setattr(int4_cuda.cuda_build, "device_arch", lambda device, choice: "90")
    monkeypatch.setattr(int4_cuda.cuda_build, "aligned", lambda x: x)
    monkeypatch.setattr(int4_cuda.torch.cuda, "current_stream", lambda device: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(int4_cuda.torch, "empty", lambda *a, **k: types.SimpleNamespace(data_ptr=lambda: 0))
    w = types.SimpleNamespace(data_ptr=lambda: 0)

    def fold_sent(rows, dtype=torch.bfloat16):
        x = types.SimpleNamespace(is_cuda=True, shape=(rows, 5120), dtype=dtype, data_ptr=lambda: 0,
                                  device=types.SimpleNamespace(index=0))
        int4_cuda._launch(x, w, w, w, 64, False, False, False)
        return sent[-1]

    assert fold_sent(1) == fold_sent(2) == fold_sent(8) == 1
    assert fold_sent(9) == fold_sent(16) == 0 and fold_sent(1, torch.float16) == 0
    for fold in (2, 3):  # the rotating candidates: the same rows
        monkeypatch.setattr(int4_cuda, "FOLD", fold)
        assert fold_sent(1) == fold_sent(8) == fold and fold_sent(9) == fold_sent(1, torch.float16) == 0


def test_the_fold_takes_the_place_of_one_instance_only(monkeypatch):
    """int4_cuda.variant: FOLD (the default) replaces BATCH 2 unpipelined for bf16 x of up to 8 rows; anything
    else keeps its instance unfolded, and FOLD off keeps it too."""
    assert int4_cuda.variant(1) == int4_cuda.variant(8) == (2, False, 1)
    assert int4_cuda.variant(9) == (2, False, 0) and int4_cuda.variant(1, bf16=False) == (2, False, 0)
    for fold in (2, 3):
        with monkeypatch.context() as m:
            m.setattr(int4_cuda, "FOLD", fold)
            assert int4_cuda.variant(1) == (2, False, fold) and int4_cuda.variant(9) == (2, False, 0)
    for name, value in (("BATCH", 4), ("PIPELINED", True), ("FOLD", 0)):
        with monkeypatch.context() as m:
            m.setattr(int4_cuda, name, value)
            assert not int4_cuda.variant(1)[2], name


def test_optimize_routes_quantized_linears_to_the_chosen_kernels(monkeypatch):
    """kernels={"int4": …, "fp8_weight": …} reach every QuantLinear call of the engine's steps as the schemes
    that take the CUDA kernels (eager, CPU: the choice is passed down; QuantLinear.partials takes a CUDA kernel
    only for CUDA rows it can take)."""
    import fastqwen
    from conftest import fresh
    from fastqwen.quant.linear import QuantLinear, quantize_modules

    seen = []
    forward, partials = QuantLinear.forward, QuantLinear.partials
    monkeypatch.setattr(QuantLinear, "forward", lambda self, x, pdl=False, fixup=False, cuda=():
                        seen.append(cuda) or forward(self, x, pdl, fixup, cuda))
    monkeypatch.setattr(QuantLinear, "partials", lambda self, x, pdl=False, fixup=False, in_dims=1, cuda=():
                        seen.append(cuda) or partials(self, x, pdl, fixup, in_dims, cuda))
    for scheme, kernels, want in (("int4", {"int4": "cuda"}, ("int4",)), ("int4", {}, ()),
                                  ("fp8-weight", {"fp8_weight": "cuda"}, ("fp8-weight",)),
                                  ("fp8-weight", {"int4": "cuda", "fp8_weight": "cuda"}, ("int4", "fp8-weight"))):
        m = fastqwen.optimize(fresh("tiny"), max_seq_len=64, compile=False, quant=scheme, kernels=kernels)
        n = len(seen)
        m.generate(torch.randint(1, 500, (1, 5)), max_new_tokens=3, do_sample=False)
        assert len(seen) > n and set(seen[n:]) == {want}, (scheme, kernels)
    calls = []  # (pdl and the one-split fixup reach the op: its CPU reference stands in for the kernel)
    monkeypatch.setattr(int4_cuda, "int4_gemv", lambda *args: calls.append(args[-2:]) or int4_cuda.reference(
        *args[:5], 1))
    monkeypatch.setattr(fp8_cuda, "fp8_gemv", lambda *args: calls.append(args[-2:]) or fp8_cuda.reference(
        *args[:3], 1))
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    for scheme in ("int4", "fp8-weight"):
        layer = quantize_modules(torch.nn.Sequential(torch.nn.Linear(256, 64)), scheme)[0]
        for pdl, fixup in ((False, False), (True, True)):
            assert layer._cuda_partials(x, layer.scale, pdl, fixup).shape == (1, 1, layer.out_features)
    assert calls == [(False, False), (True, True)] * 2


@NVCC
def test_built_libraries_refuse_arguments_out_of_range_before_touching_the_gpu(tmp_path, monkeypatch):
    """cuda_build.build compiles and caches each library; its entry point answers cudaErrorInvalidValue (1) for
    shapes, row counts, split plans and instances it does not have, before any CUDA call, and a valid call on a
    machine without a GPU gets a CUDA error code back, not a crash."""
    monkeypatch.setenv("FASTQWEN_CACHE", str(tmp_path))
    cuda_build.build.cache_clear()
    try:
        int4, fp8 = int4_cuda.library("90"), fp8_cuda.library("90")  # (the typed entry points)
        assert sorted(p.name.split("-")[0] for p in (tmp_path / "cuda").glob("*.so")) == ["fp8_gemv", "int4_gemv"]
        def call4(M=1, N=64, K=512, splits=2, per=2, batch=4, pipe=0, fold=0, loads_only=0, bf16=1, pair=0):
            return int4(0, 0, 0, 0, 0, M, N, K, splits, per, batch, pipe, fold, loads_only, bf16, pair, 0, 0, None)

        for bad in ({"N": 40}, {"K": 500}, {"M": 0}, {"M": 17}, {"splits": 3}, {"per": 1}, {"batch": 3},
                    {"batch": 4, "pipe": 1}, {"M": 9, "batch": 8}, {"M": 9, "batch": 2, "pipe": 1},
                    {"loads_only": 1, "batch": 4}, {"loads_only": 1, "M": 9, "batch": 2},
                    {"loads_only": 1, "batch": 2, "pipe": 1}, {"fold": 1, "batch": 4}, {"fold": 1, "batch": 2, "bf16": 0},
                    {"fold": 1, "batch": 2, "M": 9}, {"fold": 1, "batch": 2, "pipe": 1},
                    {"fold": 1, "batch": 2, "loads_only": 1}, {"fold": 4, "batch": 2}, {"fold": -1, "batch": 2},
                    {"fold": 2, "batch": 2, "bf16": 0}, {"fold": 2, "batch": 2, "M": 9}, {"fold": 2, "batch": 4},
                    {"fold": 3, "batch": 2, "bf16": 0}, {"fold": 3, "batch": 2, "M": 9}, {"fold": 3, "batch": 4},
                    {"fold": 3, "batch": 2, "loads_only": 1},
                    {"M": 8, "batch": 2, "pair": 1}, {"M": 16, "batch": 4, "pair": 1},
                    {"M": 16, "batch": 2, "pair": 1, "N": 48}, {"M": 16, "batch": 2, "pair": 1, "loads_only": 1}):
            assert call4(**bad) == 1, bad
        call8 = lambda M=1, N=64, K=512, splits=2, per=4, batch=4: fp8(  # noqa: E731
            0, 0, 0, 0, M, N, K, splits, per, batch, 1, 0, 0, None)
        for bad in ({"N": 40}, {"K": 500}, {"M": 0}, {"M": 17}, {"splits": 3}, {"per": 3}, {"batch": 3},
                    {"M": 9, "batch": 8}):
            assert call8(**bad) == 1, bad
        if not torch.cuda.is_available():
            for ok in (call4(), call4(M=16), call4(M=16, batch=2, pair=1),
                       call4(batch=2, pipe=1),
                       call4(loads_only=1, batch=2, bf16=0), call4(fold=1, batch=2, M=8), call4(fold=2, batch=2), call4(fold=3, batch=2, M=8),
                       call8(), call8(M=12, batch=2)):
                assert ok not in (0, 1)  # (no GPU: the runtime's error, e.g. 35)
    finally:
        cuda_build.build.cache_clear()
