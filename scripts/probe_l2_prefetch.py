"""Probe (the experiment behind kernels={"prefetch": "l2"}): does an L2-resident weight make the next one-row GEMV
faster, and does a prefetch (a separate kernel, or the previous launch's tail) get it there? 27B GDN in_proj then
out_proj, fp8-weight and int4; µs per case from CUDA-graph replays. python scripts/probe_l2_prefetch.py"""
import torch
import triton
import triton.language as tl

from fastqwen import bench
from fastqwen.ops import gemv
from fastqwen.ops.gemv import FP8_ROW, INT4, _launch, prefetch_region, stored_operands


@triton.jit
def pf_kernel(pf_ptr, pf_units, pf_ustride, pf_splits, pf_sstride, pf_run, MODE: tl.constexpr):
    gemv._prefetch_next(pf_ptr, pf_units, pf_ustride, pf_splits, pf_sstride, pf_run, MODE, 128)


@triton.jit
def touch_kernel(p, n, out, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.int32)
    for j in range(0, n, tl.num_programs(0) * BLOCK):
        acc += tl.load(p + j + i, mask=j + i < n, other=0).to(tl.int32)
    tl.store(out + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), acc)


print("copy bandwidth", bench.copy_bandwidth("cuda") / 1e12)  # (also: clocks up before the timings)
for name, fmt in (("fp8", FP8_ROW), ("int4", INT4)):
    (na, ka), (nb, kb) = (16480, 5120), (5120, 6144)
    A = stored_operands(fmt, torch.randn(na, ka, device="cuda") * 0.02)
    B = stored_operands(fmt, torch.randn(nb, kb, device="cuda") * 0.02)
    other = B[0].clone()
    xa = torch.randn(1, ka, device="cuda", dtype=torch.bfloat16)
    xb = torch.randn(1, kb, device="cuda", dtype=torch.bfloat16)
    sink = torch.empty(264 * 1024, dtype=torch.int32, device="cuda")
    bB = B[0].numel() * B[0].element_size()

    def a(pf=None, mode=None):
        _launch(xa, fmt, *A, False, na, 1, partials=True, pdl=True, prefetch=pf, prefetch_mode=mode)

    def b():
        _launch(xb, fmt, *B, False, nb, 1, partials=True, pdl=True)

    def touch(t, nbytes):
        touch_kernel[(264,)](t.view(torch.uint8), nbytes, sink, BLOCK=1024)

    def pf(t, region, mode):
        pf_kernel[(528,)](t.view(torch.uint8), *region, MODE=mode)

    sleep = 20000
    whole = prefetch_region(fmt, B[0], nb, kb, 1, 64 << 20)
    part = prefetch_region(fmt, B[0], nb, kb, 1, 8 << 20)
    cases = {
        "A B": lambda: (a(), b()),
        "A sleep B": lambda: (a(), torch.cuda._sleep(sleep), b()),
        "A touch(B) B": lambda: (a(), touch(B[0], bB), b()),
        "A touch(other) B": lambda: (a(), touch(other, bB), b()),
        "A pf1(B) sleep B": lambda: (a(), pf(B[0], whole, 1), torch.cuda._sleep(sleep), b()),
        "A pf1(other) sleep B": lambda: (a(), pf(other, whole, 1), torch.cuda._sleep(sleep), b()),
        "A pf2(B) sleep B": lambda: (a(), pf(B[0], whole, 2), torch.cuda._sleep(sleep), b()),
        "A pf2(other) sleep B": lambda: (a(), pf(other, whole, 2), torch.cuda._sleep(sleep), b()),
        "A[pf1 B] sleep B": lambda: (a((B[0], whole), 1), torch.cuda._sleep(sleep), b()),
        "A[pf1 other] sleep B": lambda: (a((other, whole), 1), torch.cuda._sleep(sleep), b()),
        "A[pf1 B 8M] sleep B": lambda: (a((B[0], part), 1), torch.cuda._sleep(sleep), b()),
        "B alone": lambda: b(),
        "B B (warm L2)": lambda: (b(), b()),
        "touch(B)": lambda: touch(B[0], bB),
        "sleep": lambda: torch.cuda._sleep(sleep),
        "pf1(B)": lambda: pf(B[0], whole, 1),
    }
    cases["A B again"] = cases["A B"]
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for label, fn in cases.items():
        for _ in range(10):  # matmuls: clocks up before each timing
            big @ big
        print(f"{name} | {label} | {bench.graph_seconds(lambda _: fn(), xa, calls=10, replays=50) * 1e6:.1f} us", flush=True)
