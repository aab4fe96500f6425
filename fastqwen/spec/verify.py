"""Acceptance of a verified speculative block, batched and sync-free.

A block is [pending, d1 … dk] run through the target at once; logits [B, k+1, V] row j predicts the token
after block position j. Each row accepts the longest prefix of drafts that the rule allows (n [B], 0 … k)
and then takes one token of the target's own: the correction at the first rejection, or the bonus after the
last draft. So every round emits n + 1 tokens: d1 … dn and `next`.
"""

import torch

from ..sampling import argmax_last, sample_probs


def accept_greedy(logits: torch.Tensor, drafts: torch.Tensor):
    """(n [B], next [B]): drafts [B, k] accepted while they equal the target's argmax."""
    target = argmax_last(logits)  # [B, k+1]
    n = (drafts == target[:, :-1]).long().cumprod(-1).sum(-1)
    return n, target.gather(1, n[:, None])[:, 0]


def accept_sampled(p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None):
    """(n [B], next [B]) by rejection sampling; the emitted tokens are distributed exactly as the target's.

    p [B, k+1, V]: the target's (filtered) distributions; q [B, k, V]: the draft's, or None for a
    deterministic draft (q = one-hot of the draft). Draft j is accepted with probability min(1, p/q); at the
    first rejection the token is drawn from norm(max(p − q, 0)); after k acceptances, from p itself.
    """
    B, k = drafts.shape
    if q is None:
        q = torch.zeros_like(p[:, :k]).scatter(-1, drafts[..., None], 1.0)
    p_d = p[:, :k].gather(-1, drafts[..., None])[..., 0]
    q_d = q.gather(-1, drafts[..., None])[..., 0]
    ok = torch.rand_like(p_d) * q_d < p_d
    n = ok.long().cumprod(-1).sum(-1)
    q_full = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # no draft after the last: residual = p
    at = n[:, None, None].expand(-1, 1, p.shape[-1])
    residual = (p.gather(1, at) - q_full.gather(1, at)).clamp(min=0)[:, 0]
    fallback = p.gather(1, at)[:, 0]  # p == q everywhere: rejection had probability 0, any p-draw is exact
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, fallback)
    return n, sample_probs(residual)


def emitted_tokens(drafts: torch.Tensor, n: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
    """[B, k+1]: d1 … dn, next, then (ignored) drafts; row b emits its first n[b] + 1 entries."""
    out = torch.cat([drafts, drafts[:, :1]], dim=1)
    return out.scatter(1, n[:, None], nxt[:, None])
