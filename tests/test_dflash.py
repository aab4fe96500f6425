"""DFlash drafts: a checkpoint written here in the real format loads, its block forward matches a plain
implementation from transformers' modules, and speculative greedy with it is token-identical."""

import json

import pytest
import torch
from conftest import fresh, left_padded
from safetensors.torch import save_file
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding, apply_rotary_pos_emb

import fastqwen

CONFIG = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
    "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "max_position_embeddings": 4096, "vocab_size": 512,
    "attention_bias": False, "tie_word_embeddings": False, "block_size": 8, "num_target_layers": 4,
    "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6,
    "dflash_config": {"mask_token_id": 500, "target_layer_ids": [0, 2]},
}


def write_draft(path, config=CONFIG, seed=3):
    """config.json + model.safetensors with random weights, tensor names as z-lab ships them (no prefix)."""
    torch.manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    cfg = Qwen3Config(**{k: v for k, v in config.items() if k not in ("architectures", "dflash_config")})
    H, n_ids = config["hidden_size"], len(config["dflash_config"]["target_layer_ids"])
    tensors = {"fc.weight": torch.randn(H, n_ids * 64) * 0.1, "hidden_norm.weight": 1 + torch.randn(H) * 0.1,
               "norm.weight": 1 + torch.randn(H) * 0.1}
    for i in range(config["num_hidden_layers"]):
        for name, p in Qwen3DecoderLayer(cfg, i).state_dict().items():
            tensors[f"layers.{i}.{name}"] = (1 + torch.randn_like(p) * 0.1) if "norm" in name else torch.randn_like(p) * 0.2
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return write_draft(tmp_path_factory.mktemp("dflash"))


