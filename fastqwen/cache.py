"""HybridCache: the static decode state of a Qwen3.5 model, allocated once.

Per full-attention layer: k, v [B, Hkv, S, D] in the model dtype. Per Gated DeltaNet layer: conv [B, C, W-1]
(the last W-1 inputs of the depthwise conv, model dtype) and state [B, HV, dk, dv] fp32. `lengths` [B]
int64 counts the tokens each row holds; the cache holds only real tokens (no padding), and the next token
of row b goes to position lengths[b]. With `block` > 0 (speculative decoding), each Gated DeltaNet layer also
keeps the per-position inputs of the last verified block for the commit's replay: the pre-conv inputs x
[B, T, C], k [B, T, H, dk], v [B, T, HV, dv] and fp32 g, beta [B, T, HV] (T = block). All tensors are registered buffers with static addresses, so CUDA
graphs that read and write them are replayed without copies.
"""

import torch
from torch import nn


class HybridCache(nn.Module):
    def __init__(self, cfg, max_batch_size: int, max_seq_len: int, dtype: torch.dtype, device, block: int = 0):
        super().__init__()
        self.max_batch_size, self.max_seq_len, self.block = max_batch_size, max_seq_len, block
        B, S = max_batch_size, max_seq_len
        for i, kind in enumerate(cfg.layer_types):
            if kind == "full_attention":
                kv_shape = (B, cfg.num_key_value_heads, S, cfg.head_dim)
                self.register_buffer(f"k{i}", torch.zeros(kv_shape, dtype=dtype, device=device))
                self.register_buffer(f"v{i}", torch.zeros(kv_shape, dtype=dtype, device=device))
            elif kind == "linear_attention":
                conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + (
                    cfg.linear_num_value_heads * cfg.linear_value_head_dim)
                conv_shape = (B, conv_dim, cfg.linear_conv_kernel_dim - 1)
                state_shape = (B, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
                self.register_buffer(f"conv{i}", torch.zeros(conv_shape, dtype=dtype, device=device))
                self.register_buffer(f"state{i}", torch.zeros(state_shape, dtype=torch.float32, device=device))
                if block:
                    H, HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
                    replay = {"x": ((B, block, conv_dim), dtype),
                              "k": ((B, block, H, cfg.linear_key_head_dim), dtype),
                              "v": ((B, block, HV, cfg.linear_value_head_dim), dtype),
                              "g": ((B, block, HV), torch.float32), "beta": ((B, block, HV), torch.float32)}
                    for name, (shape, dt) in replay.items():
                        self.register_buffer(f"replay_{name}{i}", torch.zeros(shape, dtype=dt, device=device))
            else:
                raise ValueError(f"layer {i}: unsupported layer type {kind!r}")
        self.register_buffer("lengths", torch.zeros(B, dtype=torch.int64, device=device))
        for buf in self.buffers():
            torch._dynamo.mark_static_address(buf)

    def attention(self, i: int):
        """(k, v) caches of full-attention layer i."""
        return getattr(self, f"k{i}"), getattr(self, f"v{i}")

    def recurrent(self, i: int):
        """(conv, state) of Gated DeltaNet layer i."""
        return getattr(self, f"conv{i}"), getattr(self, f"state{i}")

    def replay(self, i: int) -> dict:
        """The replay buffers (x, k, v, g, beta) of Gated DeltaNet layer i."""
        return {name: getattr(self, f"replay_{name}{i}") for name in ("x", "k", "v", "g", "beta")}

    @torch.no_grad()
    def reset(self) -> None:
        """Empty every row: zero recurrent and conv states (stale KV entries are never read)."""
        for name, buf in self.named_buffers():
            if name.startswith(("conv", "state", "lengths")):
                buf.zero_()
