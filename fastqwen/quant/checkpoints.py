"""Load pre-quantized Qwen3.5 checkpoints into QuantLinear layers without dequantizing.

Supported `quantization_config`s: Qwen's FP8 (`quant_method: fp8`, `weight_block_size: [128, 128]`: fp8
`weight` + `weight_scale_inv`, kept as they are), GPTQ (`quant_method: gptq`, 4 bits, act-order or not,
"gptq" or "gptq_v2" format) and AWQ (`quant_method: awq`, 4 bits, GEMM layout), converted exactly to our int4
layout; compressed-tensors (llm-compressor's FP8 per row, tensor or 128×128 block, and W4A16 int4, compressed.py).
Int4 groups of a multiple of 128 columns (per-channel `group_size: -1` too) become 128-column groups, their scales
and zeros repeated, which is exact and what the weight-streaming kernels take; other group sizes load exactly too
but decode through the reference (dequantize, then matmul), and a warning lists those layers.
Nothing is fetched from a hub: transformers' own loaders for these formats want kernels from there.
A quantized layer whose tensors are missing, or of shapes and dtypes its config's sizes do not give, and an fp8
tensor without its scale, are errors naming the layer: never a weight loaded unscaled or broadcast wrongly.

Checkpoints are read as Qwen publishes them: the multimodal layout's text weights (`model.language_model.*`)
under the text model's names, its vision tower (`model.visual.*`) and MTP head (`mtp.*`, see spec/mtp.py) left
out, and a MoE layer's experts stored one module each (`mlp.experts.<e>.{gate,up,down}_proj`): quantized ones
become a QuantExperts holding their tensors as stored, plain ones are stacked into transformers' 3-D
`gate_up_proj` / `down_proj`.

`save_pretrained` writes a model quantized here (quantize, or from_pretrained) back in those formats: fp8 as Qwen's
FP8, int4 as GPTQ, fp8-weight as compressed-tensors' FP8 per channel; loading it again gives the same stored
tensors.
"""

import json
import re
from pathlib import Path

import warnings

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ..ops.gemv import STEP

from . import compressed
from .experts import QuantExperts
from .formats import int4_kernel_groups, pack_int4, unpack_int4, untile_int4
from .gptq import from_awq, from_gptq, to_gptq
from .linear import QuantLinear

_TEXT_PREFIX = "model.language_model."
_EXPERT_KEY = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")


def _read_safetensors(root: Path) -> dict:
    """The checkpoint's tensors: the index's files, else model.safetensors (as transformers reads a directory without
    an index), else every *.safetensors there; a tensor in two of them is refused (one would silently win)."""
    from safetensors import safe_open

    index = root / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else None
    single = root / "model.safetensors"
    paths = [root / f for f in files] if files else [single] if single.is_file() else sorted(root.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"{root} holds no safetensors files")
    tensors, source = {}, {}
    for p in paths:
        with safe_open(str(p), framework="pt") as fh:
            for key in fh.keys():
                if key in source:
                    raise ValueError(f"{key} is in both {source[key].name} and {p.name} in {root}: remove the stray "
                                     f"file, or list the shards in model.safetensors.index.json")
                tensors[key], source[key] = fh.get_tensor(key), p
    return tensors