def plain_block_logits(model, draft, prompt, pending, k):
    """The draft's block logits from transformers' modules: context K/V and block K/V concatenated, no cache."""
    with torch.no_grad():
        out = model(prompt, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i + 1] for i in draft.target_layer_ids], dim=-1)  # outputs of layers
        ctx = draft.hidden_norm(draft.fc(feats))
        T = prompt.shape[1]
        block = torch.tensor([[pending] + [draft.mask_token_id] * k])
        x = model.get_input_embeddings()(block)
        rot = Qwen3RotaryEmbedding(draft.config)
        cos, sin = rot(x, torch.arange(T + k + 1)[None])
        for i, layer in enumerate(draft.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_norm(a.q_proj(h).view(1, k + 1, -1, 16)).transpose(1, 2)
            keys = a.k_norm(torch.cat([a.k_proj(ctx), a.k_proj(h)], 1).view(1, T + k + 1, -1, 16)).transpose(1, 2)
            vals = torch.cat([a.v_proj(ctx), a.v_proj(h)], 1).view(1, T + k + 1, -1, 16).transpose(1, 2)
            q, _ = apply_rotary_pos_emb(q, q, cos[:, T:], sin[:, T:])
            keys, _ = apply_rotary_pos_emb(keys, keys, cos, sin)
            keys, vals = keys.repeat_interleave(2, 1), vals.repeat_interleave(2, 1)
            scores = q @ keys.transpose(-1, -2) * 16**-0.5
            qpos, kpos = torch.arange(T, T + k + 1)[:, None], torch.arange(T + k + 1)[None]
            if draft.layer_types[i] == "sliding_attention":
                scores = scores.masked_fill((kpos > qpos) | (kpos <= qpos - draft.sliding_window), float("-inf"))
            o = (scores.softmax(-1) @ vals).transpose(1, 2).reshape(1, k + 1, -1)
            x = x + a.o_proj(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return model.lm_head(draft.norm(x)[:, 1:]).float()


@pytest.mark.parametrize("name, chunk", [("tiny", 32768), ("tiny-moe", 32768), ("tiny", 8)])
def test_block_forward_matches_a_plain_implementation(draft_dir, name, chunk):
    model = fastqwen.optimize(fresh(name), max_seq_len=128, compile=False, speculate="dflash", draft=draft_dir,
                              prefill_chunk_tokens=chunk)
    engine = model._fastqwen
    proposer = engine.spec.proposer
    prompt = torch.randint(1, 500, (1, 19))
    with torch.no_grad():
        first = engine._prefill([prompt[0]], do_sample=False)
        ours = engine.forward.lm_head(proposer.block_hidden(engine, 7)[:, 1:]).float()
    ref = plain_block_logits(model, proposer.draft, prompt, int(first[0]), 7)
    torch.testing.assert_close(ours[:1], ref, atol=1e-4, rtol=1e-4)
    layer = proposer.draft.layers[0]  # ours ran q+k+v and gate+up as one matmul each (fused projections)
    assert "fastqwen_fused" in layer.self_attn.__dict__ and "fastqwen_fused" in layer.mlp.__dict__


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_dflash_speculative_greedy_is_token_identical(draft_dir, name):
    plain = fastqwen.optimize(fresh(name), max_batch_size=3, max_seq_len=256, compile=False)
    rows = [torch.randint(1, 500, (n,)) for n in (66, 10, 29)]
    ids, mask = left_padded(rows)
    # (drafting through an fp8 lm_head copy too; and prefilling in chunks of 16)
    for block, draft_lm_head, chunk in ((8, None, 32768), (4, "fp8-weight", 16)):
        spec = fastqwen.optimize(fresh(name), max_batch_size=3, max_seq_len=256, compile=False,
                                 speculate="dflash", draft=draft_dir, block_size=block, draft_lm_head=draft_lm_head,
                                 prefill_chunk_tokens=chunk)
        for kw in (dict(max_new_tokens=30), dict(max_new_tokens=11)):
            expected = plain.generate(ids, attention_mask=mask, do_sample=False, **kw)
            assert torch.equal(spec.generate(ids, attention_mask=mask, do_sample=False, **kw), expected)
        alone = spec.generate(rows[1][None], max_new_tokens=30, do_sample=False)
        assert torch.equal(alone, plain.generate(rows[1][None], max_new_tokens=30, do_sample=False))
    free = expected[:, ids.shape[1]:]
    stops = torch.tensor(sorted({int(free[0, 3]), int(free[2, 7])}))
    for kw in (dict(eos_token_id=int(free[0, 4]), pad_token_id=1),
               dict(stopping_criteria=[lambda i, s, **_: torch.isin(i[:, -1], stops)]), dict(repetition_penalty=1.3)):
        kw.update(max_new_tokens=30, do_sample=False)
        expected = plain.generate(ids, attention_mask=mask, **kw)
        assert torch.equal(spec.generate(ids, attention_mask=mask, **kw), expected), kw
    torch.manual_seed(0)
    sampled = spec.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=12, top_p=0.9)
    assert sampled.shape == (3, ids.shape[1] + 12)


def test_dflash_errors(tmp_path, draft_dir):
    model = fresh("tiny")
    cases = [({"hidden_size": 32}, "hidden size 32 != target's 64"),
             ({"vocab_size": 1000}, "vocab 1000 != target's 512"),
             ({"dflash_config": {"mask_token_id": 500, "target_layer_ids": [0, 7]}}, r"target_layer_ids \[7\]"),
             ({"dflash_config": {"mask_token_id": 600, "target_layer_ids": [0, 2]}}, "mask_token_id 600"),
             ({"block_size": 1}, r"block_size 1 in its config.json.*2 or more")]
    for i, (change, message) in enumerate(cases):
        config = {**CONFIG, **change}
        if "hidden_size" in change:
            config["head_dim"] = 8
        with pytest.raises(ValueError, match=message):
            fastqwen.optimize(model, compile=False, speculate="dflash", draft=write_draft(tmp_path / str(i), config))
    mismatched = write_draft(tmp_path / "mismatched")  # (tensors of another config: torch's own RuntimeError before)
    wider = {**CONFIG, "intermediate_size": 2 * CONFIG["intermediate_size"]}
    (mismatched / "config.json").write_text(json.dumps(wider))
    with pytest.raises(ValueError, match=r"(?s)DFlash draft's tensors do not match its config.json.*mlp.gate_proj"):
        fastqwen.optimize(model, compile=False, speculate="dflash", draft=mismatched)
    with pytest.raises(ValueError, match=r"block_size must be an int in 2..8"):
        fastqwen.optimize(model, compile=False, speculate="dflash", draft=draft_dir, block_size=16)
    with pytest.raises(ValueError, match="needs draft="):
        fastqwen.optimize(model, compile=False, speculate="dflash")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        fastqwen.optimize(model, compile=False, speculate="dflash", draft=tmp_path / "nowhere")
    # options of the other speculation mode (or of none) are refused, never silently dropped
    with pytest.raises(ValueError, match=r"draft= only applies to speculative decoding; pass speculate='dflash'"):
        fastqwen.optimize(model, compile=False, draft=draft_dir)
    with pytest.raises(ValueError, match=r"block_size= sets a DFlash draft's block; pass speculate='dflash'"):
        fastqwen.optimize(model, compile=False, block_size=4)
    with pytest.raises(ValueError, match=r"num_speculative_tokens= sets the MTP head's drafts \(speculate='mtp'\); "
                                         r"with speculate='dflash' pass block_size=5 \(4 drafts and the pending "
                                         r"token\)"):
        fastqwen.optimize(model, compile=False, speculate="dflash", draft=draft_dir, num_speculative_tokens=4)


def test_draft_config_without_vocab_size_loads(tmp_path):
    """vocab_size is optional in a draft's config.json (the draft has no embedding or lm_head of its own): one
    without it loads, rather than being refused against Qwen3Config's default vocabulary (151936)."""
    config = {k: v for k, v in CONFIG.items() if k != "vocab_size"}
    plain = fastqwen.optimize(fresh("tiny"), max_seq_len=64, compile=False)
    spec = fastqwen.optimize(fresh("tiny"), max_seq_len=64, compile=False, speculate="dflash",
                             draft=write_draft(tmp_path, config))
    ids = torch.randint(1, 500, (1, 9))
    assert torch.equal(spec.generate(ids, max_new_tokens=12, do_sample=False),
                       plain.generate(ids, max_new_tokens=12, do_sample=False))


def test_draft_with_no_target_layer_ids_is_refused(tmp_path):
    """Empty ids loaded and failed in generate's first round (a cat of no features)."""
    config = {**CONFIG, "dflash_config": {"mask_token_id": 500, "target_layer_ids": []}}
    with pytest.raises(ValueError, match="target_layer_ids is empty: .*set dflash_config.target_layer_ids in its "
                                         "config.json"):
        fastqwen.optimize(fresh("tiny"), compile=False, speculate="dflash", draft=write_draft(tmp_path, config))


def test_compiled_dflash_round_matches_eager(draft_dir):
    eager = fastqwen.optimize(fresh("tiny"), max_batch_size=2, max_seq_len=128, compile=False, speculate="dflash",
                              draft=draft_dir, block_size=4)
    compiled = fastqwen.optimize(fresh("tiny"), max_batch_size=2, max_seq_len=128, compile=True,
                                 speculate="dflash", draft=draft_dir, block_size=4)
    for i, n in enumerate((9, 23)):
        ids, mask = left_padded([torch.randint(1, 500, (n,)), torch.randint(1, 500, (n - 4,))])
        expected = eager.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            assert torch.equal(compiled.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False),
                               expected)


