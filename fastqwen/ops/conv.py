"""Causal depthwise conv1d (+ silu) over new tokens with a rolling window of previous inputs.

The kernel is 4 wide, so the conv is written as W shifted multiply-adds: inductor fuses them with the silu
into one kernel, and the same code serves prefill (T = prompt), decode (T = 1) and speculative verify
(T = block).
"""

import torch
import torch.nn.functional as F


def conv_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(conv(x)) for new inputs x [B, T, C] with depthwise weight [C, W], and the window after x.

    state [B, C, W-1] holds the W-1 inputs before x (zeros for a fresh sequence). Returns the output [B, T, C]
    and the last W-1 inputs of cat(state, x) [B, C, W-1], both in x.dtype and from one read of state, which is
    left as it is: the caller stores the window (HybridCache.write; a speculative verify leaves it to
    `commit_window`). Storing it in place here would make the read and the write two uses of state, which
    inductor may order write-first and then cannot reinplace.
    """
    width = weight.shape[-1]
    seq = x.shape[1]
    window = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, C, W-1+T]
    w = weight.to(x.dtype)
    out = window[:, :, 0:seq] * w[:, 0:1]
    for j in range(1, width):
        out = out + window[:, :, j : j + seq] * w[:, j : j + 1]
    return F.silu(out).transpose(1, 2), window[:, :, seq:]


def commit_window(state: torch.Tensor, x: torch.Tensor, keep: torch.Tensor) -> None:
    """Advance windows state [..., B, C, W-1] past the first keep[b] of the T inputs x [..., B, T, C]
    (0 ≤ keep ≤ T), in place; leading dims (stacked layers) share keep.

    The new window is the W-1 inputs ending at input keep[b]-1 of cat(state, x); keep 0 leaves it as is.
    """
    width_1 = state.shape[-1]
    window = torch.cat([state, x.transpose(-1, -2).to(state.dtype)], dim=-1)  # [..., B, C, W-1+T]
    idx = keep[:, None] + torch.arange(width_1, device=keep.device)  # [B, W-1]
    state.copy_(window.gather(-1, idx[:, None, :].expand(*window.shape[:-1], width_1)))
