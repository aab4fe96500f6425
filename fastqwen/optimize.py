"""`optimize(model)`: check the model, build the cache and engine, bind our `generate`."""

import os
import warnings

import torch
from torch import nn
from transformers import (
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
)

from .generate import PREFILL_CHUNK_TOKENS, Engine, check_num_speculative_tokens
from .model import check_kernels, text_model

SUPPORTED = (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5ForConditionalGeneration,
             Qwen3_5MoeForConditionalGeneration)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


SPECULATE = ("mtp", "dflash")


def optimize(model, *, max_batch_size: int = 1, max_seq_len: int = 4096, compile: bool = True,
             compile_options: dict | None = None, speculate: str | None = None,
             num_speculative_tokens: int | None = None, draft=None, block_size: int | None = None,
             quant: str | None = None, quant_group_size: int = 128, quant_lm_head: bool = False,
             draft_lm_head: str | None = None, draft_vocab=None, compile_cache=None, kernels: dict | None = None,
             draft_quant: str | None = None, prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS):
    """Make `model.generate` run on fastqwen's static hybrid cache and compiled decode step.

    model: a transformers Qwen3.5 / Qwen3.6 model (dense or MoE; CausalLM or ConditionalGeneration, text-only
    generation) on one device. max_batch_size / max_seq_len size the cache, which is allocated now; a prompt
    plus max_new_tokens must fit in max_seq_len. compile: compile the decode step (on CUDA with max-autotune
    and CUDA graphs); compile_options: inductor options overriding that choice; compile_cache: a file where
    warmup() saves the compiled artifacts and from which a later optimize() (any process) loads them.
    draft_lm_head: with speculate, draft through a copy of lm_head quantized in this scheme ("fp8-weight",
    "fp8" or "int4"): each draft step reads a quarter to half of the bytes of the 248k-row lm_head, the
    output stays exact (the target verifies with its own lm_head), acceptance may drop slightly.
    draft_vocab: with speculate, draft over a subset of the vocabulary only: an int N (token ids 0 … N−1) or
    the token ids themselves (e.g. a corpus's most frequent); each draft step reads N of the lm_head's rows.
    Exact output as well (spec/draft_head.py); acceptance drops where the target's token is outside the subset.
    kernels: the kernel of each op whose alternatives are still being measured, e.g. {"attention": "split",
    "experts": "grouped"} (model.check_kernels lists them; the defaults are the measured fastest).
    quant: also quantizes the speculative draft (the MTP head's or the DFlash draft's linears and experts) in
    the same scheme: it is read every round, and its precision only moves acceptance, never the output.
    draft_quant: the draft's scheme when it should differ from quant's, e.g. "fp8-weight" drafts for a bf16
    target (half the draft's bytes a round; the target verifies in bf16, so the output is unchanged).
    prefill_chunk_tokens: the most prompt tokens (rows × positions) one prefill forward runs; longer prompts
    prefill in chunks (same output), which bounds prefill's activation memory (lower it on a smaller GPU).
    num_speculative_tokens: with speculate="mtp", the tokens drafted a round (default 3); block_size: with
    speculate="dflash", the verify block (drafts + the pending token; default the draft's own). Either one given
    for the other speculate mode, or draft= without speculate, is an error (never silently dropped).
    Returns the same model object; its weights and module tree are untouched, and the original generate
    stays reachable as `type(model).generate(model, ...)`.
    """
    if not isinstance(model, SUPPORTED):
        names = ", ".join(c.__name__ for c in SUPPORTED)
        raise TypeError(f"fastqwen.optimize supports {names}; got {type(model).__name__}")
    for name, value in (("max_batch_size", max_batch_size), ("max_seq_len", max_seq_len),
                        ("prefill_chunk_tokens", prefill_chunk_tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not isinstance(compile, bool):  # ("max-autotune" or "reduce-overhead" would compile with other options)
        raise ValueError(f"compile must be True or False, got {compile!r}; inductor's options go in compile_options")
    if compile_options is not None and not isinstance(compile_options, dict):
        raise ValueError(f"compile_options must be a dict of inductor options, e.g. {{'max_autotune': False}}; got "
                         f"{compile_options!r}")
    if max_seq_len < 2:
        raise ValueError("max_seq_len must be at least 2 (one prompt token and one new token)")
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        raise ValueError(f"fastqwen.optimize needs the model on one device; its parameters are on {devices}")
    device = devices.pop()
    if device.type == "meta":
        raise ValueError("fastqwen.optimize got a model on the meta device (its weights were never loaded): load its "
                         "weights (e.g. from_pretrained without a meta device map, or to_empty() then "
                         "load_state_dict) before fastqwen.optimize")
    dtype = model.get_input_embeddings().weight.dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported model dtype {dtype}; load the model in bfloat16, float16 or float32")
    check_one_dtype(model, dtype)
    text_cfg = model.config.get_text_config()
    if "linear_attention" in text_cfg.layer_types and text_cfg.hidden_act not in ("silu", "swish"):
        raise ValueError(f"hidden_act={text_cfg.hidden_act!r}: transformers applies it to the Gated DeltaNet conv's "
                         f"output, which fastqwen's conv ops compute with SiLU only (as every Qwen3.5 checkpoint)")
    rotary = text_model(model).rotary_emb
    rope = getattr(rotary, "rope_type", "default")
    if "dynamic" in rope or rope == "longrope":  # transformers rescales their frequencies past `limit` positions
        limit = (model.config.get_text_config().rope_parameters["original_max_position_embeddings"]
                 if rope == "longrope" else rotary.original_max_seq_len)
        if max_seq_len > limit:
            raise ValueError(f"rope_type={rope!r} changes its frequencies once a sequence passes {limit} positions, "
                             f"which fastqwen's cache (keys roped once, at fixed frequencies) cannot follow: pass "
                             f"max_seq_len <= {limit}, or load the model with a fixed rope (e.g. rope_type 'yarn')")
    if device.type == "cuda":
        try:
            import fla.ops.gated_delta_rule  # noqa: F401
        except ImportError as err:
            raise ImportError("fastqwen on CUDA needs flash-linear-attention: pip install flash-linear-attention") from err
    check_kernels(kernels, model.config.get_text_config(), device)
    if speculate is not None and speculate not in SPECULATE:
        raise ValueError(f"unknown speculate={speculate!r}; supported: None, {', '.join(map(repr, SPECULATE))}")
    check_speculation_options(speculate, draft, num_speculative_tokens, block_size)
    if not compile and (compile_options or compile_cache is not None):
        warnings.warn(f"compile_options and compile_cache apply to the compiled decode step; with compile=False they "
                      f"are ignored (got compile_options={compile_options!r}, compile_cache={compile_cache!r})",
                      stacklevel=2)
    for name, value in (("draft_lm_head", draft_lm_head), ("draft_vocab", draft_vocab), ("draft_quant", draft_quant)):
        if value is not None and speculate is None:
            raise ValueError(f"{name} only applies to speculative decoding; pass speculate='mtp' or 'dflash'")
    from .quant import SCHEMES

    for name, value in (("draft_lm_head", draft_lm_head), ("draft_quant", draft_quant)):
        if value is not None and value not in SCHEMES:
            raise ValueError(f"unknown {name}={value!r}; supported: {', '.join(SCHEMES)}")
    if not isinstance(quant_lm_head, bool):  # ("no" would be truthy and quantize it)
        raise ValueError(f"quant_lm_head must be True or False, got {quant_lm_head!r}")
    if compile_cache is not None and not isinstance(compile_cache, (str, os.PathLike)):  # (an int: a descriptor)
        raise ValueError(f"compile_cache must be a file path, got {compile_cache!r}")
    if quant_lm_head and quant is None:
        raise ValueError("quant_lm_head=True quantizes lm_head in quant's scheme; pass quant='fp8-weight', 'fp8' "
                         "or 'int4' too")
    draft_quant = draft_quant or quant
    if quant_group_size != 128 and "int4" not in (quant, draft_quant, draft_lm_head):
        warnings.warn(f"quant_group_size={quant_group_size} sets int4's group and is ignored: no int4 is asked "
                      f"(quant={quant!r}, draft_quant={draft_quant!r}, draft_lm_head={draft_lm_head!r}; fp8's scales "
                      f"are per 128×128 block, fp8-weight's per row)", stacklevel=2)
    if quant is not None:
        from .quant import quantize

        quantize(model, quant, group_size=quant_group_size, lm_head=quant_lm_head)
    proposer_for = None  # (engine, draft lm_head) -> proposer; built after the engine, loaded and checked before it
    if speculate == "mtp":
        from .spec.mtp import MTPHead, MTPProposer, checkpoint_source, read_mtp_tensors

        num_speculative_tokens = 3 if num_speculative_tokens is None else num_speculative_tokens
        check_num_speculative_tokens(num_speculative_tokens)
        source = draft or checkpoint_source(model)
        if not source:
            raise ValueError("speculate='mtp' needs the checkpoint the model was loaded from; pass draft=<dir>")
        head = quantize_draft(MTPHead(model, read_mtp_tensors(source)), draft_quant, quant_group_size)
        k = num_speculative_tokens
        proposer_for = lambda engine, lm_head: MTPProposer(engine, head, lm_head)  # noqa: E731
    elif speculate == "dflash":
        from .spec.dflash import DFlashDraft, DFlashProposer, read_dflash_checkpoint

        if draft is None:
            raise ValueError("speculate='dflash' needs draft=<DFlash checkpoint directory>")
        dflash = quantize_draft(DFlashDraft(*read_dflash_checkpoint(draft), model), draft_quant, quant_group_size)
        block = dflash.block_size if block_size is None else block_size
        if not isinstance(block, int) or not 2 <= block <= dflash.block_size:
            raise ValueError(f"block_size must be an int in 2..{dflash.block_size} (the draft's own block size), "
                             f"got {block!r}")
        k = block - 1
        proposer_for = lambda engine, lm_head: DFlashProposer(engine, dflash, lm_head)  # noqa: E731
    if proposer_for is not None:
        from .spec.draft_head import draft_head

        lm_head = draft_head(model.lm_head, draft_vocab, draft_lm_head, quant_group_size)  # None: the target's
    model._fastqwen = Engine(model, max_batch_size=max_batch_size, max_seq_len=max_seq_len, compile=compile,
                             compile_options=compile_options, compile_cache=compile_cache, kernels=kernels,
                             prefill_chunk_tokens=prefill_chunk_tokens)
    if proposer_for is not None:
        model._fastqwen.enable_speculation(proposer_for(model._fastqwen, lm_head), k)
    model.generate = model._fastqwen.generate
    return model


def check_speculation_options(speculate, draft, num_speculative_tokens, block_size) -> None:
    """Each speculation option belongs to one speculate mode; given without it, it would be silently dropped."""
    if speculate is None and draft is not None:
        raise ValueError("draft= only applies to speculative decoding; pass speculate='dflash' (a DFlash draft "
                         "checkpoint) or speculate='mtp' (a checkpoint with the MTP head), or drop draft=")
    if speculate != "dflash" and block_size is not None:
        fix = (f"with speculate='mtp' pass num_speculative_tokens={block_size - 1} (the drafts a round)"
               if speculate == "mtp" and isinstance(block_size, int) and block_size >= 2 else
               "pass speculate='dflash' with draft=<DFlash checkpoint directory>, or drop block_size")
        raise ValueError(f"block_size= sets a DFlash draft's block; {fix}")
    if speculate != "mtp" and num_speculative_tokens is not None:
        if speculate == "dflash":
            fix = (f"pass block_size={num_speculative_tokens + 1} ({num_speculative_tokens} drafts and the pending "
                   f"token)" if isinstance(num_speculative_tokens, int) and num_speculative_tokens >= 1 else
                   "pass block_size (drafts + 1)")
            raise ValueError(f"num_speculative_tokens= sets the MTP head's drafts (speculate='mtp'); with "
                             f"speculate='dflash' {fix}")
        raise ValueError("num_speculative_tokens= only applies to speculative decoding; pass speculate='mtp' "
                         "(or speculate='dflash' with block_size)")


def check_one_dtype(model, dtype) -> None:
    """Every matmul weight of the text model and lm_head (a parameter of two dims or more but the conv's) in the
    model dtype: one in another dtype (e.g. an lm_head left in bf16 on an fp32 model) would fail inside generate's
    first matmul. Norms, A_log, dt_bias and the conv run in any float dtype; quantized layers hold buffers."""
    convs = {id(m.weight) for m in model.modules() if isinstance(m, nn.Conv1d)}
    ours = {id(p) for m in (text_model(model), model.lm_head) for p in m.parameters()
            if p.dim() >= 2 and id(p) not in convs}
    mixed = [(name, p.dtype) for name, p in model.named_parameters()
             if id(p) in ours and p.is_floating_point() and p.dtype != dtype]
    codes = [(name, other) for name, other in mixed if other.itemsize == 1]  # (transformers' FP8Linear, say)
    if codes:  # a cast (the fix named below) would drop their scales: a silently wrong model
        raise ValueError(f"{codes[0][0]} is {codes[0][1]}, a quantized checkpoint's codes as transformers loaded "
                         f"them; casting them would drop their scales: load the checkpoint with "
                         f"fastqwen.from_pretrained(path) (it keeps FP8, GPTQ, AWQ and compressed-tensors weights "
                         f"quantized), then optimize")
    if mixed:
        (name, other), more = mixed[0], f" (and {len(mixed) - 1} more weights)" if len(mixed) > 1 else ""
        raise ValueError(f"fastqwen runs the matmuls in one dtype, the embeddings' {dtype}, but {name} is {other}{more}:"
                         f" cast them before fastqwen.optimize, e.g. model.get_submodule({name.rpartition('.')[0]!r})"
                         f".to({dtype}), or load the whole model in {dtype}")


def quantize_draft(draft, quant: str | None, group_size: int):
    """The draft module with its linears and experts in the target's quantization scheme (if any)."""
    if quant is None:
        return draft
    from .quant.linear import quantize_modules

    return quantize_modules(draft, quant, group_size=group_size, prefix="draft.")