def test_draft_keeps_fp32_rotary_frequencies_in_a_bf16_model(draft_dir):
    """A bf16 target casts the draft's weights to bf16, never its rotary frequencies: in bf16 the angle at
    position p is off by up to ~p/256 rad, which would quietly cost acceptance on a real checkpoint."""
    from fastqwen.spec.dflash import DFlashDraft, read_dflash_checkpoint

    model = fresh("tiny").to(torch.bfloat16)
    draft = DFlashDraft(*read_dflash_checkpoint(draft_dir), model)
    assert draft.fc.weight.dtype == torch.bfloat16
    want = Qwen3RotaryEmbedding(draft.config).inv_freq
    assert draft.rotary.inv_freq.dtype == torch.float32 and torch.equal(draft.rotary.inv_freq, want)


def test_a_quantized_target_drafts_through_a_quantized_draft(draft_dir):
    """quant= quantizes the DFlash draft's linears in the same scheme; the output is the quantized target's."""
    from fastqwen.quant import QuantLinear

    opts = dict(max_batch_size=2, max_seq_len=128, compile=False, quant="fp8-weight")
    plain = fastqwen.optimize(fresh("tiny"), **opts)
    spec = fastqwen.optimize(fresh("tiny"), **opts, speculate="dflash", draft=draft_dir, block_size=4)
    draft = spec._fastqwen.spec.proposer.draft
    assert isinstance(draft.fc, QuantLinear) and isinstance(draft.layers[0].mlp.down_proj, QuantLinear)
    assert isinstance(draft.layers[0].mlp.__dict__.get("fastqwen_fused"), QuantLinear)  # gate+up, fused quantized
    ids = torch.randint(1, 500, (2, 19))
    assert torch.equal(spec.generate(ids, do_sample=False, max_new_tokens=20),
                       plain.generate(ids, do_sample=False, max_new_tokens=20))


def test_split_attention_in_the_draft_gives_the_same_drafts(draft_dir, monkeypatch):
    """The default attention ("split"): the draft's full-attention layers read the cache through the split-KV
    op (every block query at the block's last position); the drafts, hence the output, equal SDPA's."""
    import fastqwen.spec.dflash as dflash_module

    ids = torch.randint(1, 500, (1, 23))
    opts = dict(max_batch_size=1, max_seq_len=128, compile=False, speculate="dflash", draft=draft_dir, block_size=6)
    split = fastqwen.optimize(fresh("tiny"), **opts)
    sdpa = fastqwen.optimize(fresh("tiny"), **opts, kernels={"attention": "sdpa"})
    drafts = {}
    for name, model in (("split", split), ("sdpa", sdpa)):
        model.generate(ids, do_sample=False, max_new_tokens=4)
        e = model._fastqwen
        with torch.no_grad():
            drafts[name] = e.spec.proposer.propose(e, 5, False)[0]
    assert torch.equal(drafts["split"], drafts["sdpa"])
    calls, real = [], dflash_module.attend_cache_split_op
    monkeypatch.setattr(dflash_module, "attend_cache_split_op", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        sdpa._fastqwen.spec.proposer.propose(sdpa._fastqwen, 5, False)
        assert not calls
        split._fastqwen.spec.proposer.propose(split._fastqwen, 5, False)
    assert len(calls) == sum(t != "sliding_attention" for t in split._fastqwen.spec.proposer.draft.layer_types)
    assert torch.equal(split.generate(ids, do_sample=False, max_new_tokens=20),
                       sdpa.generate(ids, do_sample=False, max_new_tokens=20))
