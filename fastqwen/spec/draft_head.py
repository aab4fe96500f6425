"""The lm_head a drafter reads: the target's own, or a copy over a subset of the vocabulary and/or quantized.

A draft step of MTP (or DFlash's block) reads the whole lm_head, 248320 rows: 2.0 GB at 9B, 2.5 GB at 27B, most of
a draft step's bytes. Drafting over the N most likely tokens only (FR-Spec's idea) cuts that by V / N, and a
quantized copy halves or quarters it again. Both stay lossless: the target verifies every draft with its own
full lm_head, and for sampling the draft distribution q (zero outside the subset) is as valid a proposal as any.
Only acceptance can drop, when the target's token lies outside the subset.

`draft_head(lm_head, vocab, scheme)` builds it; its logits always span the full vocabulary ([..., V], −inf
outside the subset), so proposers, argmax and rejection sampling need no change.
"""

import torch
from torch import nn


class SubsetHead(nn.Module):
    """Logits over token ids `ids` [N] (a copy of those lm_head rows, or a view when ids = 0 … N−1), scattered
    into a full-vocabulary row of −inf: h [..., H] → [..., V] fp32."""

    def __init__(self, lm_head: nn.Linear, ids: torch.Tensor, scheme: str | None = None, group: int = 128):
        super().__init__()
        N = len(ids)
        prefix = torch.equal(ids, torch.arange(N, device=ids.device))
        sub = nn.Linear(lm_head.in_features, N, bias=False, device="meta")
        sub.weight = nn.Parameter(lm_head.weight[:N] if prefix else lm_head.weight[ids], requires_grad=False)
        if scheme is not None:
            from ..quant import QuantLinear

            sub = QuantLinear.from_linear(sub, scheme, group)
        self.head, self.vocab = sub, lm_head.out_features
        self.register_buffer("ids", ids)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.head(h).float()
        full = logits.new_full((*logits.shape[:-1], self.vocab), float("-inf"))
        return full.index_copy(-1, self.ids, logits)


def vocab_ids(vocab, size: int, device) -> torch.Tensor:
    """The draft vocabulary as sorted unique token ids [N]: `vocab` is N (token ids 0 … N−1, which in Qwen's
    byte-level BPE are roughly the earliest, most frequent merges) or the ids themselves (e.g. the N most
    frequent tokens of a corpus, FR-Spec style). `size` is the target's vocabulary size. N may also be a numpy or
    0-dim torch integer (a count, not the one token id N)."""
    if isinstance(vocab, bool):
        raise ValueError(f"draft_vocab must be an int or a sequence of token ids, got {vocab!r}")
    ids = torch.as_tensor(vocab, device=device)
    if ids.dim() == 0 and not (ids.is_floating_point() or ids.dtype == torch.bool):
        n = int(ids)
        if not 1 <= n <= size:
            raise ValueError(f"draft_vocab={n} must be in 1..{size} (the target's vocabulary)")
        return torch.arange(n, device=device)
    ids = ids.flatten()
    if ids.numel() == 0 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError("draft_vocab must be a non-empty sequence of integer token ids")
    if int(ids.min()) < 0 or int(ids.max()) >= size:
        raise ValueError(f"draft_vocab has token ids outside 0..{size - 1} (the target's vocabulary)")
    unique = torch.unique(ids.long())
    if unique.numel() != ids.numel():
        raise ValueError("draft_vocab has repeated token ids")
    return unique


def draft_head(lm_head, vocab=None, scheme: str | None = None, group: int = 128):
    """The drafting head: None (the target's own) when neither a vocabulary subset nor a scheme is asked for;
    a quantized copy (QuantLinear) for a scheme alone; else a SubsetHead."""
    if vocab is None and scheme is None:
        return None
    if not isinstance(lm_head, nn.Linear):
        raise ValueError("draft_vocab / draft_lm_head need the model's lm_head as a plain nn.Linear "
                         f"(got {type(lm_head).__name__}; quant_lm_head=True already quantized it)")
    if scheme == "int4" and lm_head.in_features % group:
        raise ValueError(f"draft_lm_head='int4' needs the hidden size ({lm_head.in_features}) divisible by "
                         f"quant_group_size={group}")
    with torch.no_grad():
        if vocab is None:
            from ..quant import QuantLinear

            return QuantLinear.from_linear(lm_head, scheme, group)
        return SubsetHead(lm_head, vocab_ids(vocab, lm_head.out_features, lm_head.weight.device), scheme, group)
