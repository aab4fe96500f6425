"""Quantization formats: error bounds per scheme, and exact conversion of GPTQ / AWQ packed tensors."""

import pytest
import torch

from fastqwen.quant.formats import (
    dequantize_fp8_block,
    dequantize_fp8_rows,
    dequantize_int4,
    fake_quantize_fp8_activations,
    quantize_fp8_block,
    quantize_fp8_rows,
    quantize_int4,
)
from fastqwen.quant.gptq import from_awq, from_gptq


@pytest.mark.parametrize("shape", [(256, 384), (200, 130)])
def test_fp8_block_round_trip_within_e4m3_rounding(shape):
    w = torch.randn(shape) * torch.logspace(-2, 1, shape[0])[:, None]  # rows of very different scales
    q, s = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    back = dequantize_fp8_block(q, s)
    # e4m3 keeps 3 mantissa bits: relative error ≤ 2^-4 of each element, or an absolute floor per block
    floor = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]] * 2**-6
    assert ((back - w).abs() <= w.abs() * 2**-4 + floor).all()


def test_fp8_rows_and_activations_round_trip():
    w = torch.randn(64, 256) * 3
    q, s = quantize_fp8_rows(w)
    assert ((dequantize_fp8_rows(q, s) - w).abs() <= w.abs() * 2**-4 + s[:, None] * 2**-6).all()
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    assert ((fake_quantize_fp8_activations(x).float() - x.float()).abs() <= x.float().abs() * 2**-3 + 1e-3).all()


def test_int4_round_trip_within_half_a_step():
    # rows of very different magnitudes: fp16 scales down to its subnormals, and an all-zero row
    w = torch.randn(96, 512) * torch.logspace(-7, 1, 96)[:, None]
    w[5] = 0
    q, scale, zero = quantize_int4(w, group=128)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert scale.dtype == torch.float16 and zero.dtype == torch.uint8 and bool((scale > 0).all())
    err = (dequantize_int4(q, scale, zero) - w).abs()
    assert (err <= scale.float().repeat_interleave(128, 1) * 0.5 * (1 + 1e-6)).all()
    assert not dequantize_int4(q, scale, zero)[5].any()


def test_int4_scale_rounded_up_past_fp16s_largest_is_refused():
    """A group whose exact scale (range / 15) lies in 65504 … 65520 rounds to fp16's largest value, below it, and
    its round-up gave inf: every weight of the group decoded to NaN (QuantExperts stores quantize_int4's scales
    as they come). It is refused as any scale outside fp16's range is."""
    w = torch.zeros(16, 128)
    w[3, 5] = -65510.0 * 15
    with pytest.raises(ValueError, match="int4 scales must lie in fp16's range .* got 6.55e\\+04"):
        quantize_int4(w, group=128)


def test_int4_scales_are_stored_in_fp16_and_zeros_in_uint8():
    """QuantLinear stores any int4 scale as fp16 and zero as uint8 (3 bytes a group, the kernels' dtypes), refuses a
    scale outside fp16's range by name, and its stored bytes are half a byte a weight plus 3 a group."""
    from fastqwen.quant.linear import QuantLinear

    q, scale, zero = quantize_int4(torch.randn(32, 256), group=128)
    tensors = {"qweight": QuantLinear.from_linear(torch.nn.Linear(256, 32), "int4").qweight.clone(),
               "scale": scale.float(), "zero": zero.float()}
    layer = QuantLinear("int4", 256, 32, tensors)
    assert layer.scale.dtype == torch.float16 and layer.zero.dtype == torch.uint8
    assert torch.equal(layer.scale, scale) and torch.equal(layer.zero, zero)
    stored = sum(t.numel() * t.element_size() for t in (layer.qweight, layer.scale, layer.zero))
    assert stored == 32 * 256 // 2 + 32 * 2 * 3
    for bad in (1e6, 1e-9):
        with pytest.raises(ValueError, match="int4 scales must lie in fp16's range"):
            QuantLinear("int4", 256, 32, {**tensors, "scale": torch.full_like(tensors["scale"], bad)})


def pack_gptq(q, zeros, *, zero_offset=1):
    """Reference packer written from the format's description, one nibble at a time."""
    K, N = q.shape
    qweight = torch.zeros(K // 8, N, dtype=torch.int64)
    for k in range(K):
        qweight[k // 8] |= q[k].long() << (4 * (k % 8))
    G = zeros.shape[0]
    qzeros = torch.zeros(G, N // 8, dtype=torch.int64)
    for n in range(N):
        qzeros[:, n // 8] |= (zeros[:, n].long() - zero_offset) << (4 * (n % 8))
    as_int32 = lambda t: torch.where(t >= 2**31, t - 2**32, t).to(torch.int32)  # noqa: E731
    return as_int32(qweight), as_int32(qzeros)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_converts_exactly(act_order):
    K, N, g = 256, 64, 64
    q = torch.randint(0, 16, (K, N))
    zeros = torch.randint(1, 16, (K // g, N))
    scales = torch.rand(K // g, N, dtype=torch.float16) * 0.01 + 1e-3
    g_idx = torch.arange(K) // g
    if act_order:
        g_idx = g_idx[torch.randperm(K)]
    qweight, qzeros = pack_gptq(q, zeros)
    codes, scale, zero, perm = from_gptq(qweight, qzeros, scales, g_idx.int(), group=g)
    assert (perm is not None) == act_order
    reference = scales.float()[g_idx, torch.arange(N)[:, None]] * (q.t().float() - zeros[g_idx, torch.arange(N)[:, None]].float())
    assert torch.equal(dequantize_int4(codes, scale, zero, perm), reference)


def pack_awq(t):
    """Reference AWQ GEMM packer from the format's description: nibble i of word c holds column 8c + order[i]."""
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    out = torch.zeros(t.shape[0], t.shape[1] // 8, dtype=torch.int64)
    for c in range(t.shape[1] // 8):
        for i, col in enumerate(order):
            out[:, c] |= t[:, 8 * c + col].long() << (4 * i)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def test_awq_converts_exactly():
    K, N, g = 128, 32, 32
    q = torch.randint(0, 16, (K, N))
    zeros = torch.randint(0, 16, (K // g, N))
    scales = torch.rand(K // g, N, dtype=torch.float16) * 0.01 + 1e-3
    codes, scale, zero, perm = from_awq(pack_awq(q), pack_awq(zeros), scales, group=g)
    groups = torch.arange(K) // g
    reference = scales.float()[groups].t() * (q.t().float() - zeros[groups].t().float())
    assert perm is None and torch.equal(dequantize_int4(codes, scale, zero), reference)


def test_gptq_irregular_groups_are_refused():
    K, N, g = 64, 8, 32
    qweight, qzeros = pack_gptq(torch.randint(0, 16, (K, N)), torch.randint(1, 16, (2, N)))
    g_idx = torch.zeros(K, dtype=torch.int32)  # every column in group 0
    with pytest.raises(ValueError, match="does not assign group_size columns"):
        from_gptq(qweight, qzeros, torch.ones(2, N, dtype=torch.float16), g_idx, group=g)
