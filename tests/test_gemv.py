"""The weight-streaming kernel (fastqwen/ops/gemv.py), linear and grouped (routed experts) modes, against its
torch reference.

The Triton kernel runs here in Triton's CPU interpreter (conftest.run_in_triton_interpreter says how).
tests/gpu/test_quant_gpu.py runs the kernel compiled on real layer shapes.
"""

import pytest
import torch
from conftest import run_in_triton_interpreter

from fastqwen.quant.formats import pack_int4, unpack_int4
from fastqwen.ops.gemv import (BF16, FP8_BLOCK, FP8_ROW, INT4, expert_gemv, expert_key, expert_reference,
                               expert_swiglu_gemv,
                               gemv_beats_cublas, gemv_config, pair_rows, reference, stored_operands, swiglu_linear,
                               swiglu_reference,
                               tuned_config, wq_linear)


def operands(fmt, N, K, seed=0, tiled=True):
    """(w, scale, zero) in the stored format of a random weight [N, K] (int4 tiled where N allows: tile_int4)."""
    return stored_operands(fmt, torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05, tiled)


def test_int4_packing_round_trips():
    codes = torch.randint(0, 16, (5, 256), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (5, 128) and torch.equal(unpack_int4(packed), codes)
    assert int(packed[0, 0]) == int(codes[0, 0]) | int(codes[0, 1]) << 4


@pytest.mark.parametrize("fmt,act", [(FP8_ROW, False), (FP8_BLOCK, True), (INT4, False)])
def test_registered_op_passes_opcheck_on_cpu(fmt, act):
    w, s, z = operands(fmt, 64, 256)
    x = torch.randn(3, 256)
    # test_schema is left out: torch's SchemaCheckMode cannot compare fp8 tensors (mul not implemented)
    torch.library.opcheck(wq_linear, (x, fmt, w, s, z, act, 64),
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))
    assert torch.equal(wq_linear(x, fmt, w, s, z, act, 64), reference(x, fmt, w, s, z, act, 64)[None])  # 1 split
    heads = x.view(3, 2, 128)  # rows given per head (Linears.heads): the op flattens each row
    torch.library.opcheck(wq_linear, (heads, fmt, w, s, z, act, 64),
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))
    assert torch.equal(wq_linear(heads, fmt, w, s, z, act, 64), wq_linear(x, fmt, w, s, z, act, 64))


def expert_operands(fmt, E, N, K, seed=0):
    """Per-expert stored operands stacked on a leading expert dimension."""
    parts = [operands(fmt, N, K, seed=seed + e, tiled=False) for e in range(E)]  # (row order: tile_int4 tests both)
    return tuple(None if p[0] is None else torch.stack(p) for p in zip(*parts))


def test_expert_reference_is_a_per_pair_matmul():
    w = torch.randn(4, 24, 256)
    x = torch.randn(3, 256)
    tok, exp = torch.tensor([0, 0, 2], dtype=torch.int32), torch.tensor([3, 1, 3], dtype=torch.int32)
    y = expert_reference(x, tok, exp, BF16, w, None, None, 24)
    assert torch.allclose(y[2], w[3] @ x[2], atol=1e-5) and torch.allclose(y[1], w[1] @ x[0], atol=1e-5)
    torch.library.opcheck(expert_gemv, (x, tok, exp, BF16, w, None, None, 24),
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))
    assert torch.equal(expert_gemv(x, tok, exp, BF16, w, None, None, 24), y[None])  # one split-K partial on CPU
    # tok None: the pairs token-major, P / T a token (here one: pair p reads row p)
    assert torch.equal(pair_rows(x, exp), torch.arange(3, dtype=torch.int32))
    assert torch.equal(pair_rows(x[:1], exp), torch.zeros(3, dtype=torch.int32))
    assert torch.equal(expert_gemv(x, None, exp, BF16, w, None, None, 24),
                       expert_reference(x, torch.arange(3, dtype=torch.int32), exp, BF16, w, None, None, 24)[None])
    torch.library.opcheck(expert_gemv, (x[:1], None, exp, BF16, w, None, None, 24),
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))
    with pytest.raises(ValueError, match="P / T pairs a token"):
        expert_gemv(x[:2], None, exp, BF16, w, None, None, 24)


@pytest.mark.parametrize("fmt,act_fp8", [(BF16, False), (FP8_ROW, False), (FP8_BLOCK, True)])
def test_expert_swiglu_gemv_is_the_down_projection_of_the_activation(fmt, act_fp8):
    """The fused-activation down projection on CPU: swiglu_reference of the summed gate | up partials, rounded
    to the activations' dtype, then the per-pair matmul in the experts' format (bf16, or fp8 weights, with
    the fp8 scheme's activation rounding); the op passes opcheck; int4 experts are refused."""
    parts = torch.randn(3, 4, 2 * 256)  # 3 split-K partials of 4 pairs' gate | up rows
    exp = torch.tensor([4, 0, 4, 2], dtype=torch.int32)
    w, s, _ = (torch.randn(5, 24, 256, dtype=torch.bfloat16), None, None) if fmt == BF16 else expert_operands(fmt, 5, 24, 256)
    gate, up = parts.sum(0).chunk(2, dim=-1)
    act = (gate * torch.sigmoid(gate) * up).bfloat16()
    torch.testing.assert_close(swiglu_reference(parts, torch.bfloat16), act, rtol=0, atol=0)
    y = expert_swiglu_gemv(parts, exp, fmt, w, s, 24, torch.bfloat16, act_fp8)
    want = expert_reference(act, None, exp, fmt, w, s, None, 24, act_fp8)
    assert y.shape == (1, 4, 24) and torch.equal(y[0], want)
    if fmt == BF16:
        assert torch.allclose(y[0, 2], w[4].float() @ act[2].float(), rtol=1e-5, atol=1e-4)
    # (test_schema left out, as for wq_linear: SchemaCheckMode cannot compare fp8 tensors)
    torch.library.opcheck(expert_swiglu_gemv, (parts, exp, fmt, w, s, 24, torch.bfloat16, act_fp8),
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))
    w4, s4, _ = expert_operands(INT4, 5, 24, 256)
    with pytest.raises(ValueError, match="int4 experts run the activation separately"):
        expert_swiglu_gemv(parts, exp, INT4, w4, s4, 24, torch.bfloat16)


