"""optimize(kernels=...): the ops whose alternatives are still being measured. Each alternative gives the
default's tokens (off CUDA both run their torch references, so this checks the wiring and the grouped experts'
arithmetic; tests/gpu checks the kernels), and bad choices fail before any work."""

import pytest
import torch
from conftest import fresh, left_padded

import fastqwen
from fastqwen.model import routed_moe


def test_grouped_experts_match_the_gathered_ones():
    model = fresh("tiny-moe")
    mlp = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    h = torch.randn(3, 2, model.config.hidden_size)
    with torch.no_grad():
        hf = mlp(h)
        hf = hf[0] if isinstance(hf, tuple) else hf
        torch.testing.assert_close(routed_moe(mlp, h), hf, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(routed_moe(mlp, h, grouped=True), routed_moe(mlp, h), rtol=1e-5, atol=1e-5)


ALL = {"attention": "split", "experts": "grouped", "projections": "separate"}


@pytest.mark.parametrize("name,kernels,compile", [("tiny", {"attention": "split"}, False),
                                                  ("tiny", {"projections": "separate"}, True),
                                                  ("tiny-moe", ALL, False),
                                                  ("tiny-moe", ALL, True)])
def test_alternative_kernels_give_the_default_tokens(name, kernels, compile):
    default = fastqwen.optimize(fresh(name), max_batch_size=2, max_seq_len=96, compile=False)
    other = fastqwen.optimize(fresh(name), max_batch_size=2, max_seq_len=96, compile=compile, kernels=kernels)
    assert other._fastqwen.forward.kernels == {"attention": "sdpa", "experts": "gather", "projections": "fused",
                                               **kernels}
    ids, mask = left_padded([torch.randint(1, 500, (n,)) for n in (17, 5)])
    assert torch.equal(other.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16),
                       default.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16))


def test_bad_kernel_choices():
    with pytest.raises(ValueError, match=r"unknown kernels \['gdn'\]"):
        fastqwen.optimize(fresh("tiny"), compile=False, kernels={"gdn": "fla"})
    with pytest.raises(ValueError, match=r"kernels\['attention'\]='flash'; choose from sdpa, split"):
        fastqwen.optimize(fresh("tiny"), compile=False, kernels={"attention": "flash"})
    with pytest.raises(ValueError, match="applies to MoE models only"):
        fastqwen.optimize(fresh("tiny"), compile=False, kernels={"experts": "grouped"})
