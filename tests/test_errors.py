"""Bad input gets a clear, early error that names the fix."""

import pytest
import torch
from conftest import fresh, left_padded

import fastqwen


@pytest.fixture(scope="module")
def opt():
    return fastqwen.optimize(fresh("tiny"), max_batch_size=2, max_seq_len=64, compile=False)


def test_unsupported_models_are_refused():
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3_5TextModel

    llama = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
    with pytest.raises(TypeError, match="Qwen3_5ForCausalLM.*got LlamaForCausalLM"):
        fastqwen.optimize(llama)
    with pytest.raises(TypeError, match="got Qwen3_5TextModel"):
        fastqwen.optimize(Qwen3_5TextModel(fresh("tiny").config))
    with pytest.raises(TypeError):
        fastqwen.optimize("Qwen/Qwen3.5-9B")


def test_bad_optimize_options():
    with pytest.raises(ValueError, match="max_batch_size"):
        fastqwen.optimize(fresh("tiny"), max_batch_size=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        fastqwen.optimize(fresh("tiny"), max_seq_len=1)
    with pytest.raises(TypeError):
        fastqwen.optimize(fresh("tiny"), paged_cache=True)
    # compile="max-autotune" compiled with other options than named; a str of options failed inside inductor
    with pytest.raises(ValueError, match="compile must be True or False, got 'max-autotune'.*compile_options"):
        fastqwen.optimize(fresh("tiny"), compile="max-autotune")
    with pytest.raises(ValueError, match="compile_options must be a dict of inductor options"):
        fastqwen.optimize(fresh("tiny"), compile_options="max-autotune")
    with pytest.raises(ValueError, match="quant_lm_head must be True or False, got 'no'"):  # ("no" is truthy)
        fastqwen.optimize(fresh("tiny"), quant="int4", quant_lm_head="no")
    with pytest.raises(ValueError, match="compile_cache must be a file path, got 3"):  # (open(3): a descriptor)
        fastqwen.optimize(fresh("tiny"), compile_cache=3)
    from transformers import Qwen3_5ForCausalLM

    with torch.device("meta"):  # weights never loaded: optimize would pass and generate fail on "no data"
        empty = Qwen3_5ForCausalLM._from_config(fresh("tiny").config, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"on the meta device.*load its weights.*before fastqwen.optimize"):
        fastqwen.optimize(empty, compile=False)


def test_compile_options_without_compile_warn_that_they_are_ignored():
    with pytest.warns(UserWarning, match="with compile=False they are ignored"):
        fastqwen.optimize(fresh("tiny"), compile=False, max_seq_len=64, compile_options={"max_autotune": False})


def test_bad_optimize_options_prefill_chunk():
    with pytest.raises(ValueError, match="prefill_chunk_tokens must be a positive int"):
        fastqwen.optimize(fresh("tiny"), compile=False, prefill_chunk_tokens=0)


def test_a_cache_larger_than_the_free_gpu_memory_is_refused_before_allocating(monkeypatch):
    """layout() is what HybridCache allocates, byte for byte; on CUDA a cache that does not fit in the free
    memory is a ValueError naming the fix, raised before any allocation (so it runs on a CPU machine too)."""
    from fastqwen import cache

    cfg = fresh("tiny").config
    for block in (0, 5):
        built = cache.HybridCache(cfg, 3, 40, torch.bfloat16, "cpu", block=block)
        bufs = cache.layout(cfg, 3, 40, torch.bfloat16, block)
        assert {n: (tuple(b.shape), b.dtype) for n, b in built.named_buffers()} == bufs
        assert cache.layout_bytes(bufs) == sum(b.nbytes for b in built.buffers())
    monkeypatch.setattr(cache, "_free_bytes", lambda device: 2**30)
    need = cache.layout_bytes(cache.layout(cfg, 8, 2**20, torch.bfloat16))
    with pytest.raises(ValueError, match=rf"max_batch_size=8 x max_seq_len=1048576 needs {need / 2**30:.1f} GiB, "
                                         r"but cuda has 1.0 GiB free: lower max_seq_len or max_batch_size"):
        cache.HybridCache(cfg, 8, 2**20, torch.bfloat16, "cuda")


def test_a_cache_larger_than_the_machine_memory_is_refused_before_allocating():
    """On the CPU the bound is the machine's memory (max_seq_len=2**40 was the allocator's raw error)."""
    with pytest.raises(ValueError, match=r"max_batch_size=1 x max_seq_len=1099511627776 needs [0-9.]+ GiB, but this "
                                         r"machine has [0-9.]+ GiB of memory: lower max_seq_len or max_batch_size"):
        fastqwen.optimize(fresh("tiny"), max_seq_len=2**40, compile=False)


def test_parameters_in_another_dtype_than_the_model_are_refused():
    """An lm_head (or any linear) left in bf16 on an fp32 model passed optimize and failed in generate's first
    matmul; a quantized lm_head holds its weight in buffers of its own format, and runs in any model dtype, as do
    norms, A_log and the conv."""
    model = fresh("tiny")
    model.lm_head.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"one dtype, the embeddings' torch.float32, but lm_head.weight is "
                                         r"torch.bfloat16: cast them before fastqwen.optimize, e.g. "
                                         r"model.get_submodule\('lm_head'\).to\(torch.float32\)"):
        fastqwen.optimize(model, compile=False, max_seq_len=64)
    model.model.layers[0].mlp.to(torch.float16)
    with pytest.raises(ValueError, match=r"but model.layers.0.mlp.gate_proj.weight is torch.float16 \(and 3 more "
                                         r"weights\).*get_submodule\('model.layers.0.mlp.gate_proj'\)"):
        fastqwen.optimize(model, compile=False, max_seq_len=64)
    model.to(torch.float32)
    gdn = next(layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn"))
    gdn.conv1d.to(torch.bfloat16), gdn.norm.to(torch.bfloat16)
    gdn.A_log.data = gdn.A_log.data.double()
    from fastqwen.quant import quantize

    quantize(model, "fp8-weight", lm_head=True)
    opt = fastqwen.optimize(model, compile=False, max_seq_len=64)
    assert opt.generate(torch.randint(1, 500, (1, 5)), max_new_tokens=3).shape == (1, 8)


def test_fp8_codes_as_transformers_loads_them_are_refused_with_from_pretrained_as_the_fix():
    """transformers loads an FP8 checkpoint as FP8Linear layers: float8 codes beside their scales. The dtype check
    said to cast the layer to the model dtype, after which FP8Linear multiplies by the unscaled codes (a silently
    wrong model); the fix to name is fastqwen.from_pretrained, which keeps them quantized."""
    model = fresh("tiny").to(torch.bfloat16)
    gate = model.model.layers[0].mlp.gate_proj
    gate.weight.data = gate.weight.data.to(torch.float8_e4m3fn)  # (FP8Linear's weight; its scale is another tensor)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj.weight is torch.float8_e4m3fn, a quantized "
                                         r"checkpoint's codes.*drop their scales.*fastqwen.from_pretrained\(path\)"):
        fastqwen.optimize(model, compile=False, max_seq_len=64)