_SWIGLU_INTERPRETED = """
import torch
from fastqwen.ops.gemv import BF16, FP8_BLOCK, FP8_ROW, INT4, _launch, expert_reference, reference, swiglu_reference
from test_gemv import expert_operands
E, N, I = 5, 136, 384
exp = torch.tensor([4, 0, 2, 4, 1, 3], dtype=torch.int32)

def truncated(act):  # the interpreter casts fp32 -> bf16 by dropping the low bits (hardware rounds to nearest even)
    return (act.float().view(torch.int32) & -65536).view(torch.float32).bfloat16()


for S, wdtype in ((1, torch.bfloat16), (3, torch.bfloat16), (2, torch.float32)):
    parts = torch.randn(S, len(exp), 2 * I) * 2
    w = torch.randn(E, N, I).to(wdtype)
    act = swiglu_reference(parts, torch.float32)
    act = truncated(act) if wdtype == torch.bfloat16 else act
    ref = expert_reference(act, torch.arange(len(exp)), exp, BF16, w, None, None, N)
    for config in (None, (64, 2, 4, 2), (32, 1, 4, 3, 0, 2)):  # the default, K split in 2, steps of 256 columns
        y = _launch(parts, BF16, w, None, None, False, N, len(exp), (exp, exp), config=config, swiglu=wdtype)
        err = ((y - ref).norm() / ref.norm()).item()
        assert not y.isnan().any() and err < 1e-4, (S, wdtype, config, err)  # (silu's last bit may differ)
    for config in (None, (64, 2, 4, 2), (32, 4, 4, 3, 0, 2)):  # linear mode, one row (a dense MLP at decode)
        ref = reference(act[:1], BF16, w[0], None, None, False, N)
        for fixup in (False, True):
            y = _launch(parts[:, :1].contiguous(), BF16, w[0], None, None, False, N, 1, config=config, partials=True,
                        fixup=fixup, swiglu=wdtype)
            err = ((y.sum(0) - ref).norm() / ref.norm()).item()
            assert not y.isnan().any() and err < 1e-4 and (len(y) == 1 or not fixup), (S, config, fixup, err)
# fp8 experts (fp8-weight's per-row scales, fp8's 128-blocks), the activation rounded to bf16; a tuned config's
# BITS is dropped (the SWIGLU load is in the conversion branch). (Not fp8's e4m3 activation rounding here: the
# interpreter's fp32 -> e4m3 cast drops carries, see _INTERPRETED; tests/gpu covers it.)
parts = torch.randn(2, len(exp), 2 * I) * 2
act = truncated(swiglu_reference(parts, torch.float32))
import fastqwen.ops.gemv as gemv
for fmt in (FP8_ROW, FP8_BLOCK):
    w, s, z = expert_operands(fmt, E, N, I)
    ref = expert_reference(act, torch.arange(len(exp)), exp, fmt, w, s, None, N)
    for config in (None, (32, 2, 4, 2), "tuned with BITS"):
        if config == "tuned with BITS":
            gemv.gpu_table, config = (lambda: {gemv.expert_key(fmt, N, I, len(exp)): [32, 1, 4, 3, 1]}), None
        y = _launch(parts, fmt, w, s, None, False, N, len(exp), (exp, exp), config=config, swiglu=torch.bfloat16)
        err = ((y - ref).norm() / ref.norm()).item()
        assert not y.isnan().any() and err < 1e-4, (fmt, config, err)
w, s, z = expert_operands(INT4, E, N, I)
wf, sf, _ = expert_operands(FP8_ROW, E, N, I)
for bad in (dict(fmt=INT4, w=w, s=s, parts=parts, pairs=(exp, exp), config=None, dtype=torch.bfloat16),
            dict(fmt=FP8_ROW, w=wf, s=sf, parts=parts, pairs=(exp, exp), config=(32, 1, 4, 3, 1),  # asked for BITS
                 dtype=torch.bfloat16),
            dict(fmt=BF16, w=wf.float(), s=None, parts=parts, pairs=(exp, exp), config=None, dtype=torch.int32),
            dict(fmt=BF16, w=wf.float(), s=None, parts=parts[0], pairs=(exp, exp), config=None, dtype=torch.float32),
            dict(fmt=BF16, w=wf[0].float(), s=None, parts=parts, pairs=None, config=None,  # linear mode: one row
                 dtype=torch.float32)):
    try:
        _launch(bad["parts"], bad["fmt"], bad["w"], bad["s"], z if bad["fmt"] == INT4 else None, False, N, len(exp),
                bad["pairs"], config=bad["config"], swiglu=bad["dtype"])
        raise AssertionError("swiglu took " + str(bad))
    except ValueError as e:
        assert "swiglu takes the BF16 or an fp8 format" in str(e), e
print("swiglu ok")
"""


def test_swiglu_linear_is_the_down_projection_of_the_activation():
    """The dense fused-activation down projection on CPU (one row): swiglu_reference of the summed gate | up
    partials, rounded to the weight's dtype, then the matmul; the op passes opcheck."""
    parts = torch.randn(2, 1, 2 * 256)
    w = torch.randn(24, 256, dtype=torch.bfloat16)
    y = swiglu_linear(parts, w, 24)
    assert y.shape == (1, 1, 24)
    torch.testing.assert_close(y[0, 0], w.float() @ swiglu_reference(parts, torch.bfloat16)[0].float(),
                               rtol=1e-5, atol=1e-4)
    torch.library.opcheck(swiglu_linear, (parts, w, 24),
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))


