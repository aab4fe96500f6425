"""optimize(kernels=...): the ops whose alternatives are still being measured. Each alternative gives the
default's tokens (off CUDA both run their torch references, so this checks the wiring and the grouped experts'
arithmetic; tests/gpu checks the kernels), and bad choices fail before any work."""

import pytest
import torch
from conftest import fresh, left_padded

import fastqwen
from transformers import AutoModelForCausalLM
from fastqwen.moe import routed_moe


def test_grouped_experts_match_the_gathered_ones():
    model = fresh("tiny-moe")
    mlp = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    h = torch.randn(3, 2, model.config.hidden_size)
    with torch.no_grad():
        hf = mlp(h)
        hf = hf[0] if isinstance(hf, tuple) else hf
        torch.testing.assert_close(routed_moe(mlp, h), hf, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(routed_moe(mlp, h, grouped=True), routed_moe(mlp, h), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(routed_moe(mlp, h, grouped=True, expert_act="fused"), routed_moe(mlp, h),
                                   rtol=1e-5, atol=1e-5)
        for route in ("packed", "fused"):  # (fused: one token's router matmul and routing; more route as packed)
            for t in (h, h[:1, :1]):
                torch.testing.assert_close(routed_moe(mlp, t, grouped=True, route_kernel=route), routed_moe(mlp, t),
                                           rtol=1e-5, atol=1e-5)


ALL = {"attention": "sdpa", "experts": "grouped", "projections": "separate", "linears": "gemv", "gdn": "fla",
       "launch": "pdl", "splitk": "fixup", "gdn_norm": "fused", "expert_act": "fused",
       "route": "packed", "conv": "separate", "int4": "cuda", "fp8_weight": "cuda",
       "reductions": "inductor", "attn_glue": "separate"}  # (mlp_act "fused" needs fused projections: its own
# cases; the "cuda" kernels run their references off the GPU: tests/test_cuda_kernels.py, tests/gpu/test_cuda_kernels_gpu.py)


@pytest.mark.parametrize("name,kernels,compile", [("tiny", {"attention": "sdpa"}, False),
                                                  ("tiny", {"attention": "sdpa"}, True),
                                                  ("tiny", {"projections": "separate"}, True),
                                                  ("tiny", {"linears": "gemv"}, True),
                                                  ("tiny", {"linears": "torch"}, False),
                                                  ("tiny", {"gdn_norm": "fused"}, True),
                                                  ("tiny", {"conv": "separate"}, True),
                                                  ("tiny", {"conv": "fused"}, True),
                                                  ("tiny", {"attn_glue": "separate"}, True),
                                                  ("tiny", {"gdn_norm": "separate"}, True),
                                                  ("tiny", {"gdn_norm": "kernel", "linears": "gemv"}, True),
                                                  ("tiny", {"attn_glue": "fused", "linears": "gemv"}, True),
                                                  ("tiny", {"conv": "fused", "linears": "gemv", "gdn": "fla"}, True),
                                                  ("tiny", {"linears": "gemv", "mlp_act": "fused"}, True),
                                                  ("tiny-moe", {"linears": "gemv", "mlp_act": "fused"}, False),
                                                  ("tiny-moe", ALL, False),
                                                  ("tiny-moe", {"experts": "grouped-pdl", "launch": "pdl"}, True),
                                                  ("tiny-moe", {"experts": "grouped", "expert_act": "fused"}, True),
                                                  ("tiny-moe", {"experts": "grouped", "route": "fused"}, True),
                                                  ("tiny-moe", ALL, True)])
def test_alternative_kernels_give_the_default_tokens(name, kernels, compile):
    default = fastqwen.optimize(fresh(name), max_batch_size=2, max_seq_len=96, compile=False)
    other = fastqwen.optimize(fresh(name), max_batch_size=2, max_seq_len=96, compile=compile, kernels=kernels)
    grouped = kernels.get("experts", "").startswith("grouped")
    grouped_auto = {"expert_act": "fused", "route": "fused"} if grouped else {}  # ("auto" follows the experts)
    assert other._fastqwen.forward.kernels == {"attention": "split", "experts": "gather", "projections": "fused",
                                               "linears": "auto", "gdn": "block", "launch": "serial", "splitk": "sum",
                                               "gdn_norm": "kernel",
                                               "expert_act": "separate", "route": "argmax", "mlp_act": "separate",
                                               "conv": "fused-verify", "int4": "triton", "fp8_weight": "triton",
                                               "reductions": "persistent", "attn_glue": "fused", **grouped_auto,
                                               **kernels}
    ids, mask = left_padded([torch.randint(1, 500, (n,)) for n in (17, 5)])
    assert torch.equal(other.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16),
                       default.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16))


