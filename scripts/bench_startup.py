"""Start-up benchmark: seconds from optimize() to the first generated token, cold and warm.

    python scripts/bench_startup.py --model qwen3.5-9b

Three fresh processes of the same configuration, each timing optimize() + warmup() + a one-token generate on a
512-token prompt (model construction is timed apart):
  cold      an empty inductor cache directory and no compile_cache file: everything compiles;
  warm      the same inductor cache directory again, plus the compile_cache file the cold run wrote;
  portable  an empty inductor cache directory with only the compile_cache file (a new machine, same GPU).
Prints a table and the cold / warm ratio (issue #3's bar: warm reaches the first token >= 3x faster).
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def child(args) -> None:
    """One start: build, optimize with the compile cache, warm up, first token; prints a JSON line."""
    sys.path.insert(0, str(ROOT))
    import fastqwen
    from fastqwen import presets

    cuda = torch.cuda.is_available()
    t = time.perf_counter()
    model = presets.build(args.model, dtype=torch.bfloat16 if cuda else torch.float32,
                          device="cuda" if cuda else "cpu")
    build_s = time.perf_counter() - t
    ids = torch.randint(model.config.vocab_size, (1, args.prompt_len), device=model.device)
    opts = {"triton.cudagraphs": True} if args.no_autotune and cuda else None
    t = time.perf_counter()
    fastqwen.optimize(model, max_seq_len=args.prompt_len + 64, compile_options=opts, compile_cache=args.artifacts)
    model._fastqwen.warmup()
    model.generate(ids, max_new_tokens=1)
    if cuda:
        torch.cuda.synchronize()
    print("RESULT", json.dumps({"build_s": build_s, "first_token_s": time.perf_counter() - t}), flush=True)


def start(args, cache_dir: pathlib.Path, artifacts: pathlib.Path) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--prompt-len", str(args.prompt_len),
           "--artifacts", str(artifacts)] + (["--no-autotune"] if args.no_autotune else [])
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"start failed:\n{out.stderr[-3000:]}")
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT"))[7:])


def main():
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3.5-9b" if cuda else "tiny")
    p.add_argument("--prompt-len", type=int, default=512 if cuda else 32)
    p.add_argument("--no-autotune", action="store_true")
    p.add_argument("--json", type=pathlib.Path)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--artifacts", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        artifacts = tmp / "fastqwen-compiled.bin"
        res = {"model": args.model, "no_autotune": args.no_autotune,
               "hardware": torch.cuda.get_device_name() if cuda else "cpu"}
        for name, cache_dir in (("cold", tmp / "inductor"), ("warm", tmp / "inductor"),
                                ("portable", tmp / "inductor-empty")):
            print(f"{name}: starting", flush=True)
            res[name] = start(args, cache_dir, artifacts)
            print(f"{name:9s} build {res[name]['build_s']:7.1f} s   optimize → first token "
                  f"{res[name]['first_token_s']:7.1f} s", flush=True)
            if args.json:  # what a run cut short has measured so far
                args.json.write_text(json.dumps(res, indent=1))
    res["cold_over_warm"] = res["cold"]["first_token_s"] / res["warm"]["first_token_s"]
    res["cold_over_portable"] = res["cold"]["first_token_s"] / res["portable"]["first_token_s"]
    print(f"cold / warm {res['cold_over_warm']:.1f}x, cold / portable {res['cold_over_portable']:.1f}x")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