def test_swiglu_on_load_matches_reference_in_the_triton_interpreter():
    """_row_kernel SWIGLU: the down projection's x computed from 1, 2 or 3 gate | up partials as it loads them,
    16-bit and fp32 weights, split K and wide steps, grouped and one-row linear mode (with the fixup too); fp8
    experts (per-row and block scales, a tuned BITS dropped); int4, BITS asked for, a dtype Triton cannot round
    to, a 2-D x and several rows in linear mode are refused."""
    assert run_in_triton_interpreter(_SWIGLU_INTERPRETED).strip().endswith("swiglu ok")


_INTERPRETED_HEAD = """
import torch
from fastqwen.ops.gemv import BF16, FP8_BLOCK, FP8_ROW, INT4, _launch, expert_reference, reference, wq_matmul
from test_gemv import expert_operands, operands
worst = 0.0
# (not FP8_BLOCK with act_fp8: the interpreter's fp32 -> e4m3 cast drops the carry when rounding up into the
# next binade, e.g. 126.5 -> 64 instead of 128; tests/gpu covers that path on the hardware's cast)
# the default, K split in 2 (uneven) and 3, and the same decoded by bit moves (BITS)
CONFIGS = (None, (32, 2, 4, 2), (16, 3, 4, 1), (64, 1, 4, 2, 1), (32, 2, 4, 2, 1), (16, 3, 4, 1, 1))
# steps of 256 columns split in 2 (the second step half masked), one step of 512 (a quarter masked)
WIDE = ((32, 2, 4, 2, 0, 2), (16, 1, 4, 1, 0, 4))
# fp16 dot operands (LOWP 3: e4m3 weights, x scaled by a power of 2 into fp16): alone and with KSTEP 2
FP16 = ((32, 2, 4, 2, 0, 1, 3), (16, 1, 4, 1, 0, 2, 3))
INT4_WIDE = ((32, 1, 4, 2, 1, 2), (16, 2, 4, 1, 1, 4))  # one row decoded by bit moves, steps of 2 and 4 groups
# int4 at one row in fp16 pair arithmetic (BITS with LOWP 3): K split in 2 (rows past N: 200 is no multiple of 32),
# steps of two groups (the second step half masked), three splits unstaged
HALF2 = ((32, 2, 4, 2, 1, 1, 3), (16, 1, 4, 1, 1, 2, 3), (64, 3, 4, 1, 1, 1, 3),
         (32, 2, 4, 1, 1, 1, 3, 2), (16, 1, 4, 1, 1, 2, 3, 4))  # and 2 or 4 row tiles a program (TILES)
# the same pairs into mma.sync (BITS with LOWP 4; BLOCK_N ≥ 16 a warp): K split in 2, steps of two groups, 2 row tiles
MMA = ((64, 2, 4, 2, 1, 1, 4), (64, 1, 4, 1, 1, 2, 4), (64, 3, 4, 1, 1, 1, 4, 2))
HALF2 += MMA
"""
# linear mode: every format and config against the reference, e4m3 codes, refusals, partials, the fixup
_INTERPRETED = _INTERPRETED_HEAD + """
for fmt, act, configs, ms in [(FP8_ROW, False, CONFIGS + WIDE + FP16, (1, 3, 16, 20, 40)),
                              (FP8_BLOCK, False, CONFIGS + FP16[:1], (1, 3, 16)),
                              (INT4, False, CONFIGS + INT4_WIDE + HALF2, (1, 3, 16, 33)),
                              (BF16, False, (None,) + WIDE, (1, 3, 16))]:
    for M in ms:  # (20, 33, 40: programs of 32 and 64 rows)
        N, K = 200, 384  # N not a multiple of the program width; K three steps
        w, s, z = operands(fmt, N, K, seed=M)
        x = torch.randn(M, K, dtype=torch.bfloat16)
        for config in configs:
            if (config in INT4_WIDE or config in HALF2) and M > 1:  # (refused: below)
                continue
            x16 = x
            if config and len(config) > 6 and config[6] == 3 and M == 3:  # rows far apart in scale (x/s stays exact)
                x16 = x * torch.tensor([[1e-6], [1.0], [3e4]], dtype=torch.bfloat16)
            if fmt == BF16:  # the model's dtype
                w = w.to(x16.dtype)
            ref = reference(x16.float(), fmt, w, s, z, act, N)
            y = (wq_matmul(x16, fmt, w, s, z, act, N) if config is None
                 else _launch(x16, fmt, w, s, z, act, N, M, config=config))
            err = ((y - ref).norm(dim=1) / ref.norm(dim=1)).max().item()  # (per row: rows differ in scale)
            assert y.shape == (M, N) and not y.isnan().any(), (fmt, M, config)
            assert err < 1e-5, f"format {fmt}, act_fp8 {act}, M={M}, config {config}: relative error {err:.2e}"
            worst = max(worst, err)
codes = torch.arange(256).to(torch.uint8)
codes = codes[(codes & 0x7F) != 0x7F]  # every e4m3 code but the NaNs, subnormals and ±0 included
q = torch.zeros(len(codes), 128, dtype=torch.uint8)
q[:, 5] = codes
q = q.view(torch.float8_e4m3fn)
for M in (1, 2):  # one-hot x: y is each code's value, exactly, whichever way the kernel decodes it
    x = torch.zeros(M, 128)
    x[:, 5] = 1
    for config in ((64, 1, 4, 2, 0), (64, 1, 4, 2, 1)):
        y = _launch(x, FP8_ROW, q, torch.ones(len(codes)), None, False, len(codes), M, config=config)
        assert torch.equal(y[0], q[:, 5].float()), (M, config)
x3 = torch.randn(3, 256, dtype=torch.bfloat16)
w, s, z = operands(FP8_ROW, 64, 256)
try:  # LOWP takes 0, 3 or 4
    _launch(x3, FP8_ROW, w, s, z, False, 64, 3, config=(32, 1, 4, 2, 0, 1, 1))
    raise AssertionError("LOWP 1 was taken")
except ValueError as e:
    assert "LOWP 1 is no launch option: LOWP is 0, 3" in str(e) and "or 4" in str(e), e
for fmt, xdtype in ((INT4, torch.bfloat16), (FP8_ROW, torch.float32)):  # the fp16 dot: e4m3 weights, 16-bit x
    w, s, z = operands(fmt, 64, 256)
    try:
        _launch(x3.to(xdtype), fmt, w, s, z, False, 64, 3, config=(32, 1, 4, 2, 0, 1, 3))
        raise AssertionError(f"format {fmt} with x {xdtype} took LOWP 3")
    except ValueError as e:
        assert "LOWP 3" in str(e)
w, s, z = operands(INT4, 64, 256)
try:  # int4's fp16 pair arithmetic takes one row
    _launch(x3, INT4, w, s, z, False, 64, 3, config=(32, 1, 4, 2, 1, 1, 3))
    raise AssertionError("int4 LOWP 3 at 3 rows was taken")
except ValueError as e:
    assert "takes one row" in str(e)
try:  # several row tiles a program: the fp16 pair arithmetic's option
    _launch(x3[:1], INT4, w, s, z, False, 64, 1, config=(32, 1, 4, 2, 1, 1, 0, 2))
    raise AssertionError("TILES without LOWP 3 was taken")
except ValueError as e:
    assert "TILES 2" in str(e)
import fastqwen.ops.gemv as gemv
for fmt, M, N, K in ((FP8_ROW, 1, 200, 1024), (INT4, 5, 64, 2048), (BF16, 16, 96, 384)):  # wq_linear's partials
    w, s, z = operands(fmt, N, K)
    xp = torch.randn(M, K, dtype=torch.bfloat16)
    parts = gemv.wq_matmul(xp, fmt, w, s, z, False, N, partials=True)
    assert parts.shape == (gemv.linear_splits(fmt, N, K, M), M, N), (fmt, parts.shape)
    ref = reference(xp.float(), fmt, w, s, z, False, N)
    assert ((parts.sum(0) - ref).norm() / ref.norm()) < 1e-5
E, N, K = 5, 136, 2048  # grouped mode: the partials the fake announces (heuristic config: K split)
w, s, z = expert_operands(FP8_ROW, E, N, K)
tok, exp = torch.tensor([0, 0, 1], dtype=torch.int32), torch.tensor([4, 0, 2], dtype=torch.int32)
xg = torch.randn(2, K, dtype=torch.bfloat16)
parts = gemv._launch(xg, FP8_ROW, w, s, z, False, N, 3, (tok, exp), partials=True)
assert parts.shape[0] == gemv.split_plan(K, gemv.gemv_config(FP8_ROW, N, K, 1, 3))[1] > 1, parts.shape
ref = expert_reference(xg.float(), tok, exp, FP8_ROW, w, s, z, N)
assert ((parts.sum(0) - ref).norm() / ref.norm()) < 1e-5
for config, splits in (((32, 3, 4, 1), 3), ((32, 2, 4, 2, 0, 2), 2), ((16, 1, 4, 1, 0, 4), 1), ((16, 8, 4, 1), 3)):
    assert gemv.split_plan(384, config)[1] == splits, config  # (8 asked of 3 steps: 3)
w, s, z = operands(FP8_ROW, 64, 256)
gemv.gpu_table = lambda: {gemv.tuned_key(FP8_ROW, 64, 256, 3): [32, 1, 4, 2, 0, 1, 1]}  # a LOWP no table holds
try:
    wq_matmul(x3, FP8_ROW, w, s, None, False, 64)
    raise AssertionError("a table's LOWP 1 was taken")
except ValueError as e:
    assert "LOWP 1 is no launch option" in str(e), e
gemv.gpu_table = lambda: {gemv.tuned_key(FP8_ROW, 64, 256, 3): [32, 1, 4, 2, 0, 1, 3]}  # measured with bf16 x
assert gemv.gemv_config(FP8_ROW, 64, 256, 3) == (32, 1, 4, 2, 0, 1, 3)
y = wq_matmul(x3.float(), FP8_ROW, w, s, None, False, 64)  # fp32 x: the table's LOWP 3 is dropped, not refused
assert ((y - reference(x3.float(), FP8_ROW, w, s, None, False, 64)).norm() / y.norm()) < 1e-5
for fmt, act in ((INT4, False), (FP8_BLOCK, True)):  # a scale inside the step: wide steps are refused
    w, s, z = operands(fmt, 64, 256)
    try:
        _launch(torch.randn(1, 256), fmt, w, s, z, act, 64, 1, config=(32, 1, 4, 2, 0, 2))
        raise AssertionError(f"format {fmt} took KSTEP 2")
    except ValueError as e:
        assert "KSTEP 2 needs" in str(e)
w, s, z = operands(INT4, 200, 384)
for M in (1, 3):  # int4's scale and zero group-major (QuantLinear's layout): the same products as row-major
    x = torch.randn(M, 384, dtype=torch.float16)
    s, z = s.contiguous(), z.contiguous()
    from fastqwen.ops.gemv import group_major
    sg, zg = group_major(s), group_major(z)
    assert sg.stride() == (1, 200) and torch.equal(sg, s)
    for config in ((32, 2, 4, 2), (32, 2, 4, 2, 1)) + ((16, 2, 4, 1, 1, 2),) * (M == 1):
        assert torch.equal(_launch(x, INT4, w, sg, zg, False, 200, M, config=config),
                           _launch(x, INT4, w, s, z, False, 200, M, config=config)), (M, config)
try:  # zero laid out unlike scale
    _launch(x, INT4, w, sg, z, False, 200, 3)
    raise AssertionError("int4 took a zero laid out unlike its scale")
except ValueError as e:
    assert "one layout" in str(e)
for config in ((32, 1, 4, 1, 1, 1, 4), (64, 1, 4, 1, 0, 1, 4)):  # mma.sync: 8 rows a warp of each half; BITS
    try:
        _launch(x[:1], INT4, w, s, z, False, 200, 1, config=config)
        raise AssertionError(f"int4 took LOWP 4 with {config}")
    except ValueError as e:
        assert "LOWP 4" in str(e), e
w, s, z = operands(INT4, 64, 256)
try:  # int4 steps of several groups: one row
    _launch(x3, INT4, w, s, z, False, 64, 3, config=(32, 1, 4, 2, 1, 2))
    raise AssertionError("KSTEP 2 with int4 bit moves took 3 rows")
except ValueError as e:
    assert "KSTEP 2 with int4" in str(e)
from fastqwen.ops.gemv import _COUNTS
for fmt, M, config in ((FP8_ROW, 1, (32, 4, 4, 2)), (INT4, 1, (64, 3, 4, 2, 1)), (FP8_BLOCK, 3, (64, 2, 4, 2)),
                       (BF16, 16, (64, 4, 4, 2))):  # split-K summed in the kernel: the last program of a tile adds
    w, s, z = operands(fmt, 200, 512)
    x = torch.randn(M, 512, dtype=torch.bfloat16)
    ref = reference(x.float(), fmt, w, s, z, False, 200)
    y = _launch(x, fmt, w, s, z, False, 200, M, config=config, partials=True, fixup=True)
    assert y.shape == (1, M, 200), (fmt, y.shape)
    assert ((y[0] - ref).norm() / ref.norm()).item() < 1e-5, (fmt, M, config)
    assert torch.equal(y[0], _launch(x, fmt, w, s, z, False, 200, M, config=config)), "not the same sum"
    assert not _COUNTS[x.device].any(), "arrival counts left behind"
print("worst relative error", worst)
"""
# int4 tiled and group-major layouts against row-major, HALF2 row scales, grouped (expert) mode
_INTERPRETED_LAYOUTS = _INTERPRETED_HEAD + """
from fastqwen.ops.gemv import tile_int4, untile_int4
w, s, z = operands(INT4, 208, 384, seed=5, tiled=False)  # int4 tiled by 16 rows x a group (tile_int4): the same products
wt = tile_int4(w)
assert wt.shape == (13, 3, 16, 64) and torch.equal(untile_int4(wt), w) and tile_int4(wt) is wt
for M in (1, 3, 16):
    x = torch.randn(M, 384, dtype=torch.bfloat16)
    for config in CONFIGS + INT4_WIDE + HALF2:
        if (config in INT4_WIDE or config in HALF2) and M > 1:
            continue
        assert torch.equal(_launch(x, INT4, wt, s, z, False, 208, M, config=config),
                           _launch(x, INT4, w, s, z, False, 208, M, config=config)), (M, config)
try:  # tiled codes of another shape
    _launch(x[:1], INT4, wt, s, z, False, 192, 1)
    raise AssertionError("a tiled weight of 208 rows took N = 192")
except ValueError as e:
    assert "tiled int4" in str(e)
w, s, z = operands(INT4, 200, 384, seed=7)
for scale in (1e-6, 3e4):  # HALF2 scales x by a power of 2 into fp16's range: tiny and large rows stay exact
    x = torch.randn(1, 384, dtype=torch.bfloat16) * scale
    ref = reference(x.float(), INT4, w, s, z, False, 200)
    err = ((_launch(x, INT4, w, s, z, False, 200, 1, config=HALF2[0]) - ref).norm() / ref.norm()).item()
    assert err < 1e-5, (scale, err)
for fmt in (BF16, FP8_ROW, FP8_BLOCK, INT4):  # grouped mode: routed experts
    E, N, K = 5, 136, 256
    w, s, z = expert_operands(fmt, E, N, K)
    x = torch.randn(3, K, dtype=torch.bfloat16)
    tok = torch.tensor([0, 0, 1, 1, 2, 2], dtype=torch.int32)
    exp = torch.tensor([4, 0, 2, 4, 1, 3], dtype=torch.int32)
    ref = expert_reference(x.float(), tok, exp, fmt, w, s, z, N)
    wide = ((32, 1, 4, 3, 0, 2),) if fmt in (BF16, FP8_ROW) else ()  # steps of 256 columns (the expert sweep's)
    for config in (None, (64, 2, 4, 2), (64, 2, 4, 2, 1)) + wide:
        y = _launch(x, fmt, w, s, z, False, N, len(tok), (tok, exp), config=config)
        err = ((y - ref).norm() / ref.norm()).item()
        assert err < 1e-5, f"grouped format {fmt}, config {config}: relative error {err:.2e}"
        worst = max(worst, err)
        # tok None: token-major pairs, two a token (tok's own pattern), the row computed in the kernel
        assert torch.equal(_launch(x, fmt, w, s, z, False, N, len(tok), (None, exp), config=config), y), config
w, s, z = expert_operands(INT4, 5, 144, 256)  # int4 experts of 144 rows: tiled (tile_int4), the same products
wt = tile_int4(w, experts=True)
assert wt.shape == (5, 9, 2, 16, 64) and torch.equal(untile_int4(wt), w)
for config in (None, (64, 2, 4, 2), (64, 2, 4, 2, 1), (16, 1, 4, 1, 1, 2)):
    assert torch.equal(_launch(x, INT4, wt, s, z, False, 144, len(tok), (tok, exp), config=config),
                       _launch(x, INT4, w, s, z, False, 144, len(tok), (tok, exp), config=config)), config
print("worst relative error", worst)
"""