def test_a_rope_whose_frequencies_follow_the_length_is_refused_past_that_length():
    """rope_type 'dynamic' (and 'longrope') changes transformers' frequencies once a sequence passes the original
    length; our cache's keys are roped once, at fixed ones, so the tokens silently diverged. Within that length
    both keep the original frequencies, and the tokens are transformers'."""
    from conftest import hf_generate

    from fastqwen import presets

    rope = {**presets._ROPE, "rope_theta": 100.0, "rope_type": "dynamic", "factor": 4.0}
    ids = torch.randint(1, 500, (1, 8))
    with pytest.raises(ValueError, match=r"rope_type='dynamic' changes its frequencies once a sequence passes 16 "
                                         r"positions.*pass max_seq_len <= 16"):
        fastqwen.optimize(fresh("tiny", max_position_embeddings=16, rope_parameters=rope), compile=False)
    model = fastqwen.optimize(fresh("tiny", max_position_embeddings=16, rope_parameters=rope), compile=False,
                              max_seq_len=16)
    expected = hf_generate(fresh("tiny", max_position_embeddings=16, rope_parameters=rope), ids, max_new_tokens=8)
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False), expected)
    # a model that transformers already ran past that length holds rescaled frequencies in inv_freq: ours are the
    # original ones still
    used = fresh("tiny", max_position_embeddings=64, rope_parameters=rope)
    with torch.no_grad():
        used(torch.randint(1, 500, (1, 160)))
    assert not torch.equal(used.model.rotary_emb.inv_freq, used.model.rotary_emb.original_inv_freq)
    model = fastqwen.optimize(used, compile=False, max_seq_len=64)
    expected = hf_generate(fresh("tiny", max_position_embeddings=64, rope_parameters=rope), ids, max_new_tokens=48)
    assert torch.equal(model.generate(ids, max_new_tokens=48, do_sample=False), expected)


