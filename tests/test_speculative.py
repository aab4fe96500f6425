"""Speculative decoding is lossless: token-identical greedy output, exact state rollback, exact sampling."""

import pytest
import torch
from conftest import char_tokenizer, fresh, left_padded
from transformers.generation.streamers import BaseStreamer

import fastqwen
from fastqwen.bench import OracleProposer, miss_for_tau
from fastqwen.cache import HybridCache
from fastqwen.model import Forward
from fastqwen.spec.verify import accept_sampled

K = 4
NEW = 40


class Collect(BaseStreamer):
    """A streamer that keeps every chunk it is given, as lists."""

    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        pass


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def engines(request):
    """(plain, speculative) optimized models with identical weights; the speculative one gets its proposer later."""
    plain = fastqwen.optimize(fresh(request.param), max_batch_size=3, max_seq_len=320, compile=False)
    spec = fastqwen.optimize(fresh(request.param), max_batch_size=3, max_seq_len=320, compile=False)
    return plain, spec


def speculate(spec, reference, miss, k=K):
    spec._fastqwen.enable_speculation(OracleProposer(reference, miss, spec.config.vocab_size), k)
    return spec


@pytest.mark.parametrize("miss", [0.0, 1.0, 0.35], ids=["perfect", "useless", "partial"])
def test_greedy_is_token_identical(engines, miss):
    plain, spec = engines
    rows = [torch.randint(1, 500, (n,)) for n in (70, 9, 33)]
    ids, mask = left_padded(rows)
    expected = plain.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    speculate(spec, expected[:, ids.shape[1]:], miss)
    got = spec.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(got, expected)
    tau = spec._fastqwen.spec.acceptance_length(3)
    if miss == 0.0:
        assert tau > K  # every round accepts all K drafts (the last one may be cut by max_new_tokens)
    elif miss == 1.0:
        assert tau == 1.0
    else:
        assert 1.0 < tau < K + 1


def test_batch1_long_prompt(engines):
    plain, spec = engines
    ids = torch.randint(1, 500, (1, 200))
    expected = plain.generate(ids, max_new_tokens=NEW, do_sample=False)
    speculate(spec, expected[:, 200:], 0.2)
    assert torch.equal(spec.generate(ids, max_new_tokens=NEW, do_sample=False), expected)


def test_cache_too_short_for_any_speculative_call_is_refused():
    """max_seq_len = k + 2 took speculation and then failed every generate (the warmup too) with "nothing to
    generate"; k + 3 is the smallest cache that holds a 1-token prompt, a new token and a verify block."""
    plain = fastqwen.optimize(fresh("tiny"), max_seq_len=K + 3, compile=False)
    ids = torch.randint(1, 500, (1, 1))
    expected = plain.generate(ids, max_new_tokens=1, do_sample=False)
    for n, fits in ((K + 2, False), (K + 3, True)):
        spec = fastqwen.optimize(fresh("tiny"), max_seq_len=n, compile=False)
        if not fits:
            with pytest.raises(ValueError, match=f"max_seq_len >= {K + 3}"):
                speculate(spec, expected[:, 1:], 0.0)
            continue
        speculate(spec, expected[:, 1:], 0.0)
        assert torch.equal(spec.generate(ids, max_new_tokens=1, do_sample=False), expected)


@pytest.mark.parametrize("max_new", [1, 2, 7, 13])
def test_max_new_tokens_ending_inside_a_block(engines, max_new):
    plain, spec = engines
    ids = torch.randint(1, 500, (2, 11))
    expected = plain.generate(ids, max_new_tokens=max_new, do_sample=False)
    speculate(spec, expected[:, 11:], 0.0)
    assert torch.equal(spec.generate(ids, max_new_tokens=max_new, do_sample=False), expected)