def _check_config(qc: dict) -> str:
    method = qc.get("quant_method")
    if method == "fp8":
        if list(qc.get("weight_block_size") or []) != [128, 128]:
            raise ValueError(f"FP8 checkpoint with weight_block_size={qc.get('weight_block_size')}: only "
                             f"[128, 128] block scales are supported")
        if qc.get("activation_scheme", "dynamic") != "dynamic":  # (its per-layer input_scale is not read)
            warnings.warn(f"FP8 checkpoint with activation_scheme={qc.get('activation_scheme')!r}: its input_scale "
                          f"tensors are ignored and activations are rounded to fp8 dynamically, per token and "
                          f"128 columns, as for Qwen's dynamic checkpoints", stacklevel=3)
    elif method in ("gptq", "awq"):
        if qc.get("bits", 4) != 4:
            raise ValueError(f"{method} checkpoint with bits={qc.get('bits')}: only 4-bit is supported")
        if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
            raise ValueError(f"AWQ version {qc.get('version')!r}: only the GEMM layout is supported")
        if method == "gptq" and qc.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {qc.get('checkpoint_format')!r} is not supported")
        if method == "awq" and qc.get("zero_point", True) is not True:  # (AWQ's GEMM layout stores zeros)
            raise ValueError(f"AWQ checkpoint with zero_point={qc.get('zero_point')!r}: only AWQ's asymmetric GEMM "
                             f"layout (zero_point: true) is supported; load the bf16 checkpoint and "
                             f"optimize(model, quant='int4')")
        group = qc.get("group_size", 128)
        if group not in (-1, None) and (not isinstance(group, int) or isinstance(group, bool) or group < 1):
            raise ValueError(f"{method} checkpoint with group_size={group!r}: expected a positive int, or -1 (one "
                             f"group a row); fix its config.json's quantization_config")
    elif method == "compressed-tensors":
        compressed.check_config(qc)
    else:
        raise ValueError(f"unsupported quantization_config quant_method={method!r}; supported: fp8 (128×128 "
                         f"blocks), gptq (4-bit), awq (4-bit GEMM), compressed-tensors (fp8, int4)")
    return method


_STORED = {"fp8": ("weight", "weight_scale_inv"), "gptq": ("qweight", "qzeros", "scales"),
           "awq": ("qweight", "qzeros", "scales")}  # each quantized layer's tensors, by quant_method


def _quant_linear(method: str, qc: dict, t: dict, prefix: str, shape) -> QuantLinear:
    """The QuantLinear of module `prefix` [out_features, in_features] = `shape` from its checkpoint tensors `t`
    (keys without the prefix); a ValueError naming `prefix` where they are missing or do not fit `shape`."""
    need = (compressed.stored_names(compressed.weight_args(qc)) if method == "compressed-tensors" else
            _STORED[method] + (("g_idx",) if method == "gptq" and qc.get("desc_act") else ()))  # (act-order's columns)
    missing = [k for k in need if k not in t]
    if missing:
        raise ValueError(f"{prefix}: the {method} checkpoint holds no {', '.join(missing)} for this layer (it "
                         f"holds {sorted(t)}; each {method} layer stores {', '.join(need)}): the checkpoint is "
                         f"incomplete or in another format")
    try:
        return _convert(method, qc, t, shape)
    except ValueError as err:
        raise ValueError(f"{prefix}: {err}") from None


