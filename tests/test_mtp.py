"""MTP drafts: a checkpoint written here in the real on-disk format loads, drafts like a plain
implementation, and speculative greedy with it is token-identical to plain greedy."""

import json

import pytest
import torch
from conftest import fresh, left_padded
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import fastqwen
from fastqwen import presets
from fastqwen.model import text_model


def write_checkpoint(path, model, mtp=True):
    """save_pretrained + an extra shard with the MTP tensors and an index mapping every tensor, as released."""
    model.save_pretrained(path)
    keys = list(model.state_dict())
    weight_map = {k: "model.safetensors" for k in keys}
    if mtp:
        tensors = presets.random_mtp_tensors(model)
        save_file(tensors, str(path / "model-mtp.safetensors"))
        weight_map.update({k: "model-mtp.safetensors" for k in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def checkpoint(request, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp(request.param), fresh(request.param))


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def plain_drafts(model, head, prompt, first, k):
    """k MTP drafts computed straight from transformers' modules: each step runs the MTP layer over the whole
    sequence (no cache), feeding its own output back as the next hidden state."""
    with torch.no_grad():
        text = text_model(model)
        hidden = text(prompt).last_hidden_state  # final post-norm hidden states h_0 … h_{T-1}
        tokens = torch.cat([prompt[:, 1:], first[:, None]], dim=1)  # x_1 … x_T
        drafts = []
        for _ in range(k):
            x = head.fc(torch.cat([head.pre_fc_norm_embedding(text.embed_tokens(tokens)),
                                   head.pre_fc_norm_hidden(hidden)], -1))
            positions = torch.arange(tokens.shape[1])[None]
            x = head.layers[0](x, position_embeddings=text.rotary_emb(x, positions), attention_mask=None,
                               position_ids=positions)
            m = head.norm(x[:, -1:])
            drafts.append(model.lm_head(m[:, 0]).argmax(-1))
            tokens = torch.cat([tokens, drafts[-1][:, None]], dim=1)
            hidden = torch.cat([hidden, m], dim=1)
        return torch.stack(drafts, dim=1)


@pytest.mark.parametrize("chunk", [32768, 8], ids=["one-prefill", "chunked-prefill"])
def test_mtp_loads_and_drafts_like_a_plain_implementation(checkpoint, chunk):
    model = fastqwen.optimize(load(checkpoint), max_seq_len=128, compile=False, speculate="mtp",
                              num_speculative_tokens=3, prefill_chunk_tokens=chunk)
    engine = model._fastqwen
    prompt = torch.randint(1, 500, (1, 21))
    with torch.no_grad():
        first = engine._prefill([prompt[0]], do_sample=False)
        drafts, q = engine.spec.proposer.propose(engine, 3, False)
    assert q is None and drafts.shape == (1, 3)
    assert torch.equal(drafts, plain_drafts(model, engine.spec.proposer.head, prompt, first[:1], 3))
    assert "fastqwen_fused" in engine.spec.proposer.head.layers[0].self_attn.__dict__  # q+k+v as one matmul


def test_mtp_speculative_greedy_is_token_identical(checkpoint):
    plain = fastqwen.optimize(load(checkpoint), max_batch_size=3, max_seq_len=256, compile=False)
    spec = fastqwen.optimize(load(checkpoint), max_batch_size=3, max_seq_len=256, compile=False, speculate="mtp",
                             num_speculative_tokens=3, prefill_chunk_tokens=24)  # the 70 and 31 rows: chunked
    rows = [torch.randint(1, 500, (n,)) for n in (70, 8, 31)]
    ids, mask = left_padded(rows)
    expected = plain.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    assert torch.equal(spec.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30), expected)
    assert spec._fastqwen.spec.rounds[:3].min() > 0, "the speculative loop ran"
    free = expected[:, ids.shape[1]:]
    stops = torch.tensor(sorted({int(free[0, 4]), int(free[2, 9])}))
    for kw in (dict(max_new_tokens=30, eos_token_id=int(free[2, 5]), pad_token_id=1),
               dict(max_new_tokens=30, stopping_criteria=[lambda i, s, **_: torch.isin(i[:, -1], stops)]),
               dict(max_new_tokens=30, repetition_penalty=1.3)):  # (the MTP head's drafts stay unpenalized)
        expected = plain.generate(ids, attention_mask=mask, do_sample=False, **kw)
        assert torch.equal(spec.generate(ids, attention_mask=mask, do_sample=False, **kw), expected), kw
    torch.manual_seed(0)
    sampled = spec.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=12, temperature=0.7)
    assert sampled.shape == (3, ids.shape[1] + 12)