def test_attention_choice_applies_to_decode_and_verify_at_every_cache_length(monkeypatch):
    """"split" (the default) reads the cache through the split-KV op in decode steps (one query a row) and in
    verify blocks (k + 1 queries), short cache or long; "sdpa" never does. Every way gives the same tokens.
    (With inductor's attention glue, "attn_glue" "separate": the fused glue's split-KV op is the next test's.)"""
    import fastqwen.model as model_module
    from fastqwen.bench import OracleProposer

    calls, real = [], model_module.attend_cache_split_op
    monkeypatch.setattr(model_module, "attend_cache_split_op", lambda q, *a: calls.append(q.shape[2]) or real(q, *a))
    ids, mask = left_padded([torch.randint(1, 500, (n,)) for n in (17, 5)])
    out = {}
    for S, attention in ((64, "split"), (20000, "split"), (64, "sdpa")):
        kernels = {"attn_glue": "separate"} | ({} if attention == "split" else {"attention": attention})
        m = fastqwen.optimize(fresh("tiny"), max_batch_size=2, max_seq_len=S, compile=False, kernels=kernels)
        assert m._fastqwen.forward.split_attention == (attention == "split")
        calls.clear()
        out[S, attention] = m.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8)
        assert set(calls) == ({1} if attention == "split" else set())  # decode steps: one query a row
        m._fastqwen.enable_speculation(OracleProposer(out[S, attention][:, ids.shape[1]:], 0.0, m.config.vocab_size), 3)
        calls.clear()
        assert torch.equal(m.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8), out[S, attention])
        assert set(calls) == ({4} if attention == "split" else set())  # verify blocks of k + 1 = 4 queries
    assert torch.equal(out[20000, "split"], out[64, "split"]) and torch.equal(out[64, "sdpa"], out[64, "split"])


def test_fused_attention_glue_serves_decode_and_verify(monkeypatch):
    """kernels["attn_glue"]="fused" (the default): decode steps (one query a row) and verify blocks (k + 1
    queries) both go through the prep op and the gated merge (their CPU paths: prepare and merge_gated over the
    split-KV op's one split), prefill through neither, the gate a [B, T, n] output or, with linears "gemv", the
    projections' split-K partials; tokens, plain and speculative, are inductor's glue's ("separate")."""
    import fastqwen.model as model_module
    from fastqwen.bench import OracleProposer

    calls, real = [], model_module.merge_gated_op
    monkeypatch.setattr(model_module, "merge_gated_op", lambda o, lse, q, g, *a: calls.append((q.shape[2], g.dim()))
                        or real(o, lse, q, g, *a))
    ids, mask = left_padded([torch.randint(1, 500, (n,)) for n in (17, 5)])
    separate = fastqwen.optimize(fresh("tiny"), max_batch_size=2, max_seq_len=64, compile=False,
                                 kernels={"attn_glue": "separate"})
    want = separate.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8)
    assert not calls
    for kernels, gate_dims in (({}, 3), ({"linears": "gemv"}, 4)):  # (gate as [S, B, T, n] partials: 4 dims)
        m = fastqwen.optimize(fresh("tiny"), max_batch_size=2, max_seq_len=64, compile=False, kernels=kernels)
        calls.clear()
        assert torch.equal(m.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8), want)
        assert set(calls) == {(1, gate_dims)}, kernels  # decode: one query a row
        m._fastqwen.enable_speculation(OracleProposer(want[:, ids.shape[1]:], 0.0, m.config.vocab_size), 3)
        calls.clear()
        assert torch.equal(m.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8), want)
        assert set(calls) == {(4, gate_dims)}, kernels  # verify blocks of k + 1 = 4 queries


