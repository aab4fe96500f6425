"""Speculative decoding benchmark: per-phase costs and end-to-end speed at a fixed acceptance.

    python scripts/bench_spec.py --model qwen3.5-27b --runs mtp:3:3.0 dflash:15:6.5

Each run is `proposer:k:tau`. Random weights cannot show real acceptance, so the end-to-end figure uses
bench.OracleProposer: every round runs the real drafting compute (a random MTP head, or a random DFlash draft
of the real z-lab shape), then proposes the target's own greedy continuation with errors injected so that the
mean tokens per round is tau. All runs share one model object in one process. Per-phase costs are timed as
compiled graphs: the plain decode step (T = 1), and per run the draft, the verify step over its k + 1
positions, the commit (GDN replay + conv window) of that block and the whole round's graph; `accept_and_rest`
is the round less those three, and `tok_s_at_tau` = τ ÷ the round (its work does not depend on acceptance).
End to end, `tok_s` is (n_long − n_short) tokens over the time difference of a long and a short generate call;
those tokens took `window_rounds` rounds (the oracle restarts its counts every call, so every call of a length
does the same rounds), i.e. `window_tau` tokens a round, which differs from τ by the rounding of whole rounds:
`round_s` is the measured time of one round end to end, and `tok_s_e2e_at_tau` = τ ÷ `round_s`.
Results are written to --json after every phase, so a run cut short keeps what it measured.

    python scripts/bench_spec.py --model qwen3.5-27b --runs dflash:15:6.5 --also-kernels gdn=fla attention=sdpa

then re-optimizes the same model once per kernel set (comma-separated op=choice) and times its verify and commit
of the --verify-block block against the default's, in the same process: the candidates that act on the verify.

    python scripts/bench_spec.py --model qwen3.5-27b --layers 16 --runs --quant fp8-weight --quant-lm-head \
        --also-kernels gdn=unrolled launch=serial

does that on the first 16 layers of the stack (the real shapes, a quarter of every compile): an A/B of verify
kernels that fits one device call on a quantized 27B, where each full-stack compile takes minutes. MTP runs
work on a short stack; a DFlash draft taps target layers up to the 61st of 64, so not.
"""

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import fastqwen  # noqa: E402
from fastqwen import bench, presets  # noqa: E402
from fastqwen.bench import OracleProposer, miss_for_tau  # noqa: E402
from fastqwen.generate import check_num_speculative_tokens  # noqa: E402
from fastqwen.spec.draft_head import draft_head  # noqa: E402