def test_eos_inside_a_block_of_a_ragged_batch(engines):
    plain, spec = engines
    rows = [torch.randint(1, 500, (n,)) for n in (25, 12, 40)]
    ids, mask = left_padded(rows)
    free = plain.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)[:, ids.shape[1]:]
    eos = int(free[1, 6])  # row 1 ends mid-block; the others run on (or end) elsewhere
    kw = dict(max_new_tokens=NEW, eos_token_id=eos, pad_token_id=2, do_sample=False)
    expected = plain.generate(ids, attention_mask=mask, **kw)
    speculate(spec, free, 0.0)
    got = spec.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(got, expected)


def test_min_new_tokens_with_speculation(engines):
    plain, spec = engines
    ids = torch.randint(1, 500, (1, 10))
    free = plain.generate(ids, max_new_tokens=20, do_sample=False)[:, 10:]
    kw = dict(max_new_tokens=20, min_new_tokens=8, eos_token_id=int(free[0, 3]), do_sample=False)
    expected = plain.generate(ids, **kw)
    speculate(spec, expected[:, 10:], 0.0)
    assert torch.equal(spec.generate(ids, **kw), expected)


# float64 for the dense model, so that the one difference between the two paths, the order of summation in a
# [B·T]-row versus a B-row matmul, stays far below 1e-6; transformers' grouped expert matmul (the MoE prefill)
# has no float64 kernel, so the MoE model runs float32 with a bound at float32 rounding. Bounds are relative
# to the largest state entry (or absolute below 1).
@pytest.mark.parametrize("name,dtype,tol", [("tiny", torch.float64, 1e-6), ("tiny-moe", torch.float32, 1e-4)])
@torch.no_grad()
def test_commit_restores_exactly_the_accepted_prefix_state(name, dtype, tol):
    """Rounds of verify(block) + commit(keep) leave the conv and recurrent states, and lengths, of decoding the
    kept tokens one at a time."""
    model = fresh(name).to(dtype)
    cfg, block = model.config, 5
    spec = Forward(model, HybridCache(cfg, 2, 64, dtype, "cpu", block=block))
    prompt = torch.randint(1, 500, (2, 9))
    tokens = torch.randint(1, 500, (2, 3 * block))
    spec.prefill(0, prompt)
    spec.cache.lengths.fill_(9)
    done = torch.zeros(2, dtype=torch.long)
    for keep in ([5, 0], [1, 3], [2, 5]):  # accepted block positions per row, one round each
        keep = torch.tensor(keep)
        spec.step(torch.stack([tokens[b, done[b]:done[b] + block] for b in range(2)]), verify=True)
        spec.commit(keep)
        done += keep
    for b in range(2):
        solo = Forward(model, HybridCache(cfg, 1, 64, dtype, "cpu"))
        solo.prefill(0, prompt[b:b + 1])
        solo.cache.lengths.fill_(9)
        for t in range(int(done[b])):
            solo.step(tokens[b:b + 1, t:t + 1])
            solo.cache.lengths += 1
        assert int(spec.cache.lengths[b]) == int(solo.cache.lengths[0]) == 9 + int(done[b])
        for i, kind in enumerate(cfg.layer_types):
            if kind == "linear_attention":
                for got, want in zip(spec.cache.recurrent(i), solo.cache.recurrent(i)):
                    assert (got[b] - want[0]).abs().max() <= tol * want.abs().max().clamp(min=1)