def test_expert_act_auto_takes_the_separate_activation_for_fp8_weight_experts():
    """kernels["expert_act"] "auto" resolves to "separate" (the activation a kernel of its own) where the
    grouped experts are fp8-weight (the fastest 35B-A3B fp8 step on the H200 in four processes against two
    with "fused"), to "fused" otherwise; an engine tells check_kernels from its QuantExperts' scheme."""
    from fastqwen.model import check_kernels

    cfg = fresh("tiny-moe").config
    assert check_kernels({"experts": "grouped"}, cfg, "cpu", fp8_experts=True)["expert_act"] == "separate"
    assert check_kernels({"experts": "grouped"}, cfg, "cpu")["expert_act"] == "fused"
    assert check_kernels({"experts": "gather"}, cfg, "cpu", fp8_experts=True)["expert_act"] == "separate"
    for quant, act in (("fp8-weight", "separate"), ("int4", "fused"), (None, "fused")):
        m = fastqwen.optimize(fresh("tiny-moe"), max_seq_len=64, compile=False, quant=quant,
                              kernels={"experts": "grouped"})
        assert m._fastqwen.forward.kernels["expert_act"] == act, quant


def test_experts_auto_launches_fp8_weight_experts_with_pdl_on_cuda():
    """kernels["experts"] "auto" resolves on CUDA to "grouped-pdl" where the experts are fp8-weight (the faster
    35B-A3B fp8 step on the H200) and to "grouped" otherwise (bf16 measured slower with PDL); off CUDA to
    "gather". An explicit choice stays. ("launch" given: "auto" would ask the GPU its compute capability; sizes
    of 128: the grouped kernel's shapes.)"""
    import copy

    from fastqwen.model import check_kernels

    cfg = copy.copy(fresh("tiny-moe").config)
    cfg.hidden_size = cfg.moe_intermediate_size = 128
    experts = lambda device, fp8, **kw: check_kernels({"launch": "serial", **kw}, cfg, device, fp8_experts=fp8)["experts"]
    assert experts("cuda", True) == "grouped-pdl" and experts("cuda", False) == "grouped"
    assert experts("cpu", True) == "gather" == experts("cpu", False)
    assert experts("cuda", True, experts="grouped") == "grouped"


def test_launch_auto_is_pdl_from_hopper_on_and_pdl_before_it_is_refused(monkeypatch):
    """kernels={"launch": "auto"} (the default) resolves to "pdl" on compute capability ≥ 9.0, whatever the
    linears' scheme (int4's too since its one-row kernel triggers the next launch after its last store), and to
    "serial" below or off CUDA; asking for "pdl" on an older GPU names the fix."""
    from fastqwen.model import _launch_mode

    assert _launch_mode("auto", torch.device("cpu")) == "serial" and _launch_mode("pdl", torch.device("cpu")) == "pdl"
    for capability, auto in (((9, 0), "pdl"), ((10, 0), "pdl"), ((8, 9), "serial")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert _launch_mode("auto", torch.device("cuda")) == auto
        assert _launch_mode("serial", torch.device("cuda")) == "serial"
    with pytest.raises(ValueError, match=r"compute capability 9.0 or later \(Hopper\); this one is 8.9: use "
                                         r"'serial' or 'auto'"):
        _launch_mode("pdl", torch.device("cuda"))


def test_programmatic_dependent_launch_reaches_inductor_and_the_weight_streaming_linears(monkeypatch):
    """kernels={"launch": "pdl"}: the compiled steps get inductor's triton.enable_pdl and give serial launch's
    tokens; eagerly, every weight-streaming call (QuantLinear's and the bf16 linears') gets pdl=True, and
    fixup=True under kernels={"splitk": "fixup"}. Off CUDA the ops run their references, so this checks the
    plumbing and the ops' schemas; tests/test_gemv.py checks the kernels' wait, prefetches and fixup on sm90."""
    import fastqwen.linears as linears_module
    import fastqwen.quant.linear as quant_linear_module

    ids, mask = left_padded([torch.randint(1, 500, (n,)) for n in (17, 5)])
    out = {}
    for launch in ("serial", "pdl"):
        m = fastqwen.optimize(fresh("tiny"), max_batch_size=2, max_seq_len=96, compile=True, quant="fp8-weight",
                              kernels={"launch": launch})
        assert (m._fastqwen.compile_options or {}).get("triton.enable_pdl", False) is (launch == "pdl")
        out[launch] = m.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8)
    assert torch.equal(out["pdl"], out["serial"])

    flags = []  # (pdl, fixup) of each weight-streaming call
    real_linear, real_forward = linears_module.wq_linear, quant_linear_module.QuantLinear.forward
    monkeypatch.setattr(linears_module, "wq_linear", lambda *a: flags.append(a[7:9]) or real_linear(*a))
    monkeypatch.setattr(quant_linear_module.QuantLinear, "forward", lambda self, x, pdl=False, fixup=False,
                        cuda=(): flags.append((pdl, fixup)) or real_forward(self, x, pdl, fixup, cuda))
    for quant in (None, "fp8-weight"):  # the bf16 linears through the kernel; the quantized ones
        for splitk in ("sum", "fixup"):  # (and the split-K choice with them)
            m = fastqwen.optimize(fresh("tiny"), max_batch_size=2, max_seq_len=96, compile=False, quant=quant,
                                  kernels={"launch": "pdl", "linears": "gemv", "splitk": splitk})
            n = len(flags)
            m.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4)
            assert len(flags) > n and set(flags[n:]) == {(True, splitk == "fixup")}, (quant, splitk, flags[n:])


