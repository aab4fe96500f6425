"""HybridCache: the static decode state of a Qwen3.5 model, allocated once.

Per full-attention layer i: k{i}, v{i} [B, Hkv, S, D] in the model dtype. The L Gated DeltaNet layers share
stacked buffers, layer j of them (in model order) at index j: conv [L, B, C, W-1] (the last W-1 inputs of
the depthwise conv, model dtype) and state [L, B, HV, dk, dv] fp32. `lengths` [B] int64 counts the tokens
each row holds; the cache holds only real tokens (no padding), and the next token of row b goes to position
lengths[b]. With `block` > 0 (speculative decoding) the cache also keeps the per-position inputs of the last
verified block for the commit's replay: the pre-conv inputs replay_x [L, B, T, C], replay_k [L, B, T, H, dk],
replay_v [L, B, T, HV, dv] and fp32 replay_g, replay_beta [L, B, T, HV] (T = block). Stacking lets the commit
advance every layer in one launch (a batch of L·B rows) instead of one latency-bound launch per layer. All
tensors are registered buffers with static addresses, so CUDA graphs that read and write them are replayed
without copies.
"""

import torch
from torch import nn


class HybridCache(nn.Module):
    def __init__(self, cfg, max_batch_size: int, max_seq_len: int, dtype: torch.dtype, device, block: int = 0):
        super().__init__()
        self.max_batch_size, self.max_seq_len, self.block = max_batch_size, max_seq_len, block
        B, S = max_batch_size, max_seq_len
        unknown = {kind for kind in cfg.layer_types} - {"full_attention", "linear_attention"}
        if unknown:
            raise ValueError(f"unsupported layer types {sorted(unknown)}")
        for i, kind in enumerate(cfg.layer_types):
            if kind == "full_attention":
                kv_shape = (B, cfg.num_key_value_heads, S, cfg.head_dim)
                self.register_buffer(f"k{i}", torch.zeros(kv_shape, dtype=dtype, device=device))
                self.register_buffer(f"v{i}", torch.zeros(kv_shape, dtype=dtype, device=device))
        gdn = [i for i, kind in enumerate(cfg.layer_types) if kind == "linear_attention"]
        self.gdn_index = {i: j for j, i in enumerate(gdn)}  # model layer id -> index in the stacked buffers
        if gdn:
            L, H, HV = len(gdn), cfg.linear_num_key_heads, cfg.linear_num_value_heads
            dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
            conv_dim = 2 * H * dk + HV * dv
            self.register_buffer("conv", torch.zeros(L, B, conv_dim, cfg.linear_conv_kernel_dim - 1, dtype=dtype,
                                                     device=device))
            self.register_buffer("state", torch.zeros(L, B, HV, dk, dv, dtype=torch.float32, device=device))
            if block:
                replay = {"x": ((L, B, block, conv_dim), dtype), "k": ((L, B, block, H, dk), dtype),
                          "v": ((L, B, block, HV, dv), dtype), "g": ((L, B, block, HV), torch.float32),
                          "beta": ((L, B, block, HV), torch.float32)}
                for name, (shape, dt) in replay.items():
                    self.register_buffer(f"replay_{name}", torch.zeros(shape, dtype=dt, device=device))
        self.register_buffer("lengths", torch.zeros(B, dtype=torch.int64, device=device))
        for buf in self.buffers():
            torch._dynamo.mark_static_address(buf)

    def attention(self, i: int):
        """(k, v) caches of full-attention layer i."""
        return getattr(self, f"k{i}"), getattr(self, f"v{i}")

    def recurrent(self, i: int):
        """(conv, state) of Gated DeltaNet layer i (views into the stacked buffers)."""
        j = self.gdn_index[i]
        return self.conv[j], self.state[j]

    def replay(self, i: int | None = None) -> dict:
        """The replay buffers (x, k, v, g, beta) of Gated DeltaNet layer i; of all of them stacked if i is None."""
        names = ("x", "k", "v", "g", "beta")
        if i is None:
            return {name: getattr(self, f"replay_{name}") for name in names}
        j = self.gdn_index[i]
        return {name: getattr(self, f"replay_{name}")[j] for name in names}

    @torch.no_grad()
    def reset(self) -> None:
        """Empty every row: zero recurrent and conv states (stale KV entries are never read)."""
        for name, buf in self.named_buffers():
            if name.startswith(("conv", "state", "lengths")):
                buf.zero_()
