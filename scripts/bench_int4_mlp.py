"""The persistent int4 MLP kernel (fastqwen/ops/int4_mlp.py, a candidate) against the three launches it replaces,
at one row, in one process.

    python scripts/bench_int4_mlp.py                        # the 27B's MLP (K 5120, I 17408, N 5120)
    python scripts/bench_int4_mlp.py --shape 9b --chunks 4 8 16 --cap 0 528

Systems, each timed as a CUDA graph of back-to-back calls cycling through cold copies of the weights
(fastqwen.bench.graph_seconds): `three` is today's step (the CUDA int4 GEMV on gate | up, inductor's kernel for
the partials' sum and silu·mul, the GEMV on down); `probe` the two GEMVs' loads-only probes (their load path's
floor, nothing decoded); `persistent` the candidate at each --chunks (of down's K: 1, 2, 4, 8 for the 27B's 136
groups) and --cap (its blocks: 0 all resident). All launch with PDL as in a step (--pdl 0: serial). Prints µs per MLP, the bytes' rate, the copy bandwidth's roofline and each
system's error against the plain torch reference. The bar (docs/DESIGN-NOTES.md): the 27B's MLP within ~50 µs on
an H100, against ~60 µs for the three launches and the norm before them.
"""

import argparse
import json
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from fastqwen import bench  # noqa: E402
from fastqwen.ops import int4_cuda, int4_mlp  # noqa: E402
from fastqwen.ops.gemv import add_splits  # noqa: E402
from fastqwen.ops.int4_mlp import weights  # noqa: E402
from fastqwen.quant.linear import QuantLinear  # noqa: E402

SHAPES = {"27b": (5120, 17408, 5120), "9b": (4096, 12288, 4096)}  # (K, I, N)


def three_launches(x, gq, gs, gz, dq, ds, dz, pdl: bool):
    """Today's decode MLP after its norm on the int4 weights' tensors (gate | up's, down's): the gate | up GEMV,
    silu·mul, the down GEMV's partials."""
    I = dq.shape[1] * 128
    gu = add_splits(int4_cuda.int4_gemv(x, gq, gs, gz, 2 * I, pdl)).to(x.dtype)
    h = (F.silu(gu[:, :I].float()) * gu[:, I:].float()).to(x.dtype)
    return int4_cuda.int4_gemv(h, dq, ds, dz, ds.shape[0], pdl)


def probes(x, gate_up, down):
    """The two GEMVs' loads-only probes (x stands in for h: the probe decodes nothing)."""
    I = down.in_features
    int4_cuda.loads_only(x, gate_up.qweight, gate_up.scale, gate_up.zero, 2 * I)
    return int4_cuda.loads_only(x.new_zeros(1, I), down.qweight, down.scale, down.zero, down.out_features)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="27b", choices=list(SHAPES))
    p.add_argument("--chunks", nargs="+", type=int, default=[4, 8])
    p.add_argument("--cap", nargs="+", type=int, default=[0], help="the persistent kernel's most blocks (0: all)")
    p.add_argument("--pdl", type=int, default=1, choices=[0, 1], help="launches with PDL (as in a step)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=pathlib.Path)
    args = p.parse_args()
    K, I, N = SHAPES[args.shape]
    torch.manual_seed(0)
    dev = torch.device("cuda")
    with dev:
        base = (torch.nn.Linear(K, 2 * I, bias=False, dtype=torch.bfloat16),
                torch.nn.Linear(I, N, bias=False, dtype=torch.bfloat16))
    one = tuple(QuantLinear.from_linear(lin, "int4") for lin in base)
    nbytes = sum(t.numel() * t.element_size() for q in one for t in weights(q))
    copies = bench.cold_copies(nbytes, dev)
    mlps = [one] + [tuple(QuantLinear.from_linear(lin, "int4") for lin in base) for _ in range(copies - 1)]
    del base
    x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
    want = int4_mlp.reference(x, *(t for q in one for t in weights(q)), 1)[0]
    bw = bench.copy_bandwidth(dev)
    compiled = torch.compile(three_launches, fullgraph=True)
    # (the compiled function takes tensors: guarded on their properties, one compile for every copy)
    systems = {f"three (pdl {args.pdl})": lambda g, d: compiled(x, *weights(g), *weights(d), bool(args.pdl)),
               "probe": lambda g, d: probes(x, g, d)}
    for chunks in args.chunks:
        for cap in args.cap:
            systems[f"persistent chunks {chunks} cap {cap or int4_mlp.blocks(dev)}"] = (
                lambda g, d, c=chunks, k=cap: int4_mlp.int4_mlp(x, g, d, c, k, bool(args.pdl)))
    rows = []
    for name, fn in systems.items():
        us = min(bench.graph_seconds(fn, variants=mlps) for _ in range(args.repeats)) * 1e6
        err = None if name == "probe" else bench_error(fn(*one), want)
        rows.append({"system": name, "us": us, "TB_s": nbytes / us / 1e6, "rel_err": err})
    print(f"{torch.cuda.get_device_name()}: {args.shape} MLP at one row, {nbytes / 1e6:.1f} MB of int4 weights, "
          f"{copies} cold copies; copy bandwidth {bw / 1e12:.2f} TB/s -> roofline {nbytes / bw * 1e6:.1f} µs")
    print("| system | µs | TB/s | rel. error |\n| --- | --- | --- | --- |")
    for r in rows:
        e = "" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
        print(f"| {r['system']} | {r['us']:.1f} | {r['TB_s']:.2f} | {e} |")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "shape": args.shape,
                                         "bytes": nbytes, "copy_bandwidth": bw, "rows": rows}, indent=1))


def bench_error(parts: torch.Tensor, want: torch.Tensor) -> float:
    got = parts.double().sum(0).reshape(want.shape)
    return ((got - want.double()).norm() / want.double().norm()).item()


if __name__ == "__main__":
    main()