def test_auto_experts_take_the_grouped_kernel_on_cuda_where_the_shapes_fit():
    """kernels["experts"] "auto" (the default) resolves to "grouped" for a MoE model on CUDA whose hidden and
    expert intermediate sizes are multiples of 128 (the real 35B-A3B), to "gather" off CUDA and where they are
    not; "expert_act" and "route" "auto" follow it (the fused SiLU, and the router matmul with the routing in one
    launch, with grouped experts);
    "grouped" asked for where it cannot run is an error naming the sizes."""
    from fastqwen import presets
    from fastqwen.model import check_kernels

    moe, dense, tiny_moe = presets.config("qwen3.5-35b-a3b"), presets.config("qwen3.5-9b"), presets.config("tiny-moe")
    serial = {"launch": "serial"}  # ("auto" would ask the GPU for its compute capability)
    grouped_ops = ("experts", "expert_act", "route")
    pick = lambda kernels, cfg, device: tuple(check_kernels(kernels, cfg, device)[op] for op in grouped_ops)
    assert pick(serial, moe, "cuda") == ("grouped", "fused", "fused")
    assert pick({**serial, "experts": "grouped-pdl"}, moe, "cuda") == ("grouped-pdl", "fused", "fused")
    assert pick(serial, moe, "cpu") == ("gather", "separate", "argmax")
    assert pick(serial, dense, "cuda") == ("gather", "separate", "argmax")
    assert tiny_moe.hidden_size % 128 and pick(serial, tiny_moe, "cuda") == ("gather", "separate", "argmax")
    gelu = type(moe)(**{**moe.to_dict(), "hidden_act": "gelu"})
    assert pick(serial, gelu, "cuda") == ("grouped", "separate", "fused")  # (the fused kernel computes SiLU)
    with pytest.raises(ValueError, match="divisible by 128"):
        check_kernels({**serial, "experts": "grouped"}, tiny_moe, "cuda")


