"""Profile fastqwen's compiled decode step: where a step's time goes, kernel by kernel.

    python scripts/profile_step.py --model qwen3.5-35b-a3b --no-autotune --top 25

Builds the preset (random weights), optimizes and warms it up, fills the cache with a prompt, then records
`--steps` decode steps (CUDA graph replays) under torch.profiler. Prints the kernels that take the most
device time per step (name, launches per step, µs per step, share), the number of kernel launches per step,
and the step's device time against the roofline of its bytes (fastqwen.bench.step_bytes ÷ copy bandwidth).
A step far above its roofline with many short kernels is launch-bound; a few long kernels far below the
bandwidth are the ones to rewrite. A second table sums the kernels by category (cuBLAS GEMMs, our weight
streaming, gated delta rule, attention, sampling, inductor's fused norms and gates, eager copies). With --json
both tables are also written as JSON.

    python scripts/profile_step.py --model qwen3.5-27b --no-autotune --speculate dflash:15
    python scripts/profile_step.py --model qwen3.5-27b --no-autotune --speculate dflash:15 --quant fp8-weight --quant-lm-head

also profiles one speculative round after the decode step (proposer:k, mtp or dflash, with a random draft of the real shape as
scripts/bench_spec.py builds it): draft, verify, acceptance and commit, kernel by kernel. With --phases, the draft
and the verify (k + 1 positions) are then also profiled each as its own graph, so the round's kernels (the same
names in both) are told apart.

    python scripts/profile_step.py --model qwen3.5-27b --no-autotune --layers 16 --verify-block 16 --kernels launch=serial

profiles a verify of 16 positions as its own graph after the decode step, with no proposer (the target alone,
no feature taps), on the first 16 layers of the stack (the same shapes: per-layer costs in a quarter of the
compile). Under launch=pdl a kernel starts before its predecessor ends and the profiler counts its wait as its
own time; launch=serial gives each kernel's own duration.

    python scripts/profile_step.py --model qwen3.5-35b-a3b --no-autotune --again

profiles the step, then releases the engine, optimizes the same model again (same options) and profiles the
new step: the kernels whose time changed most, for a second system in a process running slower than the
first (the order effect in docs/BENCHMARKS.md).
"""

import argparse
import collections
import json
import pathlib
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import fastqwen  # noqa: E402
from fastqwen import bench, presets  # noqa: E402


