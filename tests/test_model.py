"""fastqwen.model's in-place changes to the HF model: fused projection weights."""

import pytest
import torch
from conftest import fresh
from transformers import AutoModelForCausalLM

import fastqwen


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_fused_projections_leave_the_model_its_forward_and_checkpoint(name, tmp_path):
    """kernels={"projections": "fused"} gives each layer's input projections one weight (their parameters
    become views of it): the model's own forward, and a save_pretrained / from_pretrained round trip, are
    unchanged."""
    model = fresh(name)
    ids = torch.randint(1, 500, (2, 11))
    with torch.no_grad():
        before = model(ids).logits
    fastqwen.optimize(model, compile=False, max_seq_len=64, kernels={"projections": "fused"})
    gdn, attn = model.model.layers[0].linear_attn, model.model.layers[3].self_attn
    mlp = model.model.layers[0].mlp
    mlp = getattr(mlp, "shared_expert", mlp)
    for module, first in ((gdn, gdn.in_proj_qkv), (attn, attn.q_proj), (mlp, mlp.gate_proj)):
        assert first.weight.untyped_storage().data_ptr() == module.fastqwen_fused.untyped_storage().data_ptr()
    assert gdn.fastqwen_fused.shape[0] == sum(gdn.fastqwen_fused_sizes)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    model.save_pretrained(tmp_path)
    with torch.no_grad():  # (a loaded MoE model may pick another experts implementation: rounding differs)
        assert torch.allclose(AutoModelForCausalLM.from_pretrained(tmp_path)(ids).logits, before, atol=1e-5)


def test_fusion_follows_weights_replaced_after_an_earlier_optimize():
    """Re-optimizing after the linears changed (quantized, or a weight swapped) must not use the stale fused
    weight: the tokens are those of a model prepared the same way without the first optimize."""
    ids = torch.randint(1, 500, (1, 9))
    gen = dict(do_sample=False, max_new_tokens=8)
    once = fastqwen.optimize(fresh("tiny"), compile=False, max_seq_len=64, quant="fp8-weight")
    twice = fastqwen.optimize(fresh("tiny"), compile=False, max_seq_len=64)
    fastqwen.optimize(twice, compile=False, max_seq_len=64, quant="fp8-weight")
    assert not hasattr(twice.model.layers[0].mlp, "fastqwen_fused")
    assert torch.equal(twice.generate(ids, **gen), once.generate(ids, **gen))
    swapped, reference = fresh("tiny"), fresh("tiny")
    fastqwen.optimize(swapped, compile=False, max_seq_len=64)
    for model in (swapped, reference):
        mlp = model.model.layers[0].mlp
        mlp.up_proj.weight = torch.nn.Parameter(torch.ones_like(mlp.up_proj.weight) * 0.01, requires_grad=False)
    fastqwen.optimize(swapped, compile=False, max_seq_len=64)
    fastqwen.optimize(reference, compile=False, max_seq_len=64)
    assert torch.equal(swapped.generate(ids, **gen), reference.generate(ids, **gen))
