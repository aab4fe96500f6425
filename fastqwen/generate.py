"""A Hugging Face compatible `generate` over our forward, static cache and compiled decode step.

The loop reads in one go, as in gpt-fast: `prefill` each row's prompt, pick the first token, then call the
compiled `decode_step` once per token. The step takes no arguments: it reads and writes static buffers
(the cache, the last token of each row, finished flags, sampling parameters), so it is one CUDA graph that
never recompiles across calls, prompt lengths or batch contents, and the host never waits on the device
inside it. The host learns that every row has finished through a `DoneWatch`: one step behind, so
the device always has the next step queued and at most one step runs past the end (none when a streamer
or stopping criteria need to see every token). With speculation enabled, the same prefill is followed by
speculative rounds instead (spec/loop.py), each also one compiled graph, watched the same way.
"""

import collections
import hashlib
import json
import os
import threading
import types
import warnings

import torch
from transformers.generation.stopping_criteria import MaxTimeCriteria, StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .cache import HybridCache
from .model import Forward
from .sampling import greedy, repetition_penalty, sample

MAX_SPECULATIVE_TOKENS = 32
# prompt tokens (rows × positions) one prefill forward runs at most: longer prompts prefill in chunks, so a
# prompt's transient activations (MLP: rows × chunk × 2·intermediate) stay bounded whatever its length
PREFILL_CHUNK_TOKENS = 32768
# the compiled steps' inductor options on CUDA unless optimize(compile_options=...) replaces them
CUDA_COMPILE_OPTIONS = {"max_autotune": True, "triton.cudagraphs": True, "coordinate_descent_tuning": True}


def source_digest(root: str = os.path.dirname(__file__)) -> str:
    """sha256 of fastqwen's source under `root` (its .py, .cu and .cuh files, paths and bytes): what no traced graph
    shows, e.g. an op's output-shape heuristic (split counts), changes it."""
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith((".py", ".cu", ".cuh"))):
            path = os.path.join(folder, name)
            h.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def compile_cache_tag(schemas: list[str] | None = None, table: dict | None = None, source: str | None = None) -> str:
    """A tag for inductor's on-disk cache keys (torch.compiler.config.cache_key_tag) naming what a compiled step
    depends on beyond its traced code: the schemas of fastqwen's registered ops, the weight-streaming
    kernel's launch table (a quantized linear's output holds one partial sum per split, so the table shapes the
    graph) and fastqwen's source (source_digest: the ops' shape functions are not in the graph). torch's own key
    misses them: after an op's arguments change, a step compiled by the older fastqwen is served from the cache
    and calls the op with the old arguments (reproduced with torch 2.13). Defaults: the ops registered now,
    ops/gemv_configs.json as loaded and this package's source."""
    if schemas is None:
        ns = torch.ops.fastqwen
        schemas = [str(getattr(ns, name).default._schema) for name in dir(ns)
                   if isinstance(getattr(ns, name, None), torch._ops.OpOverloadPacket)]
    if table is None:
        from .ops.gemv import _TUNED as table
    text = json.dumps([sorted(schemas), table, source_digest() if source is None else source], sort_keys=True)
    return "fastqwen-" + hashlib.sha256(text.encode()).hexdigest()[:16]


class DoneWatch:
    """The host's view of "every row is done" (done: a bool view [B] of the static flags) without stalling
    the device. `launched()` after each launch queues a copy of done.all() (on CUDA: asynchronous, into
    pinned memory, with an event); `finished()` reads only the copy from `lag` launches ago, so with lag 2 the
    device runs the latest launch while the host waits, and exactly one launch runs past the end (it computes
    for finished rows and changes nothing). lag 1 reads the latest launch's copy: no launch past the end,
    but the device idles while the host launches the next one. The first copy (the flags before any launch,
    e.g. every row already ended by its first token) is read at once: nothing is launched for rows that are
    all done."""

    def __init__(self, done: torch.Tensor, lag: int):
        self.done, self.lag = done, lag
        self.cuda = done.is_cuda
        self.pending = collections.deque()  # (flag, event or None), oldest first
        self.free = []  # pinned flags and events already read, for reuse
        self.first = True

    def launched(self) -> None:
        flag = self.done.all()
        if not self.cuda:
            self.pending.append((flag, None))
            return
        host, event = self.free.pop() if self.free else (torch.empty((), dtype=torch.bool, pin_memory=True),
                                                         torch.cuda.Event())
        host.copy_(flag, non_blocking=True)
        event.record()
        self.pending.append((host, event))

    def finished(self) -> bool:
        """Whether the copy from `lag` launches ago (or any older one not read yet) says every row is done."""
        lag, self.first = 1 if self.first else self.lag, False
        while len(self.pending) >= lag:
            host, event = self.pending.popleft()
            if event is not None:
                event.synchronize()
                self.free.append((host, event))
            if bool(host):
                return True
        return False


