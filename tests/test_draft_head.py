"""Drafting over a vocabulary subset (spec/draft_head.py): the head's logits, lossless speculation with MTP and
DFlash drafts restricted to it, and the errors of a bad `draft_vocab`."""

import pytest
import torch
from conftest import fresh, left_padded
from test_dflash import draft_dir  # noqa: F401  (fixture)
from test_mtp import load, write_checkpoint

import fastqwen
from fastqwen.quant import QuantLinear
from fastqwen.spec.draft_head import SubsetHead, draft_head


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("mtp-subset"), fresh("tiny"))


def test_subset_head_logits():
    lm_head = torch.nn.Linear(32, 50, bias=False)
    h = torch.randn(3, 2, 32)
    full = lm_head(h)
    prefix = draft_head(lm_head, 20)
    assert prefix.head.weight.data_ptr() == lm_head.weight.data_ptr(), "ids 0 … N−1 read the lm_head in place"
    ids = torch.tensor([3, 7, 41, 0, 12])
    chosen = draft_head(lm_head, ids.tolist())
    with torch.no_grad():
        for head, keep in ((prefix, torch.arange(20)), (chosen, ids)):
            out = head(h)
            assert out.shape == full.shape and out.dtype == torch.float32
            torch.testing.assert_close(out[..., keep], full[..., keep], rtol=1e-5, atol=1e-6)  # (GEMM blocking)
            outside = torch.ones(50, dtype=torch.bool)
            outside[keep] = False
            assert torch.isneginf(out[..., outside]).all()
    quantized = draft_head(lm_head, 20, "fp8-weight")
    assert isinstance(quantized, SubsetHead) and isinstance(quantized.head, QuantLinear)
    assert isinstance(draft_head(lm_head, None, "fp8-weight"), QuantLinear) and draft_head(lm_head) is None


@pytest.mark.parametrize("vocab", [64, "ids"], ids=["first-64", "chosen-ids"])
def test_mtp_over_a_subset_is_token_identical(mtp_checkpoint, vocab):
    plain = fastqwen.optimize(load(mtp_checkpoint), max_batch_size=3, max_seq_len=160, compile=False)
    rows = [torch.randint(1, 500, (n,)) for n in (40, 7, 19)]
    ids, mask = left_padded(rows)
    expected = plain.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    if vocab == "ids":  # the tokens plain decoding emits, and some others: a subset where drafts get accepted
        vocab = torch.unique(torch.cat([expected[:, ids.shape[1]:].flatten(), torch.arange(300, 340)])).tolist()
    spec = fastqwen.optimize(load(mtp_checkpoint), max_batch_size=3, max_seq_len=160, compile=False,
                             speculate="mtp", num_speculative_tokens=3, draft_vocab=vocab, draft_lm_head="fp8-weight")
    assert torch.equal(spec.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24), expected)
    allowed = torch.zeros(spec.config.vocab_size, dtype=torch.bool)
    allowed[spec._fastqwen.spec.proposer.lm_head.ids] = True
    e = spec._fastqwen
    with torch.no_grad():
        drafts, _ = e.spec.proposer.propose(e, 3, False)
        sampled, q = e.spec.proposer.propose(e, 3, True)
    assert allowed[drafts].all() and allowed[sampled].all()
    assert (q[..., ~allowed] == 0).all() and torch.allclose(q.sum(-1), torch.ones(()), atol=1e-5)
    torch.manual_seed(0)  # rejection sampling with a draft distribution that is zero off the subset
    out = spec.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=12, temperature=0.8)
    assert out.shape == (3, ids.shape[1] + 12)


def test_dflash_over_a_subset_is_token_identical(draft_dir):  # noqa: F811
    plain = fastqwen.optimize(fresh("tiny"), max_batch_size=2, max_seq_len=128, compile=False)
    spec = fastqwen.optimize(fresh("tiny"), max_batch_size=2, max_seq_len=128, compile=False, speculate="dflash",
                             draft=draft_dir, draft_vocab=256)
    ids, mask = left_padded([torch.randint(1, 500, (n,)) for n in (23, 9)])
    assert torch.equal(spec.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20),
                       plain.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20))


def test_bad_draft_vocab_errors(mtp_checkpoint):
    def opt(**kw):
        return fastqwen.optimize(load(mtp_checkpoint), compile=False, **kw)

    with pytest.raises(ValueError, match="draft_vocab only applies to speculative decoding"):
        opt(draft_vocab=100)
    for bad, message in ((0, r"draft_vocab=0 must be in 1..512"), (513, r"must be in 1..512"),
                         ([], "non-empty sequence of integer token ids"), ([1.5, 2.0], "integer token ids"),
                         ([3, 3, 4], "repeated token ids"), ([5, 512], r"outside 0..511"), (True, "an int or")):
        with pytest.raises(ValueError, match=message):
            opt(speculate="mtp", draft_vocab=bad)
    with pytest.raises(ValueError, match="quant_lm_head=True already quantized it"):
        opt(speculate="mtp", draft_vocab=100, quant="fp8-weight", quant_lm_head=True)


def test_a_scalar_draft_vocab_of_numpy_or_torch_is_a_count():
    """draft_vocab=np.int64(N) or torch.tensor(N) (a size computed with numpy or torch) means N tokens, as the int
    N does; it drafted over the one token id N before (lossless, but acceptance all but gone, silently)."""
    import numpy as np

    lm_head = torch.nn.Linear(32, 50, bias=False)
    for n in (np.int64(20), torch.tensor(20), np.array(20)):
        assert torch.equal(draft_head(lm_head, n).ids, torch.arange(20))
    with pytest.raises(ValueError, match=r"draft_vocab=60 must be in 1..50"):
        draft_head(lm_head, np.int32(60))
    with pytest.raises(ValueError, match="integer token ids"):
        draft_head(lm_head, torch.tensor(20.0))
