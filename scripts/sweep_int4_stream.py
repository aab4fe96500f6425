"""Candidate sweep (session 2026-12-04): ops/int4_stream.py against the table configs on the 27B shapes. Removed with the module."""
import json, os, sys, time, itertools
import torch
sys.path.insert(0, "scripts")
from fastqwen import bench
from fastqwen.ops import gemv, int4_stream as S
from bench_quant import SHAPES
OUT = os.environ.get("OUT", "/tmp")
bw = bench.copy_bandwidth("cuda")
print(f"copy bandwidth {bw/1e12:.2f} TB/s", flush=True)
which = sys.argv[1].split("|")
shapes = [s for name in ("27b", "27b-head") for s in SHAPES[name] if s[0] in which]
res = []
t_start = time.time()
for layer, N, K in shapes:
    torch.manual_seed(0)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    st = gemv.stored_operands(gemv.INT4, w)
    nbytes = sum(t.numel() * t.element_size() for t in st)
    copies = [st] + [tuple(t.clone() for t in st) for _ in range(bench.cold_copies(nbytes, "cuda") - 1)]
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    ref = gemv.reference(x, gemv.INT4, *st, False, N)
    base = lambda x, q, s, z: gemv._launch(x, gemv.INT4, q, s, z, False, N, 1, partials=True)
    tb = min(bench.graph_seconds(base, variants=[(x, *c) for c in copies]) for _ in range(3))
    row = {"layer": layer, "N": N, "K": K, "MB": nbytes / 1e6, "base_us": tb * 1e6,
           "base_cfg": str(gemv.full_config(gemv.gemv_config(gemv.INT4, N, K, 1))), "tma": {}}
    print(f"{layer} {N}x{K} base {tb*1e6:.1f} us {nbytes/tb/bw*100:.0f}%", flush=True)
    G = K // 128
    t_start = time.time()
    best = None
    for bn, warps, stages, per_sm in itertools.product((64, 128, 256), (4, 8), (3, 4, 6), (1, 2, 3)):
        if (warps == 8) != (bn == 256) or per_sm * stages * bn * 68 > 200_000:
            continue
        tiles = -(-N // bn)
        for split in (1, 2, 4, 8):
            if G % split or tiles * split < 132 or (split > 1 and tiles * split > 1100):
                continue
            cfg = (bn, split, warps, stages, per_sm)
            try:
                y = S.int4_stream(x, *st, N, cfg).sum((0, 1))
                err = ((y - ref[0]).norm() / ref.norm()).item()
                f = lambda x, q, s, z, sz: S.int4_stream(x, q, s, z, N, cfg, sz=sz)
                t = min(bench.graph_seconds(f, variants=[(x, *c, S.pack_scale_zero(*c[1:])) for c in copies]) for _ in range(2))
            except Exception as e:
                print("  ", cfg, "ERR", repr(e)[:300], flush=True)
                continue
            row["tma"][str(cfg)] = [t * 1e6, err]
            if best is None or t < best[0]:
                best = (t, cfg)
            print(f"   {cfg} {t*1e6:.1f} us {nbytes/t/bw*100:.0f}% err {err:.1e}", flush=True)
        if time.time() - t_start > float(os.environ.get("BUDGET", 480)):
            break
    if best:
        print(f"== {layer}: base {tb*1e6:.1f} us, best tma {best[0]*1e6:.1f} us {best[1]} ({nbytes/best[0]/bw*100:.0f}%)", flush=True)
    res.append(row)
    json.dump({"bw": bw, "rows": res}, open(f"{OUT}/tma_sweep.json", "w"), indent=1)
    del copies, st, w
    torch.cuda.empty_cache()
