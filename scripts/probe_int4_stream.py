"""Candidate probe (session 2026-12-04): ops/int4_stream.py with and without its decode math (MATH 0: loads only). Removed with the module."""
import os, sys, torch
from fastqwen import bench
from fastqwen.ops import gemv, int4_stream as S
bw = bench.copy_bandwidth("cuda")
for N, K in ((34816, 5120), (5120, 17408)):
    torch.manual_seed(0)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    st = gemv.stored_operands(gemv.INT4, w)
    nbytes = sum(t.numel() * t.element_size() for t in st)
    copies = [st] + [tuple(t.clone() for t in st) for _ in range(bench.cold_copies(nbytes, "cuda") - 1)]
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    base = lambda x, q, s, z: gemv._launch(x, gemv.INT4, q, s, z, False, N, 1, partials=True)
    tb = min(bench.graph_seconds(base, variants=[(x, *c) for c in copies]) for _ in range(3))
    print(f"{N}x{K} base {tb*1e6:.1f} us {nbytes/tb/bw*100:.0f}%", flush=True)
    var = [(x, *c, S.pack_scale_zero(*c[1:])) for c in copies]
    for cfg in [(128, 4, 4, 3, 1), (128, 4, 4, 3, 3), (128, 4, 4, 3, 100), (128, 8, 4, 4, 100), (256, 4, 8, 3, 1), (256, 4, 8, 3, 2), (256, 4, 8, 3, 100),
                (256, 2, 4, 4, 100), (256, 4, 4, 3, 100), (64, 2, 4, 4, 100), (64, 8, 4, 4, 100), (512, 4, 16, 3, 1), (512, 2, 16, 3, 100)]:
        if (K // 128) % cfg[1]: continue
        r = []
        for math in (1, 0):
            f = lambda x, q, s, z, sz: S.int4_stream(x, q, s, z, N, cfg, sz=sz, math=math)
            t = min(bench.graph_seconds(f, variants=var) for _ in range(2))
            r.append(f"{t*1e6:.1f} us {nbytes/t/bw*100:.0f}%")
        print(cfg, " | ".join(r), flush=True)
