"""Kernel times of the weight-streaming kernel at the launch configs this tree would use, per layer of a shape set.

    python scripts/gemv_times.py --format int4 --shapes 27b 27b-head --tag new
    python scripts/gemv_times.py --format int4 --kernel triton cuda   # the Triton and CUDA kernels, layer by layer
    python scripts/gemv_times.py --format int4 --kernel cuda --cuda-fold 0 1 --cuda-loads-only  # instances, probe
    python scripts/gemv_times.py --format int4 --kernel cuda --pdl   # chained as in a step (PDL launches)

For A/B of a kernel or stored-format change on one GPU: run it in two checkouts (old and new) in turn, in one
device call, and compare the rows. Each time is the minimum of --repeats CUDA-graph timings cycling through cold
copies of the weight (fastqwen.bench.graph_seconds, as the sweep times), at one row (decode). Prints a Markdown
row per layer, row count and kernel: tag, layer, shape, M, config, µs, stored MB, the bytes' rate. Not a sweep
(scripts/bench_quant.py --sweep): one config.
"""

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from fastqwen import bench  # noqa: E402
from fastqwen.ops import fp8_cuda, gemv, int4_cuda  # noqa: E402
from bench_quant import SHAPES, SWEPT  # noqa: E402


def timed_at(kernel: tuple, M: int, pair: int, int4: bool) -> bool:
    """Whether the CUDA instance `kernel` (BATCH, pipelined, TARGET_BLOCKS, loads-only probe, fold, pair) is timed
    at M rows: the loads-only probe up to 8 rows (it has no pair form); past 8 rows every pair choice; up to 8 rows
    only the instance with the first --cuda-pair choice where it has a pair kernel (int4's BATCH 2 unpipelined)."""
    batch, pipelined, _, probe, _, paired = kernel
    if probe:
        return M <= 8
    return M > 8 or paired == pair * (int4 and (batch, pipelined) == (2, False))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", default="int4", choices=list(SWEPT))
    p.add_argument("--shapes", nargs="+", default=["27b", "27b-head"], choices=list(SHAPES))
    p.add_argument("--tag", default="", help="first column of each row (which tree)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", nargs="+", type=int, default=[1], help="rows of x (M), each timed")
    p.add_argument("--kernel", nargs="+", default=["triton"], choices=["triton", "cuda"],
                   help="int4 and fp8-weight: the Triton kernel (ops/gemv.py) and/or the CUDA one (ops/int4_cuda.py, "
                   "ops/fp8_cuda.py)")
    p.add_argument("--cuda-batch", nargs="+", type=int, default=[int4_cuda.BATCH], choices=[2, 4, 8],
                   help="the CUDA kernel's BATCH (groups loaded before any decode), each timed")
    p.add_argument("--cuda-pipelined", nargs="+", type=int, default=[int(int4_cuda.PIPELINED)], choices=[0, 1],
                   help="the CUDA int4 kernel with the next batch's loads in flight while one decodes (BATCH 2 only)")
    p.add_argument("--cuda-fold", nargs="+", type=int, default=[int(int4_cuda.FOLD)], choices=[0, 1, 2, 3],
                   help="the CUDA int4 kernel with the zero folded out of its decode (int4_cuda.FOLD: BATCH 2 "
                   "unpipelined, bf16 x up to 8 rows; 2 and 3: with rotating loads over 2 and 3 slots), each timed")
    p.add_argument("--cuda-pair", nargs="+", type=int, default=[int(int4_cuda.PAIR)], choices=[0, 1],
                   help="the CUDA int4 kernel's 9 … 16-row instance as the pair kernel (int4_cuda.PAIR: two strips a "
                   "block), each timed at rows over 8")
    p.add_argument("--cuda-loads-only", action="store_true",
                   help="also time the int4 register kernel's BATCH 2 instance as its loads-only probe (every "
                   "weight loaded as the kernel loads it, nothing decoded, at the kernel's blocks a multiprocessor: "
                   "the load path's own rate; up to 8 rows)")
    p.add_argument("--check", action="store_true",
                   help="also print each kernel's relative error against the plain torch reference (the sum of its "
                   "partials against x · dequantized Wᵀ in fp32)")
    p.add_argument("--cuda-blocks", nargs="+", type=int, default=[int4_cuda.TARGET_BLOCKS],
                   help="the CUDA kernel's TARGET_BLOCKS (the grid size its split plan aims at), each timed")
    p.add_argument("--pdl", action="store_true",
                   help="launch every kernel with programmatic dependent launch, as a decode step does: each of the "
                   "graph's back-to-back calls then loads its first weights while the one before it drains, so the "
                   "times show how much of a launch's fixed part (its start and drain) PDL hides")
    p.add_argument("--warm", action="store_true",
                   help="also time each config on one copy of the weight, read again and again (L2-resident where "
                   "it fits: what a GEMV would gain from a weight staged in L2 during the kernels before it)")
    p.add_argument("--spread", type=float, default=0, metavar="GB",
                   help="also time each config cycling through copies of the weight that add up to GB gigabytes "
                   "(a step's weights span ~14-27 GB on a 27B, the cold copies ~2 L2 sizes): whether touching that "
                   "much memory (page-table walks, DRAM pages) slows a GEMV, as the step's profile suggests")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gemv_times.py times the CUDA kernel: it needs a GPU")
    if "cuda" in args.kernel and args.format not in ("int4", "fp8-weight"):
        sys.exit("--kernel cuda is int4's and fp8-weight's")
    cuda_module = int4_cuda if args.format == "int4" else fp8_cuda
    fmt = getattr(gemv, SWEPT[args.format])
    for layer, N, K in (s for name in args.shapes for s in SHAPES[name]):
        torch.manual_seed(0)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        stored = gemv.stored_operands(fmt, w)
        nbytes = sum(t.numel() * t.element_size() for t in stored if t is not None)
        cold = bench.cold_copies(nbytes, "cuda")
        copies = [stored] + [tuple(None if t is None else t.clone() for t in stored)
                             for _ in range(max(cold, -(-int(args.spread * 1e9) // nbytes)) - 1)]
        int4 = cuda_module is int4_cuda
        # (BATCH, pipelined, TARGET_BLOCKS, loads-only probe, fold, pair)
        registers = list(dict.fromkeys(  # (fold and pair: BATCH 2 unpipelined's alone)
            (b, bool(p), n, False, f * (int4 and (b, p) == (2, 0)), pr * (int4 and (b, p) == (2, 0)))
            for b in args.cuda_batch for p in args.cuda_pipelined for n in args.cuda_blocks for f in args.cuda_fold
            for pr in args.cuda_pair if not p or (b == 2 and int4)))
        probes = [(2, False, n, True, False, 0) for n in args.cuda_blocks] * (args.cuda_loads_only and int4)
        cuda = registers + probes if "cuda" in args.kernel else []
        for M, kernel in ((M, k) for M in args.rows for k in ["triton"] * ("triton" in args.kernel) + cuda):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            if kernel == "triton":
                run = lambda x, q, s, z: gemv._launch(  # noqa: E731
                    x, fmt, q, s, z, False, N, x.shape[0], partials=True, pdl=args.pdl)
                config = gemv.full_config(gemv.gemv_config(fmt, N, K, M))
            else:
                if not timed_at(kernel, M, args.cuda_pair[0], int4):
                    continue
                if N % 16 or K % (128 if cuda_module is int4_cuda else 64):  # (the kernels' tiles)
                    print(f"| {args.tag} | {layer} | {N}x{K} | M={M} | cuda: shape not taken | — | — | — |")
                    continue
                batch, pipelined, cuda_module.TARGET_BLOCKS, probe, fold, pair = kernel
                cuda_module.BATCH, int4_cuda.PAIR = batch, bool(pair)
                splits = f"splits {cuda_module.plan(N, K)[0]}"
                if cuda_module is int4_cuda:
                    int4_cuda.PIPELINED, int4_cuda.FOLD = pipelined, fold
                    run = ((lambda x, q, s, z: int4_cuda.loads_only(x, q, s, z, N)) if probe else  # noqa: E731
                           (lambda x, q, s, z: int4_cuda.int4_gemv(x, q, s, z, N, args.pdl)))
                else:
                    run = lambda x, q, s, z: fp8_cuda.fp8_gemv(x, q, s, args.pdl)  # noqa: E731
                config = (f"cuda batch {batch}{' pipelined' * pipelined}{' folded' * (fold > 0 and M <= 8)}"
                          f"{f' rotating {fold} slots' * (fold > 1 and M <= 8)}"
                          f"{' pair' * (int4 and int4_cuda.paired(N, M))} {splits}"
                          f"{' LOADS ONLY' * probe}")
            if args.check and not (kernel != "triton" and kernel[3]):  # (not a loads-only probe)
                got = run(x, *stored).sum(0)
                want = x.float() @ gemv.dequantized(fmt, *stored).float().t()
                config = f"{config} (error {((got - want).norm() / want.norm()).item():.1e})"  # (Triton: a tuple)
            modes = ([("", cold)] + [(" WARM", 1)] * args.warm  # (the copies cycled through: cold, one, all)
                     + [(f" SPREAD {len(copies) * nbytes / 1e9:.1f} GB", len(copies))] * (args.spread > 0))
            for mode, n in modes:
                variants = [(x, *c) for c in copies[:n]]
                t = min(bench.graph_seconds(run, variants=variants) for _ in range(args.repeats))
                pdl = " PDL" * (args.pdl and not (kernel != "triton" and kernel[3]))  # (the probe: never PDL)
                print(f"| {args.tag} | {layer} | {N}x{K} | M={M} | {config}{pdl}{mode} | {t * 1e6:.1f} µs | "
                      f"{nbytes / 1e6:.1f} MB | {nbytes / t / 1e12:.2f} TB/s |", flush=True)
        del copies, stored, w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