def time_call(fn, device, iters=20, repeats=5) -> float:
    """Seconds per fn() call: the median over `repeats` timings of `iters` back-to-back calls, after 3
    warm-ups. Back to back, as in a generate loop, so the host's launch work overlaps the device's (timing
    one call at a time would add the CUDA-graph replay's host overhead to every step)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters):
                fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3 / iters)
        else:
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            times.append((time.perf_counter() - t) / iters)
    return statistics.median(times)


def phase_costs(e, k: int, proposer=None) -> dict:
    """Seconds of the compiled verify (k + 1 positions) and commit of one round, and of `proposer`'s draft if
    given, on the engine's current cache rows; every row is marked finished first, so these steps compute
    but advance nothing. They compile under the engine's cache tag, as generate's steps do."""
    with torch.compiler.config.patch(cache_key_tag=e.cache_tag):
        return _phase_costs(e, k, proposer)


def _phase_costs(e, k: int, proposer) -> dict:
    e.state["done"].fill_(True)
    tokens = torch.zeros(e.max_batch_size, k + 1, dtype=torch.long, device=e.device)
    keep = torch.zeros(e.max_batch_size, dtype=torch.long, device=e.device)
    features = proposer.features if proposer is not None else None
    verify = e.compile(lambda: e.forward.step(tokens, verify=True, features=features))
    commit = e.compile(lambda: e.forward.commit(keep))
    out = {"verify_s": time_call(verify, e.device), "commit_s": time_call(commit, e.device)}
    if proposer is not None:
        out["draft_s"] = time_call(e.compile(lambda: proposer.propose(e, k, False)), e.device)
        out["round_graph_s"] = time_call(e.spec.greedy_round, e.device)  # the whole round, as generate runs it
    return out


def main():
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3.5-27b" if cuda else "tiny", choices=presets.NAMES)
    p.add_argument("--runs", nargs="*", default=["mtp:3:3.0", "dflash:15:6.5"],
                   help="proposer:k:tau, each (none: plain decode and the --verify-block timings only)")
    p.add_argument("--batch", type=bench.positive_int, default=1, help="rows per generate (the same prompt in each)")
    p.add_argument("--prompt-len", type=bench.positive_int, default=512 if cuda else 32)
    p.add_argument("--n-short", type=int, default=32 if cuda else 24)
    p.add_argument("--n-long", type=int, default=160 if cuda else 200)
    p.add_argument("--verify-block", type=int, default=16, help="also time verify + commit of this block (0: no)")
    p.add_argument("--quant", choices=["fp8-weight", "fp8", "int4"], help="quantize the target (optimize's quant)")
    p.add_argument("--quant-lm-head", action="store_true",
                   help="with --quant: lm_head too (optimize's quant_lm_head; the draft then reads it as well)")
    p.add_argument("--draft-lm-head", choices=["fp8-weight", "fp8", "int4"],
                   help="draft through a quantized copy of lm_head (optimize's draft_lm_head)")
    p.add_argument("--draft-vocab", type=int, help="draft over token ids 0 … N−1 only (optimize's draft_vocab)")
    p.add_argument("--draft-quant", choices=["fp8-weight", "fp8", "int4"],
                   help="the draft's own quantization (optimize's draft_quant; default: --quant's)")
    p.add_argument("--phases", nargs="*", metavar="PROPOSER", help="time draft / verify / commit for these runs "
                   "only (default: every run; none given: no run)")
    p.add_argument("--options", nargs="*", default=[], metavar="KEY=VALUE",
                   help="inductor options merged over the run's, e.g. combo_kernels=True")
    p.add_argument("--no-autotune", action="store_true")
    p.add_argument("--kernels", nargs="*", default=[], metavar="OP=CHOICE",
                   help="optimize's kernels option, e.g. attention=split linears=gemv")
    p.add_argument("--also-kernels", nargs="*", default=[], metavar="OP=CHOICE[,OP=CHOICE]",
                   help="after the runs: verify + commit under each of these kernel sets, against the default's")
    p.add_argument("--layers", type=int, help="keep only the first LAYERS decoder layers (quicker compiles; "
                   "per-layer costs as in the full stack)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="compile the steps (--no-compile: eager, for checking the script's plumbing quickly)")
    p.add_argument("--json", type=pathlib.Path)
    args = p.parse_args()
    if args.layers and any(r.startswith("dflash") for r in args.runs):
        p.error("--layers: a DFlash draft taps layers of the whole stack; time the verify (--verify-block) or MTP")
    if args.also_kernels and not args.verify_block:
        p.error("--also-kernels times the --verify-block block: give it a size")
    runs = []
    for r in args.runs:
        try:
            name, k, tau = r.split(":")
            k, tau = int(k), float(tau)
        except ValueError:
            p.error(f"--runs takes proposer:k:tau, got {r!r} (e.g. mtp:3:3.0)")
        if name not in ("mtp", "dflash"):
            p.error(f"unknown proposer {name!r} in --runs {r}: use mtp or dflash")
        try:  # (else found after the plain decode is compiled and timed)
            check_num_speculative_tokens(k)
            miss_for_tau(tau, k)
        except ValueError as err:
            p.error(f"--runs {r}: {err}")
        runs.append((name, k, tau))
    try:
        bench.check_lengths(args.n_short, args.n_long)
    except ValueError as err:
        p.error(str(err))
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    res = {"model": args.model, "batch": args.batch, "hardware": torch.cuda.get_device_name() if cuda else "cpu",
           "layers": args.layers}

    def say(m):
        print(m, flush=True)
        if args.json:
            args.json.write_text(json.dumps(res, indent=1))

    model = presets.build(args.model, dtype=dtype, device=device, layers=args.layers)
    opts = bench.compile_options(args.no_autotune, cuda, args.options)
    block = max([k + 1 for _, k, _ in runs] + [args.verify_block])
    max_seq = args.prompt_len + args.n_long + 2 * block + 8  # room for the timed blocks after a generate
    kernels = dict(kv.split("=", 1) for kv in args.kernels)
    fastqwen.optimize(model, max_batch_size=args.batch, max_seq_len=max_seq, compile=args.compile, compile_options=opts,
                      quant=args.quant, quant_lm_head=args.quant_lm_head, kernels=kernels)
    res["quant"], res["quant_lm_head"], res["kernels"] = args.quant, args.quant_lm_head, kernels
    e = model._fastqwen
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(model.config.vocab_size, (1, args.prompt_len), generator=gen).repeat(args.batch, 1).to(device)
    say("plain decode: compiling and measuring")
    e.warmup()
    res["plain_tok_s"] = args.batch * bench.decode_tok_per_s(model.generate, ids, args.n_short, args.n_long)
    reference = model.generate(ids, max_new_tokens=args.n_long, min_new_tokens=args.n_long)[:, args.prompt_len:]
    e.state["done"].fill_(True)
    res["decode_s"] = time_call(e._greedy_step, device)
    if args.verify_block:
        say(f"verify + commit of a {args.verify_block}-token block: compiling and timing")
        e.enable_speculation(OracleProposer(reference, 1.0, model.config.vocab_size), args.verify_block - 1)
        e.cache.lengths.fill_(args.prompt_len + args.n_long)  # attention cost as after a generate
        costs = phase_costs(e, args.verify_block - 1)
        res[f"verify{args.verify_block}"] = {**costs, "verify_over_decode": costs["verify_s"] / res["decode_s"],
                                             "commit_over_decode": costs["commit_s"] / res["decode_s"]}
    head = draft_head(model.lm_head, args.draft_vocab, args.draft_lm_head)  # None: the target's own
    res["draft_lm_head"], res["draft_vocab"] = args.draft_lm_head, args.draft_vocab
    res["draft_quant"] = args.draft_quant or args.quant
    for name, k, tau in runs:
        say(f"{name} k={k} at tau={tau}: compiling and measuring")
        oracle = OracleProposer(reference, miss_for_tau(tau, k), model.config.vocab_size, impose=True)
        e.enable_speculation(oracle, k)
        oracle.inner = bench.random_proposer(name, model, e, args.model, head, quant=args.draft_quant or args.quant)
        r = {"k": k, "tau": tau}
        r["tok_s"] = args.batch * bench.decode_tok_per_s(model.generate, ids, args.n_short, args.n_long)
        r["over_plain"] = r["tok_s"] / res["plain_tok_s"]
        window = {}  # rounds of one call of each length (the same in every call: the oracle restarts its counts)
        for n in (args.n_short, args.n_long):
            model.generate(ids, max_new_tokens=n, min_new_tokens=n)
            window[n] = bench.spec_rounds(e, args.batch)
        r["measured_tau"] = e.spec.acceptance_length(args.batch)  # of the long call
        # the timed difference of a long and a short call is a whole number of rounds, with its own tokens a round
        r["window_rounds"] = window[args.n_long] - window[args.n_short]
        r["window_tau"] = (args.n_long - args.n_short) / r["window_rounds"]
        r["round_s"] = args.batch * r["window_tau"] / r["tok_s"]  # end to end: host work and launches included
        r["tok_s_e2e_at_tau"] = args.batch * tau / r["round_s"]
        res[name] = r
        if args.phases is not None and name not in args.phases:
            continue
        say(f"{name}: timing draft / verify / commit")
        r.update(phase_costs(e, k, oracle.inner))
        r["accept_and_rest_s"] = r["round_graph_s"] - r["draft_s"] - r["verify_s"] - r["commit_s"]
        r["tok_s_at_tau"] = args.batch * tau / r["round_graph_s"]  # τ-independent round work, at exactly τ
        for phase in ("draft", "verify", "commit"):
            r[f"{phase}_over_decode"] = r[f"{phase}_s"] / res["decode_s"]
            r[f"{phase}_share_of_round"] = r[f"{phase}_s"] / r["round_graph_s"]
        say(json.dumps({name: r}, indent=1))
    base = res.get(f"verify{args.verify_block}")
    for alt in args.also_kernels:
        alt_kernels = {**kernels, **dict(kv.split("=", 1) for kv in alt.split(","))}
        say(f"verify + commit of a {args.verify_block}-token block with kernels {alt_kernels}: compiling and timing")
        fastqwen.optimize(model, max_batch_size=args.batch, max_seq_len=max_seq, compile=args.compile,
                          compile_options=opts, kernels=alt_kernels)  # (a quantized model stays quantized: quant was applied in place)
        e = model._fastqwen
        e.enable_speculation(OracleProposer(reference, 1.0, model.config.vocab_size), args.verify_block - 1)
        e.cache.lengths.fill_(args.prompt_len + args.n_long)
        costs = phase_costs(e, args.verify_block - 1)
        res.setdefault("also_kernels", {})[alt] = {**costs, "verify_vs_default": costs["verify_s"] / base["verify_s"],
                                                   "commit_vs_default": costs["commit_s"] / base["commit_s"]}
        say(json.dumps({alt: res["also_kernels"][alt]}, indent=1))
    say("done")


if __name__ == "__main__":
    main()
