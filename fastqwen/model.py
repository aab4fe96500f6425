"""Our forward over a Hugging Face Qwen3.5 model's own modules.

A plain walk over `layers`, in the spirit of gpt-fast's model.py: it reads the HF modules' parameters (so
their names, state dict and any weight swaps stay valid), writes the HybridCache, and calls `ops/`. Two
entry points: `prefill` runs a chunk of equal-length prompts of consecutive cache rows (the first chunk on empty
rows, each later one on the positions after the previous); `step` runs T new tokens
for every row at its own positions `cache.lengths[b] + t` and is what gets compiled into a CUDA graph.
Neither advances `cache.lengths`; the caller does, once it knows which rows advanced. A speculative verify is
`step(tokens, verify=True)`: attention K/V are written for all T positions, but the Gated DeltaNet
recurrent and conv states are only read; `commit(keep)` then advances them (and `lengths`) over each row's
accepted prefix by replaying the stashed per-position inputs.
"""

import warnings
from collections.abc import Mapping

import torch

from .cache import HybridCache
from .ops.attention import attend_cache, attend_causal, attend_prefix, rope_cos_sin
from .ops.attention_prep import attention_prep, prepare, step_positions, summed
from .ops.decode_attention import attend_cache_split_op, merge_gated_op, split_kv_partials_op
from .linears import MLP_IN, Linears, fuse_linears, fusion_intact
from .moe import routed_moe, stack_intact, stack_shared_expert
from .ops.conv import commit_window, conv_decode, conv_step, verify_prologue
from .ops.gemv import tile_counts
from .ops.gated_norm import gated_norm
from .ops.gdn import gates, gdn_chunk, gdn_decode, gdn_recurrent, gdn_replay, gdn_verify, unpack_qkv
from .ops.norm import gated_rms_norm, rms_norm

_CHUNK_MIN_TOKENS = 64  # below this, prefill uses the recurrent kernel (fla's chunk kernel wins above)


def text_model(model):
    """The decoder stack (embed_tokens, layers, norm, rotary_emb) of a CausalLM or ConditionalGeneration."""
    inner = model.model
    return getattr(inner, "language_model", inner)


KERNELS = {"attention": ("split", "sdpa"), "experts": ("auto", "gather", "grouped", "grouped-pdl"),
           "projections": ("fused", "separate"), "linears": ("auto", "torch", "gemv"),
           "gdn": ("block", "unrolled", "fla"), "launch": ("auto", "serial", "pdl"),
           "splitk": ("sum", "fixup"), "gdn_norm": ("kernel", "separate", "fused"),
           "expert_act": ("auto", "separate", "fused"), "route": ("auto", "argmax", "packed", "fused"),
           "mlp_act": ("separate", "fused"), "conv": ("fused-verify", "fused", "separate"),
           "int4": ("auto", "triton", "cuda"),
           "fp8_weight": ("triton", "cuda"), "reductions": ("persistent", "inductor"),
           "attn_glue": ("fused", "separate")}  # first: the default
CUDA_KERNELS = {"int4": "int4", "fp8_weight": "fp8-weight"}  # kernels option -> the scheme its "cuda" choices take


def cuda_schemes(kernels: dict) -> tuple:
    """The quantization schemes whose few-row products take a CUDA C++ kernel under these (checked) kernel
    choices, as QuantLinear's `cuda` tags ("int4", "fp8-weight")."""
    return tuple(scheme for op, scheme in CUDA_KERNELS.items() if kernels[op] == "cuda")


