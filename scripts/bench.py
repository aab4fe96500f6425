"""Decode-speed benchmark CLI: HF eager vs HF static + compile vs fastqwen vs the bandwidth roofline.

    python scripts/bench.py --models qwen3.5-9b qwen3.5-27b --batch-size 1 --prompt-len 512 --json docs/bench.json
    python scripts/bench.py --models qwen3.5-27b --systems fastqwen --batch-size 1 2 4 8 --prompt-len 512 32768
    python scripts/bench.py --models qwen3.5-27b --systems fastqwen fastqwen-fp8-weight   # quantized vs bf16
    python scripts/bench.py --models qwen3.5-35b-a3b --systems fastqwen fastqwen+grouped-experts   # a candidate kernel
    python scripts/bench.py --models qwen3.5-35b-a3b --systems fastqwen fastqwen-fp8-weight --isolate  # a process each
    python scripts/bench.py --models qwen3.5-35b-a3b --systems fastqwen fastqwen-fp8-weight --isolate --processes 3
        # three processes each, alternating order: medians, each process's figures in the JSON

Every (model, batch size, prompt length) is one row, all rows of a model on one model object. Prints progress
lines, then a markdown table; writes results and environment to ``--json`` (and ``--out-dir``) after every
row. scripts/plot_bench.py draws total tok/s against batch size with the roofline from that JSON.
Without CUDA it defaults to the "tiny" preset in float32 with short runs and no compilation (a smoke test).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import pathlib
import platform
import statistics
import sys

import torch
import transformers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from fastqwen import bench, presets  # noqa: E402

CUDA = torch.cuda.is_available()
DEFAULTS = (
    {"models": ["qwen3.5-9b", "qwen3.5-27b", "qwen3.5-35b-a3b"], "dtype": "bfloat16", "prompt_len": 512,
     "n_short": 32, "n_long": 160, "compile": True}
    if CUDA else
    {"models": ["tiny"], "dtype": "float32", "prompt_len": 32, "n_short": 8, "n_long": 40, "compile": False}
)


def parse_args() -> argparse.Namespace:
    """Command-line options; defaults depend on whether CUDA is available."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=DEFAULTS["models"], help="preset names (fastqwen.presets)")
    p.add_argument("--systems", nargs="+", default=list(bench.DEFAULT_SYSTEMS), choices=bench.SYSTEMS,
                   help="default: HF eager, HF static cache + compile, fastqwen; also fastqwen with an alternative "
                        "kernel (fastqwen+…) or quantized (fastqwen-…, one scheme a process); HF first, quantized last, "
                        "fastqwen and its alternatives in the order given")
    p.add_argument("--batch-size", type=bench.positive_int, nargs="+", default=[1],
                   help="rows per generate (a sweep if several)")
    p.add_argument("--ragged", action="store_true", help="rows of different prompt lengths (left-padded, the "
                   "longest --prompt-len, the shortest about half), as concurrent requests")
    p.add_argument("--quant-lm-head", action="store_true", help="a quantized system (fastqwen-…) quantizes "
                   "lm_head too (optimize's quant_lm_head; 27B: 2.5 GB of its 51 GB a step in bf16)")
    p.add_argument("--prompt-len", type=bench.positive_int, nargs="+", default=[DEFAULTS["prompt_len"]],
                   help="prompt tokens per row, i.e. the context decoding starts from (a sweep if several)")
    p.add_argument("--max-seq-len", type=int, help="fastqwen's cache size (default: what the run needs); e.g. "
                   "131072 with a short prompt times what a long cache costs decode")
    p.add_argument("--n-short", type=int, default=DEFAULTS["n_short"], help="new tokens in the short run")
    p.add_argument("--n-long", type=int, default=DEFAULTS["n_long"], help="new tokens in the long run")
    p.add_argument("--repeats", type=int, default=3, help="timed calls at each length, median taken (1 for "
                   "very long prompts: every call prefills again)")
    p.add_argument("--dtype", default=DEFAULTS["dtype"], choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cuda" if CUDA else "cpu")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=DEFAULTS["compile"],
                   help="passed to fastqwen.optimize")
    p.add_argument("--no-autotune", action="store_true",
                   help="compile fastqwen's step with default inductor + CUDA graphs instead of max-autotune "
                        "(minutes less compile time)")
    p.add_argument("--kernels", nargs="*", default=[], metavar="OP=CHOICE",
                   help="optimize's kernels for every fastqwen system (e.g. launch=pdl linears=auto); a candidate "
                   "system's own choice overrides them")
    p.add_argument("--options", nargs="*", default=[], metavar="KEY=VALUE",
                   help="inductor options merged over every fastqwen system's (e.g. triton.enable_pdl=True with a "
                   "quantized system: the option systems alone run unquantized)")
    p.add_argument("--json", type=pathlib.Path, default=pathlib.Path("docs/bench.json"), help="results file")
    p.add_argument("--out-dir", type=pathlib.Path, help="also write bench.json and bench.md here")
    p.add_argument("--isolate", action="store_true", help="time each system in a fresh process of its own and "
                   "merge the rows (a system timed after another in one process can run slower: the order "
                   "effect, docs/BENCHMARKS.md); each process builds the model again")
    p.add_argument("--processes", type=int, default=1, help="with --isolate: time each system in this many "
                   "processes, in rounds of alternating order, and report the median (a 35B-A3B step spreads "
                   "±3%% between processes of the same code)")
    args = p.parse_args()
    try:
        bench.check_lengths(args.n_short, args.n_long, args.repeats)
    except ValueError as err:
        p.error(str(err))
    for flag, pairs, form in (("--kernels", args.kernels, "OP=CHOICE"), ("--options", args.options, "KEY=VALUE")):
        for kv in pairs:
            if "=" not in kv:
                p.error(f"{flag} takes {form}, got {kv!r}")
    try:
        bench.compile_options(False, False, args.options)
    except (ValueError, SyntaxError) as err:
        p.error(f"--options: each VALUE a Python literal (True, 1, 'max-autotune'): {err}")
    return args


