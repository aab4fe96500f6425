// fp8 (e4m3, one scale a row) weight-streaming GEMV for up to 16 rows of x, on the tensor cores: the
// "fp8-weight" scheme's decode, verify and small-batch products.
//
// y[m, n] = scale[n] * sum_k x[m, k] * q[n, k], written as split-K partial sums out[s, m, n] over the chunks of
// split s (the caller adds the splits; fastqwen/ops/fp8_cuda.py).
//
// Operands, as fastqwen.quant.QuantLinear stores an fp8-weight weight [N, K] (N % 16 == 0, K % 64 == 0):
//   w      e4m3 [N, K] row-major; scale fp32 [N]
//   x      bf16 or fp16 [M, K], M <= 16, contiguous; out fp32 [splits, M, N]
//
// A block is 4 warps on one strip of 16 rows; blockIdx.y is the split; the split's chunks of 64 columns are
// dealt to the warps in turn (adjacent warps read adjacent 64 bytes of the same rows). Lane l reads 16 bytes of
// row l/4 and 16 of row l/4 + 8 at columns 16 (l%4) .. + 15 of the chunk: word j of each (columns 4j .. 4j + 3)
// is the A operand of one mma.m16n8k16 (its two e4m3 pairs converted to 16-bit pairs, exactly: e4m3 -> f16 by
// cvt, then to bf16 through fp32 for bf16 x), with the chunk's columns permuted among the k slots; the B
// operand's column n is x row n at the same columns (lane l supplies row l/4 from consecutive pairs, no
// permute; zero past M). Sums are fp32 over the whole split; the row scale multiplies them at the end.
// Weights and scales are loaded before the PDL wait (they do not depend on the previous kernel); x after it.
//
// The warps load their chunks straight into registers, BATCH chunks ahead (fp8_gemv_rows). A ring kernel fed by a
// producer warp's bulk copies (a persistent grid) was 1.35-1.9x slower on an H200 and removed (2026-12-05;
// docs/DESIGN-NOTES.md).

#include <cuda_fp16.h>

#include "strip_gemv.cuh"

namespace {

using strip_gemv::load_weights;
using strip_gemv::WARPS;
constexpr int CHUNK = 64;  // columns of a chunk: 16 bytes a lane of rows l/4 and l/4 + 8

// The two e4m3 pairs of word u as 16-bit pairs of x's type: pair 0 the low two bytes (columns 4j, 4j + 1).
template <bool BF16>
__device__ __forceinline__ void decode(uint32_t u, uint32_t& p0, uint32_t& p1) {
  uint32_t h0, h1;  // f16x2: exact (every e4m3 value is an f16 value)
  asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %2; cvt.rn.f16x2.e4m3x2 %0, lo; cvt.rn.f16x2.e4m3x2 %1, hi; }"
      : "=r"(h0), "=r"(h1)
      : "r"(u));
  if constexpr (BF16) {  // f16 -> fp32 -> bf16: exact (e4m3's 3 mantissa bits and range fit bf16)
    const __half2 a = *reinterpret_cast<const __half2*>(&h0), b = *reinterpret_cast<const __half2*>(&h1);
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(p0) : "f"(__high2float(a)), "f"(__low2float(a)));
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(p1) : "f"(__high2float(b)), "f"(__low2float(b)));
  } else {
    p0 = h0;
    p1 = h1;
  }
}

// One chunk of one warp: c[nb] += sums of q x over the chunk for x rows 8 nb .. 8 nb + 7 (c0, c1: strip row
// l/4 against x rows 8 nb + 2 (l%4) and + 1; c2, c3: row l/4 + 8). a, b: the lane's 16 bytes of rows l/4 and
// l/4 + 8; xs[nb]: x row 8 nb + l/4 at the lane's 16 columns, two uint4 (zero past M).
template <bool BF16, int NB>
__device__ __forceinline__ void chunk_dot(float (&c)[NB][4], uint4 a, uint4 b, const uint4 (&xs)[NB][2]) {
  const uint32_t wa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t A[4];
    decode<BF16>(wa[j], A[0], A[2]);  // row l/4: k slots 2 (l%4) + 0, 1 and + 8, 9
    decode<BF16>(wb[j], A[1], A[3]);  // row l/4 + 8: the same slots
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      const uint4 v = xs[nb][j / 2];  // x columns 8 (j/2) .. + 7 of the lane's 16: pairs 2j, 2j + 1 (mod 4)
      const uint32_t b0 = (j % 2) ? v.z : v.x, b1 = (j % 2) ? v.w : v.y;
      strip_gemv::mma<BF16>(c[nb], A, b0, b1);
    }
  }
}

// One warp's weights of BATCH chunks c0, c0 + WARPS, ... (< c_end): the lane's 16 bytes of both rows of each.
// rows: row l/4's 16 bytes of chunk 0 (row l/4 + 8's lie half_k uint4s further: 8 rows of K bytes).
template <int BATCH>
struct Batch {
  uint4 ta[BATCH], tb[BATCH];

  __device__ __forceinline__ void load(const uint4* rows, int half_k, int c0, int c_end) {
    const uint4* p = rows + (size_t)c0 * (CHUNK / 16);  // (then constant offsets: no address math a load)
#pragma unroll
    for (int t = 0; t < BATCH; ++t) {
      if (c0 + t * WARPS < c_end) {
        ta[t] = load_weights(p + t * WARPS * (CHUNK / 16));
        tb[t] = load_weights(p + t * WARPS * (CHUNK / 16) + half_k);
      }
    }
  }