def check_kernels(kernels: dict | None, cfg, device, fp8_experts: bool = False) -> dict:
    """The kernel choice of each op, defaults filled in ("launch" resolved): optimize's `kernels` option. The
    defaults are the ones measured fastest (docs/BENCHMARKS.md); the others stay selectable to re-measure.
    "attention": attention over the cache in decode and verify steps (and a DFlash draft's block) by the split-KV
    kernel that reads only the keys in use ("split", ops/decode_attention.py) or by SDPA with a mask over all
    max_seq_len keys ("sdpa"). Split is the default at every cache length since 2026-12-02: a 35B-A3B step with
    a 512-token context in a 576-position cache took 2906–2963 µs of device time split against 2999 µs with
    SDPA (cuDNN's kernel and its reduction cost ~13 µs a layer), a 9B step the same time either way, and in a
    131072-position cache the 9B decoded 1.27× faster split (SDPA reads every cached position each step).
    "experts": a MoE model's routed experts at decode gathered then multiplied ("gather") or read in place by
    the grouped kernel ("grouped", ops/gemv.py, the shared expert stacked in; off CUDA both run their torch
    references); "auto": "grouped" on CUDA where its shapes fit (hidden and expert intermediate sizes divisible
    by 128), else "gather" (resolved here), but "grouped-pdl" for fp8-weight experts; "grouped-pdl": grouped,
    its routing and expert launches joining programmatic dependent launch when "launch" is "pdl" (they wait for
    their predecessor before reading anything, so they overlap only their launch; quantized experts' launches
    too since 2026-12-03, but for the one-launch MLP). On the H200 (2026-12-03, each alone in its process) a
    35B-A3B fp8-weight step took 1929, 1894, 1891, 1927 and 1932 µs with it against 1951 and 1953 without,
    while bf16's took 2825 with it against 2749, 2704, 2716, 2700 and 2657 without. "projections":
    each layer's input projections as one matmul each ("separate") or one over a fused weight per layer
    ("fused": GDN qkv+z+b+a, attention q+k+v, MLP gate+up; fewer launches, same bytes; linears.fuse_linears;
    1.08× on 27B decode). "linears": the decoder's bf16 linears at decode and verify by F.linear ("torch":
    cuBLAS) or by the weight-streaming kernel ("gemv"), or by it only at the shapes where this GPU's sweep
    measured it faster ("auto"; linears.Linears; 1.05× on 27B decode; without a measured shape, as "torch").
    "gdn": the gated delta rule of decode, verify and commit by our kernel with the time loop unrolled
    ("unrolled", ops/gdn.py), the same but the verify's block solved at once ("block": ops/gdn.py
    _block_kernel, dots and a 16-row substitution instead of 16 serial steps over the state), or by
    flash-linear-attention's fused recurrent kernel ("fla"); prefill takes fla's kernels either way. "launch": each kernel of a compiled step after the previous one has finished
    ("serial") or, on Hopper and later, with programmatic dependent launch ("pdl": inductor's kernels (its
    triton.enable_pdl) and ours start while their predecessor finishes, the weight-streaming ones pulling their
    first weight tiles into L2 before they wait for it; ops/gemv.py _dependent_start); "auto": "pdl" on a GPU
    of compute capability 9.0 or later, else "serial" (on the H200 the 27B fp8-weight step took 7841 µs with
    PDL against 8251 serial, 2026-12-02; the int4 step 6341, 7002 and 6509 against 7175, 6890 and 6927 since
    its one-row kernel lets the next launch only after its last store, 2026-12-04; each alone in its process).
    "splitk": the weight-streaming kernel's split-K partial sums added by their consumer ("sum": gemv.add_splits'
    adds, which inductor folds into the next kernel, or the custom op that consumes them adds them itself) or by
    the kernel itself ("fixup": the last program of each output tile adds them, in split order; ops/gemv.py
    _split_k_fixup; the CUDA kernels, int4's and fp8-weight's, take one split: int4's summing its own was 0.85×
    the default on the 27B step, H100, 2026-12-05). "gdn_norm": the GDN block's gated RMSNorm at decode as a
    kernel of inductor's after the recurrence ("separate") or inside the unrolled decode kernel, by the last
    program of each head ("fused": ops/gdn.py _gated_norm_tail; a launch less a GDN layer; with "gdn"
    "block" or "unrolled"; a candidate: 0.94× the default on 35B-A3B, docs/BENCHMARKS.md), or as one kernel of
    ours after it at decode and verify, summing z's split-K partials itself ("kernel": ops/gated_norm.py, where
    inductor launches two on the GPU; the default since 2026-12-05, with "attn_glue" "fused" below).
    "expert_act": grouped
    experts' silu(gate)·up as a kernel of inductor's between the gate | up and the down launches ("separate")
    or computed by the down launch from the gate | up partials as it loads them ("fused": a launch less a MoE
    layer; bf16 and fp8 experts, while int4 ones keep the separate kernel; needs "experts" grouped or
    grouped-pdl and a SiLU MLP; the activation in the gate | up launch's epilogue, "paired", 0.705× the two
    launches at kernel level, made the 35B-A3B fp8-weight step 2262 and 2254 µs against 2180 and 2167 with
    "separate" in two H100 sessions and was removed, 2026-12-07).
    "route": the grouped experts' routing kernel's k rounds as
    a max then a min over the indices holding it, in 4 warps ("argmax"), or as one max over (logit, index) keys
    packed into an int64, in one warp ("packed": no shared memory, no barrier; same experts and weights;
    ops/router.py; needs "experts" grouped or grouped-pdl), or for one token the router matmul and packed
    routing in one launch ("fused": ops/router.py router_route, a launch less a layer; more tokens route as
    "packed"). "auto" (the defaults): "expert_act" "fused" where the experts resolved to grouped and the MLP is
    SiLU, else "separate" (fused with packed routing: a 35B-A3B step 2806–2827 µs of device time in two
    processes against 2880 µs with neither, 2026-12-02), but "separate" where the experts are fp8-weight
    (`fp8_experts`: QuantExperts): a 35B-A3B fp8-weight step took 1921, 1961, 1978 and 1953 µs with it, against
    2025–2055 µs with "fused" (one process each, two sessions, one H200; the one-launch expert MLP, 2000–2012
    µs though the fastest at kernel level, was removed 2026-12-07);
    "route" "fused" with grouped experts, else "argmax" (the router at kernel level 4.01 against 4.53 µs a
    layer with PDL, 4.96 against 5.21 without; the step's difference lies within the ±3% between processes).
    "mlp_act": a
    dense MLP's (and a shared expert's) silu(gate)·up at one-row decode as a kernel of inductor's ("separate") or
    computed by the down projection's weight-streaming kernel from the fused gate | up projection's partials as
    it loads them ("fused": a launch less a layer, where both weights take the kernel under "linears"; needs
    fused projections, "linears" other than "torch" and a SiLU MLP; linears.Linears.mlp; a candidate). "conv":
    a GDN layer's depthwise conv at a one-position decode as inductor's kernels ("separate": the new window, its
    write into the cache, the output: three launches) or as one kernel of ours that also advances the cached
    window in place and sums the input projection's split-K partials as it loads them ("fused":
    ops/conv.py conv_decode; a 9B step 4486–4487 µs of device time against 4529, a 35B-A3B step 2721 against
    2739, each in a process of its own, 2026-12-02), a speculative verify's conv and gates then inductor's;
    "fused-verify" (the default since 2026-12-06): that, and a speculative verify's conv and gates as one kernel
    of ours too, which sums x's, a's and b's partials and stores every replay input of the commit (ops/conv.py
    verify_prologue, where inductor launches ~6: a 16-layer 27B int4 verify of 16 took 2754 µs against 2800,
    one H100).
    "int4": an int4 QuantLinear's products on up to
    16 rows (decode, MTP's and DFlash's verify, small batches) by the Triton weight-streaming kernel ("triton",
    ops/gemv.py) or by a CUDA C++ tensor-core kernel (ops/int4_cuda.py: built with nvcc on first use, compute
    capability 9.0 or later): "cuda" its warps loading their weights into registers (ring, stream and async
    kernels measured slower and were removed, 2026-12-05); more rows take the Triton kernel either way. "auto" (the
    default) is "cuda" on a GPU of compute capability 9.0 or later where nvcc is found and the kernel builds, else
    "triton" (a failed build warns): a 27B int4 step took 7088 µs against Triton's 18766 on one H100, and 6375 µs
    against Triton's 6396 (the day before) on one H200, where its per-layer times are level with Triton's at one row
    and 2.4–3× faster at 2–16 rows (2026-12-05). "fp8_weight": the same for an fp8-weight QuantLinear ("cuda":
    ops/fp8_cuda.py, e4m3 pairs into the tensor cores; a candidate: level with Triton's on an H100, 12-18% slower at
    one row on an H200). "reductions": inductor's own choice of looped or persistent reductions ("inductor") or a
    row of up to 8192 elements on up to 16 rows always held whole, one pass ("persistent": reductions.py; the
    default since 2026-12-05: the one-row residual add + RMSNorm with 8 split-K partials is otherwise a looped
    one-program kernel, 4.9 µs on the 27B; a 27B int4 step took 6802 µs with it against 7010 on one H100, where
    inductor's multi_kernel, which picks per reduction, made it 1.030× faster). "attn_glue": a full-attention
    layer's work around the attention kernel at decode and
    verify, i.e. the q/k RMSNorms, partial rope and KV-cache write before it and the splits' merge and sigmoid output
    gate after it, as inductor's kernels ("separate": seven on a GPU, 10.8 µs a layer in a 27B int4 profile on an
    H100) or as two kernels of ours reading the q | gate, k and v projection's split-K partials ("fused":
    ops/attention_prep.py, and decode_attention.py's merge_gated_op, which reads only splits holding keys, with
    "attention" "split"; the default since 2026-12-05: with "gdn_norm" "kernel" a 27B int4 step took 6921 µs
    against 7010 on one H100, and all three defaults of that day 6614 against 6886 on another)."""
    if kernels is not None and not isinstance(kernels, Mapping):
        raise ValueError(f"kernels must be a dict of op name to kernel, e.g. {{'attention': 'sdpa'}}; got {kernels!r}")
    kernels = dict(kernels or {})
    unknown = set(kernels) - set(KERNELS)
    if unknown:
        raise ValueError(f"unknown kernels {sorted(unknown)}; choose from {sorted(KERNELS)}")
    for op, choices in KERNELS.items():
        kernels.setdefault(op, choices[0])
        if kernels[op] not in choices:
            raise ValueError(f"kernels[{op!r}]={kernels[op]!r}; choose from {', '.join(choices)}")
    kernels["launch"] = _launch_mode(kernels["launch"], torch.device(device))
    inter, cuda = getattr(cfg, "moe_intermediate_size", None), torch.device(device).type == "cuda"
    fits = inter is not None and not (cuda and (cfg.hidden_size % 128 or inter % 128))
    if kernels["experts"] == "auto":
        kernels["experts"] = ("grouped-pdl" if fp8_experts else "grouped") if cuda and fits else "gather"
    if kernels["experts"] in ("grouped", "grouped-pdl") and not fits:
        if inter is None:
            raise ValueError(f"kernels['experts']={kernels['experts']!r} applies to MoE models only")
        raise ValueError(f"kernels['experts']={kernels['experts']!r} needs hidden size ({cfg.hidden_size}) and expert "
                         f"intermediate size ({inter}) divisible by 128")
    grouped = kernels["experts"] in ("grouped", "grouped-pdl")
    if kernels["route"] == "auto":
        kernels["route"] = "fused" if grouped else "argmax"
    if kernels["expert_act"] == "auto":
        silu = grouped and getattr(cfg, "hidden_act", "silu") == "silu"
        kernels["expert_act"] = "fused" if silu and not fp8_experts else "separate"
    for op, choice in (("expert_act", "fused"), ("route", "packed"), ("route", "fused")):
        if kernels[op] == choice and kernels["experts"] not in ("grouped", "grouped-pdl"):
            raise ValueError(f"kernels[{op!r}]={choice!r} is a grouped-experts kernel: set kernels['experts'] to "
                             f"'grouped' or 'grouped-pdl' (it is {kernels['experts']!r})")
    for op in ("expert_act", "mlp_act"):
        if kernels[op] == "fused" and getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"kernels[{op!r}]={kernels[op]!r} computes SiLU; this model's hidden_act is "
                             f"{cfg.hidden_act!r}: use 'separate'")
    if kernels["mlp_act"] == "fused" and (kernels["projections"] != "fused" or kernels["linears"] == "torch"):
        raise ValueError("kernels['mlp_act']='fused' reads the fused gate | up projection's partials from the "
                         "weight-streaming kernel: it needs kernels['projections']='fused' and kernels['linears'] "
                         f"'auto' or 'gemv' (they are {kernels['projections']!r} and {kernels['linears']!r})")
    if kernels["int4"] == "auto":
        kernels["int4"] = "cuda" if _cuda_kernels_build(torch.device(device)) else "triton"
        if kernels["int4"] == "cuda":  # (the default: a failed build warns and takes Triton's kernel)
            from .ops import cuda_build, int4_cuda

            try:
                int4_cuda.library(cuda_build.device_arch(torch.device(device), int4_cuda.CHOICE))
            except RuntimeError as e:
                warnings.warn(f"kernels['int4']='auto' takes the Triton kernel: the CUDA one did not build ({e})")
                kernels["int4"] = "triton"
    if torch.device(device).type == "cuda":  # build the CUDA kernels asked for now: errors before any compile
        from .ops import cuda_build, fp8_cuda, int4_cuda

        for op, module in (("int4", int4_cuda), ("fp8_weight", fp8_cuda)):
            if kernels[op].startswith("cuda"):
                module.library(cuda_build.device_arch(torch.device(device), module.CHOICE))
    return kernels


