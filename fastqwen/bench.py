"""Decode-speed benchmark: HF eager vs HF static-cache + torch.compile vs fastqwen vs the bandwidth roofline.

Decode at small batch is memory-bound: every step streams the weights through the GPU once. So the
roofline in decode steps per second is ``copy_bandwidth / weight_bytes``, and the figure of merit is how
close each system gets to it. All speeds here are decode steps per second, i.e. tokens per second *per
sequence* (equal to total tokens/s at batch 1); prefill time is cancelled out (see ``decode_tok_per_s``).
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import statistics
import time
from typing import Callable

import torch

from . import presets
from .generate import CUDA_COMPILE_OPTIONS
from .sampling import argmax_last

QUANT_SYSTEMS = ("fastqwen-fp8-weight", "fastqwen-fp8", "fastqwen-int4")  # optimize(quant=...) after bf16
# fastqwen with an alternative kernel (optimize's `kernels`), measured against the default on the same model
CANDIDATE_SYSTEMS = {"fastqwen+split-attention": {"attention": "split"},  # (the default)
                     "fastqwen+sdpa-attention": {"attention": "sdpa"},
                     "fastqwen+grouped-experts": {"experts": "grouped"},  # (the default on CUDA: "auto")
                     "fastqwen+gather-experts": {"experts": "gather"},
                     "fastqwen+grouped-pdl-experts": {"experts": "grouped-pdl"},
                     "fastqwen+separate-projections": {"projections": "separate"},
                     "fastqwen+gemv-linears": {"linears": "gemv"},
                     "fastqwen+torch-linears": {"linears": "torch"},
                     "fastqwen+fla-gdn": {"gdn": "fla"},
                     "fastqwen+unrolled-gdn": {"gdn": "unrolled"},
                     "fastqwen+splitk-fixup": {"splitk": "fixup"},
                     "fastqwen+fused-gdn-norm": {"gdn_norm": "fused"},
                     "fastqwen+fused-expert-act": {"expert_act": "fused"},  # (the default with grouped: "auto")
                     "fastqwen+separate-expert-act": {"expert_act": "separate"},
                     "fastqwen+packed-route": {"route": "packed"},
                     "fastqwen+argmax-route": {"route": "argmax"},
                     "fastqwen+fused-route": {"route": "fused"},  # (the default with grouped: "auto")
                     "fastqwen+fused-mlp-act": {"mlp_act": "fused"},
                     "fastqwen+fused-conv": {"conv": "fused"},  # (the decode conv only: a verify's as inductor's)
                     "fastqwen+separate-conv": {"conv": "separate"},
                     "fastqwen+fused-verify-conv": {"conv": "fused-verify"},  # (the default: the verify's conv and gates too)
                     "fastqwen+serial-launch": {"launch": "serial"},
                     "fastqwen+cuda-int4": {"int4": "cuda"},  # (as fastqwen-int4+cuda-int4: the CUDA kernel,
                     "fastqwen+triton-int4": {"int4": "triton"},  # int4's "auto" on sm_90 with nvcc; Triton's)
                     "fastqwen+cuda-fp8-weight": {"fp8_weight": "cuda"},  # (fastqwen-fp8-weight+cuda-fp8-weight)
                     "fastqwen+persistent-reductions": {"reductions": "persistent"},  # (the default)
                     "fastqwen+inductor-reductions": {"reductions": "inductor"},
                     "fastqwen+fused-attn-glue": {"attn_glue": "fused"},  # (the default)
                     "fastqwen+separate-attn-glue": {"attn_glue": "separate"},
                     "fastqwen+gated-norm-kernel": {"gdn_norm": "kernel"},  # (the default)
                     "fastqwen+separate-gdn-norm": {"gdn_norm": "separate"}}
# fastqwen with inductor options merged over the run's (launch count: combo kernels launch independent
# small kernels, e.g. a GDN layer's q, k and v, as one; reductions of up to 16 unrolled, so that the MoE
# combine's sum over a token's 9 expert outputs folds into the residual add and norm after it instead of a
# launch of its own: inductor's default unrolls up to 8; inductor-pdl: inductor's own kernels launched with
# programmatic dependent launch, as our GEMVs are, so the ~600 small fused kernels of a 35B step overlap their
# launch with the kernel before; fuse-small-shared: inductor fuses kernels sharing any bytes (it needs 10 by
# default), e.g. an attention layer's v cache write into its q or k norm kernel: a launch less a layer in
# scripts/decode_kernels.py; multi-kernel: inductor compiles each reduction both looped and persistent (the whole row
# in registers, one pass) and keeps the faster at the first call: the one-row residual add + RMSNorm over 5120 with
# 8 split-K partials is a looped one-program kernel by default, ~4.9 µs each, 29 of 16 layers' 198 launches)
OPTION_SYSTEMS = {"fastqwen+combo-kernels": {"combo_kernels": True},
                  "fastqwen+multi-kernel": {"triton.multi_kernel": 1},
                  "fastqwen+unroll-reductions-16": {"unroll_reductions_threshold": 16},
                  "fastqwen+inductor-pdl": {"triton.enable_pdl": True},
                  "fastqwen+fuse-small-shared": {"score_fusion_memory_threshold": 1}}
DEFAULT_SYSTEMS = ("hf-eager", "hf-static-compile", "fastqwen")  # the others are asked for by name
# a plain fastqwen decode's tok/s (from generate's wall times) and 1 / its step's device time agree this closely,
# or the figure is marked suspect: prefill noise larger than the timed decode difference makes it meaningless
STEP_AGREEMENT = 0.15


def compile_options(no_autotune: bool, cuda: bool, extra=()) -> dict | None:
    """The scripts' inductor options: None (the engine's default: max-autotune on CUDA), or with --no-autotune
    the default inductor choice in CUDA graphs; `extra` "key=value" strings (Python literals) merged over."""
    import ast

    opts = {"triton.cudagraphs": True} if no_autotune and cuda else None
    if extra:
        pairs = [kv.split("=", 1) for kv in extra]
        opts = {**(opts or (CUDA_COMPILE_OPTIONS if cuda else {})), **{k: ast.literal_eval(v) for k, v in pairs}}
    return opts
# a quantized system with an alternative kernel, e.g. "fastqwen-int4+splitk-fixup": (quantized system, kernels),
# measured against that quantized system in the same process (one scheme a process)
QUANT_VARIANTS = {q + c.removeprefix("fastqwen"): (q, k) for q in QUANT_SYSTEMS for c, k in CANDIDATE_SYSTEMS.items()}
SYSTEMS = DEFAULT_SYSTEMS + tuple(CANDIDATE_SYSTEMS) + tuple(OPTION_SYSTEMS) + QUANT_SYSTEMS + tuple(QUANT_VARIANTS)


class OracleProposer:
    """Benchmark and test proposer: drafts the reference continuation with injected errors. Never used by optimize.

    Acceptance depends on trained weights, which random-init models lack; this proposer imposes a chosen
    acceptance profile instead. reference [B, N]: the tokens the target itself emits for each row (its
    non-speculative greedy output, first token included). Each draft is wrong with probability `miss`
    (independently), so a round accepts i drafts with probability (1-miss)^i·… (see `miss_for_tau`).
    `inner`, if given, is a real proposer whose draft compute runs every round and whose drafts are discarded,
    so a benchmark pays the real drafting cost.

    impose=True fixes the acceptance itself (see `imposed_acceptance`): each round emits ⌊τ⌋ or ⌈τ⌉ tokens
    (τ = 1 + Σᵢ (1-miss)^i, the mean the misses give), whatever the target says, so that every run of rounds from
    a call's start emits τ tokens a round to within one token, however short the benchmark. (Counts drawn from
    the misses' own distribution by a low-discrepancy sequence matched τ only on average: their first round
    accepted every draft, and a 64-token DFlash call at τ 6.5 ran at 7.9 tokens a round. A round's cost is linear
    in its accepted count, the verify's fixed, so the schedule changes no mean cost.) The schedule
    restarts with every generate call, so calls of one length do the same rounds (`spec_rounds`). The output is
    then not the target's, but every round does the work of a real round with that acceptance. Benchmarks need
    it in bf16 on random weights: there the target's near-tied logits make speculative and plain decoding part
    ways within a few tokens (kernels differ, see tests/gpu), after which a precomputed reference would never be
    accepted again.
    """

    def __init__(self, reference: torch.Tensor, miss: float, vocab_size: int, inner=None, impose: bool = False):
        self.reference, self.miss, self.vocab_size, self.inner = reference, miss, vocab_size, inner
        self.impose = impose
        # imposed rounds so far; int64 [1]: torch.compile drops in-place updates of a 0-dim float64 CPU tensor
        self.rounds = torch.zeros(1, dtype=torch.long, device=reference.device)
        torch._dynamo.mark_static_address(self.rounds)

    @property
    def features(self):
        return None if self.inner is None else self.inner.features

    def prefill(self, engine, first_row, tokens, hidden, start=0) -> None:
        if self.inner is not None:
            self.inner.prefill(engine, first_row, tokens, hidden, start)

    def start(self, engine) -> None:
        self.rounds.zero_()
        if self.inner is not None:
            self.inner.start(engine)

    def observe(self, engine, tokens, hidden, start, keep) -> None:
        if self.inner is not None:
            self.inner.observe(engine, tokens, hidden, start, keep)

    def propose(self, engine, k: int, do_sample: bool = False):
        if self.inner is not None:
            self.inner.propose(engine, k, do_sample)
        n_out = engine.spec.n_out
        ref = self.reference
        idx = (n_out[: ref.shape[0], None] + torch.arange(k, device=ref.device)).clamp(max=ref.shape[1] - 1)
        drafts = torch.zeros(n_out.shape[0], k, dtype=torch.long, device=ref.device)
        drafts[: ref.shape[0]] = ref.gather(1, idx)
        wrong = torch.rand(drafts.shape, device=drafts.device) < self.miss
        return torch.where(wrong, (drafts + 1) % self.vocab_size, drafts), None

    def imposed_acceptance(self, logits: torch.Tensor):
        """(n [B], next [B]) for impose=True; logits [B, k+1, V]. Row b's round r emits ⌊(r+1)τ + c_b⌋ - ⌊rτ +
        c_b⌋ tokens (n, one fewer, accepted drafts), c_b = frac(b·√2) so that rows take their ⌈τ⌉ rounds at
        different times: after R rounds a row has emitted Rτ tokens to within one. next = the target's greedy
        token after the accepted drafts."""
        B, k = logits.shape[0], logits.shape[1] - 1
        tau = round(1 + sum((1.0 - self.miss) ** i for i in range(1, k + 1)), 9)  # (miss_for_tau's bisection: 6.5 - ε)
        c = torch.frac(torch.arange(B, device=logits.device, dtype=torch.float64) * 1.4142135623730951)
        r = self.rounds.double()
        n = (torch.floor((r + 1) * tau + c) - torch.floor(r * tau + c)).long() - 1
        self.rounds.add_(1)
        return n, argmax_last(logits).gather(1, n[:, None])[:, 0]


def random_proposer(name: str, model, engine, preset: str, lm_head=None, quant: str | None = None):
    """The real drafting compute of `name` ("mtp" or "dflash") with random weights of the real shape, for the
    target `model` of preset `preset` (drafting through `lm_head`, default the target's; the draft quantized
    in `quant`'s scheme, as optimize does it for a quantized target). Benchmarks wrap it in an OracleProposer
    (`inner`) so that every round pays for it."""
    from .optimize import quantize_draft
    from .spec.dflash import DFlashDraft, DFlashProposer
    from .spec.mtp import MTPHead, MTPProposer

    if name == "mtp":
        head = MTPHead(model, {k[4:]: v for k, v in presets.random_mtp_tensors(model).items()})
        return MTPProposer(engine, quantize_draft(head, quant, 128), lm_head)
    if name != "dflash":
        raise ValueError(f"unknown proposer {name!r}: use mtp or dflash")
    cfg = presets.dflash_config(preset)
    tensors = presets.random_dflash_tensors(cfg, model.config.hidden_size, dtype=engine.dtype, device=engine.device)
    return DFlashProposer(engine, quantize_draft(DFlashDraft(cfg, tensors, model), quant, 128), lm_head)


def miss_for_tau(tau: float, k: int) -> float:
    """The per-draft miss probability m at which the mean tokens per round, 1 + Σ_{i=1..k} (1-m)^i, is tau."""
    if not 1.0 <= tau <= k + 1:
        raise ValueError(f"tau must be in [1, {k + 1}] for k={k}, got {tau}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        m = (lo + hi) / 2
        if 1 + sum((1 - m) ** i for i in range(1, k + 1)) > tau:
            lo = m
        else:
            hi = m
    return (lo + hi) / 2
EAGER_N = (8, 24)  # (n_short, n_long) for hf-eager on a GPU: it is slow (~7 tok/s on a 27B model)


def _sync(device: torch.device | str) -> None:
    """Wait for all queued work on ``device`` (no-op off CUDA)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device | str) -> None:
    """Release unreferenced tensors and cached allocator blocks on ``device``."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def copy_bandwidth(device: torch.device | str, nbytes: int | None = None, repeats: int = 7) -> float:
    """Achievable memory bandwidth of ``device`` in bytes/s.

    Times ``dst.copy_(src)`` of an ``nbytes`` buffer (default 2 GiB on CUDA, 256 MiB on CPU) and counts
    read + write bytes (2 * nbytes) per copy; returns the median over ``repeats`` copies after one warm-up.
    CUDA copies are timed with CUDA events, CPU copies with ``time.perf_counter``.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    nbytes = nbytes or (2 << 30 if cuda else 256 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds.append(time.perf_counter() - t0)
    del src, dst
    _free(device)
    return 2 * nbytes / statistics.median(seconds)


def cold_copies(nbytes: int, device) -> int:
    """How many copies of an operand of `nbytes` a timing must cycle through so that every call reads its copy
    from memory, as a compiled step does (its weights stream once per step): enough that twice the L2 cache
    passes between two reads of one copy. 1 off CUDA or for operands that large."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, -(-2 * l2 // max(nbytes, 1)))


def graph_seconds(fn: Callable, *args, calls: int = 20, replays: int = 10, variants=None) -> float:
    """Median seconds per fn(*args) call. On CUDA: replays of a CUDA graph of `calls` back-to-back calls (no
    launch overhead, as inside a compiled step), after 3 warm-ups outside the capture (autotuners run there);
    elsewhere wall-clock over `calls` calls (smoke runs). `variants`: argument tuples the calls cycle through
    instead of `args` (e.g. cold_copies copies of a weight, so that no call finds its weight in L2; at least
    one call each)."""
    sets = list(variants) if variants else [args]
    calls = max(calls, len(sets))
    run = lambda i: fn(*sets[i % len(sets)])  # noqa: E731
    with torch.no_grad():
        for i in range(max(3, len(sets))):
            run(i)
        if not torch.cuda.is_available() or not any(_on_cuda(a) for a in sets[0]):
            t = time.perf_counter()
            for i in range(calls):
                run(i)
            return (time.perf_counter() - t) / calls
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                run(i)
        times = []
        for _ in range(replays):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3 / calls)
    return statistics.median(times)


def _on_cuda(arg) -> bool:
    """Whether a timed call's argument lives on a GPU: a CUDA tensor, or a module with CUDA parameters or buffers."""
    if isinstance(arg, torch.nn.Module):
        return any(t.is_cuda for t in itertools.chain(arg.parameters(), arg.buffers()))
    return getattr(arg, "is_cuda", False)


def weight_bytes(model: torch.nn.Module, tokens: int = 1) -> int:
    """Bytes of weights read by one decode step over `tokens` tokens (batch rows × positions).

    Formula: sum of ``numel * element_size`` over the model's unique parameters, except
      * the input embedding table counts one row per token (hidden_size elements each), unless it is tied
        to lm_head, in which case lm_head reads all of it and it counts in full;
      * for MoE configs (``num_experts`` set), each routed-expert 3-D tensor ``[E, ...]``
        (``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``) counts the expected share of experts that
        `tokens` tokens select under uniform routing, ``1 - (1 - k/E)^tokens`` (k/E for one token).
    Everything else (attention, linear attention, norms, router, shared experts, lm_head) counts in full.
    Quantized layers (quant/: QuantLinear, QuantExperts) hold their weights as buffers in their stored format
    (codes, scales, zeros); those count the same way. Other buffers (e.g. rotary tables) and KV / recurrent
    state are not counted: see `state_bytes`.
    """
    from .quant.experts import QuantExperts
    from .quant.linear import QuantLinear

    cfg = model.config.get_text_config()
    n_experts = getattr(cfg, "num_experts", None)
    embed = model.get_input_embeddings().weight
    lm_head = model.get_output_embeddings()
    tied = lm_head is not None and getattr(lm_head, "weight", None) is embed
    stored = [(f"{m}.{n}", b) for m, module in model.named_modules() if isinstance(module, (QuantLinear, QuantExperts))
              for n, b in module.named_buffers(recurse=False)]
    total = 0
    for name, p in [*model.named_parameters(), *stored]:  # shared (tied) parameters are yielded once
        size = p.numel() * p.element_size()
        if p is embed and not tied:
            size = tokens * p.shape[-1] * p.element_size()
        elif n_experts and p.dim() >= 2 and ".experts." in name and p.shape[0] == n_experts:
            size = round(size * (1 - (1 - cfg.num_experts_per_tok / n_experts) ** tokens))
        total += size
    return total


def state_bytes(cfg, context: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of decode state one sequence moves per step at `context` cached tokens.

    Full-attention layers read K and V for every cached position: 2 · Hkv · D · context elements of `dtype`.
    Gated DeltaNet layers read and write their fp32 recurrent state (2 · HV · dk · dv · 4 bytes) and their
    conv window (2 · conv_dim · (W - 1) elements of `dtype`).
    """
    cfg = cfg.get_text_config()
    size = torch.tensor([], dtype=dtype).element_size()
    conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + (
        cfg.linear_num_value_heads * cfg.linear_value_head_dim)
    per_layer = {
        "full_attention": 2 * cfg.num_key_value_heads * cfg.head_dim * context * size,
        "linear_attention": 2 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
        + 2 * conv_dim * (cfg.linear_conv_kernel_dim - 1) * size,
    }
    return sum(per_layer[kind] for kind in cfg.layer_types)


def step_bytes(model: torch.nn.Module, batch: int = 1, context: int = 0) -> int:
    """Bytes one decode step of `batch` rows at `context` cached tokens each must move: the roofline's
    numerator (weights once for the batch, state per row)."""
    dtype = model.get_input_embeddings().weight.dtype
    return weight_bytes(model, batch) + batch * state_bytes(model.config, context, dtype)


def ragged_mask(batch: int, prompt_len: int, device) -> torch.Tensor:
    """Attention mask [batch, prompt_len] of left-padded rows whose lengths step down evenly from prompt_len to
    about half of it (row b: prompt_len − b·⌊prompt_len / 2batch⌋ tokens): a concurrent batch of requests."""
    lengths = prompt_len - torch.arange(batch) * (prompt_len // (2 * batch))
    return (torch.arange(prompt_len)[None, :] >= prompt_len - lengths[:, None]).long().to(device)


def _generate(generate_fn: Callable, input_ids: torch.Tensor, n: int, mask: torch.Tensor | None = None) -> float:
    """Run ``generate_fn`` for exactly ``n`` new tokens (greedy, no early EOS); returns wall seconds."""
    _sync(input_ids.device)
    t0 = time.perf_counter()
    out = generate_fn(
        input_ids,
        attention_mask=torch.ones_like(input_ids) if mask is None else mask,
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
    )
    _sync(input_ids.device)
    seconds = time.perf_counter() - t0
    expected = (input_ids.shape[0], input_ids.shape[1] + n)
    if tuple(out.shape) != expected:
        raise RuntimeError(f"generate returned shape {tuple(out.shape)}, expected {expected}")
    return seconds


def positive_int(text: str) -> int:
    """argparse type of the CLIs' lengths and batch sizes: an int >= 1."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {n}")
    return n


def check_lengths(n_short: int, n_long: int, repeats: int = 1) -> None:
    """Refuse timed lengths that time no decode: the speed is the tokens between a short and a long call."""
    if not (n_short >= 1 and n_long > n_short and repeats >= 1):
        raise ValueError(f"decode timing needs n_short >= 1 and n_long > n_short (the speed is the tokens between "
                         f"them over their time difference) and repeats >= 1; got n_short={n_short}, "
                         f"n_long={n_long}, repeats={repeats}")


def decode_tok_per_s(
    generate_fn: Callable, input_ids: torch.Tensor, n_short: int, n_long: int, repeats: int = 3,
    mask: torch.Tensor | None = None, warmed: bool = False, retries: int = 2,
) -> float:
    """Decode speed of ``generate_fn`` in tokens/s per sequence (decode steps per second).

    ``(n_long - n_short) / (t_long - t_short)`` with median wall times, which cancels prefill and per-call
    overhead. One warm-up call at each length first (long first, so a static cache is sized for the longest
    run and is not reallocated; ``warmed``: the caller has just made the long one). Then ``repeats`` timed
    (short, long) pairs, interleaved so that a slow stretch of a shared machine lands on both lengths alike;
    while the medians still read ``t_long <= t_short``, up to ``retries`` more rounds of pairs join the
    samples, and after that it is an error, never a made-up speed. ``generate_fn`` takes HF ``generate``
    arguments.
    """
    check_lengths(n_short, n_long, repeats)
    for n in (n_short,) if warmed else (n_long, n_short):
        _generate(generate_fn, input_ids, n, mask)
    shorts, longs = [], []
    for _ in range(1 + retries):
        for _ in range(repeats):
            shorts.append(_generate(generate_fn, input_ids, n_short, mask))
            longs.append(_generate(generate_fn, input_ids, n_long, mask))
        t_short, t_long = statistics.median(shorts), statistics.median(longs)
        if t_long > t_short:
            return (n_long - n_short) / (t_long - t_short)
    raise RuntimeError(f"timing noise: {n_long} tokens took {t_long:.4f} s, {n_short} took {t_short:.4f} s "
                       f"(medians of {len(longs)} calls each); time longer runs or on a quieter machine")


def step_times(engine, steps: int = 30) -> dict:
    """Where one plain decode step of ``engine`` waits: ``step_host_us``, the host's time to issue it (dynamo's
    guards, the CUDA-graph replay; no sync), and on CUDA ``step_device_us``, CUDA-event time a step over the
    same back-to-back calls. A host time near the device time means the GPU waits on the host. Every row is
    marked done first, so the steps run the whole graph but advance nothing (the next generate resets it)."""
    engine.state["done"].fill_(True)
    cuda = engine.device.type == "cuda"
    for _ in range(3):
        engine._greedy_step()
    _sync(engine.device)
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine._greedy_step()
    host = time.perf_counter() - t0
    out = {"step_host_us": host * 1e6 / steps}
    if cuda:
        end.record()
        end.synchronize()
        out["step_device_us"] = start.elapsed_time(end) * 1e3 / steps
    return out


def spec_rounds(engine, rows: int) -> int:
    """Rounds the last speculative generate call ran for its first `rows` rows (the longest row's; the one
    round past the end that generate.DoneWatch launches is not counted)."""
    return int(engine.spec.rounds[:rows].max())


def _hf_static_generate(model: torch.nn.Module) -> Callable:
    """HF ``generate`` with a static cache; on CUDA transformers then compiles the decode forward itself
    (its default CompileConfig: reduce-overhead, i.e. CUDA graphs). This is the baseline DESIGN.md quotes."""
    return functools.partial(type(model).generate, model, cache_implementation="static")


def _drop_engine(model: torch.nn.Module, device: torch.device | str) -> None:
    """Back to a plain HF model: fastqwen's engine (cache, compiled steps, CUDA graphs) and all dynamo /
    CUDA-graph state released, memory freed, so the next system starts as the first did."""
    model.__dict__.pop("_fastqwen", None)
    model.__dict__.pop("generate", None)
    torch._dynamo.reset()
    _free(device)


def _drop_hf_compiled(model: torch.nn.Module, device: torch.device | str) -> None:
    """Forget transformers' compiled forward and all dynamo / CUDA-graph state, then free memory."""
    for attr in ("_compiled_call", "_last_compile_config", "_previous_max_cache_length"):
        model.__dict__.pop(attr, None)
    torch._dynamo.reset()
    _free(device)


def _measure(label: str, setup: Callable[[], Callable], ids: torch.Tensor, lengths: tuple[int, int],
             say: Callable[[str], None], mask: torch.Tensor | None = None, repeats: int = 3) -> dict:
    """Set up one system and time it (``repeats`` timed calls at each length, see decode_tok_per_s); errors
    are recorded under ``error`` instead of raised.

    Returns ``setup_s`` (seconds for ``setup()``: optimize + warm-up for fastqwen), ``first_call_s`` (seconds
    for the first ``lengths[1]``-token call: includes transformers' lazy compile for hf-static-compile),
    ``tok_s`` (decode tokens/s per sequence) and the ``n_short`` / ``n_long`` used.
    """
    out = {"n_short": lengths[0], "n_long": lengths[1]}
    say(f"{label}: setting up")
    try:
        t0 = time.perf_counter()
        generate_fn = setup()
        _sync(ids.device)
        out["setup_s"] = time.perf_counter() - t0
        say(f"{label}: measuring ({lengths[0]} vs {lengths[1]} new tokens)")
        out["first_call_s"] = _generate(generate_fn, ids, lengths[1], mask)
        out["tok_s"] = decode_tok_per_s(generate_fn, ids, *lengths, repeats, mask, warmed=True)
        say(f"{label}: {out['tok_s']:.1f} tok/s")
    except Exception as e:  # keep benchmarking the other systems
        out["error"] = f"{type(e).__name__}: {e}"[:500]
        say(f"{label}: FAILED {out['error']}")
    return out


def _time_steps(label: str, model, out: dict, say: Callable[[str], None]) -> None:
    """Add `step_times` of the model's engine to a fastqwen system's results ``out`` (unless it failed, or it
    decodes speculatively: its step is a round)."""
    engine = getattr(model, "_fastqwen", None)
    if "error" in out or engine is None or engine.spec is not None:
        return
    out.update(step_times(engine))
    device = f", device {out['step_device_us']:.0f} µs" if "step_device_us" in out else ""
    say(f"{label}: a step: host {out['step_host_us']:.0f} µs{device}")
    if "step_device_us" in out:
        out["step_tok_s"] = 1e6 / out["step_device_us"]  # one token per row a step
        if abs(out["tok_s"] / out["step_tok_s"] - 1) > STEP_AGREEMENT:
            out["timing_suspect"] = True
            say(f"{label}: WARNING: {out['tok_s']:.1f} tok/s from generate's timings, {out['step_tok_s']:.1f} from a "
                "step's device time: the calls' times vary more than the decode between them takes (a slow, noisy "
                "prefill?); the figure is marked '?'; raise --n-long or --repeats")


def _measure_hf_static(label: str, model: torch.nn.Module, ids: torch.Tensor, lengths: tuple[int, int],
                       say: Callable[[str], None], mask: torch.Tensor | None = None, repeats: int = 3) -> dict:
    """``_measure`` HF static cache + compile; adds ``compiled`` (whether transformers really compiled the
    forward: it does not off CUDA) and drops the compiled graphs afterwards."""
    out = _measure(label, lambda: _hf_static_generate(model), ids, lengths, say, mask, repeats)
    out["compiled"] = "_compiled_call" in model.__dict__
    _drop_hf_compiled(model, ids.device)
    return out


def run(
    name: str,
    *,
    model: torch.nn.Module | None = None,
    systems: tuple[str, ...] = DEFAULT_SYSTEMS,
    batch_size: int = 1,
    prompt_len: int = 512,
    n_short: int = 32,
    n_long: int = 160,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cuda",
    compile: bool = True,
    compile_options: dict | None = None,
    progress: Callable[[str], None] | None = print,
    ragged: bool = False,
    quant_lm_head: bool = False,
    kernels: dict | None = None,
    max_seq_len: int | None = None,
    repeats: int = 3,
) -> dict:
    """Benchmark preset ``name`` (random weights, seed 0) on one model object in this process.

    ``model``: that preset already built (sweeps reuse it; it leaves here without fastqwen's engine), else
    it is built here. Returns a dict with the setup, ``copy_bandwidth_Bps`` (bytes/s), ``weight_bytes`` and
    ``step_bytes`` (bytes a decode step moves: weights for the batch, plus KV and recurrent state per row at
    the mean context of the timed window; see `step_bytes`), ``roofline_tok_s`` (bandwidth / step bytes, in
    tokens/s per sequence like every speed here), per-system results under ``systems`` (``tok_s`` in
    tokens/s per sequence, ``setup_s`` / ``first_call_s`` in seconds, plain fastqwen decodes also
    ``step_host_us`` / ``step_device_us`` from `step_times`, on CUDA ``step_tok_s`` (1e6 / step_device_us) and
    ``timing_suspect`` when that and ``tok_s`` differ by more than STEP_AGREEMENT; or ``error``; see ``_measure`` and
    ``_measure_hf_static``), the ratios ``fastqwen_vs_hf_static`` and ``fastqwen_vs_roofline``. fastqwen and
    its alternatives run in the order of ``systems`` (on 35B-A3B a system measured after others runs up to 11%
    slower: docs/BENCHMARKS.md, "the order effect"). HF systems
    run before ``fastqwen.optimize`` (which replaces ``model.generate``); hf-eager uses ``EAGER_N`` lengths on CUDA.
    ``compile`` and ``compile_options`` are passed to ``fastqwen.optimize``. ``ragged``: the rows are prompts of
    different lengths, left-padded (`ragged_mask`), as concurrent requests are; ``prompt_len`` is the longest.
    ``quant_lm_head``: a quantized system quantizes lm_head too (optimize's quant_lm_head); its roofline, from
    the quantized model's bytes, is ``<system>_roofline_tok_s``. ``kernels``: optimize's kernel choices for every
    fastqwen system (a candidate system's own choices override them). ``max_seq_len``: fastqwen's cache size
    (default: just what the run needs, prompt_len + n_long + 64), e.g. 131072 with a short prompt to time what a
    long cache costs a short context (the roofline counts only the KV in use). ``repeats``: timed calls at each
    length (1 for long prompts, where each call prefills again).
    """
    import fastqwen

    say = progress or (lambda _msg: None)
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    quant = [s for s in systems if s in QUANT_SYSTEMS or s in QUANT_VARIANTS]  # (in the order asked)
    if len({QUANT_VARIANTS.get(s, (s,))[0] for s in quant}) > 1 or (quant and model is not None):
        raise ValueError(f"{quant}: a quantized system quantizes the model in place, so a run takes one scheme "
                         "(with or without alternative kernels), on a model it builds itself (run one process per scheme)")
    needed = prompt_len + n_long + 64
    if max_seq_len is not None and max_seq_len < needed:
        raise ValueError(f"max_seq_len={max_seq_len} < prompt_len + n_long + 64 = {needed}")
    max_seq_len = max_seq_len or needed
    res = {"model": name, "batch_size": batch_size, "prompt_len": prompt_len, "max_seq_len": max_seq_len,
           "n_short": n_short,
           "n_long": n_long, "dtype": str(dtype).removeprefix("torch."), "device": str(device), "systems": {},
           "quant_lm_head": quant_lm_head, "kernels": dict(kernels or {}), "compile_options": compile_options}
    mask = ragged_mask(batch_size, prompt_len, device) if ragged and batch_size > 1 else None
    if mask is not None:
        res["row_lengths"] = mask.sum(1).tolist()

    res["copy_bandwidth_Bps"] = copy_bandwidth(device)
    say(f"[{name}] copy bandwidth {res['copy_bandwidth_Bps'] / 1e9:.0f} GB/s")
    built_here = model is None
    if built_here:
        say(f"[{name}] building model ({res['dtype']}, random init)")
        model = presets.build(name, dtype=dtype, device=device, seed=0).eval()
    res["weight_bytes"] = weight_bytes(model, batch_size)
    mean_prompt = prompt_len if mask is None else float(mask.float().sum(1).mean())
    context = int(mean_prompt) + (n_short + n_long) // 2
    res["step_bytes"] = step_bytes(model, batch_size, context)
    res["roofline_tok_s"] = res["copy_bandwidth_Bps"] / res["step_bytes"]
    say(f"[{name}] bytes per step {res['step_bytes'] / 1e9:.3g} GB (weights {res['weight_bytes'] / 1e9:.3g})"
        f" -> roofline {res['roofline_tok_s']:.1f} tok/s per sequence")

    gen = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(vocab, (batch_size, prompt_len), generator=gen).to(device)

    def fastqwen_setup(quant=None, own_kernels=None, options=None) -> Callable:
        """Optimize in place (quantizing first if asked) and compile the graphs; returns ``model.generate``.
        ``options``: inductor options merged over the run's compile options (or the engine's default)."""
        opts = compile_options
        if options:
            opts = {**(compile_options or CUDA_COMPILE_OPTIONS), **options}
        optimized = fastqwen.optimize(model, max_batch_size=batch_size, max_seq_len=max_seq_len,
                                      compile=compile, compile_options=opts, quant=quant,
                                      quant_lm_head=quant_lm_head and quant is not None,
                                      kernels={**(kernels or {}), **(own_kernels or {})})
        optimized._fastqwen.warmup(progress=progress)
        return optimized.generate

    label = f"[{name}]"
    if "hf-eager" in systems:  # HF first: optimize replaces model.generate
        res["systems"]["hf-eager"] = _measure(
            f"{label} hf-eager", lambda: functools.partial(type(model).generate, model), ids,
            EAGER_N if torch.device(device).type == "cuda" else (n_short, n_long), say, mask, repeats)
    if "hf-static-compile" in systems:
        res["systems"]["hf-static-compile"] = _measure_hf_static(
            f"{label} hf-static-compile", model, ids, (n_short, n_long), say, mask, repeats)
    variants = {"fastqwen": {}, **{s: {"own_kernels": k} for s, k in CANDIDATE_SYSTEMS.items()},
                **{s: {"options": o} for s, o in OPTION_SYSTEMS.items()}}
    for system in (s for s in systems if s in variants):  # in the order asked: a later one may run slower
        _drop_engine(model, device)
        res["systems"][system] = _measure(f"{label} {system}", lambda h=variants[system]: fastqwen_setup(**h), ids,
                                          (n_short, n_long), say, mask, repeats)
        _time_steps(f"{label} {system}", model, res["systems"][system], say)
    for system in quant:  # last: it quantizes the model in place (a second system of the scheme: already done)
        _drop_engine(model, device)
        base, own = QUANT_VARIANTS.get(system, (system, None))
        scheme = base.removeprefix("fastqwen-")
        res["systems"][system] = _measure(f"{label} {system}", lambda: fastqwen_setup(scheme, own), ids,
                                          (n_short, n_long), say, mask, repeats)
        _time_steps(f"{label} {system}", model, res["systems"][system], say)
        res[f"{base}_roofline_tok_s"] = res["copy_bandwidth_Bps"] / step_bytes(model, batch_size, context)
    add_ratios(res)
    _drop_engine(model, device)
    if built_here:
        del model
        _free(device)
    return res


def add_ratios(res: dict) -> dict:
    """Set a `run` result's ratios from its systems' tok/s (None where a side is missing or failed):
    ``<candidate>_vs_fastqwen``, ``<quantized>_vs_bf16`` (variants too), ``<variant>_vs_<quantized>``,
    ``fastqwen_vs_hf_static``, ``fastqwen_vs_roofline``. Returns res."""
    tok_s = {system: out.get("tok_s") for system, out in res["systems"].items()}
    ratio = lambda a, b: a / b if a and b else None  # noqa: E731
    for system in (*CANDIDATE_SYSTEMS, *OPTION_SYSTEMS):
        if system in tok_s:
            res[f"{system}_vs_fastqwen"] = ratio(tok_s[system], tok_s.get("fastqwen"))
    for system in (*QUANT_SYSTEMS, *QUANT_VARIANTS):
        if system in tok_s:
            res[f"{system}_vs_bf16"] = ratio(tok_s[system], tok_s.get("fastqwen"))
        if system in tok_s and system in QUANT_VARIANTS:
            base = QUANT_VARIANTS[system][0]
            res[f"{system}_vs_{base}"] = ratio(tok_s[system], tok_s.get(base))
    res["fastqwen_vs_hf_static"] = ratio(tok_s.get("fastqwen"), tok_s.get("hf-static-compile"))
    res["fastqwen_vs_roofline"] = ratio(tok_s.get("fastqwen"), res.get("roofline_tok_s"))
    return res


def _cell(value: float | None, fmt: str) -> str:
    """Format ``value`` with ``fmt``, or an em dash when missing."""
    return "—" if value is None else format(value, fmt)


def _tok_s(out: dict) -> str:
    """A system's tok/s, "?" after it when its step's device time disagrees (``timing_suspect``)."""
    return f"{out['tok_s']:.1f}" + ("?" if out.get("timing_suspect") else "")


def _quant_cell(r: dict) -> str:
    """"scheme tok/s (ratio×)" of each quantized system a run measured (a variant also × its scheme's), or an em
    dash."""
    cells = []
    for system in (*QUANT_SYSTEMS, *QUANT_VARIANTS):
        out = r.get("systems", {}).get(system)
        if out is None:
            continue
        name = system.removeprefix("fastqwen-")
        if "error" in out:
            cells.append(f"{name}: error")
            continue
        base = QUANT_VARIANTS.get(system, (system,))[0]
        ratio, roof = r.get(f"{system}_vs_bf16"), r.get(f"{base}_roofline_tok_s")
        notes = ([f"{ratio:.2f}×"] if ratio else []) + ([f"{out['tok_s'] / roof:.0%} of its roofline"] if roof else [])
        if system != base and r.get(f"{system}_vs_{base}"):
            notes.append(f"{r[f'{system}_vs_{base}']:.3f}× {base.removeprefix('fastqwen-')}")
        cells.append(f"{name} {_tok_s(out)}" + (f" ({', '.join(notes)})" if notes else ""))
    return "; ".join(cells) or "—"


def _candidate_cell(r: dict) -> str:
    """"name tok/s (ratio×)" of each alternative-kernel system a run measured, or an em dash."""
    cells = []
    for system in (*CANDIDATE_SYSTEMS, *OPTION_SYSTEMS):
        out = r.get("systems", {}).get(system)
        if out is not None:
            name = system.removeprefix("fastqwen+")
            ratio = r.get(f"{system}_vs_fastqwen")
            cells.append(f"{name}: error" if "error" in out else
                         f"{name} {_tok_s(out)}" + (f" ({ratio:.2f}×)" if ratio else ""))
    return "; ".join(cells) or "—"


def format_table(results: list[dict]) -> str:
    """Markdown table of ``run`` results: decode tok/s per sequence (and fastqwen's total over the batch),
    roofline tok/s per sequence, ratios, seconds. A result with a top-level ``error`` shows "error" in every
    speed column."""
    head = ["model", "batch", "prompt", "hf-eager tok/s", "hf-static-compile tok/s", "fastqwen tok/s",
            "fastqwen total tok/s", "alternative kernels tok/s (× fastqwen)", "quantized tok/s (× bf16)", "roofline tok/s", "fastqwen / hf-static", "fastqwen / roofline",
            "hf-static first call s", "fastqwen optimize+warm-up s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        s = r.get("systems", {})

        def speed(system: str) -> str:
            out = s.get(system, {})
            return "error" if "error" in out or "error" in r else _tok_s(out) if "tok_s" in out else "—"

        fq = s.get("fastqwen", {}).get("tok_s")
        row = [r["model"], str(r.get("batch_size", "")), str(r.get("prompt_len", "")), speed("hf-eager"),
               speed("hf-static-compile"), speed("fastqwen"),
               _cell(fq * r["batch_size"] if fq else None, ".1f"), _candidate_cell(r), _quant_cell(r),
               _cell(r.get("roofline_tok_s"), ".1f"),
               _cell(r.get("fastqwen_vs_hf_static"), ".2f"), _cell(r.get("fastqwen_vs_roofline"), ".0%"),
               _cell(s.get("hf-static-compile", {}).get("first_call_s"), ".0f"),
               _cell(s.get("fastqwen", {}).get("setup_s"), ".0f")]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
