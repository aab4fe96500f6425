"""The speculative commit (GDN state replay + conv window over the accepted prefix of a verified block) on a
real model's cache shapes: all Gated DeltaNet layers in one launch (Forward.commit over the stacked cache)
against one launch per layer (what the commit did before the cache was stacked), the stacked commit with our
unrolled replay kernel (kernels={"gdn": "unrolled"}), and the bytes floor.

    python scripts/bench_commit.py --models qwen3.5-27b qwen3.5-9b --block 16

µs per commit, timed as a CUDA graph of back-to-back calls; "floor" is the state bytes read and written
(2 · L · B · HV · dk · dv · 4) ÷ the copy bandwidth. The two paths are also checked to leave the same states.
Without CUDA: a smoke run on the tiny preset (wall clock, the torch reference).
"""

import argparse
import json
import pathlib
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from fastqwen import bench, presets  # noqa: E402
from fastqwen.cache import HybridCache  # noqa: E402
from fastqwen.model import Forward  # noqa: E402
from fastqwen.ops.conv import commit_window  # noqa: E402
from fastqwen.ops import gdn  # noqa: E402
from fastqwen.ops.gdn import gdn_replay, unpack_qkv  # noqa: E402


def per_layer_commit(cache: HybridCache, cfg, keep: torch.Tensor) -> None:
    """The commit as one replay launch and one window update per Gated DeltaNet layer."""
    accepted = (torch.arange(cache.block, device=keep.device)[None, :] < keep[:, None]).float()[..., None]
    for i in cache.gdn_index:
        conv, state = cache.recurrent(i)
        r = cache.replay(i)
        _, k, v = unpack_qkv(r["qkv"], cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_num_value_heads)
        gdn_replay(k, v, r["g"] * accepted, r["beta"] * accepted, state)
        commit_window(conv, r["x"], keep)
    cache.lengths.add_(keep)


def main():
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["qwen3.5-27b", "qwen3.5-9b"] if cuda else ["tiny"])
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--no-per-layer", action="store_true", help="skip the one-launch-per-layer baseline")
    p.add_argument("--tiles", nargs="*", default=[], help="also time the stacked commit with these replay tiles "
                   "(block_v:num_warps each, e.g. 16:1 32:2; ops.gdn.REPLAY_TILE is the default)")
    p.add_argument("--json", type=pathlib.Path)
    args = p.parse_args()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    bw = bench.copy_bandwidth(dev)
    rows = []
    print("| model | B | layers | stacked µs | stacked, unrolled µs | per-layer µs | floor µs | same states |\n"
          "|---|---|---|---|---|---|---|---|")
    for name in args.models:
        cfg = presets.config(name)
        for B in args.batch:
            cache = HybridCache(cfg, B, 64 + args.block, dtype, dev, block=args.block)
            gen = torch.Generator(dev).manual_seed(0)
            for buf_name, buf in cache.named_buffers():
                if buf_name.startswith(("state", "conv", "replay_")):
                    buf.copy_(torch.randn(buf.shape, generator=gen, device=dev, dtype=buf.dtype) * 0.1)
            cache.replay_g.copy_(-cache.replay_g.abs())  # log-decays are ≤ 0
            cache.replay_beta.copy_(cache.replay_beta.abs().clamp(max=1))
            keep = torch.randint(0, args.block + 1, (B,), generator=gen, device=dev)
            saved = {n: b.clone() for n, b in cache.named_buffers()}
            stacked = SimpleNamespace(cache=cache, cfg=cfg, unrolled=False, pdl=False)  # what Forward.commit reads
            unrolled = SimpleNamespace(cache=cache, cfg=cfg, unrolled=True, pdl=False)
            states = []  # after each way of committing, from the same saved buffers
            for commit in (lambda: Forward.commit(stacked, keep), lambda: Forward.commit(unrolled, keep),
                           lambda: per_layer_commit(cache, cfg, keep)):
                for n, b in cache.named_buffers():
                    b.copy_(saved[n])
                commit()
                states.append((cache.state.clone(), cache.conv.clone()))
            same = max((a - b).abs().max().item() for other in states[1:] for a, b in zip(other, states[0]))
            t_stacked = bench.graph_seconds(lambda: Forward.commit(stacked, keep))
            t_unrolled = bench.graph_seconds(lambda: Forward.commit(unrolled, keep))
            t_layer = float("nan") if args.no_per_layer else bench.graph_seconds(lambda: per_layer_commit(cache, cfg, keep))
            floor = 2 * cache.state.numel() * 4 / bw
            tiles = {}
            for tile in args.tiles:
                default, gdn.REPLAY_TILE = gdn.REPLAY_TILE, tuple(int(v) for v in tile.split(":"))
                tiles[tile] = bench.graph_seconds(lambda: Forward.commit(stacked, keep))
                gdn.REPLAY_TILE = default
                print(f"  replay tile {tile}: {tiles[tile] * 1e6:.0f} µs", flush=True)
            L = len(cache.gdn_index)
            rows.append({"model": name, "batch": B, "block": args.block, "gdn_layers": L, "stacked_s": t_stacked,
                         "unrolled_s": t_unrolled, "per_layer_s": t_layer, "floor_s": floor, "max_state_diff": same,
                         "tiles_s": tiles})
            print(f"| {name} | {B} | {L} | {t_stacked * 1e6:.0f} | {t_unrolled * 1e6:.0f} | {t_layer * 1e6:.0f} | "
                  f"{floor * 1e6:.0f} | {same:.1e} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"hardware": torch.cuda.get_device_name() if cuda else "cpu (smoke)",
                                         "copy_bandwidth_Bps": bw, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
