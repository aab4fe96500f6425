"""DFlash block-diffusion drafts (z-lab checkpoints such as z-lab/Qwen3.5-27B-DFlash).

The draft is a small Qwen3-style stack with no embedding or lm_head of its own (it uses the target's). It
reads the target's features at `target_layer_ids` (the outputs of those decoder layers), projected as
context = hidden_norm(fc(cat(features))), and drafts a whole block in one forward:

    block = [pending, MASK × (bs−1)] at positions s … s+bs−1, embedded by the target
    each layer: queries from the block; keys/values from the context of every committed position (own
    k_proj/v_proj/k_norm, no input norm) and from the block itself; full-attention layers see all of that
    (bidirectional within the block), sliding-window layers are causal within their window
    draft j (1 … bs−1) = argmax lm_head(norm(out_j)): row j predicts position s+j, no shift.

Norms are plain w·x̂ (not the target's 1 + w). Context K/V live in the draft's own KV cache, written for
the prompt after prefill and for each verified block's committed positions after each round (`observe`);
the block's K/V go to the positions after the context and are overwritten as those positions commit. The
layers' linears run through the engine's policy (linears.Linears): with fused projections (the default)
q+k+v and gate+up are one matmul each.
"""

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding

from ..cache import HybridCache
from ..linears import MLP_IN, fuse_linears
from ..model import ATTN_IN, text_model
from ..ops.attention import apply_rope, rope_cos_sin, write_kv
from ..ops.decode_attention import attend_cache_split_op
from ..ops.norm import plain_rms_norm
from ..sampling import argmax_last, filtered_probs, sample_probs


def read_dflash_checkpoint(path):
    """(config dict, tensors) of a DFlash checkpoint directory (config.json + safetensors); tensor names
    without any `model.` prefix."""
    from safetensors import safe_open

    root = Path(path)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"DFlash draft: {path} has no config.json; pass draft=<local DFlash checkpoint "
                                f"directory> (e.g. a download of z-lab/Qwen3.5-27B-DFlash)")
    config = json.loads((root / "config.json").read_text())
    if "dflash_config" not in config:
        raise ValueError(f"{path}/config.json has no dflash_config: not a DFlash draft checkpoint")
    tensors = {}
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                tensors[key.removeprefix("model.")] = fh.get_tensor(key)
    return config, tensors


