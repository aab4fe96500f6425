"""Per-GEMM speed of quantized linears at small M (decode, verify) on real layer shapes.

    python scripts/bench_quant.py --shapes 27b --m 1 2 4 8 16 --json docs/bench-quant.json

Candidates: bf16 (cuBLAS), fastqwen's small-M kernel per format (fastqwen/ops/gemv.py), and where they are
installed torchao (fp8 weight-only, fp8 dynamic per-row, int4 weight-only) and gemlite (fp8 weight-only,
int4 group 128). With --experts, also the 35B-A3B routed experts (256 of them, top-8, M tokens): the
gather-then-einsum path against the grouped kernel (`expert_gemv`) in bf16, fp8 and int4. Every candidate is timed as a CUDA graph of 20 back-to-back calls (no launch overhead, as in
a compiled decode step): median µs per call over 10 replays. The floor is the candidate's weight bytes ÷
the measured copy bandwidth; "% BW" is floor ÷ time. Candidates that fail to build or capture are reported
with their error, not skipped. This table times one weight per candidate, so shapes smaller than ~2× the L2
cache read partly from L2 (the --sweep cycles through weight copies instead: bench.cold_copies). Without CUDA it runs as a smoke test: shapes ÷ 4, 16 experts, wall-clock timing.
"""

import argparse
import copy
import json
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from fastqwen import bench  # noqa: E402
from fastqwen.linears import Linears  # noqa: E402
from fastqwen.quant.linear import QuantLinear  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TABLE = pathlib.Path(__file__).parents[1] / "fastqwen" / "ops" / "gemv_configs.json"  # the one the library reads
SMALL = 1 if DEV == "cuda" else 4  # CPU smoke runs shrink every shape

# name: [(layer, N, K)]: the decode step's matmuls with fused input projections (the default; model.fuse_linears),
# "-separate": the projections one by one (kernels={"projections": "separate"}; measured before fusion)
SHAPES = {
    "27b": [("mlp.gate+up", 34816, 5120), ("mlp.down", 5120, 17408), ("attn.q+gate+k+v", 14336, 5120),
            ("gdn.qkv+z+b+a", 16480, 5120), ("gdn.out, attn.o", 5120, 6144)],
    "35b-a3b": [("attn.q+gate+k+v", 9216, 2048), ("gdn.qkv+z+b+a", 12352, 2048), ("shared.gate+up", 1024, 2048),
                ("gdn.out, attn.o", 2048, 4096), ("router+shared gate", 257, 2048), ("lm_head", 248320, 2048)],
    "27b-separate": [("mlp.gate/up", 17408, 5120), ("attn.q+gate", 12288, 5120), ("gdn.in_qkv", 10240, 5120),
                     ("attn.k", 1024, 5120)],
    "9b": [("mlp.gate+up", 24576, 4096), ("mlp.down", 4096, 12288), ("attn.q+gate+k+v", 10240, 4096),
           ("gdn.qkv+z+b+a", 12352, 4096), ("gdn.out, attn.o", 4096, 4096), ("lm_head", 248320, 4096)],
    # the lm_heads on their own (fp8: quant_lm_head; bf16: the engine's lm_head takes the kernel where the sweep
    # stores it faster than cuBLAS, as the other bf16 linears do under linears "auto")
    "27b-head": [("lm_head", 248320, 5120)],
    "9b-head": [("lm_head", 248320, 4096)],
    "35b-a3b-head": [("lm_head", 248320, 2048)],
    # the z-lab 27B DFlash draft (Qwen3 layers, fused projections as the engine runs them; 16 positions a round)
    "27b-draft": [("q+k+v", 6144, 5120), ("o", 5120, 4096), ("gate+up", 34816, 5120), ("down", 5120, 17408),
                  ("fc", 5120, 25600)],
    # gate | up's K with fewer rows, small enough for a 50 MB L2 in int4 (21 and 31 MB): timed --warm, a kernel's
    # rate with HBM out of the way, i.e. its own ceiling (decode, issue, L2 latency) on any GPU
    "l2": [("l2-resident", 8192, 5120), ("l2-resident", 12288, 5120)],
}


