"""QuantLinear and `quantize(model, scheme)`.

Schemes: "fp8" (e4m3 weights in 128×128 blocks, activations rounded as dynamic per-token 1×128 fp8),
"fp8-weight" (e4m3 weights with one scale per output row, activations unchanged), "int4" (asymmetric
group-wise codes, group 128 by default). The forward here is the torch reference (dequantize, then matmul),
which inductor compiles as it is; small-M kernels that stream the quantized bytes replace it per scheme
(issue 4) and are tested against it.
"""

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ..model import text_model
from .formats import (
    dequantize_fp8_block,
    dequantize_fp8_rows,
    dequantize_int4,
    fake_quantize_fp8_activations,
    quantize_fp8_block,
    quantize_fp8_rows,
    quantize_int4,
)

SCHEMES = ("fp8", "fp8-weight", "int4")
_FP8_BLOCK = 128
_MIN_OUT_FEATURES = 16  # tiny projections (shared-expert gate: 1 row) stay in the model dtype


class QuantLinear(nn.Module):
    """y = x·Wᵀ (+ b) with W held in `scheme`'s format (see formats.py); buffers keep the state dict."""

    def __init__(self, scheme: str, in_features: int, out_features: int, tensors: dict, bias=None, group: int = 128):
        super().__init__()
        self.scheme, self.in_features, self.out_features, self.group = scheme, in_features, out_features, group
        for name, t in tensors.items():
            self.register_buffer(name, t)
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: str, group: int = 128) -> "QuantLinear":
        w = linear.weight.detach()
        if scheme == "fp8":
            q, s = quantize_fp8_block(w, (_FP8_BLOCK, _FP8_BLOCK))
            tensors = {"qweight": q, "scale_inv": s}
        elif scheme == "fp8-weight":
            q, s = quantize_fp8_rows(w)
            tensors = {"qweight": q, "scale": s}
        else:
            q, s, z = quantize_int4(w, group)
            tensors = {"qweight": q, "scale": s, "zero": z}
        return cls(scheme, linear.in_features, linear.out_features, tensors, linear.bias, group)

    def dequantized(self) -> torch.Tensor:
        """The weight [N, K] this layer multiplies by, in fp32."""
        if self.scheme == "fp8":
            return dequantize_fp8_block(self.qweight, self.scale_inv, (_FP8_BLOCK, _FP8_BLOCK))
        if self.scheme == "fp8-weight":
            return dequantize_fp8_rows(self.qweight, self.scale)
        return dequantize_int4(self.qweight, self.scale, self.zero, self.group, getattr(self, "perm", None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scheme == "fp8":
            x = fake_quantize_fp8_activations(x, _FP8_BLOCK)
        return F.linear(x, self.dequantized().to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"{self.scheme}, in_features={self.in_features}, out_features={self.out_features}"


def quantize(model, scheme: str, *, group_size: int = 128, lm_head: bool = False):
    """Replace the decoder's nn.Linear layers (and lm_head if asked) by QuantLinear in `scheme`, in place.

    Layers the scheme cannot take stay in the model dtype, listed in one warning: int4 needs in_features
    divisible by group_size; projections with fewer than 16 outputs are kept; 3-D MoE expert weights are not
    quantized yet. Embeddings are never quantized. Returns the model.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; supported: {', '.join(SCHEMES)}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    layers = text_model(model).layers
    slots = [(parent, name, child, f"model.layers.{prefix}.{name}".replace("..", "."))
             for prefix, parent in layers.named_modules() for name, child in parent.named_children()]
    if lm_head:
        slots.append((model, "lm_head", model.lm_head, "lm_head"))
    kept = []
    with torch.no_grad():
        for parent, name, child, full in slots:
            if not isinstance(child, nn.Linear):
                if name == "experts" and hasattr(child, "gate_up_proj"):
                    kept.append(f"{full} (3-D experts: not supported yet)")
            elif child.out_features < _MIN_OUT_FEATURES:
                kept.append(f"{full} ({child.out_features} outputs)")
            elif scheme == "int4" and child.in_features % group_size:
                kept.append(f"{full} (in_features {child.in_features} not divisible by {group_size})")
            else:
                setattr(parent, name, QuantLinear.from_linear(child, scheme, group_size))
    if kept:
        warnings.warn(f"quantize({scheme!r}) kept {len(kept)} layers in {model.dtype}: " + "; ".join(kept[:12])
                      + (" …" if len(kept) > 12 else ""), stacklevel=2)
    return model