def _cuda_kernels_build(device: torch.device) -> bool:
    """Whether fastqwen's CUDA C++ kernels can be built and run here: a GPU of compute capability 9.0 or later
    and the CUDA toolkit's nvcc (ops/cuda_build.py)."""
    from .ops import cuda_build

    return (device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (9, 0)
            and cuda_build.nvcc() is not None)


def _launch_mode(launch: str, device: torch.device) -> str:
    """"auto" → "pdl" on CUDA devices of compute capability ≥ 9.0 (griddepcontrol is Hopper's), else "serial";
    "pdl" on an older GPU is an error (our kernels' wait instruction does not exist there). Off CUDA the ops
    run their references, so any choice runs."""
    if device.type != "cuda" or launch == "serial":
        return "serial" if launch == "auto" else launch
    capability = torch.cuda.get_device_capability(device)
    if launch == "pdl" and capability < (9, 0):
        raise ValueError(f"kernels['launch']='pdl' needs a GPU of compute capability 9.0 or later (Hopper); this "
                         f"one is {capability[0]}.{capability[1]}: use 'serial' or 'auto'")
    return ("pdl" if capability >= (9, 0) else "serial") if launch == "auto" else launch


_GDN_IN = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
ATTN_IN = ("q_proj", "k_proj", "v_proj")


