"""Speculative decoding benchmark: per-step costs and end-to-end speed at a fixed acceptance.

    python scripts/bench_spec.py --model qwen3.5-27b --proposer mtp --k 3 --tau 3.0
    python scripts/bench_spec.py --model qwen3.5-27b --proposer dflash --k 15 --tau 6.5

Random weights cannot show real acceptance, so the end-to-end figure uses bench.OracleProposer: every round
runs the real drafting compute (a random MTP head, or a random DFlash draft of the real z-lab shape), then
proposes the target's own greedy continuation with errors injected so that the mean tokens per round is
`--tau`. Per-step costs are
timed as compiled graphs on one model object in one process: the plain decode step (T = 1), the verify step
over `--verify-block` positions, and the commit (GDN replay + conv window) of that block.
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
from fastqwen.spec.dflash import DFlashDraft, DFlashProposer  # noqa: E402
from fastqwen.spec.mtp import MTPHead, MTPProposer  # noqa: E402


def time_call(fn, device, iters=30) -> float:
    """Median seconds of fn() over iters calls after 3 warm-ups (CUDA events on GPU)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def step_costs(model, block: int, prompt) -> dict:
    """Seconds per compiled decode step, verify step over `block` positions, and commit of that block."""
    e = model._fastqwen
    e.enable_speculation(OracleProposer(prompt[:, :1], 1.0, model.config.vocab_size), block - 1)
    model.generate(prompt, max_new_tokens=2)  # fills the cache rows
    e.state["done"].fill_(True)  # every row finished: steps compute all rows but advance none
    tokens = torch.zeros(e.max_batch_size, block, dtype=torch.long, device=e.device)
    keep = torch.zeros(e.max_batch_size, dtype=torch.long, device=e.device)
    verify = e.compile(lambda: e.forward.step(tokens, verify=True))
    commit = e.compile(lambda: e.forward.commit(keep))
    return {"decode_s": time_call(e._greedy_step, e.device), "verify_s": time_call(verify, e.device),
            "commit_s": time_call(commit, e.device)}


def _tiny_dflash(model) -> dict:
    """A small DFlash draft config for CPU smoke runs of this script."""
    n = model.config.num_hidden_layers
    return {"hidden_size": model.config.hidden_size, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "rms_norm_eps": 1e-6,
            "rope_theta": 1e6, "vocab_size": model.config.vocab_size, "block_size": 16,
            "dflash_config": {"mask_token_id": model.config.vocab_size - 1, "target_layer_ids": [0, n - 1]}}


def main():
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3.5-27b" if cuda else "tiny", choices=presets.NAMES)
    p.add_argument("--proposer", choices=["mtp", "dflash"], default="mtp", help="whose drafting compute runs")
    p.add_argument("--k", type=int, default=3, help="drafts per round (DFlash: block size - 1)")
    p.add_argument("--tau", type=float, default=3.0, help="imposed mean tokens per round")
    p.add_argument("--verify-block", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=512 if cuda else 32)
    p.add_argument("--n-short", type=int, default=32 if cuda else 8)
    p.add_argument("--n-long", type=int, default=160 if cuda else 40)
    p.add_argument("--no-autotune", action="store_true")
    p.add_argument("--json", type=pathlib.Path)
    args = p.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    say = lambda m: print(m, flush=True)  # noqa: E731
    model = presets.build(args.model, dtype=dtype, device=device)
    opts = {"triton.cudagraphs": True} if args.no_autotune and cuda else None
    max_seq = args.prompt_len + args.n_long + 2 * args.verify_block + 8
    fastqwen.optimize(model, max_seq_len=max_seq, compile=True, compile_options=opts)
    ids = torch.randint(model.config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    res = {"model": args.model, "k": args.k, "tau": args.tau, "verify_block": args.verify_block,
           "hardware": torch.cuda.get_device_name() if cuda else "cpu"}
    say("plain decode: compiling and measuring")
    model._fastqwen.warmup()
    res["plain_tok_s"] = bench.decode_tok_per_s(model.generate, ids, args.n_short, args.n_long)
    reference = model.generate(ids, max_new_tokens=args.n_long, min_new_tokens=args.n_long)[:, args.prompt_len:]
    say("step costs: compiling and timing decode / verify / commit graphs")
    res.update(step_costs(model, args.verify_block, ids))
    res["verify_over_decode"] = res["verify_s"] / res["decode_s"]
    res["commit_over_decode"] = res["commit_s"] / res["decode_s"]
    say(f"speculative ({args.proposer}) k={args.k} at tau={args.tau}: compiling and measuring")
    e = model._fastqwen
    miss = miss_for_tau(args.tau, args.k)
    e.enable_speculation(OracleProposer(reference, miss, model.config.vocab_size, inner=None), args.k)
    if args.proposer == "mtp":
        head = MTPHead(model, {k[4:]: v for k, v in presets.random_mtp_tensors(model).items()})
        e.spec.proposer.inner = MTPProposer(e, head)  # the real drafting compute, every round
    else:
        cfg = presets.dflash_config(args.model) if args.model in presets.DFLASH_DRAFTS else _tiny_dflash(model)
        tensors = presets.random_dflash_tensors(cfg, model.config.hidden_size, dtype=dtype, device=device)
        e.spec.proposer.inner = DFlashProposer(e, DFlashDraft(cfg, tensors, model))
    res["spec_tok_s"] = bench.decode_tok_per_s(model.generate, ids, args.n_short, args.n_long)
    inner = e.spec.proposer.inner
    res["draft_s"] = time_call(e.compile(lambda: inner.propose(e, args.k, False)), device)
    res["draft_over_decode"] = res["draft_s"] / res["decode_s"]
    res["measured_tau"] = e.spec.acceptance_length(1)
    res["spec_over_plain"] = res["spec_tok_s"] / res["plain_tok_s"]
    print(json.dumps(res, indent=1))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