def candidates(linear: torch.nn.Linear) -> dict:
    """{name: (callable x -> y, weight bytes)}; a candidate that cannot be built maps to its error string."""
    N, K = linear.out_features, linear.in_features
    out = {"bf16": (lambda x: F.linear(x, linear.weight), N * K * 2),
           "fastqwen bf16": (lambda x: Linears(gemv=True)(linear, x), N * K * 2)}  # kernels={"linears": "gemv"}
    for scheme in ("fp8-weight", "fp8", "int4"):
        layer = QuantLinear.from_linear(linear, scheme)
        nbytes = sum(b.numel() * b.element_size() for b in layer.buffers())
        out[f"fastqwen {scheme}"] = (layer, nbytes)
        if scheme != "fp8":  # the CUDA C++ kernel (kernels={"int4" | "fp8_weight": "cuda"}; > 16 rows: Triton's)
            out[f"fastqwen {scheme} cuda"] = (lambda x, layer=layer: layer(x, cuda=(layer.scheme,)), nbytes)

    def build(name, make):
        try:
            out[name] = make()
        except Exception as e:  # not installed, or unsupported here
            out[name] = f"{type(e).__name__}: {e}"[:200]

    fp8_bytes, int4_bytes = N * K + N * 4, N * K // 2 + 2 * N * (K // 128) * 2  # the formats' own bytes

    def torchao(make_config, nbytes):
        import torchao.quantization as q

        lin = copy.deepcopy(linear)
        q.quantize_(lin, make_config(q))
        return lin, nbytes

    def gemlite_fp8():
        from gemlite.helper import A16W8_FP8

        return A16W8_FP8(device=DEV, dtype=torch.bfloat16).from_linear(copy.deepcopy(linear)), fp8_bytes

    def gemlite_int4():
        from gemlite.helper import A16Wn

        from fastqwen.quant.formats import quantize_int4

        q, s, z = quantize_int4(linear.weight.detach(), 128)
        layer = A16Wn(device=DEV, dtype=torch.bfloat16).from_weights(q, s.bfloat16(), z.bfloat16(), 4, 128)
        return layer, int4_bytes

    build("torchao fp8-weight", lambda: torchao(lambda q: q.Float8WeightOnlyConfig(), fp8_bytes))
    build("torchao fp8 dyn row", lambda: torchao(
        lambda q: q.Float8DynamicActivationFloat8WeightConfig(granularity=q.PerRow()), fp8_bytes))
    build("torchao int4", lambda: torchao(lambda q: q.Int4WeightOnlyConfig(group_size=128), int4_bytes))
    build("gemlite fp8-weight", gemlite_fp8)
    build("gemlite int4", gemlite_int4)
    return out


def expert_candidates(N: int, K: int, E: int = 256 if SMALL == 1 else 16, top: int = 8) -> dict:
    """{name: (callable x [M, K] -> [M·top, N], bytes a call must read for M = 1)} for routed experts."""
    from fastqwen.ops.gemv import BF16, FP8_ROW, INT4, expert_gemv, stored_operands

    w = torch.randn(E, N, K, device=DEV, dtype=torch.bfloat16) * 0.02
    exp = torch.randint(0, E, (16 * top,), device=DEV, dtype=torch.int32)

    def pairs(x):
        M = x.shape[0]
        return torch.arange(M, device=DEV, dtype=torch.int32).repeat_interleave(top), exp[: M * top]

    out = {"gather+einsum bf16": (lambda x: torch.einsum("mk,mtnk->mtn", x, w[exp[: x.shape[0] * top].view(-1, top)]),
                                  top * N * K * 2)}
    for name, fmt, nbytes in (("bf16", BF16, 2), ("fp8-weight", FP8_ROW, 1), ("int4", INT4, 0.5)):
        parts = [stored_operands(fmt, w[e]) for e in range(E)]
        ws, ss, zs = (None if p[0] is None else torch.stack(p) for p in zip(*parts))
        run = lambda x, ws=ws, ss=ss, zs=zs, fmt=fmt: expert_gemv(x, *pairs(x), fmt, ws, ss, zs, N).sum(0)  # noqa: E731
        out[f"expert_gemv {name}"] = (run, int(top * N * K * nbytes))
    return out