def test_rejection_sampling_preserves_the_target_distribution():
    """First emitted token ~ p_0 and, after an accepted draft, the next ~ p_1 (chi-square, small vocab)."""
    torch.manual_seed(0)
    V, k, n = 6, 2, 200_000
    p = torch.softmax(torch.randn(1, k + 1, V) * 1.5, -1).expand(n, -1, -1).contiguous()
    q = torch.softmax(torch.randn(1, k, V) * 1.5, -1).expand(n, -1, -1).contiguous()
    drafts = torch.multinomial(q.reshape(-1, V), 1).view(n, k)
    acc, nxt = accept_sampled(p, drafts, q)
    first = torch.where(acc > 0, drafts[:, 0], nxt)
    for tokens, expected in ((first, p[0, 0]), (torch.where(acc > 1, drafts[:, 1], nxt)[acc >= 1], p[0, 1])):
        counts = torch.bincount(tokens, minlength=V).double()
        m = counts.sum()
        chi2 = ((counts - m * expected) ** 2 / (m * expected)).sum().item()
        assert chi2 < 30, f"chi2 {chi2:.1f} with {V - 1} dof"
    # a deterministic draft (q = one-hot) is accepted with probability p(d)
    d = torch.full((n, k), 3)
    acc, _ = accept_sampled(p, d, None)
    assert abs((acc > 0).double().mean().item() - p[0, 0, 3].item()) < 0.01


def test_speculative_sampling_runs_and_reproduces(engines):
    _, spec = engines
    ids = torch.randint(1, 500, (2, 12))
    speculate(spec, torch.randint(0, 500, (2, NEW)), 0.5)
    torch.manual_seed(3)
    a = spec.generate(ids, max_new_tokens=NEW, do_sample=True, temperature=0.9, top_k=40)
    torch.manual_seed(3)
    b = spec.generate(ids, max_new_tokens=NEW, do_sample=True, temperature=0.9, top_k=40)
    assert torch.equal(a, b) and a.shape == (2, 12 + NEW)


def test_speculation_errors(engines):
    _, spec = engines
    proposer = OracleProposer(torch.zeros(1, 4, dtype=torch.long), 0.0, 512)
    with pytest.raises(ValueError, match="num_speculative_tokens must be an int in 1..32"):
        spec._fastqwen.enable_speculation(proposer, 0)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        spec._fastqwen.enable_speculation(proposer, 33)
    spec._fastqwen.enable_speculation(proposer, K)
    with pytest.raises(ValueError, match=r"one speculative block \(5\) exceeds max_seq_len=320"):
        spec.generate(torch.randint(1, 500, (1, 300)), max_new_tokens=16)


def chi2_homogeneity(a, b, vocab):
    """Two-sample chi-square statistic and degrees of freedom over tokens with expected count ≥ 5."""
    ca, cb = torch.bincount(a, minlength=vocab).double(), torch.bincount(b, minlength=vocab).double()
    pooled = (ca + cb) / (ca.sum() + cb.sum())
    keep = pooled * min(ca.sum(), cb.sum()) >= 5
    ea, eb = pooled[keep] * ca.sum(), pooled[keep] * cb.sum()
    return (((ca[keep] - ea) ** 2 / ea) + ((cb[keep] - eb) ** 2 / eb)).sum().item(), int(keep.sum()) - 1


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_speculative_sampling_keeps_the_target_distribution(name):
    """End to end: the second generated token (the first a speculative round emits, by acceptance or by the
    residual draw) is distributed as without speculation. The oracle drafts the greedy continuation, which the
    target often samples, so both branches carry weight (a wrong acceptance rule or residual fails this)."""
    kw = dict(do_sample=True, temperature=0.5, top_k=0, max_new_tokens=3)
    plain = fastqwen.optimize(fresh(name), max_batch_size=128, max_seq_len=16, compile=False)
    spec = fastqwen.optimize(fresh(name), max_batch_size=128, max_seq_len=16, compile=False)
    prompt = torch.randint(1, 500, (1, 5))
    greedy = plain.generate(prompt, max_new_tokens=3, do_sample=False)[:, 5:]
    spec._fastqwen.enable_speculation(OracleProposer(greedy.expand(128, -1), 0.0, 512), 2)
    batch = prompt.expand(128, -1)
    torch.manual_seed(0)
    a = torch.cat([plain.generate(batch, **kw)[:, -2] for _ in range(30)])
    b = torch.cat([spec.generate(batch, **kw)[:, -2] for _ in range(30)])
    assert spec._fastqwen.spec.acceptance_length(128) > 1.02, "drafts are accepted"
    chi2, dof = chi2_homogeneity(a, b, 512)
    assert chi2 < dof + 5 * (2 * dof) ** 0.5 + 5, f"chi2 {chi2:.1f} with {dof} dof"