def environment(device: str) -> dict:
    """Hardware and software versions recorded next to the results."""
    cuda = torch.device(device).type == "cuda"
    return {
        "hardware": torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def main() -> None:
    """Benchmark each model in turn (a failed model is recorded and skipped), write JSON after every row so
    partial results survive, print the markdown table last."""
    args = parse_args()
    say = functools.partial(print, flush=True)
    env = environment(args.device)
    say(f"{env['hardware']} | torch {env['torch']} | transformers {env['transformers']}")
    paths = [args.json] + ([args.out_dir / "bench.json"] if args.out_dir else [])

    def save(results: list) -> None:
        for path in paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"environment": env, "results": results}, indent=2) + "\n")

    engines = [s for s in args.systems if s.startswith("fastqwen")]
    if CUDA and len(engines) > 1 and not args.isolate:
        say(f"note: {len(engines)} fastqwen systems in one process: on 35B-A3B each after the first ran up to 11% "
            "slower (the order effect, docs/BENCHMARKS.md); --isolate times each in a process of its own")
    if args.processes < 1 or args.processes > 1 and not args.isolate:
        sys.exit("--processes takes a count of at least 1, and more than 1 only with --isolate")
    isolate = args.isolate and (len(args.systems) > 1 or args.processes > 1)
    results = isolated(args, save) if isolate else collect(args, say, save)
    table = bench.format_table(results)
    if args.out_dir:
        (args.out_dir / "bench.md").write_text(table + "\n")
    say(table)


def isolated(args: argparse.Namespace, save) -> list:
    """`collect` for each of args.systems in a fresh (spawned) process, args.processes rounds (the systems in
    alternating order), the rows of the same (model, batch size, prompt length) merged: their systems put
    together (a system timed in several processes: `median_process`) and the ratios taken again. A row that
    failed in any process keeps that error. `save(results)` after each process."""
    import concurrent.futures
    import multiprocessing

    rows: dict[tuple, list] = {}  # (model, batch size, prompt length) → that row from each process
    merged = []
    for round_ in range(args.processes):
        for system in args.systems if round_ % 2 == 0 else args.systems[::-1]:
            one = argparse.Namespace(**{**vars(args), "systems": [system]})
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                for r in pool.submit(collect, one).result():
                    rows.setdefault((r["model"], r.get("batch_size"), r.get("prompt_len")), []).append(r)
            merged = [merge_rows(same) for same in rows.values()]
            save(merged)
    return merged


