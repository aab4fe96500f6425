"""QuantLinear and `quantize(model, scheme)`.

Schemes: "fp8" (e4m3 weights in 128×128 blocks, activations rounded as dynamic per-token 1×128 fp8),
"fp8-weight" (e4m3 weights with one scale per output row, activations unchanged), "int4" (asymmetric
group-wise codes packed two a byte, group 128 by default; groups of a multiple of 128 stored as 128-column
groups, formats.int4_kernel_groups). On CUDA, inputs of at most 64 rows (decode and
verify steps, up to 4 rows of a 16-token block) go through the small-M kernel (ops/gemv.py: the weight
streamed in its stored format); larger inputs (prefill) and CPU use the torch reference: dequantize, then
matmul in the input dtype.
"""

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ..model import text_model
from ..ops import fp8_cuda, int4_cuda
from ..ops.gemv import (FORMATS, MAX_ROWS, STEP, add_splits, group_major, tile_int4, untile_int4,
                        wq_linear)
from .experts import QuantExperts
from .formats import FP8, INT4_ZERO, dequantize_weight, fake_quantize_fp8_activations, int4_scale, quantize_weight

SCHEMES = ("fp8", "fp8-weight", "int4")
_MIN_OUT_FEATURES = 16  # tiny projections (shared-expert gate: 1 row) stay in the model dtype


