"""The CUDA int4 one-row kernel (fastqwen/ops/int4_cuda.py, ops/cuda/int4_gemv.cu) off the GPU: its reference
and split plan, the op's contract, a bit-level emulation of what each lane loads, decodes and hands the tensor
cores, and its build for sm_90 (registers, no spills, the loads and MMAs it was written to issue). tests/gpu
runs the kernel itself."""

import os
import pathlib
import subprocess

import pytest
import torch

from fastqwen.model import check_kernels
from fastqwen.ops import int4_cuda
from fastqwen.ops.gemv import INT4, STEP, reference, stored_operands


def test_plan_covers_every_group_once_in_nonempty_splits():
    for N, K in ((34816, 5120), (5120, 17408), (5120, 6144), (248320, 5120), (16, 128), (48, 1024), (64, 512)):
        splits, per = int4_cuda.plan(N, K)
        groups = K // STEP
        assert 1 <= splits <= int4_cuda.MAX_SPLITS and (splits - 1) * per < groups <= splits * per, (N, K)
        assert splits == 1 or per >= 4, (N, K)  # a group for each of the block's 4 warps
    assert int4_cuda.plan(34816, 5120) == (1, 40) and int4_cuda.plan(5120, 17408) == (7, 20)
    assert int4_cuda.plan(5120, 17408, one_split=True) == (1, 136)


@pytest.mark.parametrize("N,K,M", [(64, 512, 1), (48, 1024, 3), (32, 128, 8), (16, 2048, 1)])
def test_reference_partials_sum_to_the_product_split_by_group_ranges(N, K, M):
    torch.manual_seed(N + K)
    q, s, z = stored_operands(INT4, torch.randn(N, K))
    x = torch.randn(M, K, dtype=torch.bfloat16)
    splits, per = int4_cuda.plan(N, K)
    parts = int4_cuda.int4_gemv(x, q, s, z, N)
    assert parts.shape == (splits, M, N) and parts.dtype == torch.float32
    full = reference(x.float(), INT4, q, s, z, False, N)
    assert torch.allclose(parts.sum(0), full, rtol=1e-5, atol=1e-4)
    cols = per * STEP
    for i in range(splits):  # split i: the groups [i · per, (i + 1) · per) alone
        xi = torch.zeros_like(x)
        xi[:, i * cols:(i + 1) * cols] = x[:, i * cols:(i + 1) * cols]
        assert torch.allclose(parts[i], reference(xi.float(), INT4, q, s, z, False, N), rtol=1e-5, atol=1e-4)