def test_mtp_speculation_through_the_launch_candidates_is_token_identical(checkpoint):
    """The MTP draft and the verify under the attention glue and gated-norm ops (kernels "attn_glue" "fused",
    "gdn_norm" "kernel", on the projections' split-K partials: linears "gemv") give the plain default's tokens."""
    plain = fastqwen.optimize(load(checkpoint), max_batch_size=2, max_seq_len=128, compile=False)
    spec = fastqwen.optimize(load(checkpoint), max_batch_size=2, max_seq_len=128, compile=False, speculate="mtp",
                             num_speculative_tokens=3,
                             kernels={"attn_glue": "fused", "gdn_norm": "kernel", "linears": "gemv"})
    ids, mask = left_padded([torch.randint(1, 500, (n,)) for n in (21, 6)])
    expected = plain.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    assert torch.equal(spec.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20), expected)
    assert spec._fastqwen.spec.rounds[:2].min() > 0, "the speculative loop ran"


def test_quantized_draft_lm_head_keeps_the_output_exact(checkpoint):
    """draft_lm_head: MTP drafts through an fp8 copy of lm_head (its argmax), the output stays the target's."""
    from fastqwen.quant import QuantLinear

    plain = fastqwen.optimize(load(checkpoint), max_batch_size=2, max_seq_len=128, compile=False)
    spec = fastqwen.optimize(load(checkpoint), max_batch_size=2, max_seq_len=128, compile=False, speculate="mtp",
                             num_speculative_tokens=3, draft_lm_head="fp8-weight")
    proposer = spec._fastqwen.spec.proposer
    assert isinstance(proposer.lm_head, QuantLinear) and spec.lm_head is not proposer.lm_head
    ids = torch.randint(1, 500, (2, 17))
    assert torch.equal(spec.generate(ids, do_sample=False, max_new_tokens=24),
                       plain.generate(ids, do_sample=False, max_new_tokens=24))
    h = torch.randn(4, spec.config.hidden_size)
    with torch.no_grad():  # drafts come from the fp8 weights, not the target's
        assert torch.allclose(proposer.lm_head(h), h @ proposer.lm_head.dequantized().t(), atol=1e-5)
        assert not torch.allclose(proposer.lm_head(h), spec.lm_head(h), atol=1e-3)
    with pytest.raises(ValueError, match="draft_lm_head only applies to speculative decoding"):
        fastqwen.optimize(load(checkpoint), compile=False, draft_lm_head="fp8")
    with pytest.raises(ValueError, match="unknown draft_lm_head='nf4'"):
        fastqwen.optimize(load(checkpoint), compile=False, speculate="mtp", draft_lm_head="nf4")
    with pytest.raises(ValueError, match="divisible by quant_group_size=128"):
        fastqwen.optimize(load(checkpoint), compile=False, speculate="mtp", draft_lm_head="int4")