class QuantLinear(nn.Module):
    """y = x·Wᵀ (+ b) with W held in `scheme`'s format (see formats.py; int4 codes packed by `pack_int4` and, where
    out_features is a multiple of 16, tiled by 16 rows × a group (ops/gemv.py tile_int4: the kernels stream
    whole KBs), its scale in fp16 and zero in uint8 whatever dtype they come in (int4_scale), an act-order
    permutation in the `perm` buffer); buffers keep the state dict. `group` is the group the weight was quantized
    in (the scheme's choice or the checkpoint's); int4's stored group, K / scale's columns, is 128 where that is
    a multiple of 128 (stored_group)."""

    def __init__(self, scheme: str, in_features: int, out_features: int, tensors: dict, bias=None, group: int = 128):
        super().__init__()
        _check_stored(scheme, in_features, out_features, tensors)
        self.scheme, self.in_features, self.out_features, self.group = scheme, in_features, out_features, group
        zero = tensors.get("zero")
        if scheme == "int4" and zero is not None and zero.numel() and not zero.is_meta and not (
                bool((zero == zero.round()).all()) and zero.min() >= 0 and zero.max() <= 16):
            raise ValueError(f"int4 zeros must be integers in 0…16, as quantize_int4, GPTQ and AWQ give: the one- and "
                             f"few-row kernels decode q − zero exactly in 16 bits and bound fp16 sums by |q − zero| ≤ 16; "
                             f"got values from {zero.min().item():g} "
                             f"to {zero.max().item():g}{'' if bool((zero == zero.round()).all()) else ', not all integers'}")
        if scheme == "int4" and zero is not None:  # the dtypes the kernels read (checked: no value changes but
            # a scale's rounding to fp16)
            tensors = {**tensors, "scale": int4_scale(tensors["scale"]), "zero": zero.to(INT4_ZERO)}
        for name, t in tensors.items():
            if scheme == "int4" and name in ("scale", "zero"):  # the rows of one group side by side
                t = group_major(t)
            if scheme == "int4" and name == "qweight" and not t.is_meta:  # 16 rows x a group contiguous (N % 16 == 0)
                t = tile_int4(t)
            self.register_buffer(name, t)
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: str, group: int = 128) -> "QuantLinear":
        tensors = quantize_weight(linear.weight.detach(), scheme, group)
        return cls(scheme, linear.in_features, linear.out_features, tensors, linear.bias, group)

    def dequantized(self) -> torch.Tensor:
        """The weight [N, K] this layer multiplies by, in fp32."""
        names = ("qweight", "scale_inv", "scale", "zero", "perm")
        tensors = {n: getattr(self, n) for n in names if hasattr(self, n)}
        if self.scheme == "int4":
            tensors["qweight"] = untile_int4(tensors["qweight"])
        return dequantize_weight(self.scheme, tensors)

    def stored_group(self) -> int | None:
        """int4's stored group (its scale's columns a group: 128 for any group of a multiple of 128), else None."""
        return self.in_features // self.scale.shape[-1] if self.scheme == "int4" else None

    def forward(self, x: torch.Tensor, pdl: bool = False, fixup: bool = False, cuda: tuple = ()) -> torch.Tensor:
        """x [..., in_features] → [..., out_features]; pdl: the kernel with programmatic dependent launch;
        fixup: it sums its split-K partials itself (ops/gemv.py wq_linear); cuda: the schemes whose few-row
        products take the CUDA C++ kernels ("int4": ops/int4_cuda.py, "fp8-weight": ops/fp8_cuda.py) rather than the
        Triton one (ops/gemv.py)."""
        parts = self.partials(x, pdl, fixup, cuda=cuda)
        if parts is not None:
            y = add_splits(parts).to(x.dtype)
            return y if self.bias is None else y + self.bias
        if self.scheme == "fp8":
            x = fake_quantize_fp8_activations(x, STEP)
        return F.linear(x, self.dequantized().to(x.dtype), self.bias)

    def partials(self, x: torch.Tensor, pdl: bool = False, fixup: bool = False,
                 in_dims: int = 1, cuda: tuple = ()) -> torch.Tensor | None:
        """The weight-streaming kernel's split-K partials [S, ..., out_features] fp32 of x [..., in_features]
        (bias not added; their sum, in x's dtype, is the product), or None where the kernel does not take x
        (off CUDA, too many rows, a shape it cannot stream). in_dims: x's last in_dims dims (their product
        in_features) are flattened inside the op (Linears.heads). Where this scheme is in `cuda`, up to 16 rows
        of x in the layout its CUDA kernel takes go there (ops/int4_cuda.py, ops/fp8_cuda.py; with fixup in one
        split); anything else to ops/gemv.py's kernel."""
        rows = x.shape[:-in_dims].numel()
        if not (x.is_cuda and rows <= MAX_ROWS and self.in_features % STEP == 0 and (
                self.scheme != "int4" or self.stored_group() == STEP)):
            return None
        x2 = x.reshape(rows, *x.shape[-in_dims:])
        if getattr(self, "perm", None) is not None:
            x2 = x2.reshape(rows, -1).index_select(1, self.perm)  # the stored column order
        scale = self.scale_inv if self.scheme == "fp8" else self.scale
        parts = self._cuda_partials(x2.reshape(rows, -1), scale, pdl, fixup) if self.scheme in cuda else None
        if parts is not None:
            return parts.view(parts.shape[0], *x.shape[:-in_dims], self.out_features)
        parts = wq_linear(x2, FORMATS[self.scheme], self.qweight, scale, getattr(self, "zero", None),
                          self.scheme == "fp8", self.out_features, pdl, fixup)
        return parts.view(parts.shape[0], *x.shape[:-in_dims], self.out_features)

    def _cuda_partials(self, x2: torch.Tensor, scale: torch.Tensor, pdl: bool, fixup: bool) -> torch.Tensor | None:
        """The scheme's CUDA kernel's partials [S, rows, out_features] of x2 [rows, in_features], or None where
        it does not take them (fixup: one split, as the Triton kernel's fixup gives one partial)."""
        if self.scheme == "int4" and int4_cuda.takes(x2, self.qweight, scale, self.zero):
            return int4_cuda.int4_gemv(x2, self.qweight, scale, self.zero, self.out_features, pdl, fixup)
        if self.scheme == "fp8-weight" and fp8_cuda.takes(x2, self.qweight, scale):
            return fp8_cuda.fp8_gemv(x2, self.qweight, scale, pdl, fixup)
        return None

    def extra_repr(self) -> str:
        group = f", group={self.group}" if self.scheme == "int4" else ""
        return f"{self.scheme}, in_features={self.in_features}, out_features={self.out_features}{group}"


