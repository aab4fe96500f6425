"""Norms of the Qwen3.5 target, numerically as transformers computes them.

Plain torch on purpose: under torch.compile inductor fuses these with the residual adds and casts around
them, which a registered custom op would prevent. GPU tests compare the compiled result with eager fp32.
"""

import torch
import torch.nn.functional as F


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """x in fp32, or in float64 if it already is (tests run float64 models to separate logic from rounding)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen's zero-centred RMSNorm over the last dim: x̂·(1 + w), computed in fp32, returned in x.dtype."""
    xf = _upcast(x)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + _upcast(weight))).to(x.dtype)


def plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Qwen3 / DFlash-draft RMSNorm: w·x̂ with x̂ computed in fp32 and cast back before the weight."""
    xf = _upcast(x)
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated DeltaNet output norm: (w·x̂ in x.dtype)·silu(gate) over the last dim; plain `w`, not `1 + w`."""
    xf = _upcast(x)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * xf.to(x.dtype)
    return (y * F.silu(_upcast(gate))).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x²) + eps) over the last dim (the form flash-linear-attention uses)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
