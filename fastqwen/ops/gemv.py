"""Weight-streaming matmul for few rows: y = x · Wᵀ with W read once, in its stored format, dequantized in
registers. Two uses: quantized linears at M ≤ 64 rows (decode, speculative verify: up to 4 rows of a
16-token block, 16 rows of 4 MTP positions), and the routed experts of a MoE layer (each (token, expert)
pair multiplies one row by one expert's weight, read in place: no gathered copy of the selected experts).
Quantized experts (quant/experts.py) use the second, and so do bf16 experts on CUDA by default (`moe.routed_moe`;
kernels={"experts": "gather"} gathers copies then multiplies: 2.23× slower on 35B-A3B, 2026-12-01).

Two Triton kernels, four formats (constexpr FMT):
  FP8_ROW    w e4m3 [N, K], scale [N]: acc · scale[n] at the end.
  FP8_BLOCK  w e4m3 [N, K], scale_inv [⌈N/128⌉, ⌈K/128⌉]: each 128-column step adds (x·wᵀ) · scale_inv[n/128, k/128];
             with ACT_FP8, x is first rounded per row and 128 columns to e4m3 (the "fp8" scheme's numerics).
  INT4       w uint8 [N, K/2], two codes a byte (low nibble = even column), scale fp16 and zero uint8 [N, K/128]:
             w = (q − zero) · scale (quant/formats.py).
  BF16       w [N, K] in the model dtype.
`_row_kernel` takes one row of x (batch-1 decode; each (token, expert) pair of the grouped mode): products
accumulate elementwise in registers, summed over K once at the end. `_gemv_kernel` takes 2 … 64 rows (a
program's BLOCK_M: 16, 32 or 64, the fewest that hold them; the weight is still read once) with a
tensor-core dot per step (fp32 operands, tf32: exact for e4m3 weights and bf16 activations, int4's
dequantized weights round to 2⁻¹¹ relative; the kernel is bound by weight bytes, not math; with the launch
config's LOWP 3 they are fp16, the fp8 weight converted by one instruction per two values and x scaled by a
power of 2: fp16_dot_ok).
Either decodes the weight with conversion instructions or, with the launch config's BITS, by moving bits (fp8: sign,
exponent and mantissa into fp32's places, a 2⁻¹²⁰-scaled value; int4: in the one-row kernel the code in
1.0's top mantissa bits, 1 + q/16, one LOP3 and one FFMA a weight; in the dot kernel OR-ed into 2²³'s bits; with
LOWP 3, one row on the CUDA cores in fp16 pair arithmetic, two codes at a time into the mantissas of an fp16 pair,
x scaled by a power of 2 into fp16: _int4_half2, 2 instructions a weight; with LOWP 4 the same pairs into
warp-wide mma.sync, exact products summed in fp32: _int4_mma, ~1.7 a weight):
conversions run at a fraction of the FMA rate (the M = 1 sweep found bit moves no faster for fp8: 62–76%
of bandwidth either way). The sweep decides per shape. A program owns BLOCK_N output columns and walks its share of K in
steps of 128 columns, or KSTEP × 128 (launch option; fp8-weight and bf16 without BITS, whose scales do not change
inside a step; int4 with BITS at one row, a step of KSTEP groups): an fp8 step of 128
columns moves half the bytes of a bf16 one, and the M = 1 sweep found bf16 at 88–97% of bandwidth where fp8
reached 62–76%. Split-K programs write partial sums that one add combines
(deterministic, no atomics). Launch
configs come from gemv_configs.json, measured per GPU by scripts/bench_quant.py --sweep (a shape not yet swept
takes the nearest measured N with the same K), else from a
heuristic. Grouped mode (experts): w, scale, zero carry a leading expert dimension; pair p multiplies row
tok[p] of x by expert exp[p] into row p of y. Both kernels also run in Triton's CPU interpreter, where
tests/test_gemv.py checks them, all but PDL's inline PTX: that is pinned by compiling for sm90 on the CPU and
checked against the reference on the GPU. `wq_linear` and `expert_gemv` (split-K partials, summed by the caller) are the
registered ops: the kernels on CUDA, the torch reference elsewhere. In linear mode either kernel can launch
with programmatic dependent launch (pdl, Hopper+): it starts while the previous kernel finishes, prefetches its
first weight steps into L2, and waits for that kernel before it reads x (_dependent_start).
"""

import json
import math
import pathlib
import re

import torch