def test_bad_kernel_choices():
    with pytest.raises(ValueError, match=r"kernels must be a dict of op name to kernel, e.g. "
                                         r"\{'attention': 'sdpa'\}; got 'sdpa'"):
        fastqwen.optimize(fresh("tiny"), compile=False, kernels="sdpa")
    with pytest.raises(ValueError, match=r"unknown kernels \['mlp'\]"):
        fastqwen.optimize(fresh("tiny"), compile=False, kernels={"mlp": "fused"})
    with pytest.raises(ValueError, match=r"kernels\['gdn'\]='chunk'; choose from block, unrolled, fla"):
        fastqwen.optimize(fresh("tiny"), compile=False, kernels={"gdn": "chunk"})
    with pytest.raises(ValueError, match=r"kernels\['attention'\]='flash'; choose from split, sdpa"):
        fastqwen.optimize(fresh("tiny"), compile=False, kernels={"attention": "flash"})
    with pytest.raises(ValueError, match="applies to MoE models only"):
        fastqwen.optimize(fresh("tiny"), compile=False, kernels={"experts": "grouped"})
    for op, choice in (("expert_act", "fused"), ("route", "packed"), ("route", "fused")):
        with pytest.raises(ValueError, match=r"set kernels\['experts'\] to 'grouped' or 'grouped-pdl' \(it is 'gather'\)"):
            fastqwen.optimize(fresh("tiny-moe"), compile=False, kernels={op: choice})
    model = fresh("tiny-moe", layer_types=["full_attention"] * 4)  # (with GDN layers gelu is refused first)
    model.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act is 'gelu'"):
        fastqwen.optimize(model, compile=False, kernels={"experts": "grouped", "expert_act": "fused"})
    with pytest.raises(ValueError, match=r"kernels\['mlp_act'\]='fused' computes SiLU; this model's hidden_act is 'gelu'"):
        fastqwen.optimize(model, compile=False, kernels={"mlp_act": "fused"})
    for other in ({"projections": "separate"}, {"linears": "torch"}):
        with pytest.raises(ValueError, match=r"needs kernels\['projections'\]='fused' and kernels\['linears'\]"):
            fastqwen.optimize(fresh("tiny"), compile=False, kernels={"mlp_act": "fused", **other})


def test_gemv_linears_take_the_decode_linears(monkeypatch):
    """kernels={"linears": "gemv"}: decode runs the bf16 linears (fused projections, out/o/down projections,
    the MoE router, the shared expert, lm_head) through wq_linear, prefill only its lm_head (on the last
    position), and the tokens are the default's."""
    import fastqwen.linears as linears_module

    calls = []
    real = linears_module.wq_linear
    monkeypatch.setattr(linears_module, "wq_linear", lambda x, *a: calls.append((x.shape[0], a[5])) or real(x, *a))
    ids = torch.randint(1, 500, (1, 21))
    gen = dict(do_sample=False, max_new_tokens=6)
    default = fastqwen.optimize(fresh("tiny-moe"), max_seq_len=64, compile=False)
    other = fastqwen.optimize(fresh("tiny-moe"), max_seq_len=64, compile=False, kernels={"linears": "gemv"})
    assert torch.equal(other.generate(ids, **gen), default.generate(ids, **gen))
    layers = other.config.num_hidden_layers
    # 5 a layer (fused input projections, out/o projection, the router, shared expert gate+up and down) in each
    # of the 5 decode steps, and lm_head's one row in those and in prefill (whose 21-row linears stay cuBLAS's)
    vocab = other.config.vocab_size
    heads = [c for c in calls if c[1] == vocab]
    assert len(heads) == 6 and len(calls) == 5 * layers * 5 + 6 and {rows for rows, _ in calls} == {1}


def test_decode_hands_the_gdn_op_a_and_b_as_split_k_partials(monkeypatch):
    """Where the fused input projection streams (gemv linears), a decode step gives gdn_decode a and b as its
    split-K partials [S, B, 1, HV] fp32 (the op sums them: no launch to materialise them), for the unrolled
    kernel ("block", the default, and "unrolled"); fla's decode and cuBLAS projections get the outputs [B, 1, HV]
    in the activations' dtype. The tokens are the default's."""
    import fastqwen.model as model_module

    shapes = []
    real = model_module.gdn_decode
    monkeypatch.setattr(model_module, "gdn_decode", lambda qkv, hk, dk, a, b, *r, **kw: shapes.append(
        (tuple(a.shape), tuple(b.shape), a.dtype)) or real(qkv, hk, dk, a, b, *r, **kw))
    ids = torch.randint(1, 500, (1, 21))
    gen = dict(do_sample=False, max_new_tokens=4)
    default = fastqwen.optimize(fresh("tiny"), max_seq_len=64, compile=False).generate(ids, **gen)
    HV = fresh("tiny").config.linear_num_value_heads
    for kernels, want in (({"linears": "gemv"}, ((1, 1, 1, HV), (1, 1, 1, HV), torch.float32)),
                          ({"linears": "gemv", "gdn": "unrolled"}, ((1, 1, 1, HV), (1, 1, 1, HV), torch.float32)),
                          ({"linears": "gemv", "gdn": "fla"}, ((1, 1, HV), (1, 1, HV), torch.float32)),
                          ({}, ((1, 1, HV), (1, 1, HV), torch.float32))):
        shapes.clear()
        model = fastqwen.optimize(fresh("tiny"), max_seq_len=64, compile=False, kernels=kernels)
        assert torch.equal(model.generate(ids, **gen), default), kernels
        assert shapes and set(shapes) == {want}, (kernels, set(shapes))