def test_kernel_matches_reference_in_the_triton_interpreter():
    """The kernel's interpreter checks in two halves (~2 min each), two processes at once."""
    for out in run_in_triton_interpreter(_INTERPRETED, _INTERPRETED_LAYOUTS):
        assert "worst relative error" in out


def test_launch_configs_fall_back_to_the_nearest_measured_shape():
    """A shape the sweep has not seen (a fused projection) takes the config measured for the nearest N with
    the same format, K and row bucket; nothing within 2× of N: None (the heuristic)."""
    table = {"0:17408x5120:M1": [32, 1, 4, 4], "0:12288x5120:M1": [32, 2, 4, 2], "0:12288x5120:M4": [128, 4, 4, 4],
             "2:16480x5120:M1": [64, 4, 4, 2]}
    assert tuned_config(table, FP8_ROW, 12288, 5120, 1) == [32, 2, 4, 2]  # measured
    assert tuned_config(table, FP8_ROW, 16480, 5120, 1) == [32, 1, 4, 4]  # nearest N, same format
    assert tuned_config(table, FP8_ROW, 14336, 5120, 1) == [32, 2, 4, 2]
    assert tuned_config(table, FP8_ROW, 14336, 5120, 3) == [128, 4, 4, 4]  # row bucket M4
    assert tuned_config(table, FP8_ROW, 34816, 5120, 1) == [32, 1, 4, 4]
    assert tuned_config(table, FP8_ROW, 40000, 5120, 1) is None and tuned_config(table, FP8_ROW, 16480, 6144, 1) is None