def test_op_passes_opcheck_and_takes_only_its_layout():
    q, s, z = stored_operands(INT4, torch.randn(48, 1024))
    x = torch.randn(1, 1024, dtype=torch.bfloat16)
    for one_split in (False, True):
        torch.library.opcheck(int4_cuda.int4_gemv, (x, q, s, z, 48, False, one_split),
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    assert int4_cuda.int4_gemv(x, q, s, z, 48).shape[0] == 2 and int4_cuda.int4_gemv(x, q, s, z, 48, False,
                                                                                      True).shape[0] == 1
    assert int4_cuda.takes(x, q, s, z) and int4_cuda.takes(x.half(), q, s, z) and int4_cuda.takes(
        x.expand(16, -1), q, s, z)
    untiled, _, _ = stored_operands(INT4, torch.randn(48, 1024), tiled=False)
    for args in ((x.expand(17, -1), q, s, z), (x[0], q, s, z), (x.float(), q, s, z), (x, untiled, s, z),
                 (x, q, s.contiguous(), z), (x, q, s, z.contiguous()), (x[:, :512], q, s, z)):
        assert not int4_cuda.takes(*args)


def test_kernel_choice_is_checked_and_a_missing_compiler_names_the_fix(monkeypatch):
    from fastqwen import presets

    cfg = presets.config("tiny")
    assert check_kernels({"int4": "cuda"}, cfg, "cpu")["int4"] == "cuda"
    assert check_kernels(None, cfg, "cpu")["int4"] == "triton"
    with pytest.raises(ValueError, match="choose from triton, cuda"):
        check_kernels({"int4": "cutlass"}, cfg, "cpu")
    monkeypatch.setattr(int4_cuda, "nvcc", lambda: None)
    int4_cuda.build.cache_clear()
    with pytest.raises(RuntimeError, match="install the CUDA toolkit or keep kernels\\['int4'\\]='triton'"):
        int4_cuda.build("90")
    int4_cuda.build.cache_clear()


def _u32(words: torch.Tensor) -> list[int]:
    return [int(v) & 0xFFFFFFFF for v in words.tolist()]


def _halves_to_float(bits: int, bf16: bool) -> tuple[float, float]:
    """The two 16-bit floats of a 32-bit register (low half first)."""
    pair = torch.tensor([bits & 0xFFFF, bits >> 16], dtype=torch.int32).to(torch.int16)
    return tuple(pair.view(torch.bfloat16 if bf16 else torch.float16).float().tolist())


def emulate(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, N: int) -> torch.Tensor:
    """cuda/int4_gemv.cu's arithmetic replayed lane by lane from the raw bits it loads: each lane's two 16-byte
    weight loads (uint4 lane and lane + 32 of a tile), the LOP3 / FMA decode of nibble pairs (j, j + 4) into
    16-bit (q − zero) pairs, x's byte permutes, the A / B fragments of mma.m16n8k16 as the PTX ISA lays them
    out (a0 a1: row lane/4, k 2 (lane%4) + 0, 1; a2 a3: row + 8; a4…a7: k + 8; b0 b1: k 2 (lane%4) + 0, 1 of
    column lane/4, b2 b3: k + 8; lane l's B holds x row l/4, zero past M) multiplied as matrices, c0 … c3
    (strip rows l/4 and l/4 + 8 against x rows 2 (l%4) and 2 (l%4) + 1) scaled and summed over the split's
    groups by the block's warps. Returns [splits, M, N] fp32."""
    bf16 = x.dtype == torch.bfloat16
    magic, neg_magic = (0x43004300, 0xC300) if bf16 else (0x64006400, 0xE400)
    (M, K), G = x.shape, x.shape[1] // STEP
    NB = 1 if M <= 8 else 2  # blocks of 8 B columns: x rows 8 nb … 8 nb + 7
    splits, per = int4_cuda.plan(N, K)
    xw = _u32(x.contiguous().view(torch.int32).view(-1))  # x as 32-bit words, two values each, row after row
    tiles = w.reshape(N // 16, G, 64, 16)  # 16-byte loads of each tile, in order
    out = torch.zeros(splits, M, N)

    def pair(u, j, negz):  # (lop3 then fma by 1 with −(magic + zero)): exact integers
        t = ((u >> (4 * j)) & 0x000F000F) | magic
        lo, hi = _halves_to_float(t, bf16)
        nlo, nhi = _halves_to_float(negz, bf16)
        return lo + nlo, hi + nhi

    lo_pair = lambda p, q: (p & 0xFFFF) | ((q & 0xFFFF) << 16)  # noqa: E731  (byte_perm 0x5410)
    hi_pair = lambda p, q: (p >> 16) | (q & 0xFFFF0000)  # noqa: E731  (byte_perm 0x7632)
    for strip in range(N // 16):
        for split in range(splits):
            sums = torch.zeros(4, 32, NB, 4)
            for warp in range(4):
                for g in range(split * per + warp, min(G, (split + 1) * per), 4):
                    C = torch.zeros(NB, 16, 8, dtype=torch.float64)
                    lanes = []
                    for lane in range(32):
                        a = _u32(tiles[strip, g, lane].view(torch.int32))
                        b = _u32(tiles[strip, g, lane + 32].view(torch.int32))
                        row_a = strip * 16 + lane // 4
                        za = (neg_magic | int(zero[row_a, g])) * 0x00010001
                        zb = (neg_magic | int(zero[row_a + 8, g])) * 0x00010001
                        xs = []
                        for nb in range(NB):  # x row 8 nb + lane/4 at the lane's 32 columns
                            xrow = nb * 8 + lane // 4
                            word = xrow * K // 2 + (g * 16 + (lane % 4) * 4) * 4
                            xs.append([xw[word + 4 * i:word + 4 * i + 4] if xrow < M else [0] * 4 for i in range(4)])
                        lanes.append((a, b, za, zb, xs))
                    for i in range(4):
                        for half in (0, 1):
                            A, B = torch.zeros(16, 16, dtype=torch.float64), torch.zeros(NB, 16, 8, dtype=torch.float64)
                            for lane, (a, b, za, zb, xs) in enumerate(lanes):
                                r, c = lane // 4, 2 * (lane % 4)
                                j0, j1 = 2 * half, 2 * half + 1
                                A[r, c:c + 2] = torch.tensor(pair(a[i], j0, za))
                                A[r + 8, c:c + 2] = torch.tensor(pair(b[i], j0, zb))
                                A[r, c + 8:c + 10] = torch.tensor(pair(a[i], j1, za))
                                A[r + 8, c + 8:c + 10] = torch.tensor(pair(b[i], j1, zb))
                                for nb in range(NB):
                                    v = xs[nb][i]
                                    regs = ((lo_pair(v[0], v[2]), hi_pair(v[0], v[2])) if half == 0 else
                                            (lo_pair(v[1], v[3]), hi_pair(v[1], v[3])))
                                    B[nb, c:c + 2, lane // 4] = torch.tensor(_halves_to_float(regs[0], bf16))
                                    B[nb, c + 8:c + 10, lane // 4] = torch.tensor(_halves_to_float(regs[1], bf16))
                            C += A @ B
                    for lane in range(32):  # c0 … c3 of the lane, each column block
                        r, c = lane // 4, 2 * (lane % 4)
                        sa, sb = float(scale[strip * 16 + r, g]), float(scale[strip * 16 + r + 8, g])
                        for nb, Cb in enumerate(C):
                            got = (sa * Cb[r, c], sa * Cb[r, c + 1], sb * Cb[r + 8, c], sb * Cb[r + 8, c + 1])
                            sums[warp, lane, nb] += torch.stack(got).float()
            for lane in range(32):  # the block's sum over warps: x rows m, m + 1 of strip rows r, r + 8
                r, m = lane // 4, 2 * (lane % 4)
                for nb in range(NB):
                    for value, (xrow, row) in zip(sums[:, lane, nb].sum(0), ((m, r), (m + 1, r), (m, r + 8),
                                                                           (m + 1, r + 8))):
                        if 8 * nb + xrow < M:
                            out[split, 8 * nb + xrow, strip * 16 + row] = value
    return out


@pytest.mark.parametrize("dtype,M", [(torch.bfloat16, 1), (torch.float16, 1), (torch.bfloat16, 3),
                                     (torch.float16, 8), (torch.bfloat16, 13)])
def test_emulated_lanes_give_the_reference_partials(dtype, M, monkeypatch):
    """Two strips, 6 groups in 2 splits of 3 (warps with a group and with none), zeros from 0 to 16 (GPTQ's
    range), 1, 3, 8 and 13 rows of x (13: two blocks of B columns, the second part empty)."""
    torch.manual_seed(3)
    N, K = 32, 768
    q, s, z = stored_operands(INT4, torch.randn(N, K))
    z = torch.randint(0, 17, (G := K // STEP, N), dtype=torch.uint8).t()  # (group-major, as stored)
    x = torch.randn(M, K).to(dtype)
    monkeypatch.setattr(int4_cuda, "plan", lambda N, K, one_split=False: (2, 3))
    got, want = emulate(x, q, s, z, N), int4_cuda.int4_gemv(x, q, s, z, N)
    assert G == 6 and got.shape == want.shape == (2, M, N)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4), (got - want).abs().max()


def _cuobjdump() -> str | None:
    site = os.environ.get("FASTQWEN_TRITON_SITE")
    tool = pathlib.Path(site or "/nonexistent") / "triton" / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(tool) if tool.exists() else None


@pytest.mark.skipif(int4_cuda.nvcc() is None, reason="needs the CUDA toolkit's nvcc")
def test_kernel_builds_for_sm90_without_spills_and_issues_its_loads_before_the_wait(tmp_path):
    """nvcc -Xptxas -v for sm_90: ≤ 128 registers (4 blocks of 128 threads a multiprocessor), no spills; in the
    SASS of each instance (bf16 / fp16 x, BATCH 2, 4, 8, and 2 pipelined), the first BATCH groups' 16-byte weight
    loads that skip L1, then the PDL wait, then x and the later batches; 8 tensor-core MMAs a group."""
    lib = tmp_path / "k.so"
    cmd = int4_cuda.build_command(int4_cuda.nvcc(), "90", lib)
    done = subprocess.run(cmd[:1] + ["-Xptxas", "-v"] + cmd[1:], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    regs = [int(line.split("Used ")[1].split()[0]) for line in done.stderr.splitlines() if "Used " in line]
    assert len(regs) == 12 and max(regs) <= 128, done.stderr  # (2 dtypes x BATCH 2, 4, 8, 2 pipelined; 2, 4 at NB 2)
    spills = [line.strip() for line in done.stderr.splitlines() if "spill" in line]
    assert len(spills) == 12 and all(line == "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"
                                    for line in spills), spills
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (Triton's, under $FASTQWEN_TRITON_SITE) to read the SASS")
    sass = subprocess.run([tool, "--dump-sass", str(lib)], capture_output=True, text=True).stdout
    kernels = sass.split("Function : ")[1:]
    assert len(kernels) == 12
    for k in kernels:
        _, batch, pipe, nb = k.split("int4_gemv_rows")[1].split("EE")[0].split("E")  # (…ILb1ELi2ELb1ELi1EE…)
        batch, pipe, nb = int(batch.removeprefix("Li")), pipe == "Lb1", int(nb.removeprefix("Li"))
        ops = [line.split(";")[0].split("*/")[-1].split() for line in k.splitlines() if "*/" in line and ";" in line]
        ops = [o[1] if o[0].startswith("@") else o[0] for o in ops if o]
        wait = ops.index("ACQBULK")  # griddepcontrol.wait
        weights = [i for i, o in enumerate(ops) if o.startswith("LDG.E.NA.128")]
        xs = [i for i, o in enumerate(ops) if o == "LDG.E.128"]
        copies = 3 if pipe else 2  # (the first batch's loads, then the loop's)
        assert len(weights) == 2 * batch * copies, (batch, pipe, len(weights))
        assert weights[2 * batch - 1] < wait < min(xs + weights[2 * batch:]), (batch, pipe, weights, wait, xs)
        assert sum(o.startswith("HMMA.16816.F32") for o in ops) == 8 * nb * batch * (2 if pipe else 1)


def test_optimize_routes_int4_linears_to_the_chosen_kernel(monkeypatch):
    """kernels={"int4": …} reaches every QuantLinear call of the engine's steps (eager, CPU: the choice is passed
    down; QuantLinear.partials takes the CUDA kernel only for a CUDA row it can take)."""
    import fastqwen
    from conftest import fresh
    from fastqwen.quant.linear import QuantLinear

    seen = []
    forward, partials = QuantLinear.forward, QuantLinear.partials
    monkeypatch.setattr(QuantLinear, "forward", lambda self, x, pdl=False, fixup=False, int4="triton":
                        seen.append(int4) or forward(self, x, pdl, fixup, int4))
    monkeypatch.setattr(QuantLinear, "partials", lambda self, x, pdl=False, fixup=False, in_dims=1, int4="triton":
                        seen.append(int4) or partials(self, x, pdl, fixup, in_dims, int4))
    for kernel in ("cuda", "triton"):
        m = fastqwen.optimize(fresh("tiny"), max_seq_len=64, compile=False, quant="int4", kernels={"int4": kernel})
        n = len(seen)
        m.generate(torch.randint(1, 500, (1, 5)), max_new_tokens=3, do_sample=False)
        assert len(seen) > n and set(seen[n:]) == {kernel}


@pytest.mark.skipif(int4_cuda.nvcc() is None, reason="needs the CUDA toolkit's nvcc")
def test_built_library_refuses_arguments_out_of_range_before_touching_the_gpu(tmp_path, monkeypatch):
    """build() compiles and caches the library; its entry point answers cudaErrorInvalidValue (1) for shapes,
    row counts, split plans and (batch, pipe) pairs it has no instance for, before any CUDA call, and a valid
    call on a machine without a GPU gets a CUDA error code back, not a crash."""
    monkeypatch.setenv("FASTQWEN_CACHE", str(tmp_path))
    int4_cuda.build.cache_clear()
    try:
        dll = int4_cuda.build("90")
        assert len(list((tmp_path / "cuda").glob("int4_gemv-sm90-*.so"))) == 1
        call = lambda M=1, N=64, K=512, splits=2, per=2, batch=4, pipe=0: dll.fastqwen_int4_gemv(  # noqa: E731
            0, 0, 0, 0, 0, M, N, K, splits, per, batch, pipe, 1, 0, 0, None)
        for bad in ({"N": 40}, {"K": 500}, {"M": 0}, {"M": 17}, {"splits": 3}, {"per": 1}, {"batch": 3},
                    {"batch": 4, "pipe": 1}, {"M": 9, "batch": 8}, {"M": 9, "batch": 2, "pipe": 1}):
            assert call(**bad) == 1, bad
        if not torch.cuda.is_available():
            assert call() not in (0, 1)  # (no GPU: the runtime's own error, e.g. 35, no driver)
    finally:
        int4_cuda.build.cache_clear()
