"""Sampling: the filters equal transformers' warpers, draws follow the filtered softmax, seeds reproduce."""

import pytest
import torch
from conftest import fresh
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import fastqwen
from fastqwen.sampling import filter_logits, repetition_penalty, sample, seen_through


def hf_filtered(logits, temperature, top_k, top_p, min_p):
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p:
        scores = MinPLogitsWarper(min_p)(None, scores)
    return scores


def params(B, temperature, top_k, top_p, min_p):
    return (torch.full((B,), temperature), torch.full((B,), top_k), torch.full((B,), top_p),
            torch.full((B,), min_p))


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 50, 1.0, 0.0), (1.3, 0, 0.9, 0.0), (0.6, 20, 0.95, 0.0), (1.0, 0, 1.0, 0.1),
    (0.8, 10, 0.8, 0.05),
])
def test_filters_match_transformers_warpers(temperature, top_k, top_p, min_p):
    logits = torch.randn(16, 300) * 3
    ours, order = filter_logits(logits, *params(16, temperature, top_k, top_p, min_p))
    unsorted = torch.full_like(ours, float("-inf")).scatter(-1, order, ours)
    ref = hf_filtered(logits, temperature, top_k, top_p, min_p)
    assert torch.equal(torch.isinf(unsorted), torch.isinf(ref))
    kept = ~torch.isinf(ref)
    torch.testing.assert_close(unsorted[kept], ref[kept])


@pytest.mark.parametrize("top_p", [0.8, 0.9, 0.95])
def test_top_p_over_tied_logits_keeps_the_tokens_transformers_keeps(top_p):
    """A bf16 model's logits tie often, also where top-p cuts: the tokens kept of a tie, and the cut itself (its mass
    summed from the least likely token up, as transformers sums it), are transformers'. Summed the other way and
    keeping the lowest ids of a tie, most of these rows kept other tokens (up to 0.02 of the mass moved)."""
    torch.manual_seed(1)
    logits = (torch.randn(32, 4000) * 2.5 + 5).bfloat16().float()
    ours, order = filter_logits(logits, *params(32, 0.6, 0, top_p, 0.0))
    unsorted = torch.full_like(ours, float("-inf")).scatter(-1, order, ours)
    ref = hf_filtered(logits, 0.6, 0, top_p, 0.0)
    assert torch.equal(torch.isinf(unsorted), torch.isinf(ref))
    assert torch.equal(unsorted.softmax(-1), ref.softmax(-1))
    assert torch.equal(filter_logits(torch.ones(1, 4), *params(1, 1.0, 0, 0.5, 0.0))[1][:, -2:].sort().values,
                       torch.tensor([[2, 3]])), "of four equal logits, top_p=0.5 keeps transformers' two"


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 6, 1.0), (1.5, 0, 0.8)])
def test_draws_follow_the_filtered_softmax(temperature, top_k, top_p):
    """Chi-square goodness of fit of 200k draws against softmax(filtered logits / T)."""
    logits = torch.randn(1, 12) * 1.5
    expected = hf_filtered(logits, temperature, top_k, top_p, 0.0).softmax(-1)[0]
    n = 200_000
    draws = sample(logits.expand(n, -1).contiguous(), *params(n, temperature, top_k, top_p, 0.0))
    counts = torch.bincount(draws, minlength=12).double()
    assert counts[expected == 0].sum() == 0, "a filtered-out token was drawn"
    live = expected > 0
    chi2 = ((counts[live] - n * expected[live]) ** 2 / (n * expected[live])).sum().item()
    dof = int(live.sum()) - 1
    assert chi2 < dof + 6 * (2 * dof) ** 0.5 + 10, f"chi2={chi2:.1f} with {dof} dof"


def test_generate_first_token_distribution_and_seeds():
    """End to end: the first sampled token of generate follows softmax(logits/T) after top-k/top-p."""
    ref = fresh("tiny")
    opt = fastqwen.optimize(fresh("tiny"), max_batch_size=64, max_seq_len=32, compile=False)
    prompt = torch.randint(1, 500, (1, 6))
    kw = dict(do_sample=True, temperature=2.5, top_k=30, top_p=0.95, max_new_tokens=1)
    logits = ref(prompt).logits[0, -1:]
    expected = hf_filtered(logits, 2.5, 30, 0.95, 0.0).softmax(-1)[0]
    torch.manual_seed(123)
    draws = torch.cat([opt.generate(prompt.expand(64, -1), **kw)[:, -1] for _ in range(40)])
    counts = torch.bincount(draws, minlength=expected.numel()).double()
    assert counts[expected == 0].sum() == 0
    top = expected.argsort(descending=True)[:5]  # the five likeliest tokens: frequencies within 5 sigma
    n = draws.numel()
    sigma = (n * expected[top] * (1 - expected[top])).sqrt()
    assert ((counts[top] - n * expected[top]).abs() < 5 * sigma + 1).all()
    torch.manual_seed(7)
    a = opt.generate(prompt, do_sample=True, max_new_tokens=20)
    torch.manual_seed(7)
    b = opt.generate(prompt, do_sample=True, max_new_tokens=20)
    assert torch.equal(a, b)
    torch.manual_seed(8)
    assert not torch.equal(a, opt.generate(prompt, do_sample=True, max_new_tokens=20))


@pytest.mark.parametrize("shape", [(3, 64 * 64), (2, 5, 248320), (4, 100)])
def test_two_stage_argmax_is_torchs_argmax_ties_included(shape):
    """argmax_last picks torch.argmax's index (the first maximum) also where the maximum repeats across
    chunks and within one, and on rows too short or not divisible to split."""
    from fastqwen.sampling import argmax_last

    torch.manual_seed(0)
    x = torch.randint(0, 50, shape).float()  # many ties
    assert torch.equal(argmax_last(x), x.argmax(-1))
    x = torch.randn(shape)
    x[..., -1] = x.max() + 1  # the max in the last chunk
    assert torch.equal(argmax_last(x), x.argmax(-1))


@pytest.mark.parametrize("penalty", [1.3, 0.7, 1.0])
def test_repetition_penalty_is_transformers_processor(penalty):
    """repetition_penalty over a presence mask equals transformers' RepetitionPenaltyLogitsProcessor over the token
    ids (repeats included), logits of both signs; seen_through adds a verify block's drafts one position at a time."""
    logits = torch.randn(3, 64) * 4
    ids = torch.randint(0, 64, (3, 20))
    seen = torch.zeros(3, 64, dtype=torch.bool).scatter(1, ids, True)
    want = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    assert torch.equal(repetition_penalty(logits, seen, torch.full((3,), penalty)), want)
    drafts = torch.tensor([[5, 9, 5], [1, 2, 3], [63, 0, 7]])
    at = seen_through(seen, drafts)
    assert at.shape == (3, 4, 64) and torch.equal(at[:, 0], seen)
    for j in range(1, 4):
        assert torch.equal(at[:, j], seen.scatter(1, drafts[:, :j], True)), j