def test_mtp_errors(tmp_path):
    model = fresh("tiny")
    bare = write_checkpoint(tmp_path / "bare", model, mtp=False)
    with pytest.raises(ValueError, match="has no mtp.. tensors"):
        fastqwen.optimize(load(bare), compile=False, speculate="mtp")
    other = tmp_path / "other.safetensors"
    wrong = presets.random_mtp_tensors(model)
    wrong["mtp.fc.weight"] = torch.randn(64, 96)
    save_file(wrong, str(other))
    with pytest.raises(ValueError, match=r"mtp.fc.weight is \(64, 96\), expected \(64, 128\)"):
        fastqwen.optimize(load(bare), compile=False, speculate="mtp", draft=other)
    right = tmp_path / "right.safetensors"
    save_file(presets.random_mtp_tensors(model), str(right))
    linear = fresh("tiny", layer_types=["linear_attention"] * model.config.num_hidden_layers)
    with pytest.raises(ValueError, match="needs a target with a full-attention layer.*layer_types has none"):
        fastqwen.optimize(linear, compile=False, speculate="mtp", draft=right)
    with pytest.raises(ValueError, match="unknown speculate='eagle'"):
        fastqwen.optimize(model, compile=False, speculate="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        fastqwen.optimize(model, compile=False, speculate="mtp", num_speculative_tokens=0, draft=other)
    with pytest.raises(FileNotFoundError, match="draft=<local checkpoint directory>"):
        fastqwen.optimize(model, compile=False, speculate="mtp", draft=tmp_path / "missing")
    with pytest.raises(ValueError, match="num_speculative_tokens= only applies to speculative decoding; "
                                         "pass speculate='mtp'"):
        fastqwen.optimize(model, compile=False, num_speculative_tokens=5)
    with pytest.raises(ValueError, match=r"block_size= sets a DFlash draft's block; with speculate='mtp' pass "
                                         r"num_speculative_tokens=3"):
        fastqwen.optimize(model, compile=False, speculate="mtp", draft=other, block_size=4)


def test_compiled_speculative_round_matches_eager_without_recompiling(tmp_path):
    """The whole round (k MTP drafting steps, verify, acceptance, commit, MTP catch-up) compiles as one graph."""
    path = write_checkpoint(tmp_path / "ckpt", fresh("tiny"))
    eager = fastqwen.optimize(load(path), max_batch_size=2, max_seq_len=128, compile=False, speculate="mtp",
                              num_speculative_tokens=2)
    compiled = fastqwen.optimize(load(path), max_batch_size=2, max_seq_len=128, compile=True, speculate="mtp",
                                 num_speculative_tokens=2)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    for i, n in enumerate((9, 23)):
        ids, mask = left_padded([torch.randint(1, 500, (n,)), torch.randint(1, 500, (n - 4,))])
        expected = eager.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = compiled.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
        assert torch.equal(got, expected)
    assert counters["stats"]["unique_graphs"] == 1



def test_a_quantized_target_drafts_through_a_quantized_head(checkpoint):
    """quant= quantizes the MTP head in the same scheme; the output is the quantized target's own."""
    from fastqwen.quant import QuantLinear

    opts = dict(max_batch_size=2, max_seq_len=128, compile=False, quant="int4", quant_group_size=32)
    plain = fastqwen.optimize(load(checkpoint), **opts)
    spec = fastqwen.optimize(load(checkpoint), **opts, speculate="mtp", num_speculative_tokens=3)
    head = spec._fastqwen.spec.proposer.head
    assert isinstance(head.fc, QuantLinear) and isinstance(head.layers[0].self_attn.o_proj, QuantLinear)
    ids = torch.randint(1, 500, (2, 17))
    assert torch.equal(spec.generate(ids, do_sample=False, max_new_tokens=24),
                       plain.generate(ids, do_sample=False, max_new_tokens=24))


def test_draft_quant_quantizes_the_head_of_a_bf16_target(checkpoint):
    """draft_quant: the MTP head in fp8 while the target stays as it is; the output is the target's."""
    from fastqwen.quant import QuantLinear

    opts = dict(max_batch_size=2, max_seq_len=128, compile=False)
    plain = fastqwen.optimize(load(checkpoint), **opts)
    spec = fastqwen.optimize(load(checkpoint), **opts, speculate="mtp", num_speculative_tokens=3,
                             draft_quant="fp8-weight")
    assert isinstance(spec._fastqwen.spec.proposer.head.fc, QuantLinear)
    assert not any(isinstance(m, QuantLinear) for m in spec.model.modules())
    ids = torch.randint(1, 500, (2, 17))
    assert torch.equal(spec.generate(ids, do_sample=False, max_new_tokens=24),
                       plain.generate(ids, do_sample=False, max_new_tokens=24))
    with pytest.raises(ValueError, match="draft_quant only applies to speculative decoding"):
        fastqwen.optimize(load(checkpoint), compile=False, draft_quant="fp8")
    with pytest.raises(ValueError, match="unknown draft_quant='nf4'"):
        fastqwen.optimize(load(checkpoint), compile=False, speculate="mtp", draft_quant="nf4")