  // xcols[nb]: x row 8 nb + l/4 at the lane's 16 columns of chunk 0; has_x[nb]: whether that row is < M.
  template <bool BF16, int NB>
  __device__ __forceinline__ void dot(const uint4* const (&xcols)[NB], const bool (&has_x)[NB], int c0, int c_end,
                                      float (&sums)[NB][4]) const {
#pragma unroll
    for (int t = 0; t < BATCH; ++t) {
      if (c0 + t * WARPS < c_end) {
        uint4 xs[NB][2];
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
          const uint4* p = xcols[nb] + (size_t)(c0 + t * WARPS) * (CHUNK / 8);
#pragma unroll
          for (int i = 0; i < 2; ++i) xs[nb][i] = has_x[nb] ? p[i] : make_uint4(0, 0, 0, 0);
        }
        chunk_dot<BF16, NB>(sums, ta[t], tb[t], xs);
      }
    }
  }
};

// (x without __restrict__: plain loads, made after the PDL wait, not the read-only path.)
template <bool BF16, int BATCH, int NB>
__global__ void __launch_bounds__(WARPS * 32, 4) fp8_gemv_rows(const uint16_t* x, const uint8_t* __restrict__ w,
                                                               const float* scale,  // (coherent: before the wait)
                                                               float* __restrict__ out, int M, int N, int K,
                                                               int chunks_per_split) {
  const int C = K / CHUNK, strip = blockIdx.x, split = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row_a = strip * 16 + lane / 4;
  const int c_begin = split * chunks_per_split + warp, c_end = min(C, (split + 1) * chunks_per_split);
  // row l/4's 16 bytes of chunk c at + c * 4 uint4s (row l/4 + 8: + 8 K / 16 more)
  const uint4* rows = reinterpret_cast<const uint4*>(w + (size_t)row_a * K) + (lane % 4);
  bool has_x[NB];
  const uint4* xcols[NB];  // x row 8 nb + l/4 at the lane's 16 columns of chunk c: + c * 8 uint4s
  strip_gemv::x_columns<NB, 2>(x, M, K, lane, has_x, xcols);
  float sums[NB][4] = {};
  const float scale_a = scale[row_a], scale_b = scale[row_a + 8];
  constexpr int STRIDE = BATCH * WARPS;
  Batch<BATCH> a;
  const int half_k = K / 2;  // (row l/4 + 8, in uint4s past row l/4)
  a.load(rows, half_k, c_begin, c_end);  // (weights: before the wait)
  asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the previous kernel's output (PDL)
  for (int c0 = c_begin; c0 < c_end; c0 += STRIDE) {
    if (c0 != c_begin) a.load(rows, half_k, c0, c_end);
    a.template dot<BF16, NB>(xcols, has_x, c0, c_end, sums);
  }
  strip_gemv::write_partials<NB>(sums, scale_a, scale_b, out, M, N, strip, split);
}

template <bool BF16, int BATCH, int NB>
cudaError_t launch(const cudaLaunchConfig_t& config, const void* x, const void* w, const void* scale, float* out,
                   int M, int N, int K, int chunks_per_split) {
  return cudaLaunchKernelEx(&config, fp8_gemv_rows<BF16, BATCH, NB>, static_cast<const uint16_t*>(x),
                            static_cast<const uint8_t*>(w), static_cast<const float*>(scale), out, M, N, K,
                            chunks_per_split);
}

// The instance for M rows and batch as one key (NB 1 for M <= 8, 2 past it); -1 where there is none.
int variant_key(int M, int batch) {
  const int key = (M > 8) * 100 + batch;
  switch (key) {
    case 2: case 4: case 8: case 102: case 104: return key;
    default: return -1;
  }
}

template <bool BF16>
cudaError_t launch_variant(int key, const cudaLaunchConfig_t& config, const void* x, const void* w,
                           const void* scale, float* out, int M, int N, int K, int chunks_per_split) {
  switch (key) {
    case 2: return launch<BF16, 2, 1>(config, x, w, scale, out, M, N, K, chunks_per_split);
    case 4: return launch<BF16, 4, 1>(config, x, w, scale, out, M, N, K, chunks_per_split);
    case 8: return launch<BF16, 8, 1>(config, x, w, scale, out, M, N, K, chunks_per_split);
    case 102: return launch<BF16, 2, 2>(config, x, w, scale, out, M, N, K, chunks_per_split);
    case 104: return launch<BF16, 4, 2>(config, x, w, scale, out, M, N, K, chunks_per_split);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

// Launches the kernel on `stream` of GPU `device`; returns the cudaError_t, cudaErrorInvalidValue (1) before
// touching the GPU where the arguments are out of the kernel's range: N % 16, K % 64, a split plan that leaves a
// split empty or a chunk out, M outside 1 .. 16, a batch with no instance for M (2, 4 or 8; only 2 or 4 past 8
// rows). pdl: programmatic dependent launch (the kernel waits before reading x).
extern "C" int fastqwen_fp8_gemv(const void* x, const void* w, const void* scale, float* out, int M, int N, int K,
                                 int splits, int chunks_per_split, int batch, int bf16, int pdl, int device,
                                 void* stream) {
  const int key = variant_key(M, batch);
  if (!strip_gemv::shape_ok(M, N, K, CHUNK, splits, chunks_per_split) || key < 0)
    return static_cast<int>(cudaErrorInvalidValue);
  cudaLaunchConfig_t config;
  cudaLaunchAttribute attribute;
  if (cudaError_t e = strip_gemv::launch_config(config, attribute, N, splits, pdl, device, stream); e != cudaSuccess)
    return static_cast<int>(e);
  return static_cast<int>(bf16 ? launch_variant<true>(key, config, x, w, scale, out, M, N, K, chunks_per_split)
                               : launch_variant<false>(key, config, x, w, scale, out, M, N, K, chunks_per_split));
}
