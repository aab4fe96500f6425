"""The small-M quantized-linear kernel on the H200: real 27B and 35B-A3B layer shapes, M = 1 … 16 rows, against
the fp32 torch reference; and a compiled QuantLinear step (CUDA graph) against eager."""

import pytest
import torch
from conftest import moe_block_35b, poison_allocator, rel_err

from fastqwen.ops.gemv import (BF16, FP8_BLOCK, FP8_ROW, INT4, _launch, expert_gemv, expert_reference, gemv_config,
                               reference, stored_operands, untile_int4, wq_matmul)
from fastqwen.quant.formats import fake_quantize_fp8_activations
from fastqwen.quant.linear import QuantLinear

# (N, K): 27B MLP gate/up and down, 27B attention q (with gate) and GDN qkv; 35B-A3B attention q, shared expert
SHAPES = [(17408, 5120), (5120, 17408), (12288, 5120), (10240, 5120), (8192, 2048), (512, 2048)]
FORMATS = [("fp8-weight", FP8_ROW, False), ("fp8", FP8_BLOCK, True), ("int4", INT4, False),
           ("bf16", BF16, False)]  # bf16: kernels={"linears": "gemv"}


@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("name,fmt,act", FORMATS)
# the shipped config; forced conversion / bit-move decoding; steps of 256 columns (KSTEP 2); the shipped config
# with programmatic dependent launch, then with split-K summed in the kernel (fixup) as well; the fp16 dot (LOWP 3,
# fp8 only), alone and with KSTEP 2; int4 by bit moves at one row in steps of two groups; int4's scale and zero
# row-major (stored_operands gives them group-major, QuantLinear's layout) with the shipped config; int4 at one row
# in fp16 pair arithmetic (BITS with LOWP 3), alone, in steps of two groups under programmatic dependent launch,
# and two row tiles a program (TILES); the same three with the pairs into mma.sync (LOWP 4: exact products, fp32
# sums)
@pytest.mark.parametrize("bits", [None, 0, 1, "wide", "pdl", "pdl-fixup", "fp16", "fp16-wide", "bits-wide",
                                  "row-major", "half2", "half2-wide-pdl", "half2-tiles", "mma", "mma-wide-pdl",
                                  "mma-tiles"])
def test_kernel_matches_fp32_reference(N, K, name, fmt, act, bits):
    if bits in ("wide", "fp16-wide") and fmt not in (FP8_ROW, BF16):
        pytest.skip("KSTEP > 1 is for formats with no scale inside a step")
    if bits in ("fp16", "fp16-wide") and fmt not in (FP8_ROW, FP8_BLOCK):
        pytest.skip("the fp16 dot takes e4m3 weights")
    if str(bits).startswith(("bits-", "row-", "half2", "mma")) and fmt != INT4:
        pytest.skip("16-bit pairs are int4's decode")
    w = torch.randn(N, K, device="cuda") * 0.02
    q, s, z = stored_operands(fmt, w)
    if bits == "row-major":  # (and the codes in row order: a shape whose rows are no multiple of 16)
        q, s, z = (untile_int4(q) if fmt == INT4 else q), s.contiguous(), z.contiguous()
    for M in (1, 2, 4, 8, 16, 32, 64) if not str(bits).startswith(("bits-wide", "half2", "mma")) else (1,):  # 32, 64: verify of 2 or 4 rows x 16 positions
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        poison_allocator((M, N), dtype=torch.float32)
        extra = {"wide": (0, 2), "fp16": (0, 1, 3), "fp16-wide": (0, 2, 3), "bits-wide": (1, 2), "half2": (1, 1, 3),
                 "half2-wide-pdl": (1, 2, 3), "half2-tiles": (1, 1, 3, 2), "mma": (1, 1, 4),
                 "mma-wide-pdl": (1, 2, 4), "mma-tiles": (1, 1, 4, 2)}.get(bits, (bits,))
        config = None if bits in (None, "pdl", "pdl-fixup", "row-major") else (*gemv_config(fmt, N, K, M)[:4], *extra)
        if str(bits).startswith("mma"):  # 8 rows a warp of each of the mma's two row sets
            config = (max(16 * config[2], config[0]), *config[1:])
        y = (wq_matmul(x, fmt, q, s, z, act, N, pdl=str(bits).startswith("pdl"), fixup=bits == "pdl-fixup")
             if config is None else _launch(x, fmt, q, s, z, act, N, M, config=config, pdl=str(bits).endswith("-pdl")))
        assert not y.isnan().any(), f"{name} M={M}: unwritten outputs"
        err = rel_err(y, reference(x.float(), fmt, q, s, z, act, N))
        # (fp16 products of exact operands leave fp32 sums only; the fp8 scheme's own x rounding may tie-break apart)
        bound = 1e-4 if str(bits).startswith(("fp16", "mma")) and not act else 2e-3
        assert err < bound, f"{name} {N}x{K} M={M} config {config}: relative error {err:.2e}"


