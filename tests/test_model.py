"""fastqwen.model's in-place changes to the HF model: fused projection weights."""

import pytest
import torch
from conftest import fresh, hf_generate
from transformers import AutoModelForCausalLM

import fastqwen
from fastqwen.quant.linear import QuantLinear


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
        whole = module.fastqwen_fused.weight
        assert first.weight.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
    assert gdn.fastqwen_fused.weight.shape[0] == sum(gdn.fastqwen_fused_sizes)
    assert "fastqwen_fused" not in dict(model.named_modules(remove_duplicate=False)).get("model.layers.0.linear_attn")._modules
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
    assert type(twice.model.layers[0].mlp.fastqwen_fused) is QuantLinear  # re-fused from the quantized parts
    assert torch.equal(twice.generate(ids, **gen), once.generate(ids, **gen))
    swapped, reference = fresh("tiny"), fresh("tiny")
    fastqwen.optimize(swapped, compile=False, max_seq_len=64)
    for model in (swapped, reference):
        mlp = model.model.layers[0].mlp
        mlp.up_proj.weight = torch.nn.Parameter(torch.ones_like(mlp.up_proj.weight) * 0.01, requires_grad=False)
    fastqwen.optimize(swapped, compile=False, max_seq_len=64)
    fastqwen.optimize(reference, compile=False, max_seq_len=64)
    assert torch.equal(swapped.generate(ids, **gen), reference.generate(ids, **gen))


@pytest.mark.parametrize("name, kernels", [("tiny", None), ("tiny-moe", {"experts": "grouped"})])
def test_a_model_trained_between_generations_keeps_its_parameters_mode_and_grads(name, kernels):
    """Fused projections and a stacked shared expert replaced their Parameters by requires_grad=False views, and
    optimize put the model in eval mode: a model fine-tuned between fast generations (RL rollouts, say) silently
    froze those weights, and an optimizer built before optimize stepped tensors the model no longer read. The
    model keeps its mode and Parameter objects; its grads are a plain model's, and a step reaches generate."""
    model, ref = fresh(name).train(), fresh(name).train()
    params = dict(model.named_parameters())
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    fastqwen.optimize(model, compile=False, max_seq_len=64, kernels=kernels)
    assert model.training
    assert all(p is params[n] and p.requires_grad for n, p in model.named_parameters())
    ids = torch.randint(1, 500, (1, 12))
    for m in (model, ref):
        m(ids, labels=ids).loss.backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and torch.allclose(p.grad, q.grad, atol=1e-6), n
    sgd.step()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False), hf_generate(ref, ids, max_new_tokens=8))


@pytest.mark.parametrize("scheme,compile", [("fp8-weight", False), ("int4", False), ("int4", True)])
def test_quantized_projections_fuse_and_give_the_separate_tokens(scheme, compile):
    """QuantLinears of one scheme fuse too (their stored tensors stacked by rows, each part a view of them); the
    tokens are those of the same quantized model with separate projections. (The tiny GDN blocks fuse qkv+z
    only: their 4-row a/b projections stay unquantized, so they run on their own.)"""
    ids = torch.randint(1, 500, (2, 9))
    gen = dict(do_sample=False, max_new_tokens=8)
    opts = dict(max_seq_len=64, max_batch_size=2, quant=scheme, quant_group_size=32)
    fused = fastqwen.optimize(fresh("tiny-moe"), **opts, compile=compile)
    separate = fastqwen.optimize(fresh("tiny-moe"), **opts, compile=False, kernels={"projections": "separate"})
    layer = fused.model.layers[3]
    shared = layer.mlp.shared_expert
    assert type(shared.fastqwen_fused) is QuantLinear and type(layer.self_attn.fastqwen_fused) is QuantLinear
    assert len(fused.model.layers[0].linear_attn.fastqwen_fused_sizes) == 2
    assert shared.up_proj.qweight.untyped_storage().data_ptr() == shared.fastqwen_fused.qweight.untyped_storage().data_ptr()
    torch.testing.assert_close(shared.fastqwen_fused.dequantized(),
                               torch.cat([shared.gate_proj.dequantized(), shared.up_proj.dequantized()]))
    assert torch.equal(fused.generate(ids, **gen), separate.generate(ids, **gen))


def test_fp8_block_projections_fuse_only_in_whole_blocks():
    """fp8's 128×128 scale blocks: parts fuse when every part but the last is whole blocks of rows; otherwise
    the longest prefix that does fuses (here the first two), and the rest run on their own."""
    from fastqwen.linears import Linears, fuse_linears

    torch.manual_seed(0)
    h = torch.randn(3, 128)
    for sizes, fused_parts in (((256, 128, 40), 3), ((256, 40, 128), 2), ((40, 256, 128), 0)):
        module = torch.nn.Module()
        names = [f"p{i}" for i in range(len(sizes))]
        for name, n in zip(names, sizes):
            setattr(module, name, QuantLinear.from_linear(torch.nn.Linear(128, n, bias=False), "fp8"))
        separate = Linears().project(module, h, names)
        fuse_linears(module, names)
        assert len(module.__dict__.get("fastqwen_fused_sizes", ())) == fused_parts
        for got, want in zip(Linears(fused=True).project(module, h, names), separate):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        for got, want in zip([getattr(module, n)(h) for n in names], separate):  # the parts, now views
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("gdn", ["unrolled", "fla"])
def test_gated_delta_rule_ops_get_inputs_their_kernels_read_in_place(monkeypatch, gdn):
    """A prompt's ops (fla's kernels) get q, k, v, a, b contiguous: the ops' own .contiguous() would be eager
    copies inside the step. A verify block's op gets the conv's packed output qkv [B, T, C] contiguous (q, k
    and v split inside it, read in place by the unrolled kernel), with a and b as views of the fused
    projection: the unrolled kernel reads them at their strides (kernels["conv"] "fused"; under the default
    "fused-verify" a and b come out of the verify prologue's kernel, contiguous)."""
    import fastqwen.model as fm
    from fastqwen.bench import OracleProposer

    seen = []
    for name in ("gdn_recurrent", "gdn_verify"):
        def record(*args, _op=getattr(fm, name), _name=name):
            tensors = [t for t in args[:5] if isinstance(t, torch.Tensor)]
            seen.append((_name, args[0].shape[1], [t.is_contiguous() for t in tensors]))
            return _op(*args)
        monkeypatch.setattr(fm, name, record)
    model = fastqwen.optimize(fresh("tiny"), max_batch_size=1, max_seq_len=96, compile=False,
                              kernels={"gdn": gdn, "conv": "fused"})
    ids = torch.randint(1, 500, (1, 20))
    ref = model.generate(ids, max_new_tokens=6, do_sample=False)
    model._fastqwen.enable_speculation(OracleProposer(ref[:, 20:], 0.0, model.config.vocab_size), 4)
    model.generate(ids, max_new_tokens=6, do_sample=False)
    assert {(name, T) for name, T, _ in seen} >= {("gdn_recurrent", 20), ("gdn_verify", 5)}
    assert all(all(c) for name, _, c in seen if name == "gdn_recurrent")
    assert all(c == [True, False, False] for name, _, c in seen if name == "gdn_verify"), [s for s in seen if s[0] == "gdn_verify"]