# GenerationConfig fields that change the decoding algorithm, with the value that means "off".
_UNSUPPORTED = {
    "num_beams": 1, "num_beam_groups": 1, "penalty_alpha": None,
    "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "force_words_ids": None, "constraints": None,
    "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None, "diversity_penalty": 0.0,
    "guidance_scale": None, "sequence_bias": None, "suppress_tokens": None, "begin_suppress_tokens": None,
    "forced_bos_token_id": None, "forced_eos_token_id": None, "exponential_decay_length_penalty": None,
    "watermarking_config": None, "prompt_lookup_num_tokens": None, "dola_layers": None,
    "assistant_ensemble_weight": None,  # (speculation verified against a mix of the target and the draft: lossy)
    "output_scores": False, "output_logits": False, "output_attentions": False, "output_hidden_states": False,
    "renormalize_logits": False, "remove_invalid_values": False, "token_healing": False,
}
# Arguments of GenerationMixin.generate that we do not implement; passing a value that asks for something (not None,
# False or an empty list) is an error.
_UNSUPPORTED_ARGS = (
    "logits_processor", "prefix_allowed_tokens_fn", "synced_gpus", "assistant_model", "negative_prompt_ids",
    "negative_prompt_attention_mask", "custom_generate", "inputs_embeds", "past_key_values", "cache",
    "pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "position_ids",
)


def _asks_for_something(value) -> bool:
    """Whether an unsupported generate argument's value changes anything: None, False (synced_gpus) and an empty
    list (an empty LogitsProcessorList, as some callers pass by default) do not."""
    return value is not None and value is not False and not (isinstance(value, (list, tuple)) and not value)


def check_num_speculative_tokens(k) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens must be an int in 1..{MAX_SPECULATIVE_TOKENS}, got {k!r}")