@pytest.mark.parametrize("K", [4096, 2048, 5120])  # the 9B's, the 35B-A3B's and the 27B's lm_head, 248320 rows
@pytest.mark.parametrize("name,fmt", [("bf16", BF16), ("fp8-weight", FP8_ROW), ("int4", INT4)])
@pytest.mark.parametrize("pdl", [False, True])
def test_lm_head_shapes_match_the_fp32_reference(K, name, fmt, pdl):
    """The lm_head through the kernel (bf16 under the "auto" policy where the sweep stored it faster than cuBLAS;
    fp8-weight and int4 with quant_lm_head) at one row, the tuned config of gemv_configs.json (the 27B int4 head's:
    fp16 pair arithmetic), with and without PDL: thousands of programs, every output written and within the
    format's bound."""
    if fmt == INT4 and K != 5120:
        pytest.skip("the int4 head is swept on the 27B's")
    N = 248320
    w = torch.randn(N, K, device="cuda") * 0.02
    q, s, z = stored_operands(fmt, w)
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    poison_allocator((1, N), dtype=torch.float32)
    y = wq_matmul(x, fmt, q, s, z, False, N, pdl=pdl)
    assert not y.isnan().any(), f"{name} {N}x{K}: unwritten outputs"
    err = rel_err(y, reference(x.float(), fmt, q, s, z, False, N))
    assert err < 2e-3, f"{name} {N}x{K} config {gemv_config(fmt, N, K, 1)}: relative error {err:.2e}"


@pytest.mark.parametrize("scheme", ["fp8-weight", "fp8", "int4"])
@pytest.mark.parametrize("pdl", [False, True])
def test_compiled_quant_linear_matches_eager(scheme, pdl):
    """A QuantLinear between two inductor kernels in one CUDA graph (with pdl: all three launched with
    programmatic dependent launch, so the kernel must wait for its input), against eager. The inductor kernel
    before it doubles x: exact in bf16, so that "fp8"'s activation rounding sees the same input on both paths
    (silu·3 rounded differently by inductor flipped enough fp8 roundings for 1.9% error)."""
    linear = torch.nn.Linear(5120, 17408, bias=False, device="cuda", dtype=torch.bfloat16)
    layer = QuantLinear.from_linear(linear, scheme)
    x = torch.randn(1, 1, 5120, device="cuda", dtype=torch.bfloat16)
    options = {"triton.cudagraphs": True, "triton.enable_pdl": pdl}
    step = torch.compile(lambda x: layer(x * 2, pdl=pdl).relu(), fullgraph=True,
                         options=options)
    for _ in range(3):  # warm-up, record, replay
        out = step(x)
    assert rel_err(out, layer(x * 2).relu()) < 1e-2
    big = torch.randn(80, 5120, device="cuda", dtype=torch.bfloat16)  # prefill rows (> 64): the reference path
    if scheme == "fp8":  # the scheme rounds activations to fp8 too, on every path
        big = fake_quantize_fp8_activations(big, 128)
    assert rel_err(layer(big), big.float() @ layer.dequantized().t()) < 2e-2


@pytest.mark.parametrize("group", [256, 5120])  # a GPTQ/AWQ group of 256 and one group a row (group_size -1)
def test_int4_groups_of_a_multiple_of_128_take_the_kernels(group):
    """int4 quantized in groups of a multiple of 128 (stored as 128-column groups) streams through the kernels at
    1 … 16 rows, matching the fp32 product with its dequantized weight."""
    linear = torch.nn.Linear(5120, 17408, bias=False, device="cuda", dtype=torch.bfloat16)
    torch.nn.init.normal_(linear.weight, std=0.02)
    layer = QuantLinear.from_linear(linear, "int4", group)
    assert (layer.group, layer.stored_group()) == (group, 128)
    w = layer.dequantized()
    for rows in (1, 2, 4, 8, 16):
        x = torch.randn(rows, 5120, device="cuda", dtype=torch.bfloat16)
        assert layer.partials(x) is not None
        assert rel_err(layer(x), x.float() @ w.t()) < 1e-2, rows


