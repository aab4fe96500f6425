"""The gated delta rule of one verify block on a real model's shapes: T positions from a checkpoint state that is
read and left as it is (ops.gdn.gdn_verify), one layer, batch 1. fla's recurrent kernel against our unrolled walk
at several tiles (--tiles block_v:num_warps; the default is 8:1) and the block solve (_block: --block-tiles
block_v:num_warps:block_k:stages), each checked against the fp32 reference.

    python scripts/bench_gdn.py --models qwen3.5-27b qwen3.5-9b --T 1 8 16 --tiles 8:1 16:2 --block-tiles 16:1:16:2

µs per call, timed as a CUDA graph of back-to-back calls (bench.graph_seconds), each on its own copy of the state
(bench.cold_copies: read from memory, not L2, as in a verify); "floor" is the bytes read and
written (state, q, k, v, a, b, o) ÷ the copy bandwidth: the kernel is bound by its T serial steps, not by
bytes, so the floor says how far from free it is. Without CUDA: a smoke run on the tiny preset (the reference).
"""

import argparse
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from fastqwen import bench, presets  # noqa: E402
from fastqwen.ops import gdn  # noqa: E402


def inputs(cfg, T: int, device, dtype):
    """(qkv [1, T, C], a, b [1, T, HV], A_log, dt_bias [HV], state [1, HV, K, V]) with random values."""
    hk, dk, hv, dv = (cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_num_value_heads,
                      cfg.linear_value_head_dim)
    g = torch.Generator(device="cpu").manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(device)  # noqa: E731
    qkv = rnd(1, T, 2 * hk * dk + hv * dv).to(dtype)
    return (qkv, rnd(1, T, hv).to(dtype), rnd(1, T, hv).to(dtype), rnd(hv) * 0.5, rnd(hv), rnd(1, hv, dk, dv) * 0.1)


def main():
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["qwen3.5-27b", "qwen3.5-9b"] if cuda else ["tiny"])
    p.add_argument("--T", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--tiles", nargs="*", default=["8:1"])
    p.add_argument("--block-tiles", nargs="*", default=["16:1:32:2", "16:1:16:2", "32:2:32:2"])
    p.add_argument("--json", type=pathlib.Path)
    args = p.parse_args()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    bw = bench.copy_bandwidth(dev)
    rows = []
    print("| model | T | kernel | µs | floor µs | max abs err |\n|---|---|---|---|---|---|")
    for name in args.models:
        cfg = presets.config(name)
        hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        for T in args.T:
            qkv, a, b, A_log, dt_bias, state = inputs(cfg, T, dev, dtype)
            q, k, v = gdn.unpack_qkv(qkv, hk, dk, a.shape[-1])
            want = gdn.gdn_reference(q, k, v, a, b, A_log, dt_bias, state.clone()).float()
            nbytes = state.numel() * 4 + (qkv.numel() + 2 * a.numel() + v.numel()) * qkv.element_size()
            floor_us = nbytes / bw * 1e6
            # every call reads its own copy of the state from memory, as a verify does (one layer's state,
            # ~3 MB, would otherwise stay in L2 between back-to-back calls)
            states = [(state.clone(),) for _ in range(bench.cold_copies(state.numel() * 4, dev))]
            runs = {"reference": lambda s: gdn.gdn_reference(q, k, v, a, b, A_log, dt_bias, s.clone())}
            if cuda:
                runs = {"fla": lambda s: gdn._fla_recurrent(q, k, v, a, b, s, None, True, A_log, dt_bias)}
                for tile in args.tiles:
                    bv, warps = map(int, tile.split(":"))
                    runs[f"unrolled {tile}"] = (lambda s, bv=bv, warps=warps: gdn._unrolled(
                        q, k, v, a, b, s, None, True, A_log, dt_bias, block_v=bv, warps=warps))
                for tile in args.block_tiles if T > 1 else ():
                    bv, warps, bk, stages = map(int, tile.split(":"))
                    runs[f"block {tile}"] = (lambda s, bv=bv, warps=warps, bk=bk, stages=stages: gdn._block(
                        q, k, v, a, b, s, A_log, dt_bias, block_v=bv, warps=warps, block_k=bk, stages=stages))
            for kernel, fn in runs.items():
                err = (fn(state).float() - want).abs().max().item()
                us = bench.graph_seconds(fn, variants=states) * 1e6
                rows.append({"model": name, "T": T, "kernel": kernel, "us": us, "floor_us": floor_us, "max_abs_err": err})
                print(f"| {name} | {T} | {kernel} | {us:.1f} | {floor_us:.1f} | {err:.1e} |")
    if args.json:
        hardware = torch.cuda.get_device_name() if cuda else "cpu"
        args.json.write_text(json.dumps({"hardware": hardware, "copy_bandwidth_Bps": bw, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
