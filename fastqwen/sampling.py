"""Sync-free next-token selection over logits [B, V] fp32 with per-row parameters as device tensors.

Parameters are tensors (not Python numbers) so a compiled step never recompiles when they change. The filters
follow transformers' warpers and their order: temperature, top-k, top-p, min-p. Sampling draws
argmax(p / E) with E ~ Exp(1) (the exponential-race form of a categorical draw), which needs no host sync.
"""

import torch


@torch.library.custom_op("fastqwen::cumsum_last", mutates_args=())
def cumsum_last(x: torch.Tensor) -> torch.Tensor:
    """torch.cumsum(x, -1) as an opaque op. Inductor's own scan kernel for [B > 1, vocab] fails to generate
    (torch 2.11, InductorError in get_block_shape); as a custom op the step calls aten's cumsum instead."""
    return torch.cumsum(x, -1)


@cumsum_last.register_fake
def _(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def filter_logits(logits, temperature, top_k, top_p, min_p):
    """Sorted (ascending, as transformers' top-p sorts them) filtered logits and their vocabulary indices.

    logits [B, V]; temperature [B] (> 0); top_k [B] int (0 = off); top_p [B] (1 = off); min_p [B] (0 = off).
    Filtered-out entries are -inf; the most likely token (the last) always survives.
    """
    vocab = logits.shape[-1]
    scaled = logits / temperature[:, None]
    # (transformers' top-p sort, the same call: of tied logits, it drops the ones transformers drops)
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=False)
    # top-k keeps every token whose logit ties the k-th largest, as transformers does
    # (the k-th value as a masked min, not a gather: torch 2.11's inductor fails to generate a Triton kernel
    # for that gather fused into the softmax at batch > 1)
    k = torch.where(top_k > 0, top_k, vocab).clamp(1, vocab)
    rank = torch.arange(vocab, device=logits.device)
    kth = sorted_logits.masked_fill(rank < vocab - k[:, None], float("inf")).amin(-1, keepdim=True)
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    # top-p: drop the least likely tokens while their mass, summed from the least likely up, is at most 1 - top_p
    drop = (cumsum_last(sorted_logits.softmax(-1)) <= 1 - top_p[:, None]) & (top_p[:, None] < 1.0)
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    # min-p: drop tokens less likely than min_p times the top token
    probs = sorted_logits.softmax(-1)
    drop = probs < min_p[:, None] * probs[:, -1:]
    drop[:, -1] = False
    return sorted_logits.masked_fill(drop, float("-inf")), order


def repetition_penalty(logits, seen, penalty):
    """transformers' RepetitionPenaltyLogitsProcessor over a presence mask: each logit of a token already in the
    sequence (seen, bool, logits' shape) divided by the row's penalty where positive, multiplied where negative.
    logits [..., V] fp32; penalty [...] (> 0; 1 leaves the logits as they are)."""
    p = penalty[..., None]
    return torch.where(seen, torch.where(logits < 0, logits * p, logits / p), logits)


def seen_through(seen, drafts):
    """[B, k + 1, V]: the tokens in each row's sequence at each position of a verify block [pending, d1 … dk]:
    seen [B, V] (the pending token included) and, at position j, the drafts d1 … dj too. drafts [B, k] long."""
    at = [seen]
    for i in range(drafts.shape[1]):
        at.append(at[-1].scatter(1, drafts[:, i:i + 1], True))
    return torch.stack(at, dim=1)


def sample(logits, temperature, top_k, top_p, min_p):
    """One token per row [B] drawn from the filtered distribution."""
    sorted_logits, order = filter_logits(logits, temperature, top_k, top_p, min_p)
    probs = sorted_logits.softmax(-1)
    race = probs / torch.empty_like(probs).exponential_(1)
    return order.gather(-1, argmax_last(race)[:, None])[:, 0]


def filtered_probs(logits, temperature, top_k, top_p, min_p):
    """The distribution `sample` draws from, in vocabulary order [B, V] (0 where filtered out)."""
    sorted_logits, order = filter_logits(logits, temperature, top_k, top_p, min_p)
    return torch.zeros_like(sorted_logits).scatter(-1, order, sorted_logits.softmax(-1))


def sample_probs(probs):
    """One token per row [B] from (unnormalised) probabilities [B, V], by the exponential race."""
    return argmax_last(probs / torch.empty_like(probs).exponential_(1))


def argmax_last(x: torch.Tensor, chunks: int = 64) -> torch.Tensor:
    """x.argmax(-1) (the first maximum, as torch's), in two stages when the last dim splits into `chunks`:
    the max of each chunk, then the first chunk holding the overall max. Inductor does not split an argmax
    reduction, so a single [1, 248320] row reduces in one program (71 µs of a 27B decode step, profiled);
    chunked, 64 programs share it."""
    V = x.shape[-1]
    if V % chunks or V < 64 * chunks:
        return x.argmax(-1)
    vals, idx = x.unflatten(-1, (chunks, V // chunks)).max(-1)  # [..., chunks]: first max within each chunk
    best = vals.argmax(-1, keepdim=True)  # first chunk with the overall max
    return (best * (V // chunks) + idx.gather(-1, best)).squeeze(-1)


def greedy(logits):
    """The argmax token per row [B]."""
    return argmax_last(logits)