class Engine:
    """Owns the cache, the forward and the compiled decode steps of one optimized model."""

    def __init__(self, model, *, max_batch_size: int, max_seq_len: int, compile: bool, compile_options=None,
                 compile_cache=None, kernels=None, prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS):
        self.model = model
        self.prefill_chunk_tokens = prefill_chunk_tokens
        embed = model.get_input_embeddings().weight
        self.device, self.dtype = embed.device, embed.dtype
        self.vocab_size = model.lm_head.out_features
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.cache = HybridCache(
            model.config.get_text_config(), max_batch_size, max_seq_len, self.dtype, self.device
        )
        self.forward = Forward(model, self.cache, kernels)
        B, dev = max_batch_size, self.device
        self.state = {
            "tokens": torch.zeros(B, dtype=torch.long, device=dev),  # last token of each row, not yet cached
            "done": torch.ones(B, dtype=torch.bool, device=dev),
            "n_generated": torch.zeros((), dtype=torch.long, device=dev),
            "min_new": torch.zeros((), dtype=torch.long, device=dev),
            "pad": torch.zeros((), dtype=torch.long, device=dev),
            "eos_mask": torch.zeros(self.vocab_size, dtype=torch.bool, device=dev),
            "temperature": torch.ones(B, device=dev),
            "top_k": torch.zeros(B, dtype=torch.long, device=dev),
            "top_p": torch.ones(B, device=dev),
            "min_p": torch.zeros(B, device=dev),
            "penalty": torch.ones(B, device=dev),  # repetition_penalty (1: off)
            "seen": torch.zeros(B, self.vocab_size, dtype=torch.bool, device=dev),  # tokens in each row's sequence
        }
        for buf in self.state.values():
            torch._dynamo.mark_static_address(buf)
        self.compiled = compile
        if compile and compile_options is None and self.device.type == "cuda":
            compile_options = dict(CUDA_COMPILE_OPTIONS)
        # inductor's kernels too (launch "auto" resolves to PDL only from Hopper on)
        if compile and self.forward.kernels["launch"] == "pdl":
            compile_options = {**(compile_options or {}), "triton.enable_pdl": True}
        self.compile_options = compile_options
        self.compile_cache = compile_cache
        self.reductions = self.forward.kernels["reductions"]
        self.cache_tag = compile_cache_tag()
        if self.reductions != "inductor":
            from . import reductions

            self.cache_tag += reductions.tag(self.reductions)
        if compile and compile_cache is not None and os.path.exists(compile_cache):
            with open(compile_cache, "rb") as f:
                loaded = torch.compiler.load_cache_artifacts(f.read())
            if loaded is None:  # (torch logs that alone, naming no file)
                warnings.warn(f"compile_cache {os.fspath(compile_cache)!r} holds no compiled artifacts this torch can "
                              f"read (damaged, truncated or another file): the steps compile from scratch, and "
                              f"warmup() will overwrite it", stacklevel=3)
        self._greedy_step = self.compile(self._greedy_impl)
        self._sample_step = self.compile(self._sample_impl)
        self._penalized_steps = {}  # do_sample -> the compiled step with the repetition penalty, built on first use
        self.penalized = False  # the current call's repetition_penalty is on (_set_params)
        self.spec = None
        self.lock, self.holder = threading.Lock(), None  # one call at a time: it holds the cache (thread id)

    def __deepcopy__(self, memo):
        """Refused: the steps are bound to this engine, so a copy's generate would run this one's cache and state."""
        raise TypeError("an optimized model cannot be deep-copied (the copy's generate would run the original's "
                        "cache): copy.deepcopy the model before fastqwen.optimize, then optimize each copy")

    def compile(self, fn):
        """fn (run without autograd) compiled as one full graph with this engine's options, or as is when
        compile=False."""
        if self.compiled:
            fn = torch.compile(_own_code(fn), fullgraph=True, options=self.compile_options)
            if self.reductions != "inductor":  # (kernels["reductions"]: inductor's heuristic while it compiles)
                from . import reductions

                fn = reductions.compiled_under(fn, self.reductions)
        return torch.no_grad()(fn)

    def enable_speculation(self, proposer, k: int) -> None:
        """Decode speculatively from now on: `proposer` drafts k tokens a round (see spec/loop.py).

        Reallocates the cache with room for the verify block's replay inputs.
        """
        from .spec.loop import Speculator

        check_num_speculative_tokens(k)
        if k + 3 > self.max_seq_len:  # (generate's smallest call: a 1-token prompt, 1 new token, a block)
            raise ValueError(f"max_seq_len={self.max_seq_len} leaves no room for a 1-token prompt, a new token and a "
                             f"verify block of {k + 1} tokens; pass max_seq_len >= {k + 3} or speculate fewer tokens")
        self.cache = self.forward.cache = None  # (freed first: two caches at once may not fit)
        self.cache = HybridCache(self.model.config.get_text_config(), self.max_batch_size, self.max_seq_len,
                                 self.dtype, self.device, block=k + 1)
        self.forward.cache = self.cache
        self.spec = Speculator(self, proposer, k)

    # ----- the compiled step --------------------------------------------------------------------------
    def _greedy_impl(self) -> None:
        self._decode_step(do_sample=False)

    def _sample_impl(self) -> None:
        self._decode_step(do_sample=True)

    def _decode_step(self, do_sample: bool, penalized: bool = False) -> None:
        """Run each row's last token at its position, append the next token; finished rows emit pad."""
        logits = self.forward.step(self.state["tokens"][:, None])[:, -1]
        advanced = ~self.state["done"]
        self.state["tokens"].copy_(self._select(logits, do_sample, penalized))
        self.cache.lengths.add_(advanced.long())

    def _step_for(self, do_sample: bool):
        """The compiled decode step for this call: plain, or with the repetition penalty (a graph of its own, so
        that calls without one run no [B, V] penalty work)."""
        if not self.penalized:
            return self._sample_step if do_sample else self._greedy_step
        if do_sample not in self._penalized_steps:
            self._penalized_steps[do_sample] = self.compile(lambda: self._decode_step(do_sample, penalized=True))
        return self._penalized_steps[do_sample]

    def _select(self, logits: torch.Tensor, do_sample: bool, penalized: bool = False) -> torch.Tensor:
        """Next token per row from logits [B, V]; updates `done` and `n_generated` in place (penalized: the
        repetition penalty over `seen` first, and the chosen tokens marked seen)."""
        s = self.state
        if penalized:
            logits = repetition_penalty(logits, s["seen"], s["penalty"])
        blocked = s["eos_mask"] & (s["n_generated"] < s["min_new"])
        logits = logits.masked_fill(blocked, float("-inf"))
        if do_sample:
            nxt = sample(logits, s["temperature"], s["top_k"], s["top_p"], s["min_p"])
        else:
            nxt = greedy(logits)
        nxt = torch.where(s["done"], s["pad"], nxt)
        if penalized:
            s["seen"].scatter_(1, nxt[:, None], True)
        s["done"].logical_or_(s["eos_mask"][nxt])
        s["n_generated"].add_(1)
        return nxt

    # ----- generate -----------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, inputs=None, generation_config=None, logits_processor=None, stopping_criteria=None,
                 prefix_allowed_tokens_fn=None, synced_gpus=None, assistant_model=None, streamer=None,
                 negative_prompt_ids=None, negative_prompt_attention_mask=None, custom_generate=None, **kwargs):
        """transformers' `generate` contract for greedy and sampled decoding, with its parameters in its positional
        order (so that a positional call binds as it does there); see README for what is supported."""
        named = dict(logits_processor=logits_processor, prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
                     synced_gpus=synced_gpus, assistant_model=assistant_model, negative_prompt_ids=negative_prompt_ids,
                     negative_prompt_attention_mask=negative_prompt_attention_mask, custom_generate=custom_generate)
        for name in _UNSUPPORTED_ARGS:
            if _asks_for_something(named[name] if name in named else kwargs.pop(name, None)):
                raise ValueError(f"fastqwen's generate does not support `{name}`; call the model's original "
                                 f"generate (type(model).generate(model, ...)) for it")
        embed = self.model.get_input_embeddings().weight
        if (embed.dtype, embed.device) != (self.dtype, self.device):  # (.to() after optimize: cache, fused weights)
            raise ValueError(f"the model is now {embed.dtype} on {embed.device}, but fastqwen.optimize built its cache "
                             f"and fused weights for {self.dtype} on {self.device}: call fastqwen.optimize(model, ...) "
                             f"again after casting or moving the model")
        stale = self.forward.stale_fusion()
        if stale is not None:
            name = next((n for n, m in self.model.named_modules() if m is stale), type(stale).__name__)
            raise ValueError(f"{name}'s weights were replaced since fastqwen.optimize (load_state_dict(assign=True), "
                             f"a LoRA merge, …), but its fused copy holds the old ones: call fastqwen.optimize(model, "
                             f"...) again")
        if inputs is not None and kwargs.get("input_ids") is not None:
            raise ValueError("generate got both `inputs` and `input_ids`: pass the prompt once")
        input_ids = kwargs.pop("input_ids", inputs)
        attention_mask = kwargs.pop("attention_mask", None)
        tokenizer = kwargs.pop("tokenizer", None)  # (stop_strings')
        k = self._speculative_tokens(kwargs.pop("num_speculative_tokens", None))
        kwargs.pop("use_cache", None)
        keep = kwargs.pop("logits_to_keep", None)  # (which positions' logits a forward returns: never the tokens)
        if keep is not None and not (isinstance(keep, int) and not isinstance(keep, bool) and keep >= 0
                                     or isinstance(keep, torch.Tensor)):
            raise ValueError(f"logits_to_keep must be an int >= 0 or a tensor of positions, got {keep!r}")
        types = kwargs.pop("mm_token_type_ids", None)  # (Qwen3.5's processor returns them, all 0 for text alone)
        if types is not None and bool(torch.as_tensor(types).any()):
            raise ValueError("mm_token_type_ids mark image or video tokens in the prompt; fastqwen generates from text "
                             "alone: call the model's original generate (type(model).generate(model, ...)) for them")
        default_max_length = (kwargs.get("max_length") is None and getattr(generation_config, "max_length", None)
                              is None and self.model.generation_config.max_length is None)  # (as transformers)
        gen, unused = self.model._prepare_generation_config(generation_config, **kwargs)
        unused = {k: v for k, v in unused.items() if v is not None}
        if unused:
            raise ValueError(f"fastqwen's generate got unsupported arguments: {sorted(unused)}")
        self._check_config(gen)
        criteria = self._stopping_criteria(gen, stopping_criteria, tokenizer)
        eos = self._eos_ids(gen)
        # without an attention_mask, transformers takes pad_token_id (where it is no EOS) for padding
        pad_is_padding = gen.pad_token_id if gen.pad_token_id is not None and gen.pad_token_id not in eos else None
        rows, input_ids = self._split_rows(input_ids, attention_mask, gen.num_return_sequences or 1, pad_is_padding)
        max_new, min_new = self._lengths(gen, input_ids.shape[1], default_max_length,
                                         getattr(self.model.config, "max_position_embeddings", None))
        block = self.spec.k + 1 if self.spec else 0
        too_long = [b for b, r in enumerate(rows) if len(r) + max_new + block > self.max_seq_len]
        if too_long:
            extra = f" + one speculative block ({block})" if block else ""
            raise ValueError(
                f"rows {too_long}: prompt ({max(len(rows[b]) for b in too_long)} tokens) + max_new_tokens "
                f"({max_new}){extra} exceeds max_seq_len={self.max_seq_len}; pass a larger max_seq_len to "
                f"fastqwen.optimize or generate fewer tokens")
        vocab = self.state["eos_mask"].numel()
        pad = gen.pad_token_id if gen.pad_token_id is not None else next((e for e in eos if 0 <= e < vocab), 0)
        if self.holder == threading.get_ident():  # (waiting for itself would never end)
            raise RuntimeError("generate was called from inside this model's generate (by a streamer or stopping "
                               "criterion?); its static cache serves one call at a time: call it after that one")
        with self.lock:  # a call from another thread waits for this one to end, rather than resetting its cache
            self.holder = threading.get_ident()
            try:
                self._set_params(gen, eos, pad, min_new)
                if streamer is not None:
                    streamer.put(input_ids.cpu())
                with torch.compiler.config.patch(cache_key_tag=self.cache_tag):  # (compiles happen in here, if any)
                    sequences = self._decode(rows, max_new, gen.do_sample, streamer, criteria, input_ids, eos, k)
            finally:
                self.holder = None
        sequences = torch.cat([input_ids, sequences], dim=1)
        if streamer is not None:
            streamer.end()
        if gen.return_dict_in_generate:
            return GenerateDecoderOnlyOutput(sequences=sequences)
        return sequences

    def _speculative_tokens(self, k):
        """generate's num_speculative_tokens: None (the optimize-time k), or an int 1 … that k."""
        if k is None:
            return None
        if self.spec is None:
            raise ValueError("num_speculative_tokens applies to speculative decoding; optimize the model with "
                             "speculate='mtp' or 'dflash'")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= self.spec.k:
            raise ValueError(f"num_speculative_tokens must be an int in 1..{self.spec.k} (the most this model was "
                             f"optimized for: raise optimize's num_speculative_tokens / block_size), got {k!r}")
        return k

    def _decode(self, rows, max_new, do_sample, streamer, criteria, input_ids, eos, k=None):
        """Prefill every row, then decode (k drafts a speculative round, default the optimize-time k); returns the
        new tokens [B, n] (n ≤ max_new), pad after EOS or where `criteria` (a StoppingCriteriaList or None) ended
        a row."""
        s, B = self.state, len(rows)
        first = self._prefill(rows, do_sample)
        each = streamer is not None or criteria is not None  # the host sees every token anyway
        watch = DoneWatch(s["done"][:B], lag=1 if each else 2)
        if self.spec is not None:
            return self.spec.decode(first, B, max_new, do_sample, streamer, watch, k, criteria, input_ids,
                                    pad_ended=bool(eos))
        out = torch.empty(self.max_batch_size, max_new, dtype=torch.long, device=self.device)
        out[:, 0] = first
        step = self._step_for(do_sample)
        stopped = torch.zeros(B, dtype=torch.bool, device=self.device)  # rows the criteria ended, without an EOS
        n = 1
        while True:
            if streamer is not None:
                streamer.put(out[:B, n - 1].cpu())
            if criteria is not None:  # (transformers pads the rows they end only with an EOS; else they run on)
                hit = criteria(torch.cat([input_ids, out[:B, :n]], dim=1), None).to(self.device)
                if eos:
                    s["done"][:B] |= hit
                else:
                    stopped |= hit
            watch.launched()
            if n == max_new or watch.finished() or (criteria is not None and not eos and bool(stopped.all())):
                break
            step()
            out[:, n] = s["tokens"]
            n += 1
        return self._trim(out[:B, :n], eos, s["done"][:B])

    def _prefill(self, rows, do_sample):
        """Empty the cache, run every prompt, pick each row's first token; returns it [max_batch_size]. With the
        repetition penalty on, each row's prompt tokens are marked seen first (not its left padding, which
        transformers' processor skips too: prompt_ignore_length)."""
        s, B = self.state, len(rows)
        self.cache.reset()
        logits = torch.zeros(self.max_batch_size, self.vocab_size, device=self.device)
        start = 0
        while start < B:  # runs of consecutive rows with equal prompt lengths prefill together
            end = start + 1
            while end < B and len(rows[end]) == len(rows[start]):
                end += 1
            tokens = torch.stack(rows[start:end])
            features = self.spec.proposer.features if self.spec is not None else None
            chunk = self._prefill_chunk(end - start)
            for pos in range(0, tokens.shape[1], chunk):
                part = tokens[:, pos:pos + chunk]
                logits[start:end], feats = self.forward.prefill(start, part, features, pos)
                if self.spec is not None:
                    self.spec.proposer.prefill(self, start, part, feats, pos)
            self.cache.lengths[start:end] = len(rows[start])
            start = end
        s["done"].fill_(True)
        s["done"][:B] = False
        s["n_generated"].zero_()
        if self.penalized:
            s["seen"].zero_()
            for b, row in enumerate(rows):
                s["seen"][b, row] = True
        first = self._select(logits, do_sample, self.penalized)
        s["tokens"].copy_(first)
        return first

    def _prefill_chunk(self, n_rows: int) -> int:
        """Positions per prefill forward for n_rows rows: within prefill_chunk_tokens, a multiple of 64 where
        that leaves any (the chunked GDN kernel's block), at least 1."""
        chunk = max(1, self.prefill_chunk_tokens // n_rows)
        return chunk - chunk % 64 if chunk >= 64 else chunk

    @staticmethod
    def _trim(new_tokens, eos, done):
        """Drop trailing columns in which every row had already finished (as transformers stops)."""
        if not bool(done.all()) or not eos:
            return new_tokens
        is_eos = torch.isin(new_tokens, torch.tensor(eos, device=new_tokens.device))
        has_eos = is_eos.any(1)
        if not bool(has_eos.all()):
            return new_tokens  # some row was stopped by a stopping criterion: keep the full width
        last = int(is_eos.int().argmax(1).max())
        return new_tokens[:, : last + 1]

    # ----- argument handling --------------------------------------------------------------------------
    def _check_config(self, gen) -> None:
        for field, off in _UNSUPPORTED.items():
            value = getattr(gen, field, None)
            if value is not None and value != off and not (off is False and value is None):
                raise ValueError(f"fastqwen's generate does not support {field}={value!r} (supported: greedy and "
                                 f"sampling with temperature/top_k/top_p/min_p); leave it unset, or call the model's "
                                 f"original generate (type(model).generate(model, ...)) for it")
        copies = gen.num_return_sequences
        if copies is not None and (not isinstance(copies, int) or isinstance(copies, bool) or copies < 1):
            raise ValueError(f"num_return_sequences must be an int >= 1, got {copies!r}")
        if gen.do_sample:
            if gen.temperature is None or gen.temperature <= 0:
                raise ValueError(f"temperature must be > 0 when do_sample=True, got {gen.temperature}")
            if gen.temperature < 1e-20:  # (logits / it overflow fp32: NaN probabilities, an arbitrary token)
                raise ValueError(f"temperature={gen.temperature} is too small to sample with (the scaled logits "
                                 f"overflow fp32); for the most likely token pass do_sample=False")
            if gen.top_p is not None and not 0 < gen.top_p <= 1:
                raise ValueError(f"top_p must be in (0, 1], got {gen.top_p}")
            k = gen.top_k
            if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
                raise ValueError(f"top_k must be an int >= 0 (0: off), got {k!r}")
            if gen.min_p is not None and not 0 <= gen.min_p <= 1:
                raise ValueError(f"min_p must be in [0, 1] (0: off), got {gen.min_p}")
        rp = gen.repetition_penalty
        if rp is not None and not (isinstance(rp, (int, float)) and not isinstance(rp, bool) and rp > 0):
            raise ValueError(f"repetition_penalty must be a number > 0 (1: off), got {rp!r}")

    @staticmethod
    def _stopping_criteria(gen, stopping_criteria, tokenizer):
        """The call's host-side stopping criteria as one StoppingCriteriaList (None without any): the caller's (a
        list, or one criterion), then max_time's and stop_strings' as transformers builds them. Max length and
        EOS stop rows on the device."""
        if stopping_criteria is None:
            given = []
        elif isinstance(stopping_criteria, (list, tuple)):
            given = list(stopping_criteria)
        else:
            given = [stopping_criteria]
        if gen.max_time is not None:
            given.append(MaxTimeCriteria(max_time=gen.max_time))
        if gen.stop_strings is not None:
            if tokenizer is None:
                raise ValueError("stop_strings need the model's tokenizer to match decoded text: pass it as "
                                 "generate(..., stop_strings=..., tokenizer=tokenizer)")
            given.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=gen.stop_strings))
        return StoppingCriteriaList(given) if given else None

    def _split_rows(self, input_ids, attention_mask, copies: int = 1, pad_id: int | None = None):
        """Validate the batch and repeat each row `copies` times in place (num_return_sequences: row b's copies
        become rows b·copies … b·copies + copies − 1, as transformers orders them); returns the real tokens of each
        row (padding removed) and input_ids on device. Without an attention_mask, tokens equal to pad_id (if given)
        are padding, as transformers infers its mask."""
        if input_ids is None:
            raise ValueError("generate needs input_ids [batch, length] (a LongTensor of token ids)")
        if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int):
            got = (f"{input_ids.dtype} of shape {tuple(input_ids.shape)}" if torch.is_tensor(input_ids) else
                   type(input_ids).__name__)
            raise ValueError(f"input_ids must be a 2-D integer tensor [batch, length] of int64 (or int32) token ids; "
                             f"got {got}")
        input_ids = input_ids.to(self.device, torch.long)
        B, L = input_ids.shape
        if B == 0 or L == 0:
            raise ValueError("empty prompt: input_ids must hold at least one token per row")
        if B * copies > self.max_batch_size:
            rows = f"{B} rows × num_return_sequences {copies}" if copies > 1 else f"{B} rows"
            raise ValueError(f"batch of {rows} exceeds max_batch_size={self.max_batch_size}; pass a larger "
                             f"max_batch_size to fastqwen.optimize")
        if attention_mask is None:
            mask = input_ids != pad_id if pad_id is not None else torch.ones_like(input_ids, dtype=torch.bool)
            if pad_id is not None and not bool((mask[:, 1:] >= mask[:, :-1]).all()):
                raise ValueError(f"input_ids hold pad_token_id={pad_id} inside a prompt, not only as left padding; "
                                 f"transformers would mask those tokens out: pass an attention_mask (and left "
                                 f"padding), or a pad_token_id that the prompts do not use")
        else:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids {(B, L)}")
            mask = attention_mask.to(self.device).bool()
            if not bool((mask[:, 1:] >= mask[:, :-1]).all()):
                raise ValueError("only left padding is supported: tokenize with padding_side='left'")
        if copies > 1:
            input_ids, mask = input_ids.repeat_interleave(copies, dim=0), mask.repeat_interleave(copies, dim=0)
        lengths = mask.sum(1).tolist()
        if min(lengths) == 0:
            raise ValueError(f"empty prompt in rows {[b for b, n in enumerate(lengths) if n == 0]}")
        if int(input_ids.max()) >= self.vocab_size or int(input_ids.min()) < 0:
            raise ValueError(f"input_ids hold token ids outside the vocabulary [0, {self.vocab_size})")
        return [input_ids[b, L - n:] for b, n in enumerate(lengths)], input_ids

    @staticmethod
    def _lengths(gen, input_len: int, default_max_length: bool = False, max_positions: int | None = None):
        """(max_new, min_new) tokens for prompts of input_len positions, as transformers' _prepare_generated_length
        reads them: max_new_tokens over max_length; a max_length that nobody set (default_max_length: transformers'
        20) counts new tokens, within max_positions; min_new_tokens over min_length."""
        if gen.max_new_tokens is not None:
            max_new = gen.max_new_tokens
        elif default_max_length:
            total = gen.max_length + input_len
            max_new = (total if max_positions is None else min(total, max_positions)) - input_len
        else:
            max_new = gen.max_length - input_len
        if max_new < 1:
            raise ValueError(f"nothing to generate: max_new_tokens={max_new} (max_length={gen.max_length}, "
                             f"prompt length {input_len}); pass max_new_tokens >= 1")
        if gen.min_new_tokens is not None:
            min_new = gen.min_new_tokens
        else:
            min_new = max(0, (gen.min_length or 0) - input_len)
        return max_new, min_new

    @staticmethod
    def _eos_ids(gen) -> list[int]:
        eos = gen.eos_token_id
        if eos is None:
            return []
        if torch.is_tensor(eos):
            eos = eos.tolist()
        return [eos] if isinstance(eos, int) else list(eos)

    def _set_params(self, gen, eos, pad, min_new) -> None:
        s = self.state
        s["eos_mask"].zero_()
        vocab = s["eos_mask"].numel()
        eos = [e for e in eos if 0 <= e < vocab]  # (an id past the vocabulary is never sampled, as in transformers)
        if eos:
            s["eos_mask"][torch.tensor(eos, device=self.device)] = True
        if not 0 <= pad < vocab:
            raise ValueError(f"pad_token_id={pad} is no token id (0 … {vocab - 1}): finished rows are fed it; pass "
                             f"a pad_token_id in the vocabulary")
        s["pad"].fill_(pad)
        s["min_new"].fill_(min_new)
        s["temperature"].fill_(gen.temperature if gen.do_sample else 1.0)
        s["top_k"].fill_(gen.top_k or 0)
        s["top_p"].fill_(gen.top_p if gen.top_p is not None else 1.0)
        s["min_p"].fill_(gen.min_p or 0.0)
        self.penalized = gen.repetition_penalty not in (None, 1, 1.0)
        s["penalty"].fill_(gen.repetition_penalty if self.penalized else 1.0)

    def warmup(self, do_sample: bool = False, progress=None) -> None:
        """Compile (and capture) the decode step with a short dummy generation, so later calls run warm.

        With a compile_cache path, the compiled artifacts (inductor graphs, autotuning results) are saved
        there, and loaded by the next optimize() given the same path, in any process.
        """
        if progress:
            slow = " (the first run on a GPU can take minutes: max-autotune)" if (
                self.compile_options or {}).get("max_autotune") else ""
            progress(f"compiling the decode step{slow}…")
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        n = min(4, self.max_seq_len - 1 - (self.spec.k + 1 if self.spec else 0))
        # (the mask: a generation_config pad_token_id of 0 would otherwise make the dummy prompt padding)
        self.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=do_sample)
        if self.compiled and self.compile_cache is not None:
            artifacts = torch.compiler.save_cache_artifacts()
            if artifacts is not None:
                with open(self.compile_cache, "wb") as f:
                    f.write(artifacts[0])
        if progress:
            progress("decode step compiled")


def _own_code(fn):
    """fn (a function or bound method) over a private copy of its code object. Dynamo keys its compile cache
    on code objects: without the copy, every compiled step of every engine would share one cache (and its
    recompile limit), and compiling a new step would count as a recompile of the others."""
    f = getattr(fn, "__func__", fn)
    g = types.FunctionType(f.__code__.replace(co_varnames=f.__code__.co_varnames), f.__globals__, f.__name__,
                           f.__defaults__, f.__closure__)
    g.__kwdefaults__ = f.__kwdefaults__
    return types.MethodType(g, fn.__self__) if hasattr(fn, "__func__") else g