def merge_rows(same: list) -> dict:
    """One row from the rows of the same (model, batch size, prompt length) timed in separate processes; the
    copy bandwidth and the rooflines the medians of the processes' measurements."""
    failed = [r for r in same if "error" in r]
    if failed:
        return failed[0]
    row, outs = {**same[0], "systems": {}, "isolated": True}, {}
    for r in same:
        for system, out in r["systems"].items():
            outs.setdefault(system, []).append(out)
    for key in {k for r in same for k in r if k.endswith("roofline_tok_s")} | {"copy_bandwidth_Bps"}:
        row[key] = statistics.median(r[key] for r in same if key in r)  # (each process measured the bandwidth)
    row["systems"] = {system: median_process(o) for system, o in outs.items()}
    return bench.add_ratios(row)


def median_process(outs: list) -> dict:
    """One system's result from one or more processes: with several, the fields of the process whose tok/s
    is the median's, its tok/s and step device time (and step_tok_s) replaced by their medians over the processes,
    timing_suspect if any process's was, and each process's figures under "processes"; a failed process's error if
    any failed."""
    if len(outs) == 1:
        return outs[0]
    failed = [o for o in outs if "error" in o]
    if failed:
        return failed[0]
    out = {**sorted(outs, key=lambda o: o["tok_s"])[(len(outs) - 1) // 2],
           "processes": [{k: o.get(k) for k in ("tok_s", "step_device_us", "pid")} for o in outs],
           "tok_s": statistics.median(o["tok_s"] for o in outs)}
    if all(o.get("step_device_us") for o in outs):
        out["step_device_us"] = statistics.median(o["step_device_us"] for o in outs)
        if "step_tok_s" in out:
            out["step_tok_s"] = 1e6 / out["step_device_us"]
    if any(o.get("timing_suspect") for o in outs):  # (its tok/s is in the median whichever process is shown)
        out["timing_suspect"] = True
    return out


def collect(args: argparse.Namespace, say=functools.partial(print, flush=True), save=lambda results: None) -> list:
    """The `bench.run` rows of args: each model, then each batch size, then each prompt length, all systems
    of a row in this process; `save(results)` after each row."""
    results = []
    quantized = any(s in bench.QUANT_SYSTEMS or s in bench.QUANT_VARIANTS for s in args.systems)  # (in place: a model a row)
    for name in args.models:
        try:
            model = None if quantized else presets.build(name, dtype=getattr(torch, args.dtype),
                                                         device=args.device).eval()
        except Exception as e:  # e.g. out of memory: keep going with the next model
            results.append({"model": name, "error": f"{type(e).__name__}: {e}"[:500]})
            say(f"[{name}] FAILED {results[-1]['error']}")
            continue
        for batch_size in args.batch_size:
            for prompt_len in args.prompt_len:
                try:
                    row = bench.run(
                        name, model=model, systems=tuple(args.systems), batch_size=batch_size,
                        prompt_len=prompt_len, n_short=args.n_short, n_long=args.n_long,
                        dtype=getattr(torch, args.dtype), device=args.device, compile=args.compile, progress=say,
                        compile_options=bench.compile_options(args.no_autotune, args.device.startswith("cuda"),
                                                              args.options),
                        ragged=args.ragged, quant_lm_head=args.quant_lm_head,
                        kernels=dict(kv.split("=", 1) for kv in args.kernels), max_seq_len=args.max_seq_len,
                        repeats=args.repeats,
                    )
                    results.append(row)
                    for out in row["systems"].values():
                        out["pid"] = os.getpid()  # (which process timed it: --isolate)
                except Exception as e:  # e.g. out of memory: keep going with the next row
                    error = f"{type(e).__name__}: {e}"[:500]
                    results.append({"model": name, "batch_size": batch_size, "prompt_len": prompt_len,
                                    "error": error})
                    say(f"[{name}] batch {batch_size}, prompt {prompt_len}: FAILED {error}")
                save(results)
        del model
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    main()