def _convert(method: str, qc: dict, t: dict, shape) -> QuantLinear:
    out_features, in_features = shape
    if method == "fp8":
        return QuantLinear("fp8", in_features, out_features,
                           {"qweight": t["weight"], "scale_inv": t["weight_scale_inv"].float()}, t.get("bias"))
    if method == "compressed-tensors":
        scheme, tensors, group = compressed.to_ours(compressed.weight_args(qc), t, shape)
        if scheme != "int4":
            return QuantLinear(scheme, in_features, out_features, tensors, t.get("bias"))
        return _int4_linear(tensors["codes"], tensors["scale"], tensors["zero"], tensors.get("perm"), group, shape,
                            t.get("bias"))
    group = qc.get("group_size", 128)
    group = in_features if group in (-1, None) else group
    if method == "gptq":
        g_idx = t.get("g_idx", torch.arange(in_features, dtype=torch.int32) // group)
        offset = 1 if qc.get("checkpoint_format", "gptq") == "gptq" else 0
        codes, scale, zero, perm = from_gptq(t["qweight"], t["qzeros"], t["scales"], g_idx, group=group,
                                             zero_offset=offset)
    else:
        codes, scale, zero, perm = from_awq(t["qweight"], t["qzeros"], t["scales"], group=group)
    return _int4_linear(codes, scale, zero, perm, group, shape, t.get("bias"))


def _int4_linear(codes, scale, zero, perm, group: int, shape, bias) -> QuantLinear:
    """The int4 QuantLinear [N, K] = `shape` of codes [N, K] (stored column order), scale and zero [N, K / group],
    perm [K] or None: groups of a multiple of 128 as 128-column ones (exact), codes packed."""
    scale, zero = int4_kernel_groups(scale, zero, group)
    tensors = {"qweight": pack_int4(codes), "scale": scale, "zero": zero}
    if perm is not None:
        tensors["perm"] = perm
    return QuantLinear("int4", shape[1], shape[0], tensors, bias, group)


def _text_tensors(tensors: dict) -> dict:
    """The checkpoint's tensors under the text model's names: `model.language_model.X` → `model.X`; the vision
    tower's dropped (fastqwen generates text), and the MTP head's (spec/mtp.py reads those from the path)."""
    return {("model." + k[len(_TEXT_PREFIX):] if k.startswith(_TEXT_PREFIX) else k): v for k, v in tensors.items()
            if not k.startswith(("model.visual.", "visual.", "mtp."))}


def _pop_experts(tensors: dict) -> dict:
    """Remove the per-expert tensors from `tensors`: {experts module: {expert: {projection: {name: tensor}}}}."""
    experts: dict = {}
    for key in [k for k in tensors if _EXPERT_KEY.match(k)]:
        module, e, proj, name = _EXPERT_KEY.match(key).groups()
        experts.setdefault(module, {}).setdefault(int(e), {}).setdefault(proj, {})[name] = tensors.pop(key)
    return experts


def _experts(method: str, qc: dict, prefix: str, meta, per_expert: dict, marker: str):
    """A MoE layer's experts from their per-expert checkpoint tensors: (QuantExperts, None) when they are
    quantized, else (None, {"gate_up_proj": [E, 2I, H], "down_proj": [E, H, I]}) for transformers' module."""
    E, two_i, H = meta.gate_up_proj.shape
    I = two_i // 2
    if sorted(per_expert) != list(range(E)):
        raise ValueError(f"{prefix}: the checkpoint holds experts {sorted(per_expert)[:4]}… ({len(per_expert)}), the "
                         f"config {E}")
    projs = [per_expert[e][p] for e in range(E) for p in ("gate_proj", "up_proj", "down_proj")]
    quantized = {marker in t for t in projs}
    if quantized == {False}:
        w = lambda e, p: per_expert[e][p]["weight"]  # noqa: E731
        return None, {"gate_up_proj": torch.stack([torch.cat([w(e, "gate_proj"), w(e, "up_proj")]) for e in range(E)]),
                      "down_proj": torch.stack([w(e, "down_proj") for e in range(E)])}
    if quantized != {True}:
        raise ValueError(f"{prefix}: some experts' projections are quantized and some are not")
    shapes = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
    layers = [{p: _quant_linear(method, qc, per_expert[e][p], f"{prefix}.{e}.{p}", shapes[p]) for p in shapes}
              for e in range(E)]
    first = layers[0]["down_proj"]
    if first.scheme == "fp8" and I % 128:
        raise ValueError(f"{prefix}: FP8 experts of intermediate size {I} (not a multiple of 128) cannot share one "
                         f"gate | up matrix of 128-row scale blocks")
    if any(getattr(lin, "perm", None) is not None for experts in layers for lin in experts.values()):
        raise ValueError(f"{prefix}: act-order (desc_act) GPTQ experts are not supported; quantize the experts "
                         f"without act-order, or load the bf16 checkpoint and optimize(model, quant='int4')")
    keys = [k for k in ("qweight", "scale_inv", "scale", "zero") if hasattr(first, k)]
    stored = {"gate_up": {k: torch.stack([torch.cat([getattr(x["gate_proj"], k), getattr(x["up_proj"], k)])
                                          for x in layers]) for k in keys},
              "down": {k: torch.stack([getattr(x["down_proj"], k) for x in layers]) for k in keys}}
    return QuantExperts(meta, first.scheme, first.group, stored=stored), None


def from_pretrained(path, *, dtype=torch.bfloat16, device="cpu"):
    """A Qwen3.5 model from a pre-quantized checkpoint directory, quantized layers kept quantized.

    Pass the result to fastqwen.optimize as any other model.
    """
    root = Path(path)
    config = AutoConfig.from_pretrained(root)
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        raise ValueError(f"{path} has no quantization_config, so it is no FP8, GPTQ, AWQ or compressed-tensors "
                         f"checkpoint: a bf16 one loads with transformers' from_pretrained (then "
                         f"fastqwen.optimize(model, quant=...)); a model quantized by fastqwen saves in a format this "
                         f"reads with fastqwen.save_pretrained")
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = _check_config(qc)
    del config.quantization_config
    tensors = _text_tensors(_read_safetensors(root))
    marker = {"fp8": "weight_scale_inv", "compressed-tensors": "weight_scale"}.get(method, "qweight")
    per_expert = _pop_experts(tensors)
    quantized = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith("." + marker)})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    done = set(quantized)
    for prefix, experts in per_expert.items():
        parent_name, _, name = prefix.rpartition(".")
        parent = model.get_submodule(parent_name)
        module, plain_weights = _experts(method, qc, prefix, getattr(parent, name), experts, marker)
        if module is None:
            tensors.update({f"{prefix}.{k}": v for k, v in plain_weights.items()})
        else:
            setattr(parent, name, module.to(device))
            done.add(prefix)
    for prefix in quantized:
        parent_name, _, name = prefix.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, name)
        if not isinstance(linear, torch.nn.Linear):  # (e.g. a MoE router that the quantization recipe did not ignore)
            raise ValueError(f"{path}: {prefix} is stored quantized, but it is a {type(linear).__name__}, no Linear: "
                             f"only Linear layers load quantized; load the bf16 checkpoint and "
                             f"optimize(model, quant=...), or quantize it again with {prefix} left unquantized")
        own = {k[len(prefix) + 1:]: tensors.pop(k) for k in list(tensors) if k.startswith(prefix + ".")}
        layer = _quant_linear(method, qc, own, prefix, (linear.out_features, linear.in_features))
        setattr(parent, name, layer.to(device))
    unscaled = [k for k, v in tensors.items() if v.is_floating_point() and v.element_size() == 1]
    if unscaled:  # (as plain weights they would load as their codes, unscaled)
        names = ", ".join(unscaled[:4]) + (" …" if len(unscaled) > 4 else "")
        raise ValueError(f"{path}: {names} {'is' if len(unscaled) == 1 else 'are'} stored in fp8 "
                         f"({tensors[unscaled[0]].dtype}) without a scale (weight_scale_inv) beside "
                         f"{'it' if len(unscaled) == 1 else 'them'}: the checkpoint is incomplete; download it again")
    plain = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(plain, strict=False, assign=True)
    tied = config.get_text_config().tie_word_embeddings  # (lm_head.weight: the embedding's, not stored)
    if tied and "lm_head" in done:  # a quantized head of its own: the embedding no longer is its weight
        tied = False
        for c in (model.config, model.config.get_text_config()):
            c.tie_word_embeddings = False
    missing = [m for m in missing if not m.endswith("inv_freq") and m.rsplit(".", 1)[0] not in done
               and not (tied and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{path} does not match its config: missing {missing[:6]}, unexpected {unexpected[:6]}")
    for module in model.modules():  # rotary tables are not in checkpoints: rebuild them off the meta device
        if module.__class__.__name__.endswith("RotaryEmbedding"):
            fresh = type(module)(module.config)
            module.inv_freq, module.original_inv_freq = fresh.inv_freq, fresh.original_inv_freq
    if tied:
        model.tie_weights()
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise ValueError(f"{path}: no values for {still_meta[:6]}")
    model.to(device)
    model.name_or_path = str(root)
    _warn_reference_layers(model)
    return model.eval()


def _warn_reference_layers(model) -> None:
    """One warning listing the int4 layers no weight-streaming kernel takes (groups other than 128 columns or a
    multiple of them, or in_features not a multiple of 128): they decode through the dequantize-then-matmul
    reference, many times slower than bf16."""
    slow = [f"{name} (group {m.group}, in_features {m.in_features})" for name, m in model.named_modules()
            if isinstance(m, QuantLinear) and m.scheme == "int4" and (m.stored_group() != STEP or m.in_features % STEP)]
    slow += [f"{name} (group {m.group}, sizes {m.hidden}, {m.inter})" for name, m in model.named_modules()
             if isinstance(m, QuantExperts) and m.scheme == "int4" and not m.kernel_fits()]
    if slow:
        warnings.warn(f"{len(slow)} int4 layers have no small-M kernel (it takes groups of {STEP} columns or a "
                      f"multiple of {STEP}, and in_features divisible by {STEP}); they decode through the slower "
                      f"dequantize-then-matmul reference: " + "; ".join(slow[:8]) + (" …" if len(slow) > 8 else "")
                      + f". Quantize with group_size {STEP} for speed, or load the bf16 checkpoint and "
                      "optimize(model, quant='int4')", stacklevel=2)


SHARD_BYTES = 5 << 30  # save_pretrained's largest safetensors file
_WEIGHT_FILE = re.compile(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?")  # what save_pretrained writes


def save_pretrained(model, path, *, int4_format: str = "gptq", mtp_from=None, shard_bytes: int = SHARD_BYTES) -> Path:
    """Write `model`, quantized by fastqwen.quant.quantize or loaded by from_pretrained (and not yet optimized),
    as a checkpoint from_pretrained reads back to the same stored tensors: fp8 layers as Qwen's FP8 (`weight` e4m3
    + `weight_scale_inv` per 128×128 block), int4 as GPTQ (4 bits, the layers' group or -1 for per-channel,
    act-order as g_idx, the "gptq" format, which stores zero − 1, unless a zero is 0: then "gptq_v2"; or, with
    int4_format="compressed-tensors", as its asymmetric W4A16, which vLLM serves and GPTQ's asymmetric form it
    refuses), fp8-weight
    as compressed-tensors' FP8 channel scheme (`weight` e4m3 × `weight_scale` [N, 1], other Linears `ignore`d). Routed
    experts are written one module each (`mlp.experts.<e>.{gate,up,down}_proj`), as Qwen publishes them; the rest
    of the state dict as it is (a multimodal model's vision tower too), in safetensors files of at most
    `shard_bytes` (an index beside them when several; an earlier checkpoint's weight files in `path` are removed,
    so that none is read in place of these). The MTP head (`mtp.*`, for speculate="mtp") is no part of a
    transformers model: it is copied as stored from `mtp_from`, by default the local checkpoint the model was
    loaded from when it has one (False: none; read before anything is written, so `path` may be that checkpoint).
    For other readers (vLLM, transformers) the config names the model class (`architectures`) and what stays in
    the model dtype: fp8's `modules_to_not_convert` and compressed-tensors' `ignore` list the plain Linears and
    routers (and an MTP head copied unquantized), GPTQ's `lm_head` says whether the head is quantized.
    Returns the directory."""
    from safetensors.torch import save_file

    from ..spec.mtp import checkpoint_source, stored_mtp_tensors

    if int4_format not in ("gptq", "compressed-tensors"):
        raise ValueError(f"int4_format={int4_format!r}: 'gptq' (the default) or 'compressed-tensors'")

    if getattr(model, "_fastqwen", None) is not None:
        raise ValueError("save_pretrained takes the model before fastqwen.optimize (optimize fuses projections and "
                         "stacks shared experts, which are no checkpoint's layout): quantize, save, then optimize")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, (QuantLinear, QuantExperts))}
    schemes = {m.scheme for m in layers.values()}
    if len(schemes) != 1:
        raise ValueError(f"save_pretrained writes a model quantized in one scheme; got {sorted(schemes) or 'none'} "
                         f"(a model with no quantized layer saves with its own save_pretrained)")
    scheme = schemes.pop()
    if int4_format != "gptq" and scheme != "int4":
        warnings.warn(f"int4_format={int4_format!r} is ignored: the model is quantized in {scheme!r}", stacklevel=2)
    if any(getattr(m, "stacks", None) for m in layers.values()):
        raise ValueError("a shared expert is stacked into its routed experts (optimize's layout): save before optimize")
    matrices = {f"{n}.{e}.{proj}" if isinstance(m, QuantExperts) else n: t
                for n, m in layers.items() for (e, proj), t in _stored_matrices(m).items()}
    plain = [n for n, m in model.named_modules()  # (other readers quantize what these lists do not name; routers
             if isinstance(m, torch.nn.Linear) or type(m).__name__.endswith("Router")]  # are Linears to them)
    if scheme == "fp8":
        qc = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3",
              "modules_to_not_convert": plain}
        written = {f"{k}.{new}": t[old] for k, t in matrices.items()
                   for old, new in (("qweight", "weight"), ("scale_inv", "weight_scale_inv"))}
    elif scheme == "fp8-weight":
        qc = compressed.fp8_rows_config(plain)
        written = {f"{k}.{name}": v for k, t in matrices.items()
                   for name, v in compressed.fp8_rows_tensors(t["qweight"], t["scale"]).items()}
    else:
        group = _gptq_group(matrices, {m.group for m in layers.values()})
        act_order = any(t.get("perm") is not None for t in matrices.values())
        offset = 1 if min(t["zero"].min().item() for t in matrices.values()) >= 1 else 0
        qc = (compressed.int4_config(group, act_order, plain) if int4_format == "compressed-tensors" else
              {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": False, "lm_head": "lm_head" in layers,
               "desc_act": act_order, "checkpoint_format": "gptq" if offset else "gptq_v2"})
        written = {}
        for k, t in matrices.items():
            K = t["codes"].shape[1]
            g = K if group == -1 else group
            step = g // (K // t["scale"].shape[-1])  # (stored scale columns a group: checked by _gptq_group)
            scale, zero = t["scale"][:, ::step], t["zero"][:, ::step]
            try:
                # (under act-order every layer carries weight_g_idx: a reader allocates it for each, and a layer in
                # column order (perm None) would be left with whatever that memory held)
                perm = t.get("perm")
                perm = torch.arange(K, device=t["codes"].device) if act_order and perm is None else perm
                out = (compressed.int4_tensors(t["codes"], scale, zero, perm, g)
                       if int4_format == "compressed-tensors" else
                       to_gptq(t["codes"], scale.float(), zero.float(), t.get("perm"), group=g, zero_offset=offset))
            except ValueError as err:
                raise ValueError(f"{k}: {err}") from None
            written.update({f"{k}.{name}": v for name, v in out.items()})
    biases = {f"{n}.bias": m.bias for n, m in layers.items() if getattr(m, "bias", None) is not None}
    state = {k: v for k, v in model.state_dict().items() if not any(k.startswith(n + ".") for n in layers)}
    config = model.config.to_dict()
    if "lm_head" in layers:  # (a quantized head is no longer the embedding's transpose)
        for c in (config, config.get("text_config") or {}):
            c["tie_word_embeddings"] = False
    elif model.config.get_text_config().tie_word_embeddings:
        state.pop("lm_head.weight", None)  # (the embedding's storage: tied again on load)
    config["architectures"] = [type(model).__name__]  # (transformers leaves it None: other readers need it)
    config["quantization_config"] = qc
    mtp = {}
    if mtp_from is None:
        source = checkpoint_source(model)
        if source and Path(source).exists():
            mtp = stored_mtp_tensors(source)
        elif source:
            warnings.warn(f"the MTP head is not written: the model's source {source!r} is no local checkpoint; pass "
                          f"mtp_from=<the checkpoint's directory> for speculate='mtp' on the saved one", stacklevel=2)
    elif mtp_from is not False:
        if not Path(mtp_from).exists():
            raise FileNotFoundError(f"mtp_from={str(mtp_from)!r} does not exist: pass the checkpoint directory (or "
                                    f"safetensors file) that ships the MTP head, or mtp_from=False")
        mtp = stored_mtp_tensors(mtp_from)
        if not mtp:
            raise ValueError(f"mtp_from={str(mtp_from)!r} has no mtp.* tensors: pass the checkpoint that ships the MTP "
                             f"head, or mtp_from=False")
    unscaled = sorted({k.rsplit(".", 1)[0] for k, v in mtp.items() if k.endswith(".weight") and v.dim() == 2} -
                      {k.rsplit(".", 1)[0] for k in mtp if k.endswith((".weight_scale_inv", ".weight_scale"))})
    if scheme == "fp8":  # (an MTP head copied unquantized: other readers would take its weights for fp8 codes)
        qc["modules_to_not_convert"] += unscaled
    elif qc["quant_method"] == "compressed-tensors":
        qc["ignore"] += unscaled
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in {**state, **written, **biases, **mtp}.items()}
    shards, size = [{}], 0
    for k, v in tensors.items():
        if shards[-1] and size + v.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += v.nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for name, shard in zip(names, shards):
        save_file(shard, str(root / name), metadata={"format": "pt"})
    if len(shards) > 1:
        weight_map = {k: name for name, shard in zip(names, shards) for k in shard}
        (root / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": sum(v.nbytes for v in tensors.values())}, "weight_map": weight_map}, indent=2))
        names.append("model.safetensors.index.json")
    for stale in root.iterdir():  # an earlier checkpoint's index or shards there would be read in place of these
        if stale.name not in names and _WEIGHT_FILE.fullmatch(stale.name):
            stale.unlink()
    return root


def _stored_matrices(m) -> dict:
    """{(expert, projection) or (None, None): tensors} of a QuantLinear or QuantExperts: fp8 {qweight [N, K],
    scale_inv [N/128, K/128]}; fp8-weight {qweight [N, K], scale [N]}; int4 {codes [N, K] uint8, scale and zero
    [N, K / stored group], perm [K] or None}."""
    if isinstance(m, QuantLinear):
        if m.scheme == "fp8":
            return {(None, None): {"qweight": m.qweight, "scale_inv": m.scale_inv}}
        if m.scheme == "fp8-weight":
            return {(None, None): {"qweight": m.qweight, "scale": m.scale}}
        return {(None, None): {"codes": unpack_int4(untile_int4(m.qweight)), "scale": m.scale, "zero": m.zero,
                               "perm": getattr(m, "perm", None)}}
    I, out = m.inter, {}
    for e in range(m.num_experts):
        gate_up, down = m.stored("gate_up", e), m.stored("down", e)
        if m.scheme in ("fp8", "fp8-weight"):
            if I % 128 and m.scheme == "fp8":
                raise ValueError(f"FP8 experts of intermediate size {I} (no multiple of 128) have no per-expert "
                                 f"128×128 blocks to write")
            halves = {k: (v[:I // 128 if k == "scale_inv" else I], v[I // 128 if k == "scale_inv" else I:])
                      for k, v in gate_up.items()}
            parts = {"gate_proj": {k: v[0] for k, v in halves.items()},
                     "up_proj": {k: v[1] for k, v in halves.items()}, "down_proj": down}
        else:
            codes = {name: unpack_int4(untile_int4(t["qweight"][None]))[0] for name, t in (("gu", gate_up), ("dn", down))}
            parts = {"gate_proj": {"codes": codes["gu"][:I], "scale": gate_up["scale"][:I], "zero": gate_up["zero"][:I]},
                     "up_proj": {"codes": codes["gu"][I:], "scale": gate_up["scale"][I:], "zero": gate_up["zero"][I:]},
                     "down_proj": {"codes": codes["dn"], "scale": down["scale"], "zero": down["zero"]}}
        out.update({(e, proj): t for proj, t in parts.items()})
    return out


def _gptq_group(matrices: dict, groups: set) -> int:
    """GPTQ's one group_size for int4 `matrices` (_stored_matrices): the layers' `groups` where they are one and it
    holds each matrix's stored scales and zeros exactly, else -1 where every row has one scale and zero (a
    per-channel checkpoint's layers, each loaded with its in_features as its group)."""
    def runs(t, g):  # whether scale and zero are constant over runs of g columns
        K = t["codes"].shape[1]
        stored = K // t["scale"].shape[-1]
        if K % g or g % stored:
            return False
        return all(bool((v.reshape(v.shape[0], K // g, g // stored) == v[:, ::g // stored, None]).all())
                   for v in (t["scale"], t["zero"]))

    if len(groups) == 1 and all(runs(t, next(iter(groups))) for t in matrices.values()):
        return groups.pop()
    if all(runs(t, t["codes"].shape[1]) for t in matrices.values()):
        return -1
    raise ValueError(f"GPTQ holds one group_size for every layer; these int4 layers were quantized in groups "
                     f"{sorted(groups)}: quantize the model in one group size to save it")