@pytest.mark.parametrize("miss", [0.0, 0.35], ids=["perfect", "partial"])
def test_stopping_criteria_end_rows_where_plain_decoding_ends_them(engines, miss):
    """Stopping criteria with speculation: checked at every position a round emits, so a row ends at the token
    where plain decoding's per-token check ends it, and the round's later tokens become pad or run on (rows ending at
    different positions, one at its first token); likewise stop_strings and max_time. A streamer sees the row up to
    its end only."""
    from transformers import StoppingCriteria

    plain, spec = engines
    rows = [torch.randint(1, 500, (n,)) for n in (70, 9, 33)]
    ids, mask = left_padded(rows)
    free = plain.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)[:, ids.shape[1]:]
    ends = {int(free[0, 5]), int(free[2, 11]), int(free[1, 0])}  # rows 0 and 2 mid-round (or later), row 1 at once

    class StopAtToken(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            return torch.isin(input_ids[:, -1], torch.tensor(sorted(ends)))

    tok = char_tokenizer(plain.config.vocab_size)
    calls = [dict(stopping_criteria=StopAtToken()), dict(stop_strings=[tok.decode(free[b, p:p + 2]) for b, p in ((0, 6), (1, 2), (2, 12))], tokenizer=tok),
             dict(max_time=1e-9)]
    for kw in calls:
        expected = plain.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, **kw)
        assert expected.shape[1] < ids.shape[1] + NEW, kw  # every row was stopped
        speculate(spec, free, miss)
        got = spec.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, **kw)
        assert torch.equal(got, expected), kw

    streamer = Collect()
    speculate(spec, free[:1], miss)
    got = spec.generate(ids[:1, -70:], max_new_tokens=NEW, do_sample=False, stopping_criteria=[StopAtToken()],
                        streamer=streamer)
    assert sum(streamer.chunks[1:], []) == got[0, 70:].tolist() == free[0, :6].tolist()



@pytest.mark.parametrize("miss", [0.0, 0.35], ids=["perfect", "partial"])
def test_stopping_criteria_without_an_eos_let_the_rows_they_end_run_on_with_speculation(engines, miss):
    """Without an eos_token_id (transformers then pads no row) a row that the criteria end runs on, as in plain
    decoding, until they have ended every row; rows emitting different counts a round too."""
    from transformers import StoppingCriteria

    class StopRows(StoppingCriteria):  # rows 0, 1, 2 at 7, 2 and 12 new tokens
        def __call__(self, input_ids, scores, **kw):
            return torch.tensor([input_ids.shape[1] >= 70 + n for n in (7, 2, 12)])

    plain, spec = engines
    rows = [torch.randint(1, 500, (n,)) for n in (70, 9, 33)]
    ids, mask = left_padded(rows)
    expected = plain.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)[:, :70 + 12]
    got = plain.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, stopping_criteria=[StopRows()])
    assert torch.equal(got, expected)
    speculate(spec, expected[:, 70:], miss)
    got = spec.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, stopping_criteria=[StopRows()])
    assert torch.equal(got, expected)

@pytest.mark.parametrize("miss", [0.0, 0.35], ids=["perfect", "partial"])
def test_repetition_penalty_with_speculation_is_token_identical(engines, miss):
    """The repetition penalty in a verify block: position j's logits penalize every token emitted so far and the
    drafts d1 … dj, so greedy speculation gives plain decoding's penalized tokens."""
    plain, spec = engines
    rows = [torch.randint(1, 500, (n,)) for n in (70, 9, 33)]
    ids, mask = left_padded(rows)
    for penalty in (1.3, 0.7):
        expected = plain.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                  repetition_penalty=penalty)
        speculate(spec, expected[:, ids.shape[1]:], miss)
        got = spec.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, repetition_penalty=penalty)
        assert torch.equal(got, expected), penalty