from ..quant.formats import (
    FP8_MAX,
    INT4_SCALE,
    INT4_ZERO,
    KERNEL_GROUP,
    TILE_ROWS,
    dequantize_fp8_block,
    dequantize_fp8_rows,
    fake_quantize_fp8_activations,
    pack_int4,
    quantize_fp8_block,
    quantize_fp8_rows,
    quantize_int4,
    tile_int4,
    unpack_int4,
    untile_int4,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the ops fall back to the reference
    triton = None

FP8_ROW, FP8_BLOCK, INT4, BF16 = 0, 1, 2, 3
# the dtypes a SWIGLU launch can round the activation to (the activations'), as Triton names them
_TL_DTYPES = {} if triton is None else {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
                                        torch.float32: tl.float32}
FORMATS = {"fp8-weight": FP8_ROW, "fp8": FP8_BLOCK, "int4": INT4}
MAX_ROWS = 64  # the linear mode's largest BLOCK_M; more rows take the reference path (prefill: dequantize, GEMM)
ROW_BUCKETS = (1, 4, 16, 64)  # launch configs are measured per bucket: the fewest rows of these that hold M
PAIR_BUCKETS = (16, 64, 128, 256)  # grouped-mode configs per bucket of (token, expert) pairs: 9 a token on 35B-A3B
STEP = KERNEL_GROUP  # BLOCK_K: one fp8 scale block or one int4 group per step
# 1.0f's bits, passed to the row kernel as a run-time value: held in a register, int4's mask-and-or decode
# (_int4_unit) compiles to one LOP3 instead of two (a LOP3 takes one immediate)
ONE_BITS = 0x3F800000


def _int4_mma_asm() -> str:
    """_int4_mma's PTX for one call (pack 4): operands $0-$3 out; ua $4-$7, ub $8-$11, x0 $12-$15, x1 $16-$19,
    x2 $20-$23, x3 $24-$27, zla $28, zha $32, zlb $36, zhb $40, sa $44, sb $48 (4 copies each: the first is read).
    Word e's codes decode to pairs j = 0 … 3 (q − zero for nibbles j and j + 4, as _int4_half2 pairs them with
    x_j); one mma per pair j and two words e, e + 1 takes rows a and b of both as A (k slots 2c, 2c + 1: word e;
    2c + 8, 2c + 9: word e + 1) and x_j of the same words as B, registers a 16-byte load left side by side."""
    dec = ("lop3.b32 t, {u}, 0x000F000F, 0x64006400, 0xea; sub.rn.f16x2 {p}0, t, {zl}; "
           "lop3.b32 t, {u}, 0x00F000F0, 0x64006400, 0xea; fma.rn.f16x2 {p}1, t, c, {zh}; "
           "shr.u32 v, {u}, 8; "
           "lop3.b32 t, v, 0x000F000F, 0x64006400, 0xea; sub.rn.f16x2 {p}2, t, {zl}; "
           "lop3.b32 t, v, 0x00F000F0, 0x64006400, 0xea; fma.rn.f16x2 {p}3, t, c, {zh}; ")
    body = []
    for e in (0, 2):
        for w in (e, e + 1):
            body.append(dec.format(u=f"${4 + w}", zl="$28", zh="$32", p=f"a{w - e}"))
            body.append(dec.format(u=f"${8 + w}", zl="$36", zh="$40", p=f"b{w - e}"))
        for j in range(4):
            body.append(f"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{d0, d1, d2, d3}}, "
                        f"{{a0{j}, b0{j}, a1{j}, b1{j}}}, {{${12 + 4 * j + e}, ${13 + 4 * j + e}}}, {{d0, d1, d2, d3}}; ")
    pairs = ", ".join(f"{r}{w}{j}" for r in "ab" for w in range(2) for j in range(4))
    return ("{ .reg .b32 t, v, c, " + pairs + "; .reg .f32 d0, d1, d2, d3; "
            "mov.b32 c, 0x2C002C00; mov.f32 d0, 0f00000000; mov.f32 d1, 0f00000000; mov.f32 d2, 0f00000000; "
            "mov.f32 d3, 0f00000000; " + "".join(body) +
            "mul.f32 $0, d0, $44; mul.f32 $1, d2, $48; mov.f32 $2, 0f00000000; mov.f32 $3, 0f00000000; }")


if triton is not None:
    _INT4_MMA_ASM = tl.constexpr(_int4_mma_asm())
    _INT4_MMA_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 4 + ["r"] * 40 + ["f"] * 8))

    @triton.jit
    def _pair_pointers(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, tok_ptr, exp_ptr, N, K, w_estride, s_estride,
                       SWIGLU: tl.constexpr, PER_ROW: tl.constexpr):
        """Grouped mode: move the pointers to pair program_id(1)'s x row (tok[p], or p // PER_ROW when PER_ROW is
        set: then tok is unread), expert and output row (with SWIGLU, x row p of the gate | up partials, 2K
        wide, whatever tok holds)."""
        p = tl.program_id(1)
        e = tl.load(exp_ptr + p).to(tl.int64)
        if SWIGLU:
            x_ptr = x_ptr + p.to(tl.int64) * 2 * K
        elif PER_ROW:
            x_ptr = x_ptr + (p // PER_ROW).to(tl.int64) * K
        else:
            x_ptr = x_ptr + tl.load(tok_ptr + p).to(tl.int64) * K
        return x_ptr, w_ptr + e * w_estride, s_ptr + e * s_estride, z_ptr + e * s_estride, y_ptr + p.to(tl.int64) * N

    @triton.jit
    def _swiglu_x(x_ptr, k, k_ok, K, split_stride, SWIGLU: tl.constexpr, dtype: tl.constexpr):
        """Columns k of silu(g)·u rounded to `dtype` (as the reference rounds the activation before the down
        projection), g | u = the sum of SWIGLU split-K partials, split_stride apart, of a gate | up row."""
        g = tl.zeros(k.shape, tl.float32)
        u = tl.zeros(k.shape, tl.float32)
        for s in tl.static_range(SWIGLU):
            g += tl.load(x_ptr + s * split_stride + k, mask=k_ok, other=0.0)
            u += tl.load(x_ptr + s * split_stride + K + k, mask=k_ok, other=0.0)
        return (g / (1.0 + tl.exp(-g)) * u).to(dtype).to(tl.float32)

    @triton.jit
    def _fp8_bits(u, i: tl.constexpr):
        """Byte i of each int32 word u, an e4m3 code, as fp32 · 2⁻¹²⁰, exactly (subnormals too): its sign,
        exponent and mantissa bits moved into fp32's places, with no conversion instruction."""
        return ((((u >> (8 * i)) & 0x7F) << 20) | (((u >> (8 * i + 7)) & 1) << 31)).to(tl.float32, bitcast=True)

    @triton.jit
    def _int4_bits(u, i: tl.constexpr):
        """Nibble i of each int32 word u, an int4 code q, as the fp32 2²³ + q, exactly, with no conversion
        instruction (2²³'s exponent OR-ed onto the code's bits)."""
        return (((u >> (4 * i)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)

    @triton.jit
    def _int4_unit(u, i: tl.constexpr, one):
        """Nibble i of each int32 word u, an int4 code q, as the fp32 1 + q/16, exactly: the code moved into the
        top mantissa bits of 1.0 by one shift and one and-or (a LOP3; `one` is 1.0's bits, ONE_BITS, in a
        register), with no conversion instruction. Its product with x is exact in fp32 (5 significant bits
        times bf16's 8), and (1 + q/16) · x keeps q's part at full precision, unlike 2²³ + q, whose product
        would round q · x away."""
        if 4 * i <= 19:
            m = (u << (19 - 4 * i)) & 0x00780000
        else:
            m = (u >> (4 * i - 19)) & 0x00780000
        return (m | one).to(tl.float32, bitcast=True)

    @triton.jit
    def _half2_bits(a, b):
        """int32 words holding the fp16 pair (a, b), a in the low half, each rounded to nearest from fp32."""
        lo = a.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return lo | (b.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16)

    @triton.jit
    def _half2_half(p, H: tl.constexpr):
        """Half H (0: low, 1: high) of int32 fp16 pairs p, as fp32."""
        return ((p >> (16 * H)) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _half2_pair_dot(u, p, j: tl.constexpr, z):
        """(q_j − z) · x_j + (q_{j+4} − z) · x_{j+4} in fp32: nibbles j and j + 4 of words u, fp16 pair p of x."""
        return ((((u >> (4 * j)) & 0xF).to(tl.float32) - z) * _half2_half(p, 0)
                + (((u >> (4 * j + 16)) & 0xF).to(tl.float32) - z) * _half2_half(p, 1))

    @triton.jit
    def _int4_half2(u, x0, x1, x2, x3, zlo, zhi, ASM: tl.constexpr):
        """Σ (q − zero) · x over the 8 int4 codes q of each int32 word u, in fp32 from fp16 pair arithmetic. xj
        holds the fp16 pair (x[8w + j], x[8w + 4 + j]) of word w's columns (the low half first: nibbles j and
        j + 4 of the word), zlo the pair 1024 + zero, zhi −(64 + zero). With ASM, 16 instructions for 8 weights:
        a LOP3 ORs two codes into the mantissas of a 1024 pair (1024 + q; the odd nibbles, left in place, give
        1024 + 16q), one packed subtraction (or FMA by 1/16) makes q − zero exact, one packed FMA accumulates two
        products (|sum| ≤ 4 · 16 · 512 in each half: _half2_prologue's scale), and the two halves add in fp32.
        Without ASM (Triton's interpreter runs no inline PTX) the same sum in fp32."""
        if ASM:
            r = tl.inline_asm_elementwise(
                "{ .reg .b32 t, v, a, c; .reg .b16 l, h; .reg .f32 fl, fh; mov.b32 c, 0x2C002C00; "
                "lop3.b32 t, $1, 0x000F000F, 0x64006400, 0xea; sub.rn.f16x2 t, t, $6; mul.rn.f16x2 a, t, $2; "
                "lop3.b32 t, $1, 0x00F000F0, 0x64006400, 0xea; fma.rn.f16x2 t, t, c, $7; fma.rn.f16x2 a, t, $3, a; "
                "shr.u32 v, $1, 8; "
                "lop3.b32 t, v, 0x000F000F, 0x64006400, 0xea; sub.rn.f16x2 t, t, $6; fma.rn.f16x2 a, t, $4, a; "
                "lop3.b32 t, v, 0x00F000F0, 0x64006400, 0xea; fma.rn.f16x2 t, t, c, $7; fma.rn.f16x2 a, t, $5, a; "
                "mov.b32 {l, h}, a; cvt.f32.f16 fl, l; cvt.f32.f16 fh, h; add.f32 $0, fl, fh; }",
                "=f,r,r,r,r,r,r,r", [u, x0, x1, x2, x3, zlo, zhi], dtype=tl.float32, is_pure=True, pack=1)
        else:
            z = _half2_half(zlo, 0) - 1024.0
            r = (_half2_pair_dot(u, x0, 0, z) + _half2_pair_dot(u, x1, 1, z) + _half2_pair_dot(u, x2, 2, z)
                 + _half2_pair_dot(u, x3, 3, z))
        return r

    @triton.jit
    def _int4_mma(ua, ub, x0, x1, x2, x3, zla, zha, zlb, zhb, sa, sb, ASM: tl.constexpr):
        """Rows a and b of a group (128 columns) on the tensor cores: ua, ub [R, 16] int32 words of two row sets,
        x0 … x3 the fp16 pairs of x as _int4_half2 takes them, zl / zh the zero pairs of each row set (as
        _int4_half2's zlo / zhi), sa / sb their group scales. Returns [R, 16] fp32 whose columns 4c (c = 0 … 3)
        each hold sa · Σ (q − zero) · x over row a's group, columns 4c + 1 the same for row b, and zeros elsewhere
        (four copies of each sum: the caller takes a quarter of their total, exactly).
        With ASM each call takes a thread's 4 words of one row of each set (pack 4) and runs a warp-wide
        mma.sync.m16n8k16 (fp16 in, fp32 sums) per 2 words and pair index: the weight tile's layout puts lane l on row
        l // 4 of its warp's 8 rows and words 4 (l % 4) … + 3, which is the A operand's fragment (rows a as the
        mma's rows 0 … 7, rows b as 8 … 15) with the group's 128 columns permuted among the k slots; x's pairs
        for the same words are the B operand (all 8 of its columns the same x, so every column of the product is
        the row sum). _launch checks the layout (mma_layout_check). The decode is _int4_half2's: a LOP3 and a
        packed subtraction or FMA per two codes, q − zero exact in fp16."""
        if ASM:
            r = tl.inline_asm_elementwise(_INT4_MMA_ASM, _INT4_MMA_CONSTRAINTS,
                                          [ua, ub, x0, x1, x2, x3, zla, zha, zlb, zhb, sa, sb], dtype=tl.float32,
                                          is_pure=True, pack=4)
        else:
            col = tl.arange(0, 16)[None, :]
            a = tl.sum(_int4_half2(ua, x0, x1, x2, x3, zla, zha, ASM), axis=1)[:, None] * sa
            b = tl.sum(_int4_half2(ub, x0, x1, x2, x3, zlb, zhb, ASM), axis=1)[:, None] * sb
            r = tl.where(col % 4 == 0, a, tl.where(col % 4 == 1, b, 0.0))
        return r

    @triton.jit
    def _half2_prologue(x_ptr, xp_ptr, k_start, k_end, K):
        """HALF2's x: columns [k_start, k_end) of the row, scaled by the power of 2 that puts the largest magnitude
        in (256, 512], as fp16 pairs (x[8w + j], x[8w + 4 + j]) written to xp[j, w] ([4, K / 8] int32), the
        operands _int4_half2 takes; returns the scale. Every program of a split writes the same values (a
        benign race); a CTA barrier orders this program's writes before its threads read them."""
        amax = tl.zeros((1024,), tl.float32)
        for c in range(k_start, k_end, 1024):
            k = c + tl.arange(0, 1024)
            amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + k, mask=k < k_end, other=0.0).to(tl.float32)))
        xs = 512.0 / _pow2_at_least(tl.maximum(tl.max(amax, axis=0), 1e-30))
        for c in range(k_start // 8, k_end // 8, 128):
            w = c + tl.arange(0, 128)
            ok = w < k_end // 8
            for j in tl.static_range(4):
                a = tl.load(x_ptr + 8 * w + j, mask=ok, other=0.0).to(tl.float32) * xs
                b = tl.load(x_ptr + 8 * w + 4 + j, mask=ok, other=0.0).to(tl.float32) * xs
                tl.store(xp_ptr + j * (K // 128 * 16) + w, _half2_bits(a, b), mask=ok)
        tl.debug_barrier()
        return xs

    @triton.jit
    def _prefetch_l2(ptrs, ok):
        """prefetch.global.L2 of each address in `ptrs` where `ok` (one a 128-byte line is enough)."""
        tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                                  "=r,l,r", [ptrs, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _int4_at(n, i, K, UNIT: tl.constexpr, TILED: tl.constexpr):
        """Offset of unit i (UNIT 16: int32 words of 8 codes; 64: bytes of 2) of int4 weight row n, row-major
        ([N, K/8] words) or TILED: 16 rows × one group of 128 columns contiguous (1 KB), tiles in row-tile-major,
        then group order (tile_int4). Broadcasts n against i."""
        if TILED:
            r = ((n // 16) * (K // 128) + i // UNIT) * (16 * UNIT) + (n % 16) * UNIT + i % UNIT
        else:
            r = n * (K // 128 * UNIT) + i
        return r

    @triton.jit
    def _row_load(ptrs, ASM: tl.constexpr):
        """The fp16 or uint8 values at `ptrs` (one a row of a weight tile: int4's scales, zeros), as fp32 or int32,
        loaded in the layout `ptrs` has. A tl.load would be laid out for coalescing and converted to the tile's row
        layout through shared memory, two CTA barriers a conversion, every step; this asm load is elementwise, so
        it takes its operand's layout. The threads that share a row read one address: one transaction. Without
        ASM (the interpreter): tl.load."""
        if ASM and ptrs.dtype.element_ty == tl.float16:
            r = tl.inline_asm_elementwise("ld.global.nc.b16 $0, [$1];", "=h,l", [ptrs], dtype=tl.float16,
                                          is_pure=True, pack=1).to(tl.float32)
        elif ASM:  # (a u8 load into a 32-bit register zero-extends)
            r = tl.inline_asm_elementwise("ld.global.nc.u8 $0, [$1];", "=r,l", [ptrs], dtype=tl.int32,
                                          is_pure=True, pack=1)
        elif ptrs.dtype.element_ty == tl.float16:
            r = tl.load(ptrs).to(tl.float32)
        else:
            r = tl.load(ptrs).to(tl.int32)
        return r

    @triton.jit
    def _half2_rows(tile, N, BLOCK_N: tl.constexpr, HALF2: tl.constexpr):
        """The weight rows of row tile `tile` for the one-row pair kernels, past N clamped to row N − 1 (computed,
        stored nowhere: no row masks): HALF2 1, its BLOCK_N rows twice; HALF2 2 (_int4_mma's two row sets), its
        even rows and their odd neighbours, BLOCK_N / 2 each."""
        if HALF2 == 2:
            ra = tl.minimum(tile * BLOCK_N + 2 * tl.arange(0, BLOCK_N // 2), N - 1)
            rb = tl.minimum(ra + 1, N - 1)
        else:
            ra = tl.minimum(tile * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)
            rb = ra
        return ra, rb

    @triton.jit
    def _int4_group(w_ptr, s_ptr, z_ptr, rows, g, g_end, K, s_stride, g_stride, ASM: tl.constexpr,
                    TILED: tl.constexpr):
        """Group g's operands for rows [R] < N: codes [R, 16] int32 words (16-byte loads; zero at g ≥ g_end), scales
        [R] fp32 and zeros [R] int32 (at g ≥ g_end group g_end − 1's: any group's), the latter two loaded in the
        codes' row layout (_row_load)."""
        wd = g * 16 + tl.arange(0, 16)
        u = tl.load(w_ptr + _int4_at(rows[:, None], wd[None, :], K, 16, TILED), mask=g < g_end, other=0)
        g = tl.minimum(g, g_end - 1)
        scale = _row_load(s_ptr + rows * s_stride + g * g_stride, ASM)
        zero = _row_load(z_ptr + rows * s_stride + g * g_stride, ASM)
        return u, scale, zero

    @triton.jit
    def _half2_weights(w_ptr, s_ptr, z_ptr, ra, rb, g, g_end, K, s_stride, g_stride, HALF2: tl.constexpr,
                       ASM: tl.constexpr, TILED: tl.constexpr):
        """Group g's weight operands for the pair kernels' rows (_half2_rows): HALF2 1, (codes, scales, zeros) of
        rows ra (_int4_group); HALF2 2, those of rows ra then of rows rb."""
        if HALF2 == 2:
            ua, sa, za = _int4_group(w_ptr, s_ptr, z_ptr, ra, g, g_end, K, s_stride, g_stride, ASM, TILED)
            ub, sb, zb = _int4_group(w_ptr, s_ptr, z_ptr, rb, g, g_end, K, s_stride, g_stride, ASM, TILED)
            ops = (ua, sa, za, ub, sb, zb)
        else:
            ops = _int4_group(w_ptr, s_ptr, z_ptr, ra, g, g_end, K, s_stride, g_stride, ASM, TILED)
        return ops

    @triton.jit
    def _half2_x(xp_ptr, g, g_end, K):
        """Group g's fp16 pairs of x (x0, x1, x2, x3: [16] int32 each, zero at g ≥ g_end) from _half2_prologue's
        scratch [4, K / 8]."""
        row = K // 128 * 16  # (K / 8 as a multiple of 16: 16-byte loads)
        wd = g * 16 + tl.arange(0, 16)
        ok = g < g_end
        return (tl.load(xp_ptr + wd, mask=ok, other=0), tl.load(xp_ptr + row + wd, mask=ok, other=0),
                tl.load(xp_ptr + 2 * row + wd, mask=ok, other=0), tl.load(xp_ptr + 3 * row + wd, mask=ok, other=0))

    @triton.jit
    def _half2_products(ops, xs, HALF2: tl.constexpr, ASM: tl.constexpr):
        """One group of the pair kernels from its operands (_half2_weights, _half2_x), to add to the accumulator:
        HALF2 1, scale · Σ (q − zero) · x per word ([BLOCK_N, 16]: _int4_half2); HALF2 2, _int4_mma's sums."""
        x0, x1, x2, x3 = xs
        if HALF2 == 2:
            ua, sa, za, ub, sb, zb = ops
            r = _int4_mma(ua, ub, x0[None, :], x1[None, :], x2[None, :], x3[None, :],
                          (za * 0x10001 + 0x64006400)[:, None], (za * 0x100010 - 0x2BFF2C00)[:, None],
                          (zb * 0x10001 + 0x64006400)[:, None], (zb * 0x100010 - 0x2BFF2C00)[:, None],
                          sa[:, None], sb[:, None], ASM)
        else:  # the zero, an integer in 0 … 16 (QuantLinear checks), as the fp16 pairs 1024 + zero and −(64 + zero)
            u, scale, zi = ops  # by integer arithmetic on their bits (0xD400D400: −64, −64)
            r = _int4_half2(u, x0[None, :], x1[None, :], x2[None, :], x3[None, :], (zi * 0x10001 + 0x64006400)[:, None],
                            (zi * 0x100010 - 0x2BFF2C00)[:, None], ASM) * scale[:, None]
        return r

    @triton.jit
    def _dependent_start(w_ptr, n, n_ok, k_start, k_end, K, FMT: tl.constexpr, BITS: tl.constexpr,
                         BLOCK_K: tl.constexpr, TILED: tl.constexpr = 0, TRIGGER: tl.constexpr = 1):
        """Programmatic dependent launch (launch_pdl): while the previous kernel in the stream finishes, pull
        this program's first two steps of weight rows into L2 (the weight is no kernel's output), then wait
        for that kernel (x is its output) and, with TRIGGER, let the next one launch (without: the caller
        does, later). Columns [k_start, k_end) of K."""
        if BITS:
            per_word: tl.constexpr = 8 if FMT == 2 else 4  # columns an int32 word holds
            row, first, last, line = K // per_word, k_start // per_word, k_end // per_word, 32
            lines: tl.constexpr = 2 * BLOCK_K // per_word // 32
        elif FMT == 2:  # two int4 codes a byte
            row, first, last, line = K // 2, k_start // 2, k_end // 2, 128
            lines: tl.constexpr = 2 * BLOCK_K // 2 // 128
        elif FMT == 3:  # bf16
            row, first, last, line = K, k_start, k_end, 64
            lines: tl.constexpr = 2 * BLOCK_K // 64
        else:  # e4m3
            row, first, last, line = K, k_start, k_end, 128
            lines: tl.constexpr = 2 * BLOCK_K // 128
        if TILED:  # int4 in 16-row tiles of a group: each row's 64 bytes of the first two steps' groups
            unit: tl.constexpr = 16 if BITS else 64
            grp = k_start // 128 + tl.arange(0, 2 * BLOCK_K // 128)
            _prefetch_l2(w_ptr + _int4_at(n[:, None], grp[None, :] * unit, K, unit, TILED),
                         n_ok[:, None] & (grp * 128 < k_end)[None, :])
        else:
            col = first + tl.arange(0, lines) * line
            _prefetch_l2(w_ptr + n[:, None].to(tl.int64) * row + col[None, :], n_ok[:, None] & (col < last)[None, :])
        tl.extra.cuda.gdc_wait()
        if TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _split_k_fixup(y0_ptr, offs, ok, cnt_ptr, tile, slot, SPLITS: tl.constexpr):
        """Split-K summed in the kernel (FIXUP): once its partial is stored (at y0 + split · slot + offs), a
        program counts itself in on its output tile; the last to arrive adds the tile's SPLITS partials in split
        order (deterministic) into slot 0 and sets the count back to 0 for the next launch. The partials are
        read from L2 (.cg): other SMs wrote them."""
        tl.debug_barrier()  # every thread's part of the partial stored before the count
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            total = tl.load(y0_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLITS):
                total += tl.load(y0_ptr + s * slot + offs, mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(y0_ptr + offs, total, mask=ok)
            tl.atomic_xchg(cnt_ptr + tile, 0)

    @triton.jit
    def _row_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, tok_ptr, exp_ptr, N, K, s_stride, g_stride, w_estride, s_estride,
                    k_per_split, ONE, cnt_ptr, xp_ptr, FMT: tl.constexpr, ACT_FP8: tl.constexpr,
                    GROUPED: tl.constexpr, FP8_LIMIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    ACC_K: tl.constexpr, STAGES: tl.constexpr, BITS: tl.constexpr, PDL: tl.constexpr,
                    FIXUP: tl.constexpr = 0, SWIGLU: tl.constexpr = 0, PER_ROW: tl.constexpr = 0,
                    ACT_DTYPE: tl.constexpr = tl.bfloat16, HALF2: tl.constexpr = 0, ASM: tl.constexpr = 1,
                    TILES: tl.constexpr = 1, TILED: tl.constexpr = 0):
        """One row of x (decode at batch 1, or one (token, expert) pair): products accumulate elementwise in
        registers and are summed over K once, at the end (no per-step reduction, no tensor-core layout).
        BITS: the weight is read as int32 words and decoded by bit moves (_fp8_bits, _int4_unit) instead of
        conversion instructions; word column j of a step holds columns 4j … 4j+3 (fp8) or 8j … 8j+7 (int4).
        int4 with BITS: a step accumulates (1 + q/16) · x, one FFMA a weight after a shift and a LOP3; since
        Σ (q − zero) · x = 16 · Σ (1 + q/16) · x − (16 + zero) · Σ x, the group's 16 · scale multiplies the
        step's partial products and scale · (16 + zero) · Σ x is subtracted per output. SWIGLU (16-bit, fp32 or
        e4m3 weights decoded by conversion, not BITS): x is the gate | up projection's SWIGLU split-K partials
        [SWIGLU, P, 2K] fp32 and pair p's row is their silu(gate)·up rounded to ACT_DTYPE, computed as it loads
        (_swiglu_x). HALF2 (int4 with BITS, launch option LOWP 3, linear mode; 2: LOWP 4, the pairs into mma.sync,
        _int4_mma, even and odd rows as the mma's two row sets): the program first writes its K
        columns of x as scaled fp16 pairs to xp (_half2_prologue), then each word of 8 codes takes 16
        instructions of fp16 pair arithmetic (_int4_half2) and one FFMA by its row's group scale. TILES (HALF2
        only, launch option): a program computes TILES tiles of BLOCK_N rows one after another, so that one
        prologue serves them all. Grouped mode with PDL waits first: a pair's expert is the previous kernel's (the
        router's) output."""
        n = tl.program_id(0) * TILES * BLOCK_N + tl.arange(0, BLOCK_N)  # (the first tile's rows)
        split = tl.program_id(2)  # split-K: this program sums K columns [split·k_per_split, +k_per_split)
        y0_ptr = y_ptr
        y_ptr += split.to(tl.int64) * tl.num_programs(1) * N
        if GROUPED:
            if PDL:  # a pair's expert and row are the previous kernel's (the router's) output: wait, then read
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
            x_ptr, w_ptr, s_ptr, z_ptr, y_ptr = _pair_pointers(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, tok_ptr, exp_ptr,
                                                               N, K, w_estride, s_estride, SWIGLU, PER_ROW)
        k_end = tl.minimum(K, (split + 1) * k_per_split)
        g_end = k_end // 128  # (HALF2: the end of this split's groups)
        if PDL and not GROUPED:  # int4 lets the next kernel launch only once its sums are stored (at the end)
            _dependent_start(w_ptr, n, n < N, split * k_per_split, k_end, K, FMT, BITS, BLOCK_K, TILED, FMT != 2)
        if HALF2:
            x_scale = _half2_prologue(x_ptr, xp_ptr, split * k_per_split, k_end, K)
        for t in tl.static_range(TILES):  # TILES tiles of BLOCK_N rows, one after another (HALF2: one prologue)
            n = (tl.program_id(0) * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = n < N
            if HALF2:
                ra, rb = _half2_rows(tl.program_id(0) * TILES + t, N, BLOCK_N, HALF2)
            if HALF2 == 2:  # even and odd rows as the mma's two row sets
                acc = tl.zeros((BLOCK_N // 2, ACC_K), tl.float32)
            else:
                acc = tl.zeros((BLOCK_N, ACC_K), tl.float32)
            acc_odd = tl.zeros((BLOCK_N, ACC_K), tl.float32)  # int4's odd columns
            offset = tl.zeros((BLOCK_N,), tl.float32)  # int4 with BITS: Σ over groups of scale · (16 + zero) · Σ x
            for k0 in tl.range(split * k_per_split, k_end, BLOCK_K, num_stages=STAGES):
                if HALF2 == 2 or (HALF2 and TILED):  # tiled codes, or the tensor cores (_int4_mma): 16-byte
                    # loads, scale and zero loaded in the codes' row layout; KSTEP groups a step, each its scale
                    for sub in tl.static_range(BLOCK_K // 128):
                        g = k0 // 128 + sub
                        acc += _half2_products(
                            _half2_weights(w_ptr, s_ptr, z_ptr, ra, rb, g, g_end, K, s_stride, g_stride, HALF2, ASM,
                                           TILED), _half2_x(xp_ptr, g, g_end, K), HALF2, ASM)
                elif HALF2:  # no row masks (rows past N repeat row N − 1, stored nowhere; words past the split
                    # are masked by column alone): no per-row predicates. (The row-major scale loads convert to the
                    # tile's row layout through shared memory: loading them as _int4_mma does, with 16-byte weight
                    # loads, measured 6-17% slower on the 27B's shapes, 2026-12-02)
                    n_in = tl.minimum(n, N - 1)
                    for sub in tl.static_range(BLOCK_K // 128):  # KSTEP groups of 128 columns, each with its scale
                        wd = (k0 + 128 * sub) // 8 + tl.arange(0, 16)
                        wd_ok = wd < k_end // 8
                        u = tl.load(w_ptr + n_in[:, None] * (K // 8) + wd[None, :], mask=wd_ok[None, :], other=0)
                        g = tl.minimum(k0 // 128 + sub, k_end // 128 - 1)  # (a step past the split: any group's)
                        scale = tl.load(s_ptr + n_in * s_stride + g * g_stride)
                        # the zero, an integer in 0 … 16 (QuantLinear checks), as the fp16 pairs 1024 + zero and
                        # −(64 + zero) by integer arithmetic (their bits)
                        zi = tl.load(z_ptr + n_in * s_stride + g * g_stride).to(tl.int32)
                        zlo = zi * 0x10001 + 0x64006400
                        zhi = zi * 0x100010 - 0x2BFF2C00  # (0xD400D400: −64, −64)
                        x0 = tl.load(xp_ptr + wd, mask=wd_ok, other=0)
                        x1 = tl.load(xp_ptr + K // 8 + wd, mask=wd_ok, other=0)
                        x2 = tl.load(xp_ptr + 2 * (K // 8) + wd, mask=wd_ok, other=0)
                        x3 = tl.load(xp_ptr + 3 * (K // 8) + wd, mask=wd_ok, other=0)
                        acc += _int4_half2(u, x0[None, :], x1[None, :], x2[None, :], x3[None, :], zlo[:, None],
                                           zhi[:, None], ASM) * scale[:, None]
                elif BITS and FMT == 2:
                    for sub in tl.static_range(BLOCK_K // 128):  # KSTEP groups of 128 columns, each with its scale
                        wd = (k0 // 128 + sub) * 16 + tl.arange(0, 16)
                        wd_ok = wd < k_end // 8
                        u = tl.load(w_ptr + _int4_at(n[:, None], wd[None, :], K, 16, TILED),
                                    mask=n_ok[:, None] & wd_ok[None, :], other=0)
                        g = k0 // 128 + sub
                        part = tl.zeros((BLOCK_N, 16), tl.float32)
                        xsum = tl.zeros((16,), tl.float32)
                        for i in tl.static_range(8):
                            xi = tl.load(x_ptr + 8 * wd + i, mask=wd_ok, other=0.0).to(tl.float32)
                            part += _int4_unit(u, i, ONE) * xi[None, :]  # (1 + q/16) · x
                            xsum += xi
                        g_ok = n_ok & (g < k_end // 128)
                        scale = tl.load(s_ptr + n * s_stride + g * g_stride, mask=g_ok, other=0.0)
                        zero = tl.load(z_ptr + n * s_stride + g * g_stride, mask=g_ok, other=0.0)
                        acc += part * (16.0 * scale)[:, None]
                        offset += scale * (16.0 + zero) * tl.sum(xsum, axis=0)
                elif BITS:  # fp8
                    wd = k0 // 4 + tl.arange(0, BLOCK_K // 4)
                    wd_ok = wd < k_end // 4
                    u = tl.load(w_ptr + n[:, None] * (K // 4) + wd[None, :], mask=n_ok[:, None] & wd_ok[None, :],
                                other=0)
                    if ACT_FP8:
                        k = k0 + tl.arange(0, BLOCK_K)
                        xs = tl.load(x_ptr + k, mask=k < k_end, other=0.0).to(tl.float32)
                        xs = tl.maximum(tl.max(tl.abs(xs), axis=0) / FP8_LIMIT, 1e-12)
                    part = tl.zeros((BLOCK_N, BLOCK_K // 4), tl.float32)
                    for i in tl.static_range(4):
                        xi = tl.load(x_ptr + 4 * wd + i, mask=wd_ok, other=0.0).to(tl.float32)
                        if ACT_FP8:
                            xi = (xi / xs).to(tl.float8e4nv).to(tl.float32) * xs
                        part += _fp8_bits(u, i) * xi[None, :]
                    if FMT == 1:
                        part = part * tl.load(s_ptr + (n // BLOCK_K) * s_stride + (k0 // BLOCK_K) * g_stride,
                                              mask=n_ok, other=0.0)[:, None]
                    acc += part
                elif FMT == 2:  # byte j holds columns 2j (low nibble) and 2j + 1 (high)
                    j = k0 // 128 * 64 + tl.arange(0, BLOCK_K // 2)  # (BLOCK_K 128)
                    j_ok = j < k_end // 2
                    xe = tl.load(x_ptr + 2 * j, mask=j_ok, other=0.0).to(tl.float32)
                    xo = tl.load(x_ptr + 2 * j + 1, mask=j_ok, other=0.0).to(tl.float32)
                    b = tl.load(w_ptr + _int4_at(n[:, None], j[None, :], K, 64, TILED),
                                mask=n_ok[:, None] & j_ok[None, :], other=0)
                    g = k0 // BLOCK_K
                    scale = tl.load(s_ptr + n * s_stride + g * g_stride, mask=n_ok, other=0.0)[:, None]
                    zero = tl.load(z_ptr + n * s_stride + g * g_stride, mask=n_ok, other=0.0)[:, None]
                    acc += ((b & 0xF).to(tl.float32) - zero) * scale * xe[None, :]
                    acc_odd += ((b >> 4).to(tl.float32) - zero) * scale * xo[None, :]
                else:
                    k = k0 + tl.arange(0, BLOCK_K)
                    k_ok = k < k_end
                    if SWIGLU:
                        x = _swiglu_x(x_ptr, k, k_ok, K, tl.num_programs(1) * 2 * K, SWIGLU, ACT_DTYPE)
                    else:
                        x = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
                    if ACT_FP8:
                        xs = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_LIMIT, 1e-12)
                        x = (x / xs).to(tl.float8e4nv).to(tl.float32) * xs
                    w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                    w = w.to(tl.float32)
                    if FMT == 1:
                        w = w * tl.load(s_ptr + (n // BLOCK_K) * s_stride + (k0 // BLOCK_K) * g_stride, mask=n_ok,
                                        other=0.0)[:, None]
                    acc += w * x[None, :]
            if HALF2 == 2:  # rows a (even) at columns 4c, b (odd) at 4c + 1, four copies each
                quarter = tl.arange(0, ACC_K)[None, :] % 4
                ya = tl.sum(tl.where(quarter == 0, acc, 0.0), axis=1)
                yb = tl.sum(tl.where(quarter == 1, acc, 0.0), axis=1)
                y = tl.reshape(tl.join(ya, yb), (BLOCK_N,)) * 0.25
            else:
                y = tl.sum(acc, axis=1)
            if FMT == 2 and not BITS:
                y += tl.sum(acc_odd, axis=1)
            if HALF2:
                y = y / x_scale  # (a power of 2: exact)
            elif FMT == 2 and BITS:
                y -= offset
            if BITS and FMT < 2:
                y = y * 1.329227995784916e36  # 2¹²⁰: _fp8_bits' codes were 2⁻¹²⁰ of their values
            if FMT == 0:
                y = y * tl.load(s_ptr + n, mask=n_ok, other=0.0)
            tl.store(y_ptr + n, y, mask=n_ok)
            if FIXUP:  # (linear mode: program_id(1) is x's row)
                _split_k_fixup(y0_ptr, tl.program_id(1) * N + n, n_ok, cnt_ptr,
                               (tl.program_id(0) * TILES + t) * tl.num_programs(1) + tl.program_id(1),
                               tl.num_programs(1) * N, FIXUP)
        if PDL and not GROUPED and FMT == 2:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _pow2_at_least(t):
        """The least power of 2 ≥ t (positive normal fp32), by bits: round the mantissa up into the exponent."""
        return ((t.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, M, N, K, s_stride, g_stride, k_per_split, cnt_ptr,
                     FMT: tl.constexpr,
                     ACT_FP8: tl.constexpr, FP8_LIMIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, STAGES: tl.constexpr, BITS: tl.constexpr, LOWP: tl.constexpr,
                     PDL: tl.constexpr, FIXUP: tl.constexpr = 0, TILED: tl.constexpr = 0):
        """2 … 64 rows of x: a tensor-core dot (fp32 operands, tf32) per 128-column step (BITS: as in
        _row_kernel, one dot per word position; int4's dots take q − zero, exact in tf32, and scale after).
        LOWP 3 (e4m3 weights without BITS: fp16_dot_ok): fp16 operands, the weight converted by one instruction
        per two values (e4m3 → bf16 takes three) and x scaled per row and step by s, the least power of
        2 ≥ max|x|/2¹⁵, so that x/s is exact in fp16 down to 2⁻²⁹ of the row's maximum (below, within 2⁻³⁹ of
        it); with ACT_FP8 x's e4m3 codes, exact in fp16, and its per-row scale multiplies the product. Half the
        tf32 dot's tensor-core instructions (at M = 16 the tf32 mma.sync alone needs about as long as the weight
        bytes)."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        split = tl.program_id(2)
        y0_ptr = y_ptr
        y_ptr += split.to(tl.int64) * M * N
        n_ok, m_ok = n < N, m < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        k_end = tl.minimum(K, (split + 1) * k_per_split)
        if PDL:
            _dependent_start(w_ptr, n, n_ok, split * k_per_split, k_end, K, FMT, BITS, BLOCK_K, TILED)
        for k0 in tl.range(split * k_per_split, k_end, BLOCK_K, num_stages=STAGES):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < k_end
            x = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            if ACT_FP8:
                xs = tl.maximum(tl.max(tl.abs(x), axis=1) / FP8_LIMIT, 1e-12)
                xq = (x / xs[:, None]).to(tl.float8e4nv)
                x = xq.to(tl.float32) * xs[:, None]
            if BITS and FMT == 2:
                wd = k0 // 128 * 16 + tl.arange(0, BLOCK_K // 8)  # (BLOCK_K 128)
                wd_ok = wd < k_end // 8
                u = tl.load(w_ptr + _int4_at(n[:, None], wd[None, :], K, 16, TILED), mask=n_ok[:, None] & wd_ok[None, :],
                            other=0)
                g = k0 // BLOCK_K
                off = tl.load(z_ptr + n * s_stride + g * g_stride, mask=n_ok, other=0.0)[:, None] + 8388608.0
                part = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
                for i in tl.static_range(8):
                    xi = tl.load(x_ptr + m[:, None] * K + 8 * wd[None, :] + i, mask=m_ok[:, None] & wd_ok[None, :],
                                 other=0.0).to(tl.float32)
                    part += tl.dot(xi, tl.trans(_int4_bits(u, i) - off))
                acc += part * tl.load(s_ptr + n * s_stride + g * g_stride, mask=n_ok, other=0.0)[None, :]
            elif BITS:  # fp8
                wd = k0 // 4 + tl.arange(0, BLOCK_K // 4)
                wd_ok = wd < k_end // 4
                u = tl.load(w_ptr + n[:, None] * (K // 4) + wd[None, :], mask=n_ok[:, None] & wd_ok[None, :], other=0)
                part = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
                for i in tl.static_range(4):
                    xi = tl.load(x_ptr + m[:, None] * K + 4 * wd[None, :] + i, mask=m_ok[:, None] & wd_ok[None, :],
                                 other=0.0).to(tl.float32)
                    if ACT_FP8:
                        xi = (xi / xs[:, None]).to(tl.float8e4nv).to(tl.float32) * xs[:, None]
                    # back to the code's value before the dot: tensor cores may flush fp32 subnormals
                    part += tl.dot(xi, tl.trans(_fp8_bits(u, i) * 1.329227995784916e36))
                if FMT == 1:
                    part = part * tl.load(s_ptr + (n // BLOCK_K) * s_stride + (k0 // BLOCK_K) * g_stride, mask=n_ok,
                                          other=0.0)[None, :]
                acc += part
            elif FMT == 2:
                half = k0 // 128 * 64 + tl.arange(0, BLOCK_K // 2)  # (BLOCK_K 128)
                b = tl.load(w_ptr + _int4_at(n[:, None], half[None, :], K, 64, TILED),
                            mask=n_ok[:, None] & (half < k_end // 2)[None, :], other=0)
                q = tl.join(b & 0xF, b >> 4).reshape(BLOCK_N, BLOCK_K).to(tl.float32)
                g = k0 // BLOCK_K
                scale = tl.load(s_ptr + n * s_stride + g * g_stride, mask=n_ok, other=0.0)
                zero = tl.load(z_ptr + n * s_stride + g * g_stride, mask=n_ok, other=0.0)
                acc += tl.dot(x, tl.trans((q - zero[:, None]) * scale[:, None]))
            else:
                w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                if LOWP == 3:  # fp16 operands: e4m3 → fp16 is one exact conversion per 2 weights (docstring)
                    if ACT_FP8:
                        part = tl.dot(xq.to(tl.float16), tl.trans(w.to(tl.float16))) * xs[:, None]
                    else:
                        s16 = _pow2_at_least(tl.maximum(tl.max(tl.abs(x), axis=1) / 32768.0, 1e-30))
                        xh = (x * (1.0 / s16)[:, None]).to(tl.float16)  # exact: a power of 2, |x/s16| ≤ 2¹⁵
                        part = tl.dot(xh, tl.trans(w.to(tl.float16))) * s16[:, None]
                else:
                    part = tl.dot(x, tl.trans(w.to(tl.float32)))
                if FMT == 1:
                    part = part * tl.load(s_ptr + (n // BLOCK_K) * s_stride + (k0 // BLOCK_K) * g_stride, mask=n_ok,
                                          other=0.0)[None, :]
                acc += part
        if FMT == 0:
            acc = acc * tl.load(s_ptr + n, mask=n_ok, other=0.0)[None, :]
        offs, ok = m[:, None] * N + n[None, :], m_ok[:, None] & n_ok[None, :]
        tl.store(y_ptr + offs, acc, mask=ok)
        if FIXUP:
            _split_k_fixup(y0_ptr, offs, ok, cnt_ptr, tl.program_id(0), M * N, FIXUP)


_TUNED = json.loads((pathlib.Path(__file__).with_name("gemv_configs.json")).read_text())


def tuned_key(fmt: int, N: int, K: int, rows: int) -> str:
    """Key of a launch config in gemv_configs.json: format, shape and row bucket (ROW_BUCKETS)."""
    return f"{fmt}:{N}x{K}:M{next(b for b in ROW_BUCKETS if rows <= b)}"


def tuned_config(table: dict, fmt: int, N: int, K: int, rows: int):
    """The measured config for this shape in `table` (one GPU's part of gemv_configs.json); failing that, the
    one measured for the nearest N (within 2×) with the same format, K and row bucket (a fused projection's
    shape before the sweep has seen it); else None."""
    if tuned_key(fmt, N, K, rows) in table:
        return table[tuned_key(fmt, N, K, rows)]
    prefix, bucket = f"{fmt}:", tuned_key(fmt, N, K, rows).rsplit(":", 1)[1]
    near = []
    for key, config in table.items():
        f, shape, b = key.split(":")
        if f"{f}:" != prefix:
            continue
        n, k = map(int, shape.split("x"))
        if k == K and b == bucket and N / 2 <= n <= 2 * N:
            near.append((abs(math.log(n / N)), config))
    return min(near, key=lambda t: t[0])[1] if near else None


def expert_key(fmt: int, N: int, K: int, pairs: int) -> str | None:
    """Key of a grouped-mode launch config in gemv_configs.json: format, one expert's [N, K] and the pair-count
    bucket (PAIR_BUCKETS: the fewest pairs of these that hold `pairs`); None above the largest bucket."""
    bucket = next((b for b in PAIR_BUCKETS if pairs <= b), None)
    return None if bucket is None else f"{fmt}:{N}x{K}:P{bucket}"


def gemv_beats_cublas(table: dict, N: int, K: int, rows: int) -> bool:
    """Whether `table` (one GPU's part of gemv_configs.json) has the bf16 kernel measured faster than cuBLAS at
    this exact shape and row bucket: the sweep stores "cublas:NxK:Mb" = [cuBLAS µs, kernel µs]."""
    times = table.get("cublas:" + tuned_key(BF16, N, K, rows).split(":", 1)[1])
    return times is not None and times[1] < times[0]


def gpu_table() -> dict:
    """This GPU's measured launch configs (empty without CUDA or for a GPU the sweep has not seen)."""
    return _TUNED.get(torch.cuda.get_device_name(), {}) if torch.cuda.is_available() else {}


def gemv_config(fmt: int, N: int, K: int, rows: int, columns: int = 1) -> tuple[int, ...]:
    """(BLOCK_N, SPLIT_K, num_warps, num_stages[, BITS[, KSTEP[, LOWP[, TILES]]]]) for `rows` rows of an
    [N, K] weight in format `fmt`, with `columns` independent copies of the grid (expert pairs in grouped mode). Both modes take
    scripts/bench_quant.py --sweep's measured best for this GPU when gemv_configs.json has it (grouped mode: per
    pair-count bucket, expert_key); otherwise enough programs that short K walks keep many loads in flight: BLOCK_N 64 (128 for int4, whose
    rows are half as wide; above 16 rows half that, 8 warps and 2 stages), K split in up to 8 parts of at least 4
    steps. One row of fp8 per-row weights (linear mode) takes what the H200 sweep found best on every 27B shape:
    BLOCK_N 32, 4 stages, steps of 256 columns (KSTEP 2). BITS (default 0) decodes the
    weight by bit moves instead of conversion instructions (see _fp8_bits); KSTEP (default 1) widens each step
    to KSTEP × 128 columns (FP8_ROW and BF16 without BITS; int4 with BITS at one row); LOWP (default 0): 3, fp16
    operands for the M > 1 kernel's dot (fp16_dot_ok: fp8 weights, x scaled by a power of 2) and fp16 pair
    arithmetic for int4 at one row; 4, int4 at one row with its pairs into mma.sync; TILES (default 1) is int4's
    one-row pair kernels' (_row_kernel); the sweep tries them all."""
    tuned = (tuned_config(gpu_table(), fmt, N, K, rows) if columns == 1
             else gpu_table().get(expert_key(fmt, N, K, columns)))
    if tuned:
        return tuple(tuned)
    wide = rows > 16  # a 32- or 64-row x tile: narrower programs of 8 warps keep the registers in bounds
    wide_steps = fmt == FP8_ROW and rows == 1 and columns == 1  # 256-column steps: as many bytes as a bf16 step
    bn = 32 if wide_steps else (128 if fmt == INT4 else 64) // (2 if wide else 1)
    kstep = 2 if wide_steps else 1
    split = 1
    while split < 8 and K // (STEP * kstep) // (2 * split) >= 4 and -(-N // bn) * columns * split < 8 * 132:
        split *= 2
    return bn, split, 8 if wide else 4, 2 if fmt == INT4 or wide else 4, 0, kstep


def full_config(config) -> tuple[int, ...]:
    """A launch config with its optional elements filled in: (BLOCK_N, SPLIT_K, num_warps, num_stages, BITS = 0,
    KSTEP = 1, LOWP = 0, TILES = 1)."""
    return (*config, *(0, 1, 0, 1)[len(config) - 4:])


def fp16_dot_ok(fmt: int, x_dtype, bits: bool) -> bool:
    """Whether the M > 1 kernel's dot can take fp16 operands (launch option LOWP 3): e4m3 weights decoded by
    conversion (not BITS), x in bf16 or fp16 (scaled by a power of 2 into fp16's range: see _gemv_kernel) or
    rounded to e4m3 by the fp8 scheme."""
    return fmt in (FP8_ROW, FP8_BLOCK) and not bits and x_dtype in (torch.bfloat16, torch.float16)


def split_plan(K: int, config) -> tuple[int, int]:
    """(columns per split, number of splits) of K under launch config `config`: whole steps per split."""
    split, kstep = full_config(config)[1], full_config(config)[5]
    block_k = STEP * kstep
    steps = -(-K // block_k)
    k_per_split = -(-steps // split) * block_k
    return k_per_split, -(-K // k_per_split)


def linear_splits(fmt: int, N: int, K: int, rows: int) -> int:
    """How many partial sums the linear mode's default launch writes for this shape (wq_linear's dim 0)."""
    return split_plan(K, gemv_config(fmt, N, K, rows))[1]


def _launch(x, fmt, w, scale, zero, act_fp8, out_features, rows, pairs=None, config=None, partials=False,
            pdl=False, fixup=False, swiglu=None):
    """fp32 y [rows, out_features]; `pairs` = (tok, exp) int32 [P] switches to grouped mode (rows = P, one x
    row each); `config` overrides gemv_config. Split-K writes per-split partials and sums them (deterministic);
    with `partials` they come back unsummed, [splits, rows, out_features] (split_plan). `fixup` (linear mode):
    the kernel sums them itself, the last program of each output tile in split order (_split_k_fixup), and
    `partials` gets [1, rows, out_features]. `pdl`: launch with programmatic dependent launch (Hopper+;
    _dependent_start; grouped mode waits before it reads its pairs, so it prefetches nothing: it only overlaps
    its launch with the previous kernel). `swiglu`, a dtype (BF16 or fp8 formats decoded by conversion; grouped
    mode, or linear mode at one row): x is a gate | up launch's partials [S, rows, 2K] fp32 and pair p's (the
    row's) x their silu(gate)·up rounded to that dtype, the activations' (_row_kernel SWIGLU; tok unread)."""
    K = x.shape[-1] // 2 if swiglu is not None else x.shape[1]
    if K % STEP:
        raise ValueError(f"the weight-streaming kernel needs K divisible by {STEP}; got K={K}")
    N = out_features
    grouped = pairs is not None
    M = 1 if grouped else rows
    explicit = config is not None
    config = config or gemv_config(fmt, N, K, M, rows if grouped else 1)
    bn, split, warps, stages, bits, kstep, lowp, tiles = full_config(config)
    bits = bool(bits) and fmt != BF16
    if lowp not in (0, 3, 4):
        raise ValueError(f"LOWP {lowp} is no launch option: LOWP is 0, 3 (the fp16 dot for e4m3 weights at more than "
                         "one row; int4's fp16 pairs at one row) or 4 (int4's pairs into mma.sync at one row)")
    if swiglu is not None:
        if (fmt == INT4 or (act_fp8 and fmt == BF16) or swiglu not in _TL_DTYPES or x.dim() != 3
                or x.shape[1] != rows or (not grouped and rows != 1) or (bits and explicit)):
            raise ValueError(f"swiglu takes the BF16 or an fp8 format decoded by conversion (no BITS), a 16-bit or "
                             f"fp32 activation dtype, x the gate | up partials [S, {rows}, 2K] and grouped mode or "
                             f"one row; got format {fmt}, BITS {int(bits)}, dtype {swiglu}, grouped {grouped}, x "
                             f"{tuple(x.shape)}")
        bits = False  # (a tuned config's BITS: the SWIGLU load is in the conversion branch)
    if kstep != 1 and not (fmt == INT4 and bits) and (fmt not in (FP8_ROW, BF16) or bits or act_fp8):
        raise ValueError(f"KSTEP {kstep} needs a format with no scale inside a step (FP8_ROW or BF16) and no BITS or "
                         "fp8 activations, or int4 with BITS (a step of KSTEP groups)")
    # int4 at one row (_row_kernel HALF2): LOWP 3 fp16 pair arithmetic, LOWP 4 the pairs into mma.sync (_int4_mma)
    half2 = {3: 1, 4: 2}.get(lowp, 0) if fmt == INT4 and bits else 0
    if lowp == 4 and not half2 and explicit:
        raise ValueError(f"LOWP 4 (int4 pairs into mma.sync at one row) needs int4 with BITS; got format {fmt}, BITS "
                         f"{int(bits)}")
    if half2 and (M != 1 or grouped or (half2 == 2 and bn < 16 * warps)):
        if explicit:
            raise ValueError(f"LOWP {lowp} with int4 and BITS (fp16 pairs) takes one row in linear mode (LOWP 4: "
                             f"BLOCK_N ≥ 16 a warp); got {M} rows, grouped {grouped}, BLOCK_N {bn}, {warps} warps")
        half2, lowp = 0, 0
    lowp = 0 if lowp == 4 else lowp
    if tiles != 1 and not half2:
        if explicit:
            raise ValueError(f"TILES {tiles} (several row tiles a program) takes int4's fp16 pair arithmetic at one row "
                             f"(BITS with LOWP 3); got format {fmt}, BITS {int(bits)}, LOWP {lowp}, {M} rows")
        tiles = 1
    if lowp == 3 and not half2 and not fp16_dot_ok(fmt, x.dtype, bits):
        if explicit:
            raise ValueError(f"LOWP 3 (the fp16 dot) needs e4m3 weights (fp8-weight or fp8) decoded by conversion (no "
                             f"BITS) and 16-bit activations; got format {fmt}, x {x.dtype}, BITS {int(bits)}")
        lowp = 0
    if kstep != 1 and fmt == INT4 and M > 1:
        raise ValueError(f"KSTEP {kstep} with int4 takes one row; got {M} rows")
    tiled = fmt == INT4 and w.dim() == 4 + grouped  # tile_int4's layout ([E, …] in grouped mode)
    if tiled and (tuple(w.shape[grouped:]) != (N // TILE_ROWS, K // STEP, TILE_ROWS, STEP // 2) or N % TILE_ROWS
                  or not (w[0] if grouped else w).is_contiguous()):
        raise ValueError(f"a tiled int4 weight (tile_int4) takes shape [N/16, K/128, 16, 64] for N={N}, K={K} "
                         f"([E, …] in grouped mode), each one contiguous; got {tuple(w.shape)}, grouped {grouped}")
    if bits:
        w = w.view(torch.int32)  # 4 fp8 codes or 8 int4 codes a word, in column order
    block_k = STEP * kstep
    k_per_split, split = split_plan(K, config)
    y = torch.empty(split, rows, N, dtype=torch.float32, device=x.device)
    fix = split if fixup and split > 1 and not grouped else 0  # FIXUP: the number of partials a tile adds
    cnt = tile_counts(x.device, triton.cdiv(N, bn)) if fix else y  # (any pointer when not read)
    one = scale[0] if grouped and scale is not None else scale  # one expert's scales
    # a 2-D scale's strides (rows, groups): row-major, or group-major as QuantLinear keeps int4's (a program's rows of
    # one group then lie side by side); int4's zero is laid out as its scale
    s_stride, g_stride = one.stride() if one is not None and one.dim() == 2 else (1, 1)
    if fmt == INT4 and (zero.stride() != scale.stride() or scale.dtype != INT4_SCALE or zero.dtype != INT4_ZERO):
        raise ValueError(f"int4's scale and zero need one layout and the stored dtypes, {INT4_SCALE} and {INT4_ZERO} "
                         f"(formats.quantize_int4 and QuantLinear give them); got strides {scale.stride()} and "
                         f"{zero.stride()}, dtypes {scale.dtype} and {zero.dtype}")
    w_estride = w.stride(0) if grouped else 0
    s_estride = scale.stride(0) if grouped and scale is not None else 0
    tok, exp = pairs if grouped else (x, x)  # unused pointers outside grouped mode
    per_row = 0
    if grouped and tok is None:  # pairs token-major, P / T of them a token: pair p reads x row p // (P / T)
        per_row, tok = max(rows // max(x.shape[0], 1), 1), exp
    scale = w if scale is None else scale  # BF16 reads no scale; any pointer does
    zero = scale if zero is None else zero  # only INT4 reads a zero
    if M == 1:
        xp = torch.empty(K // 2, dtype=torch.int32, device=x.device) if half2 else y  # HALF2's x pairs [4, K / 8]
        acc_k = STEP // (8 if fmt == INT4 else 4) if bits else STEP // 2 if fmt == INT4 else block_k
        kernel = _row_kernel[(triton.cdiv(triton.cdiv(N, bn), tiles), rows, split)](
            x, w, scale, zero, y, tok, exp, N, K, s_stride, g_stride, w_estride, s_estride,
            k_per_split, ONE_BITS, cnt, xp, FMT=fmt, ACT_FP8=act_fp8, GROUPED=grouped, FP8_LIMIT=FP8_MAX, BLOCK_N=bn,
            BLOCK_K=block_k, ACC_K=acc_k, STAGES=stages, BITS=bits, PDL=pdl, FIXUP=fix,
            SWIGLU=x.shape[0] if swiglu is not None else 0, PER_ROW=per_row,
            ACT_DTYPE=_TL_DTYPES.get(swiglu, tl.bfloat16), HALF2=half2,
            ASM=not triton.knobs.runtime.interpret, TILES=tiles, TILED=tiled, num_warps=warps, launch_pdl=pdl)
        if half2 == 2 and not triton.knobs.runtime.interpret:
            mma_layout_check(kernel)
    else:
        _gemv_kernel[(triton.cdiv(N, bn), 1, split)](
            x, w, scale, zero, y, M, N, K, s_stride, g_stride, k_per_split, cnt, FMT=fmt,
            ACT_FP8=act_fp8, FP8_LIMIT=FP8_MAX, BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=bn,
            BLOCK_K=block_k, STAGES=stages,
            BITS=bits, LOWP=lowp, PDL=pdl, FIXUP=fix, TILED=tiled, num_warps=warps, launch_pdl=pdl)
    if fix:
        return y[:1] if partials else y[0]
    return y if partials else y[0] if split == 1 else y.sum(0)


_MMA_LAYOUT = "sizePerThread = [1, 4], threadsPerWarp = [8, 4]"
_MMA_CHECKED = set()


def mma_layout_check(kernel) -> None:
    """_int4_mma's fragments assume Triton laid the weight tile out with 4 words a thread along a row and lanes
    4g … 4g + 3 on one row (_MMA_LAYOUT, each word load 16 bytes). Checked once per compiled kernel, in its
    Triton GPU IR: another layout would mix rows in the mma, so it is an error, not a slow path."""
    if id(kernel) in _MMA_CHECKED:
        return
    ir = kernel.asm["ttgir"]
    tiles = [line for line in ir.splitlines()  # the tile's loads, or with STAGES > 1 its reads from shared memory
             if ("tt.load" in line and "x16x!tt.ptr<i32>" in line) or ("ttg.local_load" in line and "x16xi32" in line)]
    layouts = {m.group(1) for line in tiles for m in [re.search(r"x16x(?:!tt\.ptr<i32>|i32), #(blocked\d*)>", line)] if m}
    defs = dict(re.findall(r"^#(blocked\d*) = #ttg\.blocked<\{(.*)\}>", ir, re.M))
    if not tiles or not layouts or any(_MMA_LAYOUT not in defs.get(name, "") for name in layouts):
        raise RuntimeError(f"int4 LOWP 4 (mma.sync) needs the weight tile laid out as {_MMA_LAYOUT}; Triton chose "
                           f"{[defs.get(name) for name in layouts]}: use LOWP 3 for this config")
    _MMA_CHECKED.add(id(kernel))


_COUNTS = {}  # device -> int32 counts of split-K fixups (zero between launches: each last program resets its own)


def tile_counts(device, tiles: int) -> torch.Tensor:
    """The in-kernel fixups' arrival counts (split-K here, ops/gdn.py's gated norm), at least `tiles` of them,
    zero-filled once per device and kept (a captured CUDA graph holds their address; Forward reserves them
    before any capture: one allocated inside a CUDA-graph tree's pool would outlive it). Launches on one stream
    run one after another (with PDL a kernel counts only after its wait), so they share them."""
    counts = _COUNTS.get(device)
    if counts is None or counts.numel() < tiles:
        counts = _COUNTS[device] = torch.zeros(max(tiles, 1 << 16), dtype=torch.int32, device=device)
    return counts


def wq_matmul(x: torch.Tensor, fmt: int, w, scale, zero, act_fp8: bool, out_features: int,
              partials: bool = False, pdl: bool = False, fixup: bool = False) -> torch.Tensor:
    """The kernel in linear mode: x [M ≤ 64, K] (contiguous, any float dtype) → fp32 y [M, out_features], or
    with `partials` its split-K partial sums [linear_splits(…), M, out_features] ([1, …] with `fixup`: summed in
    the kernel); `pdl`: programmatic dependent launch."""
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"wq_matmul takes at most {MAX_ROWS} rows; got {x.shape[0]}")
    return _launch(x, fmt, w, scale, zero, act_fp8, out_features, x.shape[0], partials=partials, pdl=pdl,
                   fixup=fixup)


def group_major(t: torch.Tensor) -> torch.Tensor:
    """int4's scale or zero [N, K/group] (logical shape kept) stored group-major: a program's rows of one group
    lie side by side, so its per-step load of BLOCK_N scales (and zeros) touches BLOCK_N / 8 sectors of 32 bytes
    rather than BLOCK_N (row-major, one sector a row for 4 bytes). The kernels take either layout."""
    return t.t().contiguous().t()


def stored_operands(fmt: int, w: torch.Tensor, tiled: bool = True):
    """(w, scale, zero) of weight w [N, K] in format `fmt`'s stored layout, as the kernel takes them (int4's
    scale and zero group-major and, with `tiled`, its codes in 16-row tiles where N allows: tile_int4, as
    QuantLinear keeps them; an expert's codes stay in row order, tiled False)."""
    if fmt == FP8_ROW:
        return (*quantize_fp8_rows(w), None)
    if fmt == FP8_BLOCK:
        return (*quantize_fp8_block(w, (STEP, STEP)), None)
    if fmt == BF16:
        return w, None, None
    q, s, z = quantize_int4(w, STEP)
    return tile_int4(pack_int4(q)) if tiled else pack_int4(q), group_major(s), group_major(z)


def dequantized(fmt: int, w, scale, zero) -> torch.Tensor:
    """The fp32 weight [N, K] the stored operands stand for."""
    if fmt == FP8_ROW:
        return dequantize_fp8_rows(w, scale)
    if fmt == FP8_BLOCK:
        return dequantize_fp8_block(w, scale, (STEP, STEP))
    if fmt == BF16:
        return w.float()
    q = unpack_int4(untile_int4(w))
    N, K = q.shape
    return ((q.float().view(N, -1, STEP) - zero[..., None]) * scale[..., None]).view(N, K)


def reference(x, fmt: int, w, scale, zero, act_fp8: bool, out_features: int) -> torch.Tensor:
    """The linear mode in plain torch, fp32 out: dequantize the weight, then matmul."""
    if act_fp8:
        x = fake_quantize_fp8_activations(x, STEP)
    return x.float() @ dequantized(fmt, w, scale, zero).t()


def pair_rows(x: torch.Tensor, exp: torch.Tensor) -> torch.Tensor:
    """The x row of each of P token-major pairs over T rows (P / T a row): [0, …, 0, 1, …] int32 [P]."""
    per_row = max(exp.shape[0] // max(x.shape[0], 1), 1)
    return torch.arange(exp.shape[0], device=exp.device, dtype=torch.int32) // per_row


def expert_reference(x, tok, exp, fmt: int, w, scale, zero, out_features: int, act_fp8: bool = False) -> torch.Tensor:
    """The grouped mode in plain torch: row p = x[tok[p]] · W[exp[p]]ᵀ, fp32 [P, out_features] (tok None: the
    pairs are token-major, P / T a token, pair_rows)."""
    tok = pair_rows(x, exp) if tok is None else tok
    if act_fp8:
        x = fake_quantize_fp8_activations(x, STEP)
    rows = [x[t].float() @ dequantized(fmt, w[e], None if scale is None else scale[e],
                                       None if zero is None else zero[e]).t()
            for t, e in zip(tok.tolist(), exp.tolist())]
    return torch.stack(rows) if rows else x.new_empty(0, out_features, dtype=torch.float32)


def _on_kernel(x: torch.Tensor) -> bool:
    return x.is_cuda and triton is not None


def add_splits(parts: torch.Tensor) -> torch.Tensor:
    """The sum over dim 0 of split-K partials [S, ...] as S − 1 adds in split order. In a compiled step inductor
    folds pointwise adds into the consumer's kernel whatever S is, while `parts.sum(0)` is a reduction it unrolls
    into the consumer only below its unroll_reductions_threshold (8): at 8 or more partials (the CUDA kernels'
    plans on the 27B's o / out and down projections, several GEMV configs) a launch of its own before a
    reduction consumer (the residual RMSNorm), 2 a layer. Folded, a one-row RMSNorm's single program reads the
    S partials itself (8 × 5120 fp32 from L2), and still the 27B int4 step took 7212–7239 µs against 7342 with
    sum(0) (H100, 2026-12-05, each alone in its process)."""
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


@torch.library.custom_op("fastqwen::wq_linear", mutates_args=())
def wq_linear(x: torch.Tensor, fmt: int, w: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor | None,
              act_fp8: bool, out_features: int, pdl: bool = False, fixup: bool = False) -> torch.Tensor:
    """x [M, K] · Wᵀ as split-K partial sums [S, M, out_features] fp32, whose sum over dim 0 is the product
    (x may also be [M, …], each row's trailing dims flattened here to its K columns: see Linears.heads):
    the kernel on CUDA (S = linear_splits(…)), the reference elsewhere (S = 1). The caller sums (add_splits), so
    that inside a compiled step inductor folds the adds into the consumer's kernel instead of a launch of their
    own after every split-K matmul (~200 launches a 27B fp8 decode step).
    pdl: launch with programmatic dependent launch (kernels={"launch": "pdl"}; Hopper and later). fixup: the
    kernel sums its partials itself (S = 1; kernels={"splitk": "fixup"}), where a consumer that cannot take
    the add (a custom op's input) would otherwise launch a sum of its own."""
    x = x.reshape(x.shape[0], -1)
    if _on_kernel(x):
        return wq_matmul(x.contiguous(), fmt, w, scale, zero, act_fp8, out_features, partials=True, pdl=pdl,
                         fixup=fixup)
    return reference(x, fmt, w, scale, zero, act_fp8, out_features)[None]


@wq_linear.register_fake
def _(x, fmt, w, scale, zero, act_fp8, out_features, pdl=False, fixup=False):
    splits = linear_splits(fmt, out_features, x.shape[1:].numel(), x.shape[0]) if _on_kernel(x) and not fixup else 1
    return x.new_empty(splits, x.shape[0], out_features, dtype=torch.float32)



@torch.library.custom_op("fastqwen::expert_gemv", mutates_args=())
def expert_gemv(x: torch.Tensor, tok: torch.Tensor | None, exp: torch.Tensor, fmt: int, w: torch.Tensor,
                scale: torch.Tensor | None, zero: torch.Tensor | None, out_features: int,
                act_fp8: bool = False, pdl: bool = False) -> torch.Tensor:
    """Routed experts: x [T, K], pairs tok / exp [P] int32, expert weights w [E, N, K] (stored format, with
    scale / zero [E, …]) → split-K partial sums [S, P, out_features] fp32 whose sum over dim 0 has row
    p = x[tok[p]] · W[exp[p]]ᵀ (the caller sums, as for wq_linear). tok None: the pairs are token-major, P / T
    of them a token (pair_rows), computed in the kernel: a decode step builds no index tensor (a launch a layer
    inside a compiled step). Kernel on CUDA, the reference (S = 1) elsewhere. pdl: launch with programmatic
    dependent launch (kernels={"experts": "grouped-pdl"})."""
    if tok is None and exp.shape[0] % max(x.shape[0], 1):
        raise ValueError(f"tok None needs P / T pairs a token: {exp.shape[0]} pairs over {x.shape[0]} rows")
    if _on_kernel(x):
        return _launch(x.contiguous(), fmt, w, scale, zero, act_fp8, out_features, exp.shape[0], (tok, exp),
                       partials=True, pdl=pdl)
    return expert_reference(x, tok, exp, fmt, w, scale, zero, out_features, act_fp8)[None]


@expert_gemv.register_fake
def _(x, tok, exp, fmt, w, scale, zero, out_features, act_fp8=False, pdl=False):
    P = exp.shape[0]
    splits = split_plan(x.shape[1], gemv_config(fmt, out_features, x.shape[1], 1, P))[1] if _on_kernel(x) else 1
    return x.new_empty(splits, P, out_features, dtype=torch.float32)


def swiglu_reference(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """silu(gate)·up in `dtype` from a gate | up projection's split-K partials [S, P, 2I] fp32 → [P, I]."""
    gate, up = parts.sum(0).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(dtype)


@torch.library.custom_op("fastqwen::expert_swiglu_gemv", mutates_args=())
def expert_swiglu_gemv(parts: torch.Tensor, exp: torch.Tensor, fmt: int, w: torch.Tensor, scale: torch.Tensor | None,
                       out_features: int, act_dtype: torch.dtype, act_fp8: bool = False,
                       pdl: bool = False) -> torch.Tensor:
    """Routed experts' down projection on the activation of their gate | up projection: parts [S, P, 2I] fp32
    (an expert_gemv's partials), exp [P] int32, w [E, out_features, I] in format fmt (BF16, FP8_ROW or
    FP8_BLOCK, with scale [E, …]) → split-K partials [S', P, out_features] fp32 whose sum over dim 0 has row
    p = swiglu_reference(parts, act_dtype)[p] · W[exp[p]]ᵀ (act_fp8: the activation rounded to e4m3 per 128
    columns, as expert_gemv does). On CUDA the kernel computes the activation as it loads it (_row_kernel
    SWIGLU): no launch of its own."""
    if fmt == INT4:
        raise ValueError("expert_swiglu_gemv takes bf16 or fp8 experts; int4 experts run the activation separately")
    if _on_kernel(parts):
        return _launch(parts.contiguous(), fmt, w, scale, None, act_fp8, out_features, parts.shape[1], (exp, exp),
                       partials=True, pdl=pdl, swiglu=act_dtype)
    act = swiglu_reference(parts, act_dtype)
    return expert_reference(act, None, exp, fmt, w, scale, None, out_features, act_fp8)[None]


@torch.library.custom_op("fastqwen::swiglu_linear", mutates_args=())
def swiglu_linear(parts: torch.Tensor, w: torch.Tensor, out_features: int, pdl: bool = False,
                  fixup: bool = False) -> torch.Tensor:
    """A dense gated MLP's down projection on the activation of its gate | up projection, one row: parts
    [S, 1, 2I] fp32 (a wq_linear's partials of the fused gate | up weight), w [out_features, I] unquantized →
    split-K partials [S', 1, out_features] fp32 (S' = 1 with fixup) whose sum is swiglu_reference(parts) · wᵀ.
    On CUDA the kernel computes the activation as it loads it (_row_kernel SWIGLU): no launch of its own."""
    if _on_kernel(parts):
        return _launch(parts.contiguous(), BF16, w, None, None, False, out_features, 1, partials=True, pdl=pdl,
                       fixup=fixup, swiglu=w.dtype)
    return (swiglu_reference(parts, w.dtype).float() @ w.float().t())[None]


@swiglu_linear.register_fake
def _(parts, w, out_features, pdl=False, fixup=False):
    splits = linear_splits(BF16, out_features, parts.shape[2] // 2, 1) if _on_kernel(parts) and not fixup else 1
    return parts.new_empty(splits, parts.shape[1], out_features)


@expert_swiglu_gemv.register_fake
def _(parts, exp, fmt, w, scale, out_features, act_dtype, act_fp8=False, pdl=False):
    P, inter = parts.shape[1], parts.shape[2] // 2
    splits = split_plan(inter, gemv_config(fmt, out_features, inter, 1, P))[1] if _on_kernel(parts) else 1
    return parts.new_empty(splits, P, out_features)