def test_a_gdn_conv_activation_other_than_silu_is_refused():
    """transformers applies hidden_act to the Gated DeltaNet conv's output (and the MLPs'); our conv ops apply SiLU,
    so with another hidden_act every token silently diverged. A model without GDN layers runs its MLPs' own act_fn:
    its tokens are transformers'."""
    from conftest import hf_generate

    with pytest.raises(ValueError, match=r"hidden_act='gelu'.*Gated DeltaNet.*SiLU"):
        fastqwen.optimize(fresh("tiny", hidden_act="gelu"), compile=False, max_seq_len=64)
    full = dict(hidden_act="gelu", layer_types=["full_attention"] * 4)
    model = fastqwen.optimize(fresh("tiny", **full), compile=False, max_seq_len=64)
    ids = torch.randint(1, 500, (1, 8))
    expected = hf_generate(fresh("tiny", **full), ids, max_new_tokens=8)
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False), expected)

def test_prompt_longer_than_cache(opt):
    with pytest.raises(ValueError, match="exceeds max_seq_len=64.*larger max_seq_len"):
        opt.generate(torch.randint(1, 500, (1, 70)), max_new_tokens=4)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        opt.generate(torch.randint(1, 500, (1, 40)), max_new_tokens=30)


def test_deep_copying_an_optimized_model_is_refused_with_the_order_that_works(opt):
    """A deep copy's generate would still run the original's steps, cache and state (its output wrong, the
    original's state overwritten): refused, naming the fix (copy first, then optimize the copy)."""
    import copy

    with pytest.raises(TypeError, match=r"copy.deepcopy the model before fastqwen.optimize"):
        copy.deepcopy(opt)

def test_a_model_cast_after_optimize_is_told_to_optimize_again():
    """Casting (or moving) the model after optimize leaves the cache and the fused weights in the old dtype: generate
    says so, where the first matmul failed with "expected m1 and m2 to have the same dtype"; optimizing again works."""
    model = fastqwen.optimize(fresh("tiny"), compile=False, max_seq_len=32).to(torch.bfloat16)
    ids = torch.randint(1, 500, (1, 5))
    with pytest.raises(ValueError, match=r"now torch.bfloat16 on cpu.*torch.float32 on cpu.*fastqwen.optimize.*again"):
        model.generate(ids, max_new_tokens=4)
    fastqwen.optimize(model, compile=False, max_seq_len=32)
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 9)

def test_projection_weights_replaced_after_optimize_are_told_to_optimize_again():
    """load_state_dict(assign=True) after optimize replaces the weights that the fused input projections are views
    of, which then hold the old ones: generate said nothing and decoded with them. It says so now, and optimizing
    again decodes with the new weights, as transformers does."""
    from conftest import hf_generate

    other = fresh("tiny")
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ids = torch.randint(1, 500, (1, 9))
    model = fastqwen.optimize(fresh("tiny"), compile=False, max_seq_len=32)
    model.load_state_dict(other.state_dict(), assign=True)
    with pytest.raises(ValueError, match=r"layers.0.linear_attn's .*replaced.*fastqwen.optimize\(model, ...\) again"):
        model.generate(ids, max_new_tokens=8)
    fastqwen.optimize(model, compile=False, max_seq_len=32)
    got = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, hf_generate(other, ids, max_new_tokens=8))