def test_num_return_sequences_with_speculation_draws_as_the_repeated_batch(engines):
    """num_return_sequences with speculative sampling: the rows repeated in place, drawn as that batch would be
    under the same seed."""
    plain, spec = engines
    ids = torch.randint(1, 500, (1, 9))
    speculate(spec, plain.generate(ids, max_new_tokens=NEW, do_sample=False)[:, 9:].expand(3, -1), 0.35)
    kw = dict(do_sample=True, temperature=1.5, max_new_tokens=20)
    torch.manual_seed(5)
    got = spec.generate(ids, num_return_sequences=3, **kw)
    torch.manual_seed(5)
    assert torch.equal(got, spec.generate(ids.repeat(3, 1), **kw))
    assert got.shape[0] == 3 and len({tuple(r) for r in got[:, 9:].tolist()}) > 1


def test_streamer_sees_every_token_with_speculation(engines):
    plain, spec = engines
    ids = torch.randint(1, 500, (1, 8))
    expected = plain.generate(ids, max_new_tokens=17, do_sample=False)
    speculate(spec, expected[:, 8:], 0.3)
    streamer = Collect()
    out = spec.generate(ids, max_new_tokens=17, do_sample=False, streamer=streamer)
    assert torch.equal(out, expected)
    assert streamer.chunks[0] == ids[0].tolist() and sum(streamer.chunks[1:], []) == out[0, 8:].tolist()


def test_streamer_sees_every_row_of_a_batch_with_speculation(engines):
    """A streamer over a ragged batch gets what plain decoding gives it: one [rows] tensor a position, every row's
    token there and pad after a row's end (row 1 ends by EOS, mid-round where a round accepts drafts), not row 0's
    tokens only."""
    plain, spec = engines
    ids, mask = left_padded([torch.randint(1, 500, (n,)) for n in (12, 5)])
    free = plain.generate(ids, attention_mask=mask, max_new_tokens=17, do_sample=False)[:, ids.shape[1]:]
    kw = dict(attention_mask=mask, max_new_tokens=17, do_sample=False, eos_token_id=int(free[1, 6]), pad_token_id=3)
    want, got = Collect(), Collect()
    expected = plain.generate(ids, streamer=want, **kw)
    speculate(spec, free, 0.3)
    assert torch.equal(spec.generate(ids, streamer=got, **kw), expected)
    assert got.chunks == want.chunks


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_imposed_acceptance_reaches_the_chosen_tau(compile):
    """OracleProposer(impose=True), the benchmarks' proposer: every row's mean tokens per round is the τ that
    miss_for_tau chose, though the drafts are random tokens the target rejects. Each row's ~48 rounds emit
    48τ tokens to within one, so each row lands within 0.06 of τ (random draws would scatter by ±0.16 per row);
    the last round, cut by max_new_tokens, is most of that slack. (One layer of the tiny preset: the imposed
    acceptance does not depend on the model.)"""
    spec = fastqwen.optimize(fresh("tiny", layers=1), max_batch_size=64, max_seq_len=160, compile=compile)
    k, tau = 4, 2.5
    drafts_from = torch.randint(1, 500, (64, 140))
    spec._fastqwen.enable_speculation(OracleProposer(drafts_from, miss_for_tau(tau, k), 512, impose=True), k)
    prompt = torch.randint(1, 500, (64, 6))
    torch.manual_seed(0)
    spec.generate(prompt, max_new_tokens=121, min_new_tokens=121)
    measured = spec._fastqwen.spec.acceptance_length(64)
    assert abs(measured - tau) < 0.03, f"tau {measured:.3f}, imposed {tau}"
    s = spec._fastqwen.spec
    per_row = (s.n_out[:64] - 1).double() / s.rounds[:64]
    assert (per_row - tau).abs().max() < 0.06, f"row taus {per_row.min():.3f} … {per_row.max():.3f}, imposed {tau}"