class DFlashDraft(nn.Module):
    """fc, hidden_norm, Qwen3 decoder layers, norm, rotary embedding; config read from the checkpoint."""

    def __init__(self, config: dict, tensors: dict, model):
        super().__init__()
        target = text_model(model).config
        dcfg = config["dflash_config"]
        self.target_layer_ids = list(dcfg["target_layer_ids"])
        self.mask_token_id = int(dcfg["mask_token_id"])
        self.block_size = int(config.get("block_size", 16))
        cfg = Qwen3Config(**{k: v for k, v in config.items() if k not in ("architectures", "auto_map", "dflash_config")})
        self.sliding_window = config.get("sliding_window")
        self.layer_types = list(config.get("layer_types") or ["full_attention"] * cfg.num_hidden_layers)
        self._check_fit(cfg, target, tensors, config)
        H = cfg.hidden_size
        emb = model.get_input_embeddings().weight
        with torch.device(emb.device):
            self.fc = nn.Linear(len(self.target_layer_ids) * target.hidden_size, H, bias=False)
            self.hidden_norm = Qwen3RMSNorm(H, eps=cfg.rms_norm_eps)
            self.layers = nn.ModuleList([Qwen3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
            self.norm = Qwen3RMSNorm(H, eps=cfg.rms_norm_eps)
        self.to(emb.dtype)
        with torch.device(emb.device):  # after the cast: rotary frequencies stay fp32, as in transformers
            self.rotary = Qwen3RotaryEmbedding(cfg)  # (in bf16, angles at position p would be off by ~p/256 rad)
        self.config, self.eps = cfg, cfg.rms_norm_eps
        try:
            missing, unexpected = self.load_state_dict(tensors, strict=False)
        except RuntimeError as err:  # (a tensor of another shape than the draft's config gives it)
            raise ValueError(f"DFlash draft's tensors do not match its config.json: {err}") from err
        missing = [m for m in missing if not m.startswith("rotary.")]
        if missing or unexpected:
            raise ValueError(f"DFlash draft does not fit: missing {missing[:6]}, unexpected {unexpected[:6]}")

    def _check_fit(self, cfg, target, tensors, config: dict) -> None:
        problems = []
        if cfg.hidden_size != target.hidden_size:
            problems.append(f"hidden size {cfg.hidden_size} != target's {target.hidden_size}")
        if "vocab_size" in config and cfg.vocab_size != target.vocab_size:  # (cfg has Qwen3Config's default)
            problems.append(f"vocab {cfg.vocab_size} != target's {target.vocab_size}")
        ids = self.target_layer_ids
        bad = [i for i in ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            problems.append(f"target_layer_ids {bad} outside the target's {target.num_hidden_layers} layers")
        if not ids:
            problems.append("target_layer_ids is empty: the draft reads the outputs of target layers, at least one; set "
                            "dflash_config.target_layer_ids in its config.json to the layers it was trained on")
        if not 0 <= self.mask_token_id < target.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} outside the target's vocab")
        if self.block_size < 2:  # (optimize's block_size check then read "an int in 2..1")
            problems.append(f"block_size {self.block_size} in its config.json: a block holds the pending token and "
                            f"at least one draft (2 or more)")
        fc = tensors.get("fc.weight")
        want = (cfg.hidden_size, len(self.target_layer_ids) * target.hidden_size)
        if fc is None or tuple(fc.shape) != want:
            problems.append(f"fc.weight is {None if fc is None else tuple(fc.shape)}, expected {want}")
        if problems:
            raise ValueError("DFlash draft does not fit the target: " + "; ".join(problems))

    def context(self, feats):
        """Projected context [.., T, H] from the target's features [.., T, len(ids)·H]."""
        return plain_rms_norm(self.fc(feats), self.hidden_norm.weight, self.eps)


class DFlashProposer:
    """Drafts k ≤ block_size−1 tokens a round with a DFlashDraft; see the module docstring."""

    def __init__(self, engine, draft: DFlashDraft, lm_head=None):
        """lm_head: as for MTPProposer (default: the target's own)."""
        self.draft = draft
        self.lm_head = lm_head if lm_head is not None else engine.forward.lm_head
        self.features = tuple(draft.target_layer_ids)
        cfg = draft.config
        kv_cfg = Qwen3Config(**{**cfg.to_dict(), "layer_types": ["full_attention"] * cfg.num_hidden_layers})
        self.cache = HybridCache(kv_cfg, engine.max_batch_size, engine.max_seq_len, engine.dtype, engine.device)
        self.head_dim = cfg.head_dim
        self.lin = engine.forward.lin
        if self.lin.fused:
            for layer in draft.layers:
                fuse_linears(layer.self_attn, ATTN_IN)
                fuse_linears(layer.mlp, MLP_IN)

    def _rope(self, positions, dtype):
        r = self.draft.rotary
        return rope_cos_sin(positions, r.inv_freq, float(r.attention_scaling), dtype)

    def _write_context(self, feats, positions, rows) -> None:
        """Context K/V of features [n, T, F] at positions [n, T] into cache rows `rows`, every layer."""
        ctx = self.draft.context(feats)
        cos, sin = self._rope(positions, ctx.dtype)
        n, T, _ = ctx.shape
        for i, layer in enumerate(self.draft.layers):
            a = layer.self_attn
            k = plain_rms_norm(self.lin(a.k_proj, ctx).view(n, T, -1, self.head_dim), a.k_norm.weight,
                               self.eps).transpose(1, 2)
            v = self.lin(a.v_proj, ctx).view(n, T, -1, self.head_dim).transpose(1, 2)
            k_cache, v_cache = self.cache.attention(i)
            write_kv(k_cache[rows], v_cache[rows], apply_rope(k, cos, sin), v, positions)

    @property
    def eps(self):
        return self.draft.eps

    def prefill(self, engine, first_row, tokens, feats, start=0) -> None:
        n, T = tokens.shape
        positions = torch.arange(start, start + T, device=tokens.device).expand(n, -1)
        self._write_context(feats, positions, slice(first_row, first_row + n))

    def start(self, engine) -> None:
        pass

    def block_hidden(self, engine, k: int):
        """The draft's output over [pending, MASK × k] at positions lengths … lengths+k: [B, k+1, H]."""
        s, d = engine.cache.lengths, self.draft
        pending = engine.state["tokens"]
        block = torch.cat([pending[:, None], torch.full_like(pending[:, None], d.mask_token_id).expand(-1, k)], 1)
        B, T = block.shape
        positions = s[:, None] + torch.arange(T, device=s.device)
        x = engine.forward.embed(block)
        cos, sin = self._rope(positions, x.dtype)
        keys = torch.arange(engine.max_seq_len, device=s.device)
        full = (keys[None, None, :] <= (s + k)[:, None, None]).expand(-1, T, -1)  # context + whole block
        causal = keys[None, None, :] <= positions[:, :, None]
        # with the split-KV kernel (Forward.split_attention), a full-attention layer reads only the keys in
        # use: every query of the block sees keys 0 … s+k, i.e. the kernel's mask at position s+k
        split = engine.forward.split_attention
        block_end = (s + k)[:, None].expand(-1, T)
        for i, layer in enumerate(d.layers):
            a = layer.self_attn
            h = plain_rms_norm(x, layer.input_layernorm.weight, self.eps)
            q, kb, vb = (t.view(B, T, -1, self.head_dim) for t in self.lin.project(a, h, ATTN_IN))
            q = plain_rms_norm(q, a.q_norm.weight, self.eps).transpose(1, 2)
            kb = plain_rms_norm(kb, a.k_norm.weight, self.eps).transpose(1, 2)
            vb = vb.transpose(1, 2)
            k_cache, v_cache = self.cache.attention(i)
            write_kv(k_cache, v_cache, apply_rope(kb, cos, sin), vb, positions)
            sliding = d.layer_types[i] == "sliding_attention" and d.sliding_window
            if split and not sliding:
                o = attend_cache_split_op(apply_rope(q, cos, sin), k_cache, v_cache, block_end, a.scaling)
            else:
                mask = causal & (keys[None, None, :] > positions[:, :, None] - d.sliding_window) if sliding else full
                o = F.scaled_dot_product_attention(apply_rope(q, cos, sin), k_cache, v_cache,
                                                   attn_mask=mask[:, None], scale=a.scaling, enable_gqa=True)
            x = x + self.lin(a.o_proj, o.transpose(1, 2).reshape(B, T, -1))
            x = x + self.lin.mlp(layer.mlp, plain_rms_norm(x, layer.post_attention_layernorm.weight, self.eps))
        return plain_rms_norm(x, d.norm.weight, self.eps)

    def propose(self, engine, k: int, do_sample: bool):
        logits = self.lm_head(self.block_hidden(engine, k)[:, 1:]).float()  # [B, k, V]
        if not do_sample:
            return argmax_last(logits), None
        s = engine.state
        rep = lambda t: t.repeat_interleave(k)  # noqa: E731
        q = filtered_probs(logits.flatten(0, 1), rep(s["temperature"]), rep(s["top_k"]), rep(s["top_p"]),
                           rep(s["min_p"])).view(logits.shape)
        return sample_probs(q.flatten(0, 1)).view(q.shape[:2]), q

    def observe(self, engine, tokens, feats, start, keep) -> None:
        positions = start[:, None] + torch.arange(tokens.shape[1], device=start.device)
        self._write_context(feats, positions, slice(None))