@pytest.mark.parametrize("fmt", [BF16, FP8_ROW, INT4])
def test_grouped_expert_kernel_matches_reference_at_35b_shapes(fmt):
    """Routed experts of 35B-A3B: 256 experts, gate_up [2·512, 2048] and down [2048, 512]; 1 and 4 tokens × top-8."""
    torch.manual_seed(0)
    for N, K in ((1024, 2048), (2048, 512)):
        parts = [stored_operands(fmt, torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02)
                 for _ in range(16)]  # 16 distinct experts, tiled to 256 (memory)
        w, s, z = (None if p[0] is None else torch.stack(p).repeat(16, *[1] * p[0].dim()) for p in zip(*parts))
        for T in (1, 4):
            x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
            tok = torch.arange(T, device="cuda", dtype=torch.int32).repeat_interleave(8)
            exp = torch.randint(0, 256, (T * 8,), device="cuda", dtype=torch.int32)
            poison_allocator((T * 8, N), dtype=torch.float32)
            y = expert_gemv(x, tok, exp, fmt, w, s, z, N).sum(0)  # (split-K partials)
            assert not y.isnan().any()
            err = rel_err(y, expert_reference(x.float(), tok, exp, fmt, w, s, z, N))
            assert err < 2e-3, f"format {fmt} {N}x{K} T={T}: relative error {err:.2e}"


@pytest.mark.parametrize("act", ["separate", "fused"])
@pytest.mark.parametrize("scheme", ["fp8-weight", "fp8", "int4"])
def test_quant_experts_routed_kernel_matches_the_prefill_loop(scheme, act, monkeypatch):
    """QuantExperts at the 35B-A3B expert shape (32 of its 256 experts): decode's grouped kernels, with the
    activation in a kernel of its own or computed by the down launch ("fused"; fp8 schemes), vs the
    dequantize-then-grouped-matmul prefill transformers' contract runs (8 experts dequantized at a time)."""
    from types import SimpleNamespace

    import fastqwen.quant.experts as experts_module
    from fastqwen.quant.experts import QuantExperts

    monkeypatch.setattr(experts_module, "PREFILL_EXPERTS", 8)
    calls = []  # the kernels routed launches: the path asked for must be the one that runs
    for name in ("expert_swiglu_gemv", "expert_gemv"):
        def spy(*args, _f=getattr(experts_module, name), _name=name, **kw):
            calls.append(_name)
            return _f(*args, **kw)
        monkeypatch.setattr(experts_module, name, spy)
    launches = {"fused": ["expert_gemv", "expert_swiglu_gemv"],
                "separate": ["expert_gemv", "expert_gemv"]}[experts_module.kernel_path(scheme, act)]

    torch.manual_seed(0)
    E, H, inter = 32, 2048, 512
    experts = SimpleNamespace(gate_up_proj=torch.randn(E, 2 * inter, H, device="cuda", dtype=torch.bfloat16) * 0.02,
                              down_proj=torch.randn(E, H, inter, device="cuda", dtype=torch.bfloat16) * 0.02,
                              act_fn=torch.nn.functional.silu)
    q = QuantExperts(experts, scheme, 128)
    for T in (1, 4, 64):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        idx = torch.stack([torch.randperm(E, device="cuda")[:8] for _ in range(T)])
        w = torch.rand(T, 8, device="cuda", dtype=torch.bfloat16)
        calls.clear()
        got = (q.routed(x, idx, act) * w[..., None]).sum(1)
        assert calls == launches, (scheme, act, calls)
        assert rel_err(got, q(x, idx, w)) < 2e-2
        # (kernels experts "grouped-pdl"): the same launches with programmatic dependent launch, the same sums
        assert torch.equal(q.routed(x, idx, act, True), q.routed(x, idx, act))
        if act != "separate":  # the same expert outputs as the separate activation's, but for silu's last bits
            assert rel_err(q.routed(x, idx, act), q.routed(x, idx)) < (1e-2 if scheme == "fp8" else 1e-3)


@pytest.mark.parametrize("scheme", ["fp8-weight", "fp8", "int4"])
def test_quantized_moe_block_with_the_shared_expert_stacked_matches_its_hf_forward(scheme):
    """A 35B-A3B MoE block quantized (routed experts, shared expert): routed_moe compiled, with the shared
    expert stacked as expert 256 of the quantized experts and its gate as row 256 of the router, against the
    block's own forward on the same quantized weights (transformers' loop; the shared expert on its own)."""
    from fastqwen.model import routed_moe
    from fastqwen.moe import stack_shared_expert
    from fastqwen.quant.linear import quantize_modules

    block = quantize_modules(moe_block_35b(), scheme)
    h = torch.randn(4, 1, block.gate.weight.shape[-1], device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = block(h)
        ref = (ref[0] if isinstance(ref, tuple) else ref).float()
        assert stack_shared_expert(block) and block.experts.stacks is not None
        torch._dynamo.reset()  # (routed_moe's compiles in other tests count toward dynamo's recompile limit)
        f = torch.compile(routed_moe, fullgraph=True)
        assert rel_err(f(block, h, True), ref) < 2e-2
        assert rel_err(f(block, h, True, expert_act="fused"), ref) < 2e-2  # (decode's default: expert_act "fused")
        assert rel_err(f(block, h, True, pdl=True), ref) < 2e-2  # (fp8-weight's default experts: "grouped-pdl")