def _check_stored(scheme: str, K: int, N: int, tensors: dict) -> None:
    """A ValueError naming the tensor unless `tensors` are `scheme`'s stored layout for a layer of K inputs and N
    outputs: fp8 qweight [N, K] e4m3 + scale_inv [⌈N/128⌉, ⌈K/128⌉]; fp8-weight qweight [N, K] e4m3 + scale [N];
    int4 codes packed [N, K/2] uint8 (or tiled, tile_int4) + scale and zero [N, G] with G dividing K, perm [K].
    A mismatched scale would otherwise broadcast into a wrong weight, or fail deep inside a matmul."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; supported: {', '.join(SCHEMES)}")
    blocks = (-(-N // STEP), -(-K // STEP))
    groups = tensors["scale"].shape[-1] if scheme == "int4" and tensors.get("scale") is not None else 1
    want = {"fp8": {"qweight": ((N, K), FP8), "scale_inv": (blocks, None)},
            "fp8-weight": {"qweight": ((N, K), FP8), "scale": ((N,), None)},
            "int4": {"qweight": ((N, K // 2), torch.uint8), "scale": ((N, groups), None), "zero": ((N, groups), None),
                     "perm": ((K,), None)}}[scheme]
    layer = f"a layer of in_features={K}, out_features={N}"
    for name, (shape, dtype) in want.items():
        t = tensors.get(name)
        if t is None:
            if name != "perm":
                raise ValueError(f"{scheme} layer without its {name!r} tensor ({layer}): expected {list(shape)}")
            continue
        got = tuple(t.shape)
        if name == "qweight" and scheme == "int4" and t.dim() == 4:  # (tile_int4's [N/16, K/128, 16, 64]: no copy)
            got = (got[0] * got[2], got[1] * got[3])
        if got != shape or (dtype is not None and t.dtype != dtype):
            raise ValueError(f"{scheme} {name} of shape {list(got)} ({t.dtype}) does not fit {layer}: expected "
                             f"{list(shape)}{f' {dtype}' if dtype else ''} (formats.py's stored layout); the tensors "
                             f"and the config's sizes disagree (transposed, or another layer's?)")
    if scheme == "int4" and K % groups:
        raise ValueError(f"int4 scale of shape {list(tensors['scale'].shape)} does not fit {layer}: its {groups} "
                         f"columns must be groups that divide in_features")


def quantize(model, scheme: str, *, group_size: int = 128, lm_head: bool = False):
    """Replace the decoder's nn.Linear layers (and lm_head if asked) by QuantLinear in `scheme`, in place.

    Layers the scheme cannot take stay in the model dtype, listed in one warning: int4 needs in_features
    divisible by group_size; projections with fewer than 16 outputs are kept, and so are nn.Linear subclasses
    (a LoRA layer: their forward is more than x·Wᵀ). MoE layers' 3-D routed experts
    become QuantExperts (quant/experts.py) in the same scheme. On CUDA, layers the small-M kernel cannot take (ops/gemv.py) are quantized but listed in a
    second warning: they run the reference path. Embeddings are never quantized. Returns the model.
    """
    _check(scheme, group_size)
    extra = [(model, "lm_head", model.lm_head, "lm_head")] if lm_head else []
    _quantize_slots(_slots(text_model(model).layers, "model.layers.") + extra, scheme, group_size)
    return model


def quantize_modules(root: nn.Module, scheme: str, *, group_size: int = 128, prefix: str = "") -> nn.Module:
    """quantize() for every linear and routed-expert block under `root` (a speculative draft: the MTP head,
    a DFlash draft), with the same rules and warnings. Returns root."""
    _check(scheme, group_size)
    _quantize_slots(_slots(root, prefix), scheme, group_size)
    return root


def _check(scheme, group_size):
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; supported: {', '.join(SCHEMES)}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")


def _slots(root: nn.Module, prefix: str) -> list:
    """(parent, attribute, child, full name) of every child module under root."""
    return [(parent, name, child, f"{prefix}{path}.{name}".replace("..", ".").lstrip("."))
            for path, parent in root.named_modules() for name, child in parent.named_children()]


def _quantize_slots(slots: list, scheme: str, group_size: int) -> None:
    """Quantize the linears and routed experts among `slots` (_slots' tuples) in place, one at a time: each
    slot is cleared as it is taken, so a layer's original weights are freed once its quantized module replaces
    it (the peak is the model plus one layer's temporaries, not the model in both formats: a 27B bf16 model
    on an 80 GB GPU quantizes to fp8-weight). `slots` is left empty."""
    done = [(full, child) for _, _, child, full in slots if isinstance(child, (QuantLinear, QuantExperts))]
    layout = lambda sch, group: (sch, group if sch == "int4" else None)  # noqa: E731 (fp8's scales: no group)
    other = [(full, child) for full, child in done if layout(child.scheme, child.group) != layout(scheme, group_size)]
    if other:  # quantized layers are skipped below: never leave them in another scheme than the one asked for
        full, child = other[0]
        raise ValueError(f"quantize({scheme!r}, group_size={group_size}): the model is already quantized "
                         f"({len(other)} modules, e.g. {full} as {child.scheme!r}, group {child.group}); to run it as "
                         f"it is, leave quant= unset; to quantize it another way, load it in bf16 again")
    kept, slow, added = [], [], []
    first = next((p for _, _, child, _ in slots for p in child.parameters()), None)
    cuda, dtype = first is not None and first.is_cuda, getattr(first, "dtype", None)
    del first
    slots.reverse()
    with torch.no_grad():
        while slots:
            parent, name, child, full = slots.pop()
            if not isinstance(child, nn.Linear):
                if name == "experts" and hasattr(child, "gate_up_proj"):
                    H, inter = child.down_proj.shape[1:]
                    if scheme == "int4" and (H % group_size or inter % group_size):
                        kept.append(f"{full} (expert sizes {H}, {inter} not divisible by {group_size})")
                        continue
                    setattr(parent, name, QuantExperts(child, scheme, group_size))
            elif type(child) is not nn.Linear:  # (a LoRA layer, a quantized format: its forward is more than x·Wᵀ)
                kept.append(f"{full} (a {type(child).__name__}, not a plain nn.Linear)")
            elif child.out_features < _MIN_OUT_FEATURES:
                kept.append(f"{full} ({child.out_features} outputs)")
            elif scheme == "int4" and child.in_features % group_size:
                kept.append(f"{full} (in_features {child.in_features} not divisible by {group_size})")
            else:
                setattr(parent, name, QuantLinear.from_linear(child, scheme, group_size))
                added.append(full)
                if cuda and (child.in_features % STEP or (scheme == "int4" and group_size % STEP)):
                    slow.append(f"{full} (in_features {child.in_features}, group {group_size})")
    if slow:
        warnings.warn(f"quantize({scheme!r}): no small-M kernel for {len(slow)} layers (it needs in_features "
                      f"divisible by {STEP} and int4 groups of a multiple of {STEP}); they decode through the slower "
                      f"dequantize-then-matmul reference: " + "; ".join(slow[:12]) + (" …" if len(slow) > 12 else ""),
                      stacklevel=3)
    if done and added:  # (a loaded checkpoint: the layers its producer kept unquantized, e.g. GDN in_proj_a / b)
        warnings.warn(f"quantize({scheme!r}): the model was already quantized ({len(done)} modules) and {len(added)} "
                      f"more layers it kept in {dtype} are now quantized too: " + "; ".join(added[:12])
                      + (" …" if len(added) > 12 else "") + "; to run a loaded checkpoint as it is, leave quant= unset",
                      stacklevel=3)
    if kept:
        warnings.warn(f"quantize({scheme!r}) kept {len(kept)} layers in {dtype}: " + "; ".join(kept[:12])
                      + (" …" if len(kept) > 12 else ""), stacklevel=3)
