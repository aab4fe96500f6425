"""Small-M quantized linear: y [M, N] = x [M, K] · Wᵀ for M ≤ 16 rows (decode, speculative verify), with W
streamed in its stored format (formats.py) and dequantized in registers, so each weight byte is read once.

One Triton kernel, three formats (constexpr FMT):
  FP8_ROW    w e4m3 [N, K], scale [N]: acc · scale[n] at the end.
  FP8_BLOCK  w e4m3 [N, K], scale_inv [⌈N/128⌉, ⌈K/128⌉]: each 128-column step adds (x·wᵀ) · scale_inv[n/128, k/128];
             with ACT_FP8, x is first rounded per row and 128 columns to e4m3 (the "fp8" scheme's numerics).
  INT4       w uint8 [N, K/2], two codes a byte (low nibble = even column), scale and zero [N, K/G]:
             w = (q − zero) · scale with G = 128 (one group per step).
A program owns BLOCK_N output columns for every row and walks K in steps of 128. The dot takes fp32 operands
(tf32 on the GPU): at these M the kernel is bound by weight bytes, not math, and fp32 keeps it within
rounding of the torch reference (it also runs in Triton's CPU interpreter, where tests/test_quant_kernels.py
checks it). `wq_linear` is the registered op: the kernel on CUDA, the reference (dequantize, matmul) elsewhere.
"""

import torch

from .formats import (
    FP8_MAX,
    dequantize_fp8_block,
    dequantize_fp8_rows,
    fake_quantize_fp8_activations,
    pack_int4,
    quantize_fp8_block,
    quantize_fp8_rows,
    quantize_int4,
    unpack_int4,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op falls back to the reference
    triton = None

FP8_ROW, FP8_BLOCK, INT4 = 0, 1, 2
FORMATS = {"fp8-weight": FP8_ROW, "fp8": FP8_BLOCK, "int4": INT4}
MAX_ROWS = 16  # the kernel's BLOCK_M; more rows take the reference path (prefill: dequantize once, then GEMM)
STEP = 128  # BLOCK_K: one fp8 scale block or one int4 group per step

if triton is not None:

    @triton.jit
    def _wq_matmul_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, M, N, K, s_stride,
                          FMT: tl.constexpr, ACT_FP8: tl.constexpr, FP8_LIMIT: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        n_ok, m_ok = n < N, m < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in tl.range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            x = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            x = x.to(tl.float32)
            if ACT_FP8:
                xs = tl.maximum(tl.max(tl.abs(x), axis=1) / FP8_LIMIT, 1e-12)
                x = (x / xs[:, None]).to(tl.float8e4nv).to(tl.float32) * xs[:, None]
            if FMT == 2:
                half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                b = tl.load(w_ptr + n[:, None] * (K // 2) + half[None, :],
                            mask=n_ok[:, None] & (half < K // 2)[None, :], other=0)
                q = tl.join(b & 0xF, b >> 4).reshape(BLOCK_N, BLOCK_K).to(tl.float32)
                g = k0 // BLOCK_K
                scale = tl.load(s_ptr + n * s_stride + g, mask=n_ok, other=0.0)
                zero = tl.load(z_ptr + n * s_stride + g, mask=n_ok, other=0.0)
                w = (q - zero[:, None]) * scale[:, None]
                acc += tl.dot(x, tl.trans(w))
            else:
                w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                part = tl.dot(x, tl.trans(w.to(tl.float32)))
                if FMT == 1:
                    part = part * tl.load(s_ptr + (n // BLOCK_K) * s_stride + k0 // BLOCK_K, mask=n_ok, other=0.0)[None, :]
                acc += part
        if FMT == 0:
            acc = acc * tl.load(s_ptr + n, mask=n_ok, other=0.0)[None, :]
        tl.store(y_ptr + m[:, None] * N + n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


def _block_n(N: int) -> int:
    """Output columns per program: the widest of 64/32/16 that still gives ≥ 256 programs (2 waves on an H200)."""
    return next((b for b in (64, 32) if N // b >= 256), 16)


def wq_matmul(x: torch.Tensor, fmt: int, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
              act_fp8: bool, out_features: int) -> torch.Tensor:
    """Launch the kernel: x [M ≤ 16, K] (any float dtype, contiguous) → fp32 y [M, out_features]."""
    M, K = x.shape
    if M > MAX_ROWS or K % STEP:
        raise ValueError(f"wq_matmul takes at most {MAX_ROWS} rows and K divisible by {STEP}; got {tuple(x.shape)}")
    N = out_features
    y = torch.empty(M, N, dtype=torch.float32, device=x.device)
    bn = _block_n(N)
    s_stride = scale.shape[1] if scale.dim() == 2 else 1
    _wq_matmul_kernel[(triton.cdiv(N, bn),)](
        x, w, scale, zero if zero is not None else scale, y, M, N, K, s_stride,
        FMT=fmt, ACT_FP8=act_fp8, FP8_LIMIT=FP8_MAX, BLOCK_M=MAX_ROWS, BLOCK_N=bn, BLOCK_K=STEP)
    return y


def stored_operands(fmt: int, w: torch.Tensor):
    """(w, scale, zero) of weight w [N, K] in format `fmt`'s stored layout, as the kernel takes them."""
    if fmt == FP8_ROW:
        return (*quantize_fp8_rows(w), None)
    if fmt == FP8_BLOCK:
        return (*quantize_fp8_block(w, (STEP, STEP)), None)
    q, s, z = quantize_int4(w, STEP)
    return pack_int4(q), s, z


def reference(x, fmt: int, w, scale, zero, act_fp8: bool, out_features: int) -> torch.Tensor:
    """The same product in plain torch, fp32 out: dequantize the weight, then matmul."""
    if act_fp8:
        x = fake_quantize_fp8_activations(x, STEP)
    if fmt == FP8_ROW:
        weight = dequantize_fp8_rows(w, scale)
    elif fmt == FP8_BLOCK:
        weight = dequantize_fp8_block(w, scale, (STEP, STEP))
    else:
        q = unpack_int4(w)
        N, K = q.shape
        weight = ((q.float().view(N, -1, STEP) - zero[..., None]) * scale[..., None]).view(N, K)
    return x.float() @ weight.t()


@torch.library.custom_op("fastqwen::wq_linear", mutates_args=())
def wq_linear(x: torch.Tensor, fmt: int, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
              act_fp8: bool, out_features: int) -> torch.Tensor:
    """fp32 x [M, K] · Wᵀ → [M, out_features] fp32: the kernel on CUDA, the reference elsewhere."""
    if x.is_cuda and triton is not None:
        return wq_matmul(x.contiguous(), fmt, w, scale, zero, act_fp8, out_features)
    return reference(x, fmt, w, scale, zero, act_fp8, out_features)


@wq_linear.register_fake
def _(x, fmt, w, scale, zero, act_fp8, out_features):
    return x.new_empty(x.shape[0], out_features, dtype=torch.float32)