SWEPT = {"fp8-weight": "FP8_ROW", "int4": "INT4", "bf16": "BF16"}  # formats the sweep tunes (name: gemv constant)


def sweep(shapes, ms, bw, table: pathlib.Path | None, formats=tuple(SWEPT), lowps=None, ksteps=None,
          row_order=False) -> list[dict]:
    """Time the weight-streaming kernel over its launch configs (BLOCK_N, SPLIT_K, num_warps, num_stages, BITS:
    conversion instructions or bit moves to decode the weight, KSTEP: 128-column blocks a loop step, LOWP: 3 for
    the fp16 dot (e4m3 weights, M > 1) and int4's fp16 pair arithmetic at one row, 4 for int4's pairs into
    mma.sync at one row) per layer, format and M (`lowps`: only configs with these
    LOWP values, beside the config in use; `ksteps` likewise for KSTEP); print the default config's time beside the best one. The best is the
    one cheapest for the step: kernel time plus
    the consumer's read of its fp32 split-K partials. With `table`, merge the best configs into that
    gemv_configs.json under this GPU's name (fastqwen.ops.gemv reads it at import). The kernel is timed without the
    split-K sum, which the compiled steps fold into the consumer's kernel. 8 warps never won. Since 2026-12-01 the
    timed calls cycle through copies of the weight (bench.cold_copies), so that each streams it from memory as a
    step does; before, one weight called 20 times partly sat in the 50 MB L2 (shapes under ~100 MB read faster
    than in a step, and the table's configs for them were picked in that regime)."""
    import itertools

    from fastqwen.ops import gemv

    configs = list(itertools.product((32, 64, 128), (1, 2, 4, 8, 16), (4,), (2, 4), (0, 1), (1,), (0,)))
    # KSTEP (tiles up to 32K weights: a [128, 512] fp32 accumulator would spill; KSTEP > 1 for fp8-weight and bf16)
    wide = [c for c in itertools.product((32, 64, 128), (1, 2, 4, 8), (4,), (2, 4), (0,), (2, 4), (0,))
            if c[0] * 128 * c[5] <= 32768]
    # LOWP 3 (e4m3 weights, M > 1: the fp16 dot)
    fp16 = [c for c in itertools.product((32, 64, 128), (1, 2, 4, 8), (4,), (2, 3, 4), (0,), (1, 2), (3,))
            if c[0] * 128 * c[5] <= 32768]
    # int4 at one row by bit moves in steps of 2 or 4 groups (KSTEP): 256 or 512 columns of a row in flight a step
    int4_wide = list(itertools.product((64, 128), (2, 4, 8, 16), (4,), (2, 3), (1,), (2, 4)))
    # int4 at one row in fp16 pair arithmetic (BITS with LOWP 3), steps of 1 or 2 groups, staged (cp.async) or not
    # (512 rows with 8 or 16 warps: a program's x prologue shared by more rows)
    half2 = [c for c in itertools.product((64, 128, 256, 512), (1, 4, 8, 16), (4, 8, 16), (1, 2), (1,), (1, 2), (3,))
             if (c[0] < 256 and c[2] == 4) or (c[0] == 256 and c[2] < 16) or (c[0] == 512 and c[2] > 4)]
    # and 2 or 4 row tiles a program (TILES), its x prologue (an L2 round trip, a reduction, a barrier) paid once
    half2 += list(itertools.product((128, 256), (4, 8, 16), (4,), (1,), (1,), (1, 2), (3,), (2, 4)))
    # the same pairs into mma.sync (LOWP 4): at least 16 rows a warp
    half2 += [c for c in itertools.product((64, 128, 256, 512), (1, 4, 8, 16), (4, 8), (1, 2), (1,), (1, 2), (4,))
              if c[0] >= 16 * c[2] and c[0] // c[2] <= 64]
    rows, best_of = [], {}
    for model in shapes:
        for layer, N, K in SHAPES[model]:
            head = N > 65536  # an lm_head: swept only as a shape set of its own (27b-head, …), with no split
            if head and not model.endswith("-head"):
                continue
            w = torch.randn(N // SMALL, K // SMALL, device=DEV, dtype=torch.bfloat16) * 0.02
            N, K = w.shape
            for name, fmt in ((f, getattr(gemv, SWEPT[f])) for f in formats):
                q, sc, z = gemv.stored_operands(fmt, w, tiled=not row_order)  # (int4: tile_int4 unless row_order)
                nbytes = sum(t.numel() * t.element_size() for t in (q, sc, z) if t is not None)
                # copies of the weight, cycled through so that every call streams its weight from memory, as in a
                # step (one weight, called 20 times, partly sits in L2: a 5120x6144 fp8 weight is 31 MB)
                weights = [(q, sc, z)] + [tuple(None if t is None else t.clone() for t in (q, sc, z))
                                          for _ in range(bench.cold_copies(nbytes, DEV) - 1)]
                for m in ms:
                    x = torch.randn(m, K, device=DEV, dtype=torch.bfloat16)
                    default = gemv.full_config(gemv.gemv_config(fmt, N, K, m))
                    times = {}
                    kstep_ok = lambda c: c[5] == 1 or fmt in (gemv.FP8_ROW, gemv.BF16)  # noqa: E731
                    tried = configs + [c for c in wide if kstep_ok(c)]
                    tried += [c for c in fp16 if m > 1 and fmt in (gemv.FP8_ROW, gemv.FP8_BLOCK) and kstep_ok(c)]
                    tried += [c for c in int4_wide + half2 if fmt == gemv.INT4 and m == 1]
                    if lowps is not None:
                        tried = [c for c in tried if gemv.full_config(c)[6] in lowps]
                    if ksteps is not None:
                        tried = [c for c in tried if gemv.full_config(c)[5] in ksteps]
                    if head:  # 248k rows are programs enough without splitting K
                        tried = [c for c in tried if c[1] == 1]
                    for cfg in [default] + [c for c in tried if K // (128 * c[5]) >= c[1]
                                            and gemv.full_config(c) != default
                                            and not (fmt == gemv.BF16 and c[4])]:  # bf16 has no bit decoding
                        try:
                            times[cfg] = bench.graph_seconds(  # (partials: summed in the consumer)
                                lambda x, q, sc, z, cfg=cfg: gemv._launch(x, fmt, q, sc, z, False, N, m, config=cfg,
                                                                          partials=True),
                                variants=[(x, *wq) for wq in weights])
                        except Exception as e:  # out of resources (shared memory) for the largest tiles
                            print(f"  {cfg}: {type(e).__name__}", flush=True)
                    # what the step pays: the kernel, and the consumer's read of its fp32 partial sums (at M = 16 and
                    # 8 splits, 8% of a 27B MLP's time: a split that wins the kernel by less loses the step)
                    cost = {c: t + gemv.split_plan(K, c)[1] * m * N * 4 / bw for c, t in times.items()}
                    best = min(cost, key=cost.get)
                    best_of[gemv.tuned_key(fmt, N, K, m)] = best
                    if fmt == gemv.BF16:  # for kernels={"linears": "auto"}: is the kernel worth it over cuBLAS here?
                        copies = [w] + [w.clone() for _ in range(bench.cold_copies(w.numel() * 2, DEV) - 1)]
                        cublas = bench.graph_seconds(F.linear, variants=[(x, c) for c in copies]) + m * N * 2 / bw
                        # (+ its bf16 output's write)
                        best_of["cublas:" + gemv.tuned_key(fmt, N, K, m).split(":", 1)[1]] = [
                            round(cublas * 1e6, 2), round(cost[best] * 1e6, 2)]
                        print(f"  cuBLAS {cublas * 1e6:.1f} µs", flush=True)
                    row = {"model": model, "layer": layer, "N": N, "K": K, "format": name, "M": m,
                           "default": default, "default_us": times[default] * 1e6, "best": best,
                           "best_us": times[best] * 1e6, "best_bw": nbytes / bw / times[best],
                           "default_cost_us": cost[default] * 1e6, "best_cost_us": cost[best] * 1e6,
                           "times_us": [[list(c), round(t * 1e6, 2)] for c, t in times.items()]}  # (every config's)
                    rows.append(row)
                    print(f"| sweep | {layer} {N}x{K} | {name} M={m} | default {default} {row['default_us']:.1f} µs "
                          f"({nbytes / bw / times[default]:.0%}) | best {best} {row['best_us']:.1f} µs "
                          f"({row['best_bw']:.0%}) | with the partials' read {row['default_cost_us']:.1f} → "
                          f"{row['best_cost_us']:.1f} µs |", flush=True)
                merge_table(table, best_of)
    return rows


# the routed experts of 35B-A3B, one expert's [N, K] (gate+up stacked; the shared expert stacked as expert 256 with
# the grouped kernel's default), and the (token, expert) pairs a token makes: top-8 + the shared one
EXPERT_SHAPES = [("experts.gate_up", 1024, 2048), ("experts.down", 2048, 512)]
EXPERT_PAIRS = 9


def sweep_experts(bw, table: pathlib.Path | None, formats=("bf16",), tokens=(1,), E=257) -> list[dict]:
    """Time the grouped kernel (expert_gemv's launch) over its launch configs (BLOCK_N, SPLIT_K, 4 warps,
    num_stages, KSTEP for bf16 and fp8-weight) for each EXPERT_SHAPES matrix of E experts at the pairs of each
    count of `tokens` (EXPERT_PAIRS a token; 1: batch-1 decode, 4 or 8: batched decode, 16: a verify block), each
    token's experts drawn at random per call from 16 draws (no call finds its experts in L2: a step reads each
    layer's once); print the default config's time beside the best. The best is the cheapest for the step,
    the consumer's read of the fp32 split-K partials included; with `table`, it is merged in under this GPU's
    name (gemv.expert_key), which gemv_config then uses for that pair bucket."""
    import itertools

    from fastqwen.ops import gemv

    configs = [c for c in itertools.product((32, 64, 128), (1, 2, 4, 8), (4,), (2, 3, 4), (0,), (1, 2))
               if c[0] * 128 * c[5] <= 32768]
    gen = torch.Generator().manual_seed(0)
    rows, best_of = [], {}
    for (layer, N, K), T, name in itertools.product(EXPERT_SHAPES, tokens, formats):
        N, K, pairs = N // SMALL, K // SMALL, T * EXPERT_PAIRS
        w = torch.randn(E, N, K, device=DEV, dtype=torch.bfloat16) * 0.02
        x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
        tok = torch.arange(T, device=DEV, dtype=torch.int32).repeat_interleave(EXPERT_PAIRS)
        draws = [torch.cat([torch.randperm(E - 1, generator=gen)[:EXPERT_PAIRS - 1], torch.tensor([E - 1])])
                 for _ in range(16 * T)]
        variants = [(x, tok, torch.cat(draws[i * T:(i + 1) * T]).to(DEV, torch.int32)) for i in range(16)]
        fmt = getattr(gemv, SWEPT[name])
        parts = [gemv.stored_operands(fmt, w[e]) for e in range(E)]
        q, sc, z = (None if t[0] is None else torch.stack(t) for t in zip(*parts))
        nbytes = pairs * sum(t[0].numel() * t.element_size() for t in (q, sc, z) if t is not None)
        default = gemv.full_config(gemv.gemv_config(fmt, N, K, 1, pairs))
        tried = [c for c in configs if K // (128 * c[5]) >= c[1] and (c[5] == 1 or fmt in (gemv.FP8_ROW, gemv.BF16))
                 and gemv.full_config(c) != default]
        times = {}
        for cfg in [default] + tried:
            try:
                times[cfg] = bench.graph_seconds(
                    lambda x, tok, exp, cfg=cfg: gemv._launch(x, fmt, q, sc, z, False, N, pairs, (tok, exp),
                                                              config=cfg, partials=True), variants=variants)
            except Exception as e:  # out of resources (shared memory) for the largest tiles
                print(f"  {cfg}: {type(e).__name__}", flush=True)
        cost = {c: t + gemv.split_plan(K, c)[1] * pairs * N * 4 / bw for c, t in times.items()}
        best = min(cost, key=cost.get)
        best_of[gemv.expert_key(fmt, N, K, pairs)] = best
        row = {"model": "35b-a3b", "layer": layer, "N": N, "K": K, "format": name, "pairs": pairs,
               "default": default, "default_us": times[default] * 1e6, "best": best, "best_us": times[best] * 1e6,
               "best_bw": nbytes / bw / times[best], "default_cost_us": cost[default] * 1e6,
               "best_cost_us": cost[best] * 1e6}
        rows.append(row)
        print(f"| sweep | {layer} {pairs}x {N}x{K} | {name} | default {default} {row['default_us']:.1f} µs "
              f"({nbytes / bw / times[default]:.0%}) | best {best} {row['best_us']:.1f} µs ({row['best_bw']:.0%}) "
              f"| with the partials' read {row['default_cost_us']:.1f} → {row['best_cost_us']:.1f} µs |", flush=True)
        merge_table(table, best_of)
    return rows


def merge_table(table: pathlib.Path | None, best_of: dict) -> None:
    """Merge the best configs found so far into `table` under this GPU's name (after every layer, so a run cut
    short keeps what it measured)."""
    if table and DEV == "cuda" and best_of:
        tuned = json.loads(table.read_text()) if table.exists() else {}
        tuned.setdefault(torch.cuda.get_device_name(), {}).update(best_of)
        table.write_text(json.dumps(tuned, indent=1, sort_keys=True) + "\n")


def merge_tables(parts: list[pathlib.Path], table: pathlib.Path) -> None:
    """Merge sweep tables (each {GPU name: {key: config}}, as --write-table leaves them) into `table`, later
    parts winning where they overlap."""
    tuned = json.loads(table.read_text()) if table.exists() else {}
    for part in parts:
        for gpu, configs in json.loads(part.read_text()).items():
            tuned.setdefault(gpu, {}).update(configs)
    table.write_text(json.dumps(tuned, indent=1, sort_keys=True) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["27b", "35b-a3b", "27b-separate"], choices=list(SHAPES))
    p.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--experts", action="store_true", help="also the 35B-A3B routed experts")
    p.add_argument("--only", help="time only candidates whose name contains this (e.g. 'expert_gemv', 'fastqwen')")
    p.add_argument("--sweep", action="store_true", help="only time the kernel's launch configs per layer and M")
    p.add_argument("--sweep-experts", type=int, nargs="*", metavar="TOKENS", help="with --sweep: also the grouped "
                   "kernel's configs for the 35B-A3B routed experts, at these token counts (9 pairs each; default 1)")
    p.add_argument("--formats", nargs="+", default=list(SWEPT), choices=list(SWEPT), help="with --sweep: these only")
    p.add_argument("--lowp", type=int, nargs="+", help="with --sweep: only configs with these LOWP values (and "
                   "the config in use): 3 for the fp16 dot and int4's fp16 pairs, 4 for int4's pairs into mma.sync")
    p.add_argument("--kstep", type=int, nargs="+", help="with --sweep: only configs with these KSTEP values (and the "
                   "config in use), e.g. 2 4 for the wide steps")
    p.add_argument("--int4-row-order", action="store_true", help="with --sweep: int4 codes in row order (as experts and "
                   "layers of rows no multiple of 16 keep them) instead of QuantLinear's 16-row tiles (tile_int4); "
                   "writes no table")
    p.add_argument("--write-table", type=pathlib.Path, help="with --sweep: merge the best configs into this file "
                   "(fastqwen/ops/gemv_configs.json is the one the library reads)")
    p.add_argument("--merge-tables", nargs="+", type=pathlib.Path, metavar="TABLE",
                   help="merge these sweep tables (gemv_configs_<tag>.json) into --write-table (default: the "
                   "library's) and exit")
    p.add_argument("--json", type=pathlib.Path)
    args = p.parse_args()
    if args.merge_tables:
        merge_tables(args.merge_tables, args.write_table or TABLE)
        return
    bw = bench.copy_bandwidth(DEV)
    res = {"hardware": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke)", "torch": torch.__version__, "copy_bandwidth_Bps": bw,
           "rows": []}
    print(f"{res['hardware']}, copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    if args.sweep:
        table = None if args.int4_row_order else args.write_table  # (the table's configs are the tiled codes')
        res["sweep"] = sweep(args.shapes, args.m, bw, table, args.formats, args.lowp, args.kstep, args.int4_row_order)
        if args.sweep_experts is not None:
            res["sweep_experts"] = sweep_experts(bw, args.write_table, args.formats, tuple(args.sweep_experts) or (1,))
        if args.json:
            args.json.write_text(json.dumps(res, indent=1))
        return
    jobs = [(model, layer, N // SMALL, K // SMALL, lambda N=N // SMALL, K=K // SMALL: candidates(_linear(N, K)))
            for model in args.shapes for layer, N, K in SHAPES[model]]
    if args.experts:
        jobs += [("35b-a3b", f"experts.{part} (top-8 of 256)", N // SMALL, K // SMALL,
                  lambda N=N // SMALL, K=K // SMALL: expert_candidates(N, K))
                 for part, N, K in (("gate_up", 1024, 2048), ("down", 2048, 512))]
    for model, layer, N, K, make in jobs:
        for name, c in make().items():
            if args.only and args.only not in name and not (args.only == "fastqwen" and name == "bf16"):
                continue
            row = {"model": model, "layer": layer, "N": N, "K": K, "candidate": name}
            if isinstance(c, str):
                row["error"] = c
            else:
                fn, nbytes = c
                row["weight_bytes"] = nbytes  # at M = 1 for experts (M tokens read up to M·top experts)
                for m in args.m:
                    x = torch.randn(m, K, device=DEV, dtype=torch.bfloat16)
                    try:
                        t = bench.graph_seconds(fn, x)
                        row[f"M{m}_us"], row[f"M{m}_bw"] = t * 1e6, nbytes / bw / t
                    except Exception as e:
                        row[f"M{m}_error"] = f"{type(e).__name__}: {e}"[:200]
            res["rows"].append(row)
            cells = [f"{row[f'M{m}_us']:.1f} µs {row[f'M{m}_bw']:.0%}" if f"M{m}_us" in row else "error"
                     for m in args.m]
            print(f"| {model} | {layer} {N}x{K} | {name} | " + " | ".join(cells if "error" not in row
                                                                            else [row["error"]]) + " |", flush=True)
            if args.json:
                args.json.write_text(json.dumps(res, indent=1))


def _linear(N: int, K: int) -> torch.nn.Linear:
    torch.manual_seed(0)
    linear = torch.nn.Linear(K, N, bias=False, device=DEV, dtype=torch.bfloat16)
    torch.nn.init.normal_(linear.weight, std=0.02)
    return linear


if __name__ == "__main__":
    main()