@pytest.mark.parametrize("k, tau", [(3, 3.0), (15, 6.5), (4, 2.5), (4, 1.0), (4, 5.0)])
def test_imposed_acceptance_keeps_every_run_of_rounds_within_a_token_of_tau(k, tau):
    """A benchmark's window is a few rounds from a call's start: after R rounds each row has emitted Rτ tokens to
    within one, for every R (the Weyl sequence over the misses' distribution accepted every draft in round 0, so a
    64-token DFlash call at τ 6.5 ran at 7.9 tokens a round), and never more than k drafts."""
    oracle = OracleProposer(torch.zeros(3, 8, dtype=torch.long), miss_for_tau(tau, k), 512, impose=True)
    logits = torch.randn(3, k + 1, 512)
    emitted = torch.zeros(3, dtype=torch.float64)
    for rounds in range(1, 120):
        n, nxt = oracle.imposed_acceptance(logits)
        assert ((n >= 0) & (n <= k)).all()
        assert torch.equal(nxt, logits.argmax(-1).gather(1, n[:, None])[:, 0])
        emitted += n + 1
        assert ((emitted - rounds * tau).abs() < 1).all(), (rounds, emitted.tolist())


def test_imposed_acceptance_restarts_with_every_call():
    """The imposed counts restart with each generate call, so every call of one length does the same rounds
    (bench_spec's end-to-end window counts on it); a longer call does more."""
    from fastqwen.bench import spec_rounds

    spec = fastqwen.optimize(fresh("tiny"), max_batch_size=1, max_seq_len=96, compile=False)
    e = spec._fastqwen
    e.enable_speculation(OracleProposer(torch.randint(1, 500, (1, 80)), miss_for_tau(2.5, 4), 512, impose=True), 4)
    prompt = torch.randint(1, 500, (1, 6))
    seen = []
    for n in (13, 31, 13):
        spec.generate(prompt, max_new_tokens=n, min_new_tokens=n)
        seen.append((spec_rounds(e, 1), e.spec.acceptance_length(1)))
    assert seen[0] == seen[2] and seen[1][0] > seen[0][0], seen


@pytest.mark.parametrize("k", [1, 2, K])
def test_fewer_drafts_per_call_are_token_identical(engines, k):
    """generate(num_speculative_tokens=k) with k below the optimize-time K: a smaller verify block in the same
    cache (its replay masks the unused positions), same tokens."""
    plain, spec = engines
    ids, mask = left_padded([torch.randint(1, 500, (n,)) for n in (25, 6, 40)])
    expected = plain.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    speculate(spec, expected[:, ids.shape[1]:], 0.3)
    got = spec.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, num_speculative_tokens=k)
    assert torch.equal(got, expected)
    assert 1.0 < spec._fastqwen.spec.acceptance_length(3) <= k + 1


def test_num_speculative_tokens_errors(engines):
    plain, spec = engines
    ids = torch.randint(1, 500, (1, 5))
    speculate(spec, torch.randint(1, 500, (1, 20)), 0.3)
    with pytest.raises(ValueError, match=rf"num_speculative_tokens must be an int in 1..{K}"):
        spec.generate(ids, max_new_tokens=4, num_speculative_tokens=K + 1)
    with pytest.raises(ValueError, match="num_speculative_tokens must be an int"):
        spec.generate(ids, max_new_tokens=4, num_speculative_tokens=0)
    with pytest.raises(ValueError, match="applies to speculative decoding"):
        plain.generate(ids, max_new_tokens=4, num_speculative_tokens=2)