def test_fused_mlp_activation_takes_each_one_row_mlp(monkeypatch):
    """kernels={"mlp_act": "fused"} (with gemv linears): each decode step of a one-row engine runs every
    layer's MLP as the fused gate | up projection, then swiglu_linear on its partials; prefill (many rows) and
    an engine of two rows keep the separate activation; the tokens are the default's."""
    import fastqwen.linears as linears_module

    calls = []
    real = linears_module.swiglu_linear
    monkeypatch.setattr(linears_module, "swiglu_linear", lambda parts, *a: calls.append(parts.shape) or real(parts, *a))
    gen = dict(do_sample=False, max_new_tokens=6)
    kernels = {"linears": "gemv", "mlp_act": "fused"}
    default = fastqwen.optimize(fresh("tiny"), max_batch_size=2, max_seq_len=64, compile=False)
    one_row = fastqwen.optimize(fresh("tiny"), max_seq_len=64, compile=False, kernels=kernels)
    ids = torch.randint(1, 500, (1, 21))
    assert torch.equal(one_row.generate(ids, **gen), default.generate(ids, **gen))
    inter = one_row.config.intermediate_size
    assert calls == [(1, 1, 2 * inter)] * (one_row.config.num_hidden_layers * 5)  # 5 decode steps, none in prefill
    calls.clear()
    two_rows = fastqwen.optimize(fresh("tiny"), max_batch_size=2, max_seq_len=64, compile=False, kernels=kernels)
    ids, mask = left_padded([torch.randint(1, 500, (n,)) for n in (17, 5)])
    assert torch.equal(two_rows.generate(ids, attention_mask=mask, **gen),
                       default.generate(ids, attention_mask=mask, **gen))
    assert calls == []
    monkeypatch.undo()  # compiled: the op in the traced step
    compiled = fastqwen.optimize(fresh("tiny"), max_seq_len=64, compile=True, kernels=kernels)
    ids = torch.randint(1, 500, (1, 13))
    assert torch.equal(compiled.generate(ids, **gen), default.generate(ids, **gen))


def test_the_shared_expert_stacks_onto_the_routed_ones(tmp_path):
    """With grouped experts, the shared expert becomes expert E of the stacked weights and its gate row E of
    the router: the HF parameters are views (forward and state dict unchanged), routed_moe gives the HF
    block's output, re-stacking is a no-op, and a replaced parameter drops the stack."""
    from fastqwen.moe import stack_shared_expert

    model = fresh("tiny-moe")
    mlp = model.model.layers[0].mlp
    h = torch.randn(3, 2, model.config.hidden_size)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        hf = mlp(h)
        hf = hf[0] if isinstance(hf, tuple) else hf
        assert stack_shared_expert(mlp) and stack_shared_expert(mlp)
        gate_up, down, router = mlp.fastqwen_stacked
        E = mlp.experts.gate_up_proj.shape[0]
        assert gate_up.shape[0] == down.shape[0] == router.shape[0] == E + 1
        assert mlp.shared_expert.up_proj.weight.untyped_storage().data_ptr() == gate_up.untyped_storage().data_ptr()
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
        again = mlp(h)
        torch.testing.assert_close(again[0] if isinstance(again, tuple) else again, hf, rtol=0, atol=0)
        torch.testing.assert_close(routed_moe(mlp, h, grouped=True), hf, rtol=1e-4, atol=1e-5)
        model.save_pretrained(tmp_path)  # parameters that are views of the stacks save and load as before
        ids = torch.randint(1, 500, (1, 9))
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path)(ids).logits, model(ids).logits)
        mlp.shared_expert.down_proj.weight = torch.nn.Parameter(torch.zeros_like(mlp.shared_expert.down_proj.weight))
        assert stack_shared_expert(mlp)  # re-stacked from the new parameter
        assert torch.equal(mlp.fastqwen_stacked[1][E], torch.zeros_like(mlp.fastqwen_stacked[1][E]))