class Forward:
    def __init__(self, model, cache: HybridCache, kernels: dict | None = None):
        text = text_model(model)
        self.cfg = text.config
        self.embed, self.layers, self.norm, self.lm_head = text.embed_tokens, text.layers, text.norm, model.lm_head
        # (original_inv_freq: a dynamic rope's inv_freq is rescaled in place once transformers ran past its
        # original length, which optimize keeps max_seq_len within)
        self.inv_freq = getattr(text.rotary_emb, "original_inv_freq", text.rotary_emb.inv_freq)
        self.rope_scaling = float(getattr(text.rotary_emb, "attention_scaling", 1.0))
        self.eps = self.cfg.rms_norm_eps
        self.cache = cache
        # cos, sin [max_seq_len, R] of every position, for attention_prep to read at a step's positions: passed
        # as [B, T, R], inductor wrote them with a kernel before each attention layer's op (16 a 27B step)
        dtype = text.embed_tokens.weight.dtype
        self.rope_table = rope_cos_sin(torch.arange(cache.max_seq_len, device=cache.lengths.device)[None],
                                       self.inv_freq, self.rope_scaling, dtype)
        self.rope_table = tuple(t[0] for t in self.rope_table)
        self.offsets = torch.arange(cache.max_seq_len, device=cache.lengths.device)  # (a step's t, step_positions)
        # read by the compiled steps through this object, not as a module's buffers: unmarked, cudagraph trees
        # would copy each into the graph's own input at every replay
        for t in (self.inv_freq, *self.rope_table, self.offsets):
            torch._dynamo.mark_static_address(t)
        fp8_experts = any(getattr(m, "scheme", None) == "fp8-weight" and hasattr(m, "routed")  # (QuantExperts)
                          for m in self.layers.modules())
        self.kernels = check_kernels(kernels, self.cfg, cache.lengths.device, fp8_experts)
        self.split_attention = self.kernels["attention"] == "split"  # decode, verify and DFlash draft blocks
        self.unrolled = self.kernels["gdn"] in ("block", "unrolled")  # (a Triton compile per T: not for prefill)
        self.block = self.kernels["gdn"] == "block"
        self.fused_norm = self.kernels["gdn_norm"] == "fused"
        self.norm_kernel = self.kernels["gdn_norm"] == "kernel"
        self.fused_conv = self.kernels["conv"] in ("fused", "fused-verify")
        self.verify_conv = self.kernels["conv"] == "fused-verify"
        self.fused_glue = self.kernels["attn_glue"] == "fused"
        self.pdl = self.kernels["launch"] == "pdl"
        self.lin = Linears(fused=self.kernels["projections"] == "fused",
                           gemv={"torch": False, "gemv": True, "auto": "auto"}[self.kernels["linears"]],
                           pdl=self.pdl, fixup=self.kernels["splitk"] == "fixup",
                           fused_act=self.kernels["mlp_act"] == "fused",
                           cuda=cuda_schemes(self.kernels))
        if cache.lengths.device.type == "cuda":  # the kernels' arrival counts (split-K fixup, fused GDN norm, expert
            tile_counts(cache.lengths.device, 0)  # MLP, fused route), allocated before any capture
        self.fusions, self.stacks = [], []  # (module, names) of each fuse_linears call, stacked MLPs: stale_fusion
        for layer in self.layers:
            self.prepare_layer(layer)

    def prepare_layer(self, layer) -> None:
        """Give a decoder layer (the model's, or an MTP head's) this forward's kernel layout: the shared expert
        stacked onto the routed ones (grouped experts), input projections fused (fused projections)."""
        grouped = self.kernels["experts"] in ("grouped", "grouped-pdl")
        stacked = grouped and hasattr(layer.mlp, "experts") and stack_shared_expert(layer.mlp)
        if stacked:
            self.stacks.append(layer.mlp)
        if not self.lin.fused:
            return
        fusions = [(layer.linear_attn, _GDN_IN)] if hasattr(layer, "linear_attn") else []
        fusions += [(layer.self_attn, ATTN_IN)] if hasattr(layer, "self_attn") else []
        if not stacked:  # (a stacked shared expert runs inside the grouped expert launch)
            fusions.append((getattr(layer.mlp, "shared_expert", layer.mlp), MLP_IN))
        for module, names in fusions:
            fuse_linears(module, names)
        self.fusions += fusions

    def stale_fusion(self):
        """The first module whose fused input projection or expert stack no longer holds its parameters' weights
        (they were replaced since it was built), or None."""
        return next((m for m, names in self.fusions if not fusion_intact(m, names)),
                    next((mlp for mlp in self.stacks if not stack_intact(mlp)), None))

    # ----- entry points -------------------------------------------------------------------------------
    def prefill(self, first_row: int, tokens: torch.Tensor, features=None, start: int = 0):
        """Run prompt tokens [n, T] at positions start … start+T-1 of cache rows first_row … first_row+n-1,
        which must hold exactly the `start` positions before them (none for a prompt's first chunk).

        Returns the logits of each chunk's last token [n, V] fp32 and the requested `features` of every
        position (see `_features`; None when features is None).
        """
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
        rows = slice(first_row, first_row + tokens.shape[0])
        h, taps = self._layers(tokens, positions, rows, "prefill", self._taps(features), past=start)
        h = self.final_norm(h)
        return self.lin(self.lm_head, h[:, -1]).float(), self._features(features, h, taps)

    def step(self, tokens: torch.Tensor, verify: bool = False, features=None):
        """Run tokens [B, T] (B = cache batch) at positions lengths[b] + t; returns logits [B, T, V] fp32, or
        (logits, features [B, T, F]) when `features` is requested (see `_features`).

        verify: leave the recurrent state for `commit` (T ≤ the cache's block).
        """
        T = tokens.shape[1]
        # one position: the lengths themselves, a view; more: step_positions' buffer, which every attention op reads
        lengths = self.cache.lengths
        positions = lengths[:, None] if T == 1 else step_positions(lengths, self.offsets[:T])
        mode = "verify" if verify else "decode"
        h, taps = self._layers(tokens, positions, slice(None), mode, self._taps(features))
        h = self.final_norm(h)
        logits = self.lin(self.lm_head, h).float()  # (the policy's: cuBLAS unless the sweep timed the kernel faster)
        return logits if features is None else (logits, self._features(features, h, taps))

    @staticmethod
    def _taps(features):
        return () if features in (None, "final") else tuple(features)

    @staticmethod
    def _features(features, h, taps):
        """features None: None; "final": the final post-norm hidden states [.., T, H] (what MTP reads);
        a sequence of layer ids: the outputs of those decoder layers concatenated [.., T, len·H] (DFlash)."""
        if features is None:
            return None
        return h if features == "final" else torch.cat(taps, dim=-1)

    def commit(self, keep: torch.Tensor) -> None:
        """Accept the first keep[b] (0 ≤ keep ≤ T) positions of the last verified block of each row. Every
        Gated DeltaNet layer at once: the stacked replay inputs [L, B, T, …] run as one batch of L·B rows."""
        if self.cache.gdn_index:
            block = torch.arange(self.cache.block, device=keep.device)
            accepted = (block[None, :] < keep[:, None]).float()[None, ..., None]  # [1, B, T, 1]
            r = self.cache.replay()
            cfg = self.cfg
            _, k, v = unpack_qkv(r["qkv"].flatten(0, 1), cfg.linear_num_key_heads, cfg.linear_key_head_dim,
                                 cfg.linear_num_value_heads)
            gdn_replay(k, v, (r["g"] * accepted).flatten(0, 1),
                       (r["beta"] * accepted).flatten(0, 1), self.cache.state.flatten(0, 1), self.unrolled,
                       self.pdl)
            commit_window(self.cache.conv, r["x"], keep)
        self.cache.lengths.add_(keep)

    # ----- the stack ----------------------------------------------------------------------------------
    def final_norm(self, h):
        return rms_norm(h, self.norm.weight, self.eps)

    def _layers(self, tokens, positions, rows, mode, taps=(), past: int = 0):
        """The decoder stack; returns the last layer's output and the outputs of layers `taps` (in order).
        past: in prefill, the number of positions the rows already hold."""
        x = self.embed(tokens)
        tapped = {}
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_scaling, x.dtype)
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_layernorm.weight, self.eps)
            if self.cfg.layer_types[i] == "linear_attention":
                h = self._gdn(layer.linear_attn, h, rows, mode, i)
            else:
                k_cache, v_cache = self.cache.attention(i)
                h = self._attention(layer.self_attn, h, cos, sin, positions, k_cache[rows], v_cache[rows], mode,
                                    past)
            x = x + h
            h = rms_norm(x, layer.post_attention_layernorm.weight, self.eps)
            x = x + self._mlp(layer.mlp, h, mode)
            if i in taps:
                tapped[i] = x
        return x, [tapped[i] for i in taps]

    def _gdn(self, m, h, rows, mode, i):
        """Gated DeltaNet block of layer i on cache rows `rows`: projections, conv, gated delta rule, gated norm,
        out_proj. h [B, T, H]."""
        B, T, _ = h.shape
        cfg = self.cfg
        heads = (cfg.linear_num_key_heads, cfg.linear_key_head_dim)
        conv, state = (t[rows] for t in self.cache.recurrent(i))
        # an unrolled decode sums a's and b's split-K partials as it loads them (no launch to materialise them),
        # the fused conv x's
        fused_conv = mode == "decode" and T == 1 and self.fused_conv
        verify_conv = mode == "verify" and self.verify_conv and rows == slice(None)
        norm_kernel = self.norm_kernel and mode != "prefill"  # (the gated norm's op sums z's partials itself)
        raw = (("in_proj_b", "in_proj_a") if (mode == "decode" and self.unrolled) or verify_conv else ()) + (
            ("in_proj_qkv",) if fused_conv or verify_conv else ()) + (("in_proj_z",) if norm_kernel else ())
        x, z, b, a = self.lin.project(m, h, _GDN_IN, raw)
        if fused_conv:  # the cached window advanced in place by the op
            qkv = conv_decode(x, m.conv1d.weight[:, 0], conv, self.pdl)
        elif verify_conv:  # the window left to the commit; every replay input stored by the op
            replay = self.cache.replay(i)
            qkv, a, b = verify_prologue(x, a, b, m.conv1d.weight[:, 0], conv, m.A_log, m.dt_bias, replay["x"],
                                        replay["qkv"], replay["g"], replay["beta"], self.pdl)
        else:
            qkv, window = conv_step(x, m.conv1d.weight[:, 0], conv)
            if mode != "verify":  # (a verify leaves the window to the commit)
                self.cache.write("conv", i, window, rows)
        if mode == "verify":  # q, k, v split inside the ops: the conv's output stays one buffer (the replay's too)
            qkv = qkv.contiguous()  # (conv_step's output is a [B, C, T] buffer transposed: heads apart by T)
            o = gdn_verify(qkv, *heads, a, b, m.A_log, m.dt_bias, state, self.unrolled, self.pdl, self.block)
            if not verify_conv:
                g, beta = gates(a, b, m.A_log, m.dt_bias)
                for name, value in (("x", x), ("qkv", qkv), ("g", g), ("beta", beta)):
                    if T < self.cache.block:  # (fewer drafts this call) zeros after T: the commit masks them
                        value = torch.cat([value, value.new_zeros(B, self.cache.block - T, *value.shape[2:])], 1)
                    self.cache.write(f"replay_{name}", i, value)
            return self._gdn_out(m, o, z, norm_kernel)
        if mode == "decode" and (B == 1 or self.unrolled):  # (fla's kernel would need copies of the views)
            pdl = self.pdl and self.unrolled
            if self.fused_norm:  # o comes out of the op normalised and gated
                o = gdn_decode(qkv, *heads, a, b, m.A_log, m.dt_bias, state, self.unrolled, pdl, z, m.norm.weight,
                               m.norm.variance_epsilon)
                return self.lin(m.out_proj, o.reshape(B, T, -1))
            o = gdn_decode(qkv, *heads, a, b, m.A_log, m.dt_bias, state, self.unrolled, pdl)
            return self._gdn_out(m, o, z, norm_kernel)
        q, k, v = unpack_qkv(qkv, *heads, cfg.linear_num_value_heads)
        # contiguous here, so inductor writes them from kernels it has anyway (q, k, v from the conv's): fla's
        # kernels need them so, and the ops' own .contiguous() would be eager copies once T > 1 (or B > 1)
        q, k, v, a, b = (t.contiguous() for t in (q, k, v, a, b))
        if mode == "prefill" and T >= _CHUNK_MIN_TOKENS:
            o = gdn_chunk(q, k, v, a, b, m.A_log, m.dt_bias, state)
        else:  # a short prefill chunk, or batched decode with fla's kernel
            o = gdn_recurrent(q, k, v, a, b, m.A_log, m.dt_bias, state)
        return self._gdn_out(m, o, z, norm_kernel)

    def _gdn_out(self, m, o, z, norm_kernel: bool = False):
        """The GDN block's gated RMSNorm (per head, gate z) and out_proj of the recurrence's o [B, T, Hv, Dv];
        norm_kernel: the norm as our op (kernels["gdn_norm"] "kernel"; z may be split-K partials)."""
        if norm_kernel:
            o = gated_norm(o, z, m.norm.weight, m.norm.variance_epsilon, self.pdl)
        else:
            o = gated_rms_norm(o, z.reshape(o.shape), m.norm.weight, m.norm.variance_epsilon)
        return self.lin.heads(m.out_proj, o)  # (per head into the op: the norm is one kernel, Linears.heads)

    def _attention(self, m, h, cos, sin, positions, k_cache, v_cache, mode, past: int = 0):
        """Gated full attention: q/k norms, partial rope, cache write, attention, sigmoid output gate. In
        prefill the T positions follow the `past` ones the rows hold."""
        B, T, _ = h.shape
        D = m.head_dim
        fused = self.fused_glue and mode != "prefill"  # (q | gate, k, v as split-K partials where they stream)
        qg, k, v = self.lin.project(m, h, ATTN_IN, ATTN_IN if fused else ())
        norms = (m.q_norm.weight, m.k_norm.weight, m.q_norm.eps, m.k_norm.eps, cos, sin, positions, k_cache, v_cache)
        if fused:  # (the tables, read at the positions: cos and sin unused, no kernel writes them)
            q = attention_prep(qg, k, v, *norms[:4], *self.rope_table, *norms[6:], self.pdl)
            if self.split_attention:  # the splits' merge and the output gate: one kernel of ours too
                o = merge_gated_op(*split_kv_partials_op(q, k_cache, v_cache, positions, m.scaling, True), q, qg,
                                   self.pdl)
                return self.lin(m.o_proj, o)
        else:
            q, k, v = prepare(qg, k, v, *norms)
        if mode == "prefill" and past == 0:
            o = attend_causal(q, k, v, m.scaling)
        elif mode == "prefill":
            o = attend_prefix(q, k_cache[:, :, :past + T], v_cache[:, :, :past + T], m.scaling)
        elif self.split_attention:
            o = attend_cache_split_op(q, k_cache, v_cache, positions, m.scaling)
        else:
            o = attend_cache(q, k_cache, v_cache, positions, m.scaling)
        gate = summed(qg, h.dtype).reshape(B, T, -1, 2 * D)[..., D:]
        o = o.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate.reshape(B, T, -1))
        return self.lin(m.o_proj, o)

    def _mlp(self, mlp, h, mode):
        if not hasattr(mlp, "experts"):
            return self.lin.mlp(mlp, h)
        if mode == "prefill":
            return mlp(h)  # transformers' own grouped expert loop
        experts = self.kernels["experts"]
        return routed_moe(mlp, h, grouped=experts in ("grouped", "grouped-pdl"), lin=self.lin,
                          pdl=self.pdl and experts == "grouped-pdl", expert_act=self.kernels["expert_act"],
                          route_kernel=self.kernels["route"])
