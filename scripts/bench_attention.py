"""Decode attention over the static KV cache: SDPA with a mask (attend_cache, the default) against the split-KV
kernel that reads only the keys in use (attend_cache_split), on the 27B attention shape.

    python scripts/bench_attention.py --json docs/bench-attention.json

For each max_seq_len S, used length L, batch B and query count T (1: decode, 16: verify): µs per call (CUDA
graph of back-to-back calls) and the share of the copy bandwidth the KV bytes in use (B · 2 · Hkv · L · D · 2)
would allow. SDPA reads all S positions whatever L is; the kernel reads L. Without CUDA: a smoke run on small
shapes with the same code paths (wall clock).
"""

import argparse
import itertools
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from fastqwen import bench  # noqa: E402
from fastqwen.ops.attention import attend_cache  # noqa: E402
from fastqwen.ops.decode_attention import attend_cache_split_op  # noqa: E402


def main():
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-seq-len", type=int, nargs="+", default=[4096, 32768, 131072] if cuda else [512])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--queries", type=int, nargs="+", default=[1, 16])
    p.add_argument("--json", type=pathlib.Path)
    args = p.parse_args()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    Hq, Hkv, D = (24, 4, 256) if cuda else (6, 2, 64)  # 27B full-attention layers
    bw = bench.copy_bandwidth(dev)
    rows = []
    print("| S | L | B | T | SDPA µs | split-KV µs | split-KV % of BW |\n|---|---|---|---|---|---|---|")
    for S, B, T in itertools.product(args.max_seq_len, args.batch, args.queries):
        k = torch.randn(B, Hkv, S, D, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        for L in sorted({512, S - T}):
            q = torch.randn(B, Hq, T, D, device=dev, dtype=dtype)
            pos = (L - T + torch.arange(T, device=dev)).expand(B, T).contiguous()
            row = {"S": S, "L": L, "B": B, "T": T, "kv_bytes": B * 2 * Hkv * L * D * k.element_size()}
            for name, fn in (("sdpa", attend_cache), ("split", attend_cache_split_op)):
                try:
                    row[f"{name}_us"] = bench.graph_seconds(fn, q, k, v, pos, D ** -0.5) * 1e6
                except Exception as e:  # e.g. out of memory at 128K x 8
                    row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(row)
            cell = lambda n: f"{row[n + '_us']:.1f}" if n + "_us" in row else "error"  # noqa: E731
            share = f"{row['kv_bytes'] / bw / (row['split_us'] / 1e6):.0%}" if "split_us" in row else "—"
            print(f"| {S} | {L} | {B} | {T} | {cell('sdpa')} | {cell('split')} | {share} |", flush=True)
        del k, v
        if args.json:
            args.json.write_text(json.dumps({"hardware": torch.cuda.get_device_name() if cuda else "cpu",
                                             "copy_bandwidth_Bps": bw, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