@pytest.mark.parametrize("gdn", ["block", "unrolled"])
def test_speculative_verify_with_our_gdn_kernels_is_token_identical(gdn):
    """kernels={"gdn": "block" / "unrolled"} reach the verify of a compiled speculative round (off CUDA the ops
    run their reference, so this checks the plumbing and the ops' schemas; tests/gpu compares the kernels). One
    layer of the tiny preset: a GDN layer, all the choice touches."""
    from fastqwen.bench import OracleProposer

    plain = fastqwen.optimize(fresh("tiny", layers=1), max_batch_size=2, max_seq_len=96, compile=False)
    spec = fastqwen.optimize(fresh("tiny", layers=1), max_batch_size=2, max_seq_len=96, compile=True,
                             kernels={"gdn": gdn})
    ids, mask = left_padded([torch.randint(1, 500, (n,)) for n in (17, 5)])
    expected = plain.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    spec._fastqwen.enable_speculation(OracleProposer(expected[:, ids.shape[1]:], 0.3, spec.config.vocab_size), 4)
    assert torch.equal(spec.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20), expected)


@pytest.mark.parametrize("compile", [False, True])
def test_verify_prologue_stores_the_replay_and_is_token_identical(compile, monkeypatch):
    """kernels={"conv": "fused-verify"} (the default): a speculative verify's conv and gates go through
    verify_prologue (x, a, b as the projection's outputs or partials; off CUDA its reference), which stores every
    replay input of the commit; plain and speculative tokens are those of "fused" (the model's own gates and
    replay writes), compiled or not."""
    import fastqwen.model as model_module
    from fastqwen.bench import OracleProposer

    calls, real = [], model_module.verify_prologue
    if not compile:  # (a spy in a compiled step would guard on the list: the calls are counted eagerly)
        monkeypatch.setattr(model_module, "verify_prologue", lambda x, *a: calls.append(x.shape[-2]) or real(x, *a))
    ids, mask = left_padded([torch.randint(1, 500, (n,)) for n in (17, 5)])
    control = fastqwen.optimize(fresh("tiny"), max_batch_size=2, max_seq_len=96, compile=False,
                                kernels={"conv": "fused"})
    want = control.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    m = fastqwen.optimize(fresh("tiny"), max_batch_size=2, max_seq_len=96, compile=compile)
    assert torch.equal(m.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20), want)
    assert not calls  # (decode: conv_decode, as "fused")
    m._fastqwen.enable_speculation(OracleProposer(want[:, ids.shape[1]:], 0.3, m.config.vocab_size), 4)
    assert torch.equal(m.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20), want)
    assert compile or (calls and set(calls) == {5}), calls  # (verify blocks of k + 1 = 5 positions)


def test_quant_experts_kernel_path_per_scheme_and_activation():
    """QuantExperts.routed's launches on CUDA: the fused down launch for fp8 schemes, int4 always separate; an
    unknown activation (the removed "mlp" and "paired" among them) is refused by name."""
    from fastqwen.quant.experts import kernel_path

    want = {("fp8-weight", "fused"): "fused", ("fp8-weight", "separate"): "separate",
            ("fp8", "fused"): "fused", ("fp8", "separate"): "separate",
            ("int4", "fused"): "separate", ("int4", "separate"): "separate"}
    assert {key: kernel_path(*key) for key in want} == want
    for act in ("auto", "mlp", "paired"):
        with pytest.raises(ValueError, match="'separate' or 'fused'"):
            kernel_path("fp8-weight", act)
