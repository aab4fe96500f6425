"""HybridCache: the static decode state of a Qwen3.5 model, allocated once.

Per full-attention layer i: k{i}, v{i} [B, Hkv, S, D] in the model dtype. The L Gated DeltaNet layers share
stacked buffers, layer j of them (in model order) at index j: conv [L, B, C, W-1] (the last W-1 inputs of
the depthwise conv, model dtype) and state [L, B, HV, dk, dv] fp32. `lengths` [B] int64 counts the tokens
each row holds; the cache holds only real tokens (no padding), and the next token of row b goes to position
lengths[b]. With `block` > 0 (speculative decoding) the cache also keeps the per-position inputs of the last
verified block for the commit's replay: the pre-conv inputs replay_x [L, B, T, C], the conv's packed
outputs replay_qkv [L, B, T, C] (q, k, v: the replay reads k and v in place) and fp32 replay_g, replay_beta
[L, B, T, HV] (T = block). Stacking lets the commit
advance every layer in one launch (a batch of L·B rows) instead of one latency-bound launch per layer. All
tensors are registered buffers with static addresses, so CUDA graphs that read and write them are replayed
without copies.
"""

import math
import os

import torch
from torch import nn


def layout(cfg, max_batch_size: int, max_seq_len: int, dtype: torch.dtype, block: int = 0) -> dict:
    """{buffer name: (shape, dtype)} of a HybridCache with these sizes (see the module docstring)."""
    B, S = max_batch_size, max_seq_len
    unknown = {kind for kind in cfg.layer_types} - {"full_attention", "linear_attention"}
    if unknown:
        raise ValueError(f"unsupported layer types {sorted(unknown)}")
    bufs = {}
    for i, kind in enumerate(cfg.layer_types):
        if kind == "full_attention":
            kv_shape = (B, cfg.num_key_value_heads, S, cfg.head_dim)
            bufs[f"k{i}"] = bufs[f"v{i}"] = (kv_shape, dtype)
    L = sum(kind == "linear_attention" for kind in cfg.layer_types)
    if L:
        H, HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        conv_dim = 2 * H * dk + HV * dv
        bufs["conv"] = ((L, B, conv_dim, cfg.linear_conv_kernel_dim - 1), dtype)
        bufs["state"] = ((L, B, HV, dk, dv), torch.float32)
        if block:
            bufs.update({"replay_x": ((L, B, block, conv_dim), dtype), "replay_qkv": ((L, B, block, conv_dim), dtype),
                         "replay_g": ((L, B, block, HV), torch.float32),
                         "replay_beta": ((L, B, block, HV), torch.float32)})
    bufs["lengths"] = ((B,), torch.int64)
    return bufs


def layout_bytes(bufs: dict) -> int:
    return sum(math.prod(shape) * dt.itemsize for shape, dt in bufs.values())


def _free_bytes(device) -> int:
    """What torch can still allocate on a CUDA device: the driver's free memory plus the blocks torch's
    caching allocator holds unused (a cache just dropped, e.g. by enable_speculation, sits there)."""
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return torch.cuda.mem_get_info(device)[0] + cached


def _ram_bytes() -> int:
    """The machine's physical memory: more than this can never be allocated on the CPU."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class HybridCache(nn.Module):
    def __init__(self, cfg, max_batch_size: int, max_seq_len: int, dtype: torch.dtype, device, block: int = 0):
        """Allocates every buffer now; first checks that they fit in the free memory on CUDA, in the machine's
        memory on the CPU (a clear error naming max_seq_len and max_batch_size rather than the allocator's)."""
        super().__init__()
        self.max_batch_size, self.max_seq_len, self.block = max_batch_size, max_seq_len, block
        bufs = layout(cfg, max_batch_size, max_seq_len, dtype, block)
        need, on = layout_bytes(bufs), torch.device(device).type
        room = _free_bytes(device) if on == "cuda" else _ram_bytes() if on == "cpu" else need  # (others: unchecked)
        if need > room:
            where = (f"{device} has {room / 2**30:.1f} GiB free" if on == "cuda" else
                     f"this machine has {room / 2**30:.1f} GiB of memory")
            raise ValueError(f"the static cache for max_batch_size={max_batch_size} x max_seq_len={max_seq_len} "
                             f"needs {need / 2**30:.1f} GiB, but {where}: lower max_seq_len or max_batch_size")
        for name, (shape, dt) in bufs.items():
            self.register_buffer(name, torch.zeros(shape, dtype=dt, device=device))
        gdn = [i for i, kind in enumerate(cfg.layer_types) if kind == "linear_attention"]
        self.gdn_index = {i: j for j, i in enumerate(gdn)}  # model layer id -> index in the stacked buffers
        self.gdn_ids = torch.arange(len(gdn), device=device)  # index tensors for `write`
        for buf in (*self.buffers(), self.gdn_ids):
            torch._dynamo.mark_static_address(buf)

    def attention(self, i: int):
        """(k, v) caches of full-attention layer i."""
        return getattr(self, f"k{i}"), getattr(self, f"v{i}")

    def recurrent(self, i: int):
        """(conv, state) of Gated DeltaNet layer i (views into the stacked buffers)."""
        j = self.gdn_index[i]
        return self.conv[j], self.state[j]

    def write(self, name: str, i: int, value: torch.Tensor, rows: slice = slice(None)) -> None:
        """Store value [n, …] as rows `rows` of Gated DeltaNet layer i's slice of the stacked buffer `name`
        ("conv", "replay_x", …), in place. For all rows (the compiled steps) this is an index_put_ on the whole
        buffer: under torch.compile a copy into the layer's view becomes a functional select_scatter over the
        whole stacked buffer, which inductor does not turn back into an in-place write (it rewrote all L layers'
        windows once per layer), while it does reinplace index_put_. Prefill (other rows) runs eagerly."""
        j, buf = self.gdn_index[i], getattr(self, name)
        if rows == slice(None):
            buf.index_put_((self.gdn_ids[j:j + 1],), value[None].to(buf.dtype))
        else:
            buf[j, rows].copy_(value)

    def replay(self, i: int | None = None) -> dict:
        """The replay buffers (x, qkv, g, beta) of Gated DeltaNet layer i; of all of them stacked if i is None."""
        names = ("x", "qkv", "g", "beta")
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
