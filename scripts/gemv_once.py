"""A few launches of the weight-streaming kernel on one layer, for a profiler to read one of them.

    ncu --clock-control none --kernel-name regex:"_row_kernel|_gemv_kernel" --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        python scripts/gemv_once.py --format int4 --shape 34816 5120 --m 1

(`bash scripts/gpu_check.sh ncu` runs that.) Builds a random weight of the shape in the format's stored layout
(ops/gemv.stored_operands; --row-major: int4's scale and zero row-major instead of group-major) and launches the
kernel --launches times, one at a time, with the config the library would use or --config. Prints the config
and the launch count. Not a benchmark (scripts/bench_quant.py times the kernels): this only gives Nsight Compute
one launch whose counters say what bounds it (stall reasons, sectors per request, L2 and DRAM throughput).
"""

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from fastqwen.ops import gemv  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", default="int4", choices=["int4", "fp8-weight", "fp8", "bf16"])
    p.add_argument("--shape", type=int, nargs=2, default=[34816, 5120], metavar=("N", "K"))
    p.add_argument("--m", type=int, default=1, help="rows of x")
    p.add_argument("--config", type=int, nargs="+", help="a launch config (gemv_config's tuple); default: the "
                   "library's for this GPU and shape")
    p.add_argument("--row-major", action="store_true", help="int4's scale and zero row-major")
    p.add_argument("--launches", type=int, default=5)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gemv_once.py launches the CUDA kernel: it needs a GPU")
    fmt = {"int4": gemv.INT4, "fp8-weight": gemv.FP8_ROW, "fp8": gemv.FP8_BLOCK, "bf16": gemv.BF16}[args.format]
    N, K = args.shape
    w, s, z = gemv.stored_operands(fmt, torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02)
    if args.row_major and fmt == gemv.INT4:
        s, z = s.contiguous(), z.contiguous()
    x = torch.randn(args.m, K, device="cuda", dtype=torch.bfloat16)
    config = tuple(args.config) if args.config else gemv.gemv_config(fmt, N, K, args.m)
    for _ in range(args.launches):
        gemv._launch(x, fmt, w, s, z, fmt == gemv.FP8_BLOCK, N, args.m, config=config, partials=True)
    torch.cuda.synchronize()
    print(f"{args.format} {N}x{K} M={args.m} config {gemv.full_config(config)}: {args.launches} launches")


if __name__ == "__main__":
    main()