def test_auto_linears_take_the_kernel_only_where_the_sweep_measured_it_faster():
    table = {"cublas:5120x6144:M1": [30.0, 26.5], "cublas:5120x6144:M16": [31.0, 33.0], "3:5120x6144:M1": [64, 4, 4, 4]}
    assert gemv_beats_cublas(table, 5120, 6144, 1)
    assert not gemv_beats_cublas(table, 5120, 6144, 9)  # M16 bucket: cuBLAS was faster
    assert not gemv_beats_cublas(table, 5120, 17408, 1)  # never measured: cuBLAS
    assert tuned_config(table, BF16, 5120, 6144, 1) == [64, 4, 4, 4] and tuned_config(table, BF16, 12288, 6144, 1) is None


def test_grouped_configs_are_measured_per_pair_bucket(monkeypatch):
    """Grouped mode takes the expert sweep's config for its pair-count bucket (expert_key), never a linear-mode
    entry of the same shape, and its heuristic where the sweep has not measured."""
    import fastqwen.ops.gemv as gemv

    assert expert_key(BF16, 1024, 2048, 9) == "3:1024x2048:P16" and expert_key(BF16, 1024, 2048, 72) == "3:1024x2048:P128"
    assert expert_key(BF16, 1024, 2048, 300) is None
    heuristic = gemv_config(BF16, 1024, 2048, 1, 40)  # (gpu_table is empty off CUDA)
    table = {"3:1024x2048:P16": [128, 2, 4, 3, 0, 2], "3:1024x2048:M1": [32, 8, 4, 2]}
    monkeypatch.setattr(gemv, "gpu_table", lambda: table)
    assert gemv_config(BF16, 1024, 2048, 1, 9) == (128, 2, 4, 3, 0, 2)
    assert gemv_config(BF16, 1024, 2048, 1, 40) == heuristic  # bucket P64: not measured
    assert gemv_config(BF16, 1024, 2048, 1) == (32, 8, 4, 2)  # the linear mode's own entry


