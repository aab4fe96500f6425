"""Prefetching the next weight-streaming launch's first reads into L2 (kernels={"prefetch": "l2"}), pair by pair:
two linears of a real shape with a gap between them (a spin kernel standing in for the norms, conv, recurrence
and attention between two linears of a step), timed as one CUDA graph over cold copies of both weights (no launch
finds its weight in L2 from an earlier one), without and with the first launch's tail prefetching the second's
first reads (ops/gemv.py prefetch_region, _prefetch_next), per budget and prefetch mode (1: a line a lane,
2: the bulk prefetch). Both launches as a decode step runs them: one row, programmatic dependent launch.

    python scripts/bench_prefetch.py --formats fp8-weight int4 --gaps 0 2 8 --budgets 8 16 32

µs per pair (first launch + gap + second launch); "gap" is the spin kernel's own time; "saved" is the best
variant's gain over "off", "bound" what the gap alone could hide: the bytes prefetched, or as many as the
copy bandwidth moves during the gap, whichever is fewer, at that bandwidth.
"""

import argparse
import datetime
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from fastqwen import bench  # noqa: E402
from fastqwen.ops.gemv import BF16, FORMATS, _launch, prefetch_region, stored_operands  # noqa: E402

# (first [N, K], second [N, K]) on the 27B: GDN in_proj then out_proj (the recurrence between), MLP gate | up then
# down (the activation between), out_proj then gate | up (the residual add and norm between)
PAIRS = {"gdn-in>out": ((16480, 5120), (5120, 6144)), "mlp-up>down": ((34816, 5120), (5120, 17408)),
         "out>mlp-up": ((5120, 6144), (34816, 5120))}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", nargs="+", default=["fp8-weight", "int4"], choices=[*FORMATS, "bf16"])
    p.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    p.add_argument("--gaps", type=float, nargs="+", default=[0, 2, 8], help="µs of the spin kernel between")
    p.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32], help="MiB prefetched at most")
    p.add_argument("--modes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--json", type=pathlib.Path)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_prefetch needs CUDA")
    bw = bench.copy_bandwidth("cuda")
    khz = torch.cuda.get_device_properties(0).clock_rate
    variants = [(m, b) for m in args.modes for b in args.budgets]
    head = " | ".join(f"m{m} {b} MiB" for m, b in variants)
    print(f"| format | pair | gap µs | off | {head} | saved | bound |\n|{'---|' * (6 + len(variants))}")
    rows = []
    for name in args.formats:
        fmt = BF16 if name == "bf16" else FORMATS[name]
        for pair in args.pairs:
            (na, ka), (nb, kb) = PAIRS[pair]
            ops = []
            for n, k in ((na, ka), (nb, kb)):
                w = torch.randn(n, k, device="cuda") * 0.02
                ops.append(stored_operands(fmt, w.bfloat16() if fmt == BF16 else w))
            nbytes = sum(t.numel() * t.element_size() for op in ops for t in op if t is not None)
            copies = [tuple(t if t is None else t.clone() for op in ops for t in op)
                      for _ in range(bench.cold_copies(nbytes, "cuda"))]
            xa = torch.randn(args.rows, ka, device="cuda", dtype=torch.bfloat16)
            xb = torch.randn(args.rows, kb, device="cuda", dtype=torch.bfloat16)
            for gap in args.gaps:
                cycles = int(gap * khz / 1e3)

                def run(qa, sa, za, qb, sb, zb, region=None, mode=None):
                    nxt = (qb, region) if region else None
                    _launch(xa, fmt, qa, sa, za, False, na, args.rows, partials=True, pdl=True, prefetch=nxt,
                            prefetch_mode=mode)
                    if cycles:
                        torch.cuda._sleep(cycles)
                    _launch(xb, fmt, qb, sb, zb, False, nb, args.rows, partials=True, pdl=True)

                gap_us = bench.graph_seconds(torch.cuda._sleep, cycles) * 1e6 if cycles else 0.0
                off = bench.graph_seconds(run, variants=copies) * 1e6
                times, regions = {}, {}
                for mode, budget in variants:
                    region = prefetch_region(fmt, ops[1][0], nb, kb, args.rows, budget << 20)
                    regions[budget] = region
                    times[f"m{mode}-{budget}"] = bench.graph_seconds(
                        run, variants=[(*c, region, mode) for c in copies]) * 1e6
                best = min(times.values())
                fetched = max(r[0] * r[2] * r[4] for r in regions.values() if r)
                bound = min(fetched, gap_us * 1e-6 * bw) / bw * 1e6
                cells = " | ".join(f"{t:.1f}" for t in times.values())
                print(f"| {name} | {pair} | {gap_us:.1f} | {off:.1f} | {cells} | {off - best:.1f} | {bound:.1f} |",
                      flush=True)
                rows.append({"format": name, "pair": pair, "gap_us": gap_us, "off_us": off, "us": times,
                             "regions": regions, "bound_us": bound, "rows": args.rows})
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                         "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                                         "copy_bandwidth_Bps": bw, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
