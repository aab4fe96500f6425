"""Causal depthwise conv1d (+ silu) over new tokens with a rolling window of previous inputs.

The kernel is 4 wide, so the conv is written as W shifted multiply-adds: inductor fuses them with the silu
and the state update into one kernel, and the same code serves prefill (T = prompt) and decode (T = 1).
"""

import torch
import torch.nn.functional as F


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """silu(conv(x)) for new inputs x [B, T, C] with depthwise weight [C, W].

    state [B, C, W-1] holds the W-1 inputs before x (zeros for a fresh sequence); it is overwritten in
    place with the last W-1 inputs of cat(state, x). Returns [B, T, C] in x.dtype.
    """
    width = weight.shape[-1]
    seq = x.shape[1]
    window = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, C, W-1+T]
    state.copy_(window[:, :, seq:])
    w = weight.to(x.dtype)
    out = window[:, :, 0:seq] * w[:, 0:1]
    for j in range(1, width):
        out = out + window[:, :, j : j + seq] * w[:, j : j + 1]
    return F.silu(out).transpose(1, 2)