_SM90 = """
import re
import triton.language as tl
from sm90 import compile_sm90, count, cuobjdump, main_loop, stack_bytes
from fastqwen.ops import gemv

ALIGNED = ("x_ptr", "w_ptr", "s_ptr", "z_ptr", "y_ptr", "N", "K", "k_per_split")

def w_type(fmt, bits):
    return "*i32" if bits else "*u8" if fmt == gemv.INT4 else "*bf16" if fmt == gemv.BF16 else "*fp8e4nv"

def sz_types(fmt):  # scale and zero: int4's fp16 and uint8 (formats.INT4_SCALE, INT4_ZERO), the fp8 formats' fp32
    return dict(s_ptr="*fp16", z_ptr="*u8") if fmt == gemv.INT4 else dict(s_ptr="*fp32", z_ptr="*fp32")

def ptx(fmt, lowp, act=False, bits=False, pdl=False, fixup=0):  # the 16-row kernel
    sig = dict(x_ptr="*bf16", w_ptr=w_type(fmt, bits), **sz_types(fmt),
               y_ptr="*fp32", M="i32", N="i32", K="i32", s_stride="i32", g_stride="i32", k_per_split="i32",
               cnt_ptr="*i32")
    consts = dict(FMT=fmt, ACT_FP8=act, FP8_LIMIT=448.0, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, STAGES=4, BITS=bits,
                  LOWP=lowp, PDL=pdl, FIXUP=fixup)
    return compile_sm90(gemv._gemv_kernel, sig, consts, ALIGNED, num_stages=4).asm["ptx"]

def row_kernel(fmt, bits, BN=128, pdl=False, fixup=0, grouped=False, swiglu=0, per_row=0, half2=0, stages=2, tiles=1):
    # one-row kernel, 128-column steps
    sig = dict(x_ptr="*fp32" if swiglu else "*bf16", w_ptr=w_type(fmt, bits), **sz_types(fmt),
               y_ptr="*fp32", tok_ptr="*i32", exp_ptr="*i32", N="i32", K="i32", s_stride="i32", g_stride="i32",
               w_estride="i32", s_estride="i32", k_per_split="i32", ONE="i32", cnt_ptr="*i32", xp_ptr="*i32")
    acc_k = 128 // (8 if fmt == gemv.INT4 else 4) if bits else 64 if fmt == gemv.INT4 else 128
    consts = dict(FMT=fmt, ACT_FP8=False, GROUPED=grouped, FP8_LIMIT=448.0, BLOCK_N=BN, BLOCK_K=128, ACC_K=acc_k,
                  STAGES=stages, BITS=bits, PDL=pdl, FIXUP=fixup, SWIGLU=swiglu, PER_ROW=per_row,
                  ACT_DTYPE=tl.bfloat16, HALF2=half2, ASM=1, TILES=tiles)
    return compile_sm90(gemv._row_kernel, sig, consts, ALIGNED + ("xp_ptr",), num_stages=stages)

def sass(fmt, bits, BN=128):
    return cuobjdump(row_kernel(fmt, bits, BN), "-sass")

# bit-move decoding: no conversion instruction touches the weights (x's bf16 -> fp32 is a shift, an IMAD.U32; int4's
# one I2F is its row's uint8 zero); int4: one and-or LOP3 per weight (128 rows x 128 columns / 128 threads = 128
# weights a thread a step)
for fmt in (gemv.FP8_ROW, gemv.INT4):
    code = sass(fmt, True)
    assert count(code, "I2F") <= (fmt == gemv.INT4) and count(code, "F2F") == 0, (fmt, "conversions in the bit-move decode")
assert count(sass(gemv.INT4, False), "I2F") >= 128  # (the conversion decode, for contrast)
assert count(sass(gemv.INT4, True), "LOP3") <= 1.25 * 128

for fmt in (gemv.FP8_ROW, gemv.INT4):
    code = ptx(fmt, 0)
    assert "cp.async" in code, "the weight is not staged asynchronously"
    assert "wgmma" not in code and "mma.sync" in code

# LOWP 3: fp16 mma, the e4m3 weight decoded by cvt.rn.f16x2.e4m3x2 alone
for fmt in (gemv.FP8_ROW, gemv.FP8_BLOCK):
    code = ptx(fmt, 3)
    assert re.search(r"mma\\S*\\.f32\\.f16\\.f16", code), (fmt, "no fp16 dot")
    assert "tf32" not in code and "cvt.rn.bf16" not in code, fmt  # (x's bf16 → fp32 stays)
    assert code.count("cvt.rn.f16x2.e4m3x2") >= 32, fmt  # [64, 128] weights / 128 threads, 2 a cvt
    assert "cvt.f32.f16" not in code, (fmt, "the weight goes through fp32")

# int4 at one row in fp16 pair arithmetic (HALF2: BITS with LOWP 3), as the 27B sweep ships it (unstaged): 8 codes a
# word in 4 LOP3, 2 HADD2 and 6 HFMA2 / HMUL2 (128 rows x 16 words / 128 threads: 16 words a thread a step), no
# conversion instruction on the codes (x's F2F are the prologue's), no spill; unmasked weight rows (no predicate a row)
kernel = row_kernel(gemv.INT4, True, 128, half2=1, stages=1)
code = cuobjdump(kernel, "-sass")
packed = count(code, "HFMA2") + count(code, "HMUL2")
assert 6 * 16 <= packed <= 8 * 16 and 2 * 16 <= count(code, "HADD2") <= 5 * 16, (packed, count(code, "HADD2"))
assert count(code, "I2F") == 0 and count(code, "LOP3") >= 4 * 16 and stack_bytes(kernel) == 0
assert "fma.rn.f16x2" in kernel.asm["ptx"] and "bar.sync" in kernel.asm["ptx"]  # (the prologue's barrier)
assert count(code, "SEL") < count(sass(gemv.INT4, True), "SEL"), "per-row predicates in the HALF2 loop"
# two row tiles a program (TILES 2): one prologue (one barrier), twice the pair arithmetic, no spill
two = row_kernel(gemv.INT4, True, 128, half2=1, stages=1, tiles=2)
code2 = cuobjdump(two, "-sass")
assert count(code2, "HFMA2") + count(code2, "HMUL2") >= 2 * 6 * 16 and stack_bytes(two) == 0
prologue = lambda ptx: (len(re.findall(r"\\bmax\\.", ptx)), ptx.count("cvt.rn.f16"))  # x's largest magnitude, fp16 x  # noqa: E731
assert prologue(two.asm["ptx"]) == prologue(kernel.asm["ptx"]), "a prologue a tile"
# the pairs into mma.sync (LOWP 4): a 16-byte load a thread and row (the fragment layout, checked as _launch checks
# it), one HMMA per 16 codes of the two rows a call takes (128 rows x 16 words / 128 threads: 16 words, 8 a row
# set: 16 HMMA a step), no fp16 accumulation, no register moves to pair x for the B operand, no spill
mma = row_kernel(gemv.INT4, True, 128, pdl=True, half2=2, stages=1)  # (Hopper's launch: "auto" is PDL)
gemv.mma_layout_check(mma)
code = cuobjdump(mma, "-sass")
assert count(main_loop(code), "HMMA") == 16 and stack_bytes(mma) == 0, count(main_loop(code), "HMMA")
assert count(code, "HFMA2") + count(code, "HADD2") <= 4 * 16 + 8, "pair arithmetic beyond the decode"
assert count(code, "IMAD.MOV") < 2 * 16, count(code, "IMAD.MOV")  # (x's pairs by pair index took two a HMMA)
# int4 codes tiled by 16 rows x a group (tile_int4): both one-row pair kernels read 16 bytes a load (128 rows x 16
# words / 128 threads / 4 words a load: 4 loads a step, and 4 for x's pairs)
for half2 in (1, 2):
    sig = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*fp16", z_ptr="*u8", y_ptr="*fp32", tok_ptr="*i32", exp_ptr="*i32",
               N="i32", K="i32", s_stride="i32", g_stride="i32", w_estride="i32", s_estride="i32", k_per_split="i32",
               ONE="i32", cnt_ptr="*i32", xp_ptr="*i32")
    consts = dict(FMT=gemv.INT4, ACT_FP8=False, GROUPED=False, FP8_LIMIT=448.0, BLOCK_N=128, BLOCK_K=128, ACC_K=16,
                  STAGES=1, BITS=True, PDL=True, FIXUP=0, SWIGLU=0, PER_ROW=0, ACT_DTYPE=tl.bfloat16, HALF2=half2, ASM=1,
                  TILES=1, TILED=1)
    tiled = compile_sm90(gemv._row_kernel, sig, consts, ALIGNED + ("xp_ptr",), num_stages=1)
    loop = main_loop(cuobjdump(tiled, "-sass"))
    assert count(loop, "LDG.E.128") == 8 and count(loop, "BAR") == 0, (half2, count(loop, "LDG.E.128"))
    if half2 == 2:
        gemv.mma_layout_check(tiled)

# programmatic dependent launch: every global read of the previous kernel's output comes after griddepcontrol.wait,
# the weight's L2 prefetches before it; each format's weight layout, both kernels
for fmt, bits, half2 in ((gemv.FP8_ROW, False, 0), (gemv.FP8_ROW, True, 0), (gemv.INT4, False, 0), (gemv.INT4, True, 0),
                         (gemv.BF16, False, 0), (gemv.INT4, True, 1)):
    for code in (row_kernel(fmt, bits, 32, pdl=True, half2=half2).asm["ptx"], ptx(fmt, 0, bits=bits, pdl=True)):
        wait = code.index("griddepcontrol.wait")
        reads = [m.start() for m in re.finditer(r"ld\\.global|cp\\.async\\.c", code)]
        assert reads and min(reads) > wait, (fmt, bits, "a global read before the wait")
        assert 0 < code.index("prefetch.global.L2") < wait and "griddepcontrol.launch_dependents" in code, (fmt, bits)
    # int4's one-row kernel lets the next kernel launch only after its last store; the others right after the wait
    code = row_kernel(fmt, bits, 32, pdl=True, half2=half2).asm["ptx"]
    trigger, stores = code.index("griddepcontrol.launch_dependents"), [m.start() for m in re.finditer(r"st\\.global", code)]
    assert stores and (trigger > max(stores) if fmt == gemv.INT4 else trigger < min(stores)), (fmt, bits, half2)
    assert "griddepcontrol" not in row_kernel(fmt, bits, 32).asm["ptx"]  # (without PDL: none)
# grouped mode (kernels={"experts": "grouped-pdl"}): the pairs are the router's output, so nothing is read, not even
# prefetched, before the wait
for fmt in (gemv.BF16, gemv.FP8_ROW):
    code = row_kernel(fmt, False, 32, pdl=True, grouped=True).asm["ptx"]
    wait = code.index("griddepcontrol.wait")
    reads = [m.start() for m in re.finditer(r"ld\\.global|cp\\.async\\.c|prefetch", code)]
    assert reads and min(reads) > wait and "griddepcontrol.launch_dependents" in code, (fmt, "grouped: read before the wait")

# PER_ROW (decode's token-major pairs, tok None): the x row from the pair's index, tok never read
loads = lambda code: len(re.findall(r"ld\\.global", code))  # noqa: E731
for fmt in (gemv.BF16, gemv.FP8_ROW):
    with_tok, per_row = (row_kernel(fmt, False, 32, grouped=True, per_row=r).asm["ptx"] for r in (0, 9))
    assert loads(per_row) == loads(with_tok) - 1, (fmt, loads(per_row), loads(with_tok))

# split-K summed in the kernel: an acquire-release count at GPU scope after a CTA barrier, reads of the partials
# from L2 (.cg); without FIXUP no atomic at all
for code in (row_kernel(gemv.FP8_ROW, False, 32, fixup=4).asm["ptx"], ptx(gemv.FP8_ROW, 0, fixup=4)):
    atom = code.index("atom.global.gpu.acq_rel.add")
    assert code.rfind("bar.sync", 0, atom) > 0 and "ld.global.cg" in code[atom:], "fixup's ordering"
assert "atom." not in row_kernel(gemv.FP8_ROW, False, 32).asm["ptx"] and "atom." not in ptx(gemv.FP8_ROW, 0)

# SWIGLU (kernels={"expert_act": "fused"}, grouped, bf16 and fp8-weight experts; {"mlp_act": "fused"}, linear
# with PDL and the fixup as decode runs it): the activation from 3 partials at the tile the sweeps took for the
# 35B expert and 9B down projections; no spill, and the activation rounded to bf16 to nearest
for fmt, swiglu, grouped, pdl, fixup in ((gemv.BF16, 0, True, False, 0), (gemv.BF16, 3, True, False, 0),
                                         (gemv.BF16, 0, False, True, 4), (gemv.BF16, 3, False, True, 4),
                                         (gemv.FP8_ROW, 0, True, False, 0), (gemv.FP8_ROW, 3, True, False, 0)):
    kernel = row_kernel(fmt, False, 32, grouped=grouped, swiglu=swiglu, pdl=pdl, fixup=fixup)
    assert stack_bytes(kernel) == 0, (fmt, swiglu, grouped, "spills")
    rounded = "ex2.approx" in kernel.asm["ptx"] and "cvt.rn.bf16.f32" in kernel.asm["ptx"]
    assert rounded == bool(swiglu), (fmt, swiglu, "the activation is not computed here and rounded to bf16 to nearest")
# a grouped launch under PDL (its pairs' experts are the router's output) loads and prefetches nothing before it waits
code = row_kernel(gemv.FP8_ROW, False, 32, grouped=True, per_row=9, pdl=True).asm["ptx"]
assert "ld.global" not in code[:code.index("griddepcontrol.wait")] and "prefetch.global.L2" not in code
print("ok")
"""


def test_kernels_compile_for_sm90_as_designed():
    """Compiled for sm90 here (no GPU: Triton ships ptxas and cuobjdump). The one-row kernel's bit-move
    decoding issues no conversion instruction, and int4's takes one LOP3 a weight. The 16-row kernel stages the
    weight with cp.async and its dot is an mma.sync (fp8 and int4); with LOWP 3 an fp16 one, the e4m3 weight
    decoded by one conversion per two values. SWIGLU computes the activation and rounds it to bf16 to nearest
    (cvt.rn), without spilling. A grouped launch under PDL loads nothing before its wait."""
    assert run_in_triton_interpreter(_SM90, interpret=False).strip().endswith("ok")