def test_experts_replaced_after_optimize_with_a_stacked_shared_expert_are_told_to_optimize_again():
    """With grouped experts the shared expert is stacked onto the routed ones (their parameters views of one
    stack): routed experts replaced after optimize left the stack with the old ones, unchecked."""
    model = fastqwen.optimize(fresh("tiny-moe"), compile=False, max_seq_len=32, kernels={"experts": "grouped"})
    experts = model.model.layers[0].mlp.experts
    experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.detach() * 2)
    with pytest.raises(ValueError, match=r"layers.0.mlp's weights were replaced.*optimize\(model, ...\) again"):
        model.generate(torch.randint(1, 500, (1, 5)), max_new_tokens=4)


def test_empty_prompts(opt):
    with pytest.raises(ValueError, match="empty prompt"):
        opt.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=4)
    ids, mask = left_padded([torch.tensor([5, 6, 7]), torch.tensor([5])])
    mask[1] = 0
    with pytest.raises(ValueError, match=r"empty prompt in rows \[1\]"):
        opt.generate(ids, attention_mask=mask, max_new_tokens=4)


def test_batch_larger_than_max_batch_size(opt):
    with pytest.raises(ValueError, match="3 rows exceeds max_batch_size=2"):
        opt.generate(torch.randint(1, 500, (3, 5)), max_new_tokens=4)


def test_right_padding_is_refused(opt):
    ids = torch.randint(1, 500, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    with pytest.raises(ValueError, match="padding_side='left'"):
        opt.generate(ids, attention_mask=mask, max_new_tokens=4)


@pytest.mark.parametrize("kw", [dict(num_beams=2), dict(typical_p=0.9), dict(output_scores=True),
                                dict(no_repeat_ngram_size=3), dict(assistant_ensemble_weight=0.5, use_mtp=True)])
def test_unsupported_generation_options(opt, kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        opt.generate(torch.randint(1, 500, (1, 5)), max_new_tokens=4, **kw)


def test_unsupported_arguments(opt):
    ids = torch.randint(1, 500, (1, 5))
    with pytest.raises(ValueError, match="does not support `logits_processor`"):
        opt.generate(ids, max_new_tokens=4, logits_processor=[lambda i, s: s])
    with pytest.raises(ValueError, match="unsupported arguments.*foo"):
        opt.generate(ids, max_new_tokens=4, foo=1)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        opt.generate(ids, max_new_tokens=4, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="too small to sample with.*do_sample=False"):
        opt.generate(ids, max_new_tokens=4, do_sample=True, temperature=1e-38)
    with pytest.raises(ValueError, match=r"num_beams=2 .*type\(model\).generate\(model, ...\)"):
        opt.generate(ids, max_new_tokens=4, num_beams=2)
    with pytest.raises(ValueError, match="both `inputs` and `input_ids`"):
        opt.generate(ids, input_ids=ids, max_new_tokens=4)
    with pytest.raises(ValueError, match="pad_token_id=-1 is no token id"):
        opt.generate(ids, max_new_tokens=4, pad_token_id=-1)


@pytest.mark.parametrize("kw, match", [(dict(top_k=-1), "top_k must be an int >= 0"),
                                       (dict(top_k=2.5), "top_k must be an int >= 0"),
                                       (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
                                       (dict(min_p=-0.1), r"min_p must be in \[0, 1\]")])
def test_bad_sampling_parameters(opt, kw, match):
    """transformers' warpers refuse these; silently treating them as "off" would sample from another distribution."""
    with pytest.raises(ValueError, match=match):
        opt.generate(torch.randint(1, 500, (1, 5)), max_new_tokens=4, do_sample=True, **kw)


def test_malformed_input_ids(opt):
    with pytest.raises(ValueError, match="2-D integer tensor"):
        opt.generate(torch.randint(1, 500, (5,)), max_new_tokens=4)
    with pytest.raises(ValueError, match=r"int64 \(or int32\).*got torch.int16"):  # (an integer tensor, too narrow)
        opt.generate(torch.randint(1, 500, (1, 5), dtype=torch.int16), max_new_tokens=4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        opt.generate(torch.tensor([[1, 2, 10_000]]), max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        opt.generate(torch.randint(1, 500, (1, 5)), max_new_tokens=0)
    with pytest.raises(ValueError, match="nothing to generate.*max_length=5"):
        opt.generate(torch.randint(1, 500, (1, 5)), max_length=5)