def main():
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3.5-27b" if cuda else "tiny", choices=presets.NAMES)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=512 if cuda else 32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--options", nargs="*", default=[], metavar="KEY=VALUE",
                   help="inductor options merged over the run's, e.g. combo_kernels=True")
    p.add_argument("--no-autotune", action="store_true")
    p.add_argument("--kernels", nargs="*", default=[], metavar="OP=CHOICE",
                   help="optimize's kernels option, e.g. attention=split linears=gemv")
    p.add_argument("--speculate", metavar="PROPOSER:K", help="profile a speculative round: mtp:3, dflash:15, …")
    p.add_argument("--phases", action="store_true", help="with --speculate: also the draft and the verify, each "
                   "as its own graph")
    p.add_argument("--verify-block", type=int, metavar="T", help="also profile a verify of T positions alone "
                   "(no proposer, no feature taps)")
    p.add_argument("--layers", type=int, help="keep only the first LAYERS decoder layers (quicker compiles)")
    p.add_argument("--quant", choices=["fp8-weight", "fp8", "int4"], help="quantize the target and draft (optimize's quant)")
    p.add_argument("--quant-lm-head", action="store_true", help="with --quant: lm_head too (optimize's quant_lm_head)")
    p.add_argument("--again", action="store_true", help="after the decode step: release the engine, optimize the "
                   "same model again and profile its step once more, listing the kernels whose time changed most "
                   "(the order effect, docs/BENCHMARKS.md)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="compile the steps (--no-compile: eager, for checking the script's plumbing quickly)")
    p.add_argument("--json", type=pathlib.Path)
    args = p.parse_args()
    if args.phases and not args.speculate:
        p.error("--phases profiles a speculative round's draft and verify: give --speculate")
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    model = presets.build(args.model, dtype=dtype, device=device, layers=args.layers)
    opts = bench.compile_options(args.no_autotune, cuda, args.options)
    ids = torch.randint(model.config.vocab_size, (args.batch_size, args.prompt_len), device=device)

    def optimized(quant):
        """The model optimized and warmed up, its cache rows at the prompt length; its engine."""
        fastqwen.optimize(model, max_batch_size=args.batch_size, max_seq_len=args.prompt_len + 64,
                          compile=args.compile, compile_options=opts, kernels=dict(kv.split("=", 1) for kv in args.kernels), quant=quant,
                          quant_lm_head=args.quant_lm_head and quant is not None)
        model._fastqwen.warmup()
        model.generate(ids, max_new_tokens=8)  # (then every row is done)
        return model._fastqwen

    e = optimized(args.quant)
    report = [profile_one(e._greedy_step, "step", model, args)]
    if args.again:
        bench._drop_engine(model, device)
        e = optimized(None)  # (already quantized in place, if asked)
        report.append(profile_one(e._greedy_step, "step, optimized again", model, args))
        print_changes(report[0], report[-1], args.top)
    if args.speculate:
        name, k = args.speculate.split(":")
        oracle = bench.OracleProposer(torch.zeros(args.batch_size, 64, dtype=torch.long, device=device), 0.5,
                                      model.config.vocab_size, impose=True)
        e.enable_speculation(oracle, int(k))
        oracle.inner = bench.random_proposer(name, model, e, args.model, quant=args.quant)
        model.generate(ids, max_new_tokens=8)
        report.append(profile_one(e.spec.greedy_round, f"{args.speculate} round", model, args))
        if args.phases:
            k, inner = int(k), oracle.inner
            tokens = torch.zeros(args.batch_size, k + 1, dtype=torch.long, device=device)
            with torch.compiler.config.patch(cache_key_tag=e.cache_tag):  # (as generate compiles its steps)
                draft = e.compile(lambda: inner.propose(e, k, False))
                verify = e.compile(lambda: e.forward.step(tokens, verify=True, features=inner.features))
                report.append(profile_one(draft, f"{name} draft", model, args))
                report.append(profile_one(verify, f"verify ({k + 1})", model, args))
    if args.verify_block:
        T = args.verify_block
        e.enable_speculation(bench.OracleProposer(torch.zeros(args.batch_size, 64, dtype=torch.long, device=device),
                                                  0.5, model.config.vocab_size), T - 1)
        e.cache.lengths.fill_(args.prompt_len)  # (the cache's contents do not change the timing)
        tokens = torch.zeros(args.batch_size, T, dtype=torch.long, device=device)
        with torch.compiler.config.patch(cache_key_tag=e.cache_tag):
            verify = e.compile(lambda: e.forward.step(tokens, verify=True))
            report.append(profile_one(verify, f"verify ({T}) alone", model, args))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


CATEGORIES = (  # (category, regex on the kernel name); the first match wins
    ("GEMM: cuBLAS", r"nvjet|gemm|cutlass|xmma|splitKreduce"),
    ("GEMM: fastqwen weight streaming", r"_row_kernel|_gemv_kernel"),
    ("gated delta rule", r"gated_delta|_unrolled_kernel|chunk_|recurrent"),
    ("attention", r"sdpa|flash|attention|cudnn|_split_kv|_combine"),
    ("argmax / sampling", r"argmax|topk|sort|multinomial|exponential"),
    ("memset / memcpy", r"Memset|Memcpy"),
    ("eager copies", r"direct_copy|elementwise_kernel"),
    ("inductor fused (norms, gates, residuals)", r"^triton_"),
)


def print_changes(before: dict, after: dict, top: int) -> None:
    """The kernels (by name) whose µs a step changed most between two profile_one reports, and the totals."""
    a = {name: us for name, _, us in before["kernels"]}
    b = {name: us for name, _, us in after["kernels"]}
    delta = sorted(((name, a.get(name, 0.0), b.get(name, 0.0)) for name in a.keys() | b.keys()),
                   key=lambda r: -abs(r[2] - r[1]))
    print(f"kernels {before['step_us']:.0f} → {after['step_us']:.0f} µs a step, wall "
          f"{before['wall_us'] or 0:.0f} → {after['wall_us'] or 0:.0f} µs")
    print("| kernel | µs before | µs after | change |\n|---|---|---|---|")
    for name, x, y in delta[:top]:
        print(f"| {name[:90]} | {x:.1f} | {y:.1f} | {y - x:+.1f} |")


def categorize(rows) -> dict:
    """{category: [launches, µs]} of profile rows (name, launches, µs), in CATEGORIES order, then "other"."""
    import re

    out = {name: [0.0, 0.0] for name, _ in CATEGORIES + (("other", ""),)}
    for kernel, n, us in rows:
        cat = next((name for name, rx in CATEGORIES if re.search(rx, kernel)), "other")
        out[cat][0] += n
        out[cat][1] += us
    return {k: v for k, v in out.items() if v[0]}


def profile_one(step, what: str, model, args) -> dict:
    """Profile `steps` calls of `step` (a compiled graph) with every cache row marked done, so each call
    computes and advances nothing; print the table and return it as a dict. `wall_us` is the device time per
    call measured by CUDA events around back-to-back calls: wall − the kernels' sum is the idle time between
    kernels inside the graph."""
    e, cuda = model._fastqwen, model.device.type == "cuda"
    e.state["done"].fill_(True)
    for _ in range(3):
        step()
    wall_us = None
    if cuda:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(args.steps):
            step()
        b.record()
        b.synchronize()
        wall_us = a.elapsed_time(b) * 1e3 / args.steps
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(args.steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    per_kernel = collections.defaultdict(lambda: [0, 0.0])  # name -> [launches, µs]
    for ev in prof.events():
        kernel = ev.device_type == torch.autograd.DeviceType.CUDA if cuda else ev.cpu_parent is None
        if kernel:
            per_kernel[ev.name][0] += 1
            per_kernel[ev.name][1] += ev.device_time_total if cuda else ev.cpu_time_total
    step_us = sum(us for _, us in per_kernel.values()) / args.steps
    launches = sum(n for n, _ in per_kernel.values()) / args.steps
    nbytes = bench.step_bytes(model, args.batch_size, args.prompt_len + 8)
    roof_us = nbytes / bench.copy_bandwidth(e.device) * 1e6
    rows = sorted(((name, n / args.steps, us / args.steps) for name, (n, us) in per_kernel.items()),
                  key=lambda r: -r[2])
    wall = f", {wall_us:.0f} µs wall (idle {wall_us - step_us:.0f})" if wall_us else ""
    print(f"{args.model}, batch {args.batch_size}, context {args.prompt_len}: {step_us:.0f} µs of kernels per {what}"
          f"{wall}, {launches:.0f} launches; a decode step's roofline {roof_us:.0f} µs ({nbytes / 1e9:.2f} GB)"
          + ("" if args.speculate and what != "step" else f" -> {roof_us / (wall_us or step_us):.0%}"))
    print(f"| kernel | launches / {what} | µs / {what} | share |\n|---|---|---|---|")
    for name, n, us in rows[: args.top]:
        print(f"| {name[:90]} | {n:.0f} | {us:.1f} | {us / step_us:.1%} |")
    categories = categorize(rows)
    print(f"| category | launches / {what} | µs / {what} | share |\n|---|---|---|---|")
    for name, (n, us) in categories.items():
        print(f"| {name} | {n:.0f} | {us:.1f} | {us / step_us:.1%} |")
    return {"model": args.model, "batch_size": args.batch_size, "what": what, "prompt_len": args.prompt_len,
            "step_us": step_us, "wall_us": wall_us, "launches": launches, "roofline_us": roof_us, "kernels": rows,
            "categories": categories}

if __name__ == "__main__":
    main()
