// What fastqwen's few-row GEMV kernels (int4_gemv.cu, fp8_gemv.cu) share: a block of 4 warps on one strip of 16
// weight rows, each lane's 16-byte loads of rows l/4 and l/4 + 8 feeding mma.m16n8k16 as its A operand, x rows
// as the B operand's columns (8 a column block, NB blocks), fp32 partial sums out[split, m, n].

#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace strip_gemv {

constexpr int WARPS = 4;  // a block: one strip of 16 rows, the split's K steps dealt to 4 warps

// Streamed once: kept out of L1. A coherent load, not the read-only path (.nc), and volatile: ptxas schedules
// .nc loads freely around griddepcontrol.wait (seen hoisting the wait above them), not these, so the first
// batch stays in flight before the PDL wait.
__device__ __forceinline__ uint4 load_weights(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// c += A B on the tensor cores: A a lane's four 16-bit pairs (bf16 or fp16), B its two, fp32 sums.
template <bool BF16>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (BF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// x row 8 nb + l/4 of the lane's column block nb (the B operand it supplies): where its columns of step 0 start,
// LANE uint4s into the row for each lane % 4 (a row clamped to M - 1: rows past M read row M - 1 again, harmless
// where their sums are not written).
template <int NB, int LANE>
__device__ __forceinline__ void x_columns(const uint16_t* x, int M, int K, int lane, const uint4* (&cols)[NB]) {
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
    cols[nb] = reinterpret_cast<const uint4*>(x + (size_t)min(nb * 8 + lane / 4, M - 1) * K) + (lane % 4) * LANE;
}

// The same, and whether each row is < M (has_x: where the kernel gates its loads on it, never reading past M).
template <int NB, int LANE>
__device__ __forceinline__ void x_columns(const uint16_t* x, int M, int K, int lane, bool (&has_x)[NB],
                                          const uint4* (&cols)[NB]) {
  x_columns<NB, LANE>(x, M, K, lane, cols);
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) has_x[nb] = nb * 8 + lane / 4 < M;
}

// The epilogue of one strip: lane l's sums[nb] (c0, c1: row l/4 of the strip against x rows 8 nb + 2 (l%4) and
// + 1; c2, c3: row l/4 + 8), times the rows' scales (scale_a, scale_b), summed over the 4 warps into
// out[split, m, the strip's rows] (M rows); once a block (its shared sums are not read again).
template <int NB>
__device__ __forceinline__ void write_partials(const float (&sums)[NB][4], float scale_a, float scale_b, float* out,
                                               int M, int N, int strip, int split) {
  __shared__ float part[WARPS][8 * NB][16];  // [warp][x row][row of the strip]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, row = lane / 4, m = 2 * (lane % 4);
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    part[warp][8 * nb + m][row] = scale_a * sums[nb][0];
    part[warp][8 * nb + m + 1][row] = scale_a * sums[nb][1];
    part[warp][8 * nb + m][row + 8] = scale_b * sums[nb][2];
    part[warp][8 * nb + m + 1][row + 8] = scale_b * sums[nb][3];
  }
  __syncthreads();
  for (int t = threadIdx.x; t < 16 * M; t += WARPS * 32) {
    const int col = t % 16, xrow = t / 16;
    float s = 0.f;
#pragma unroll
    for (int v = 0; v < WARPS; ++v) s += part[v][xrow][col];
    out[((size_t)split * M + xrow) * N + strip * 16 + col] = s;
  }
}

// Whether (M, N, K, splits, steps a split) are in a kernel's range: N % 16, K % step_columns, 1 <= M <= 16, every
// split nonempty and every K step in one.
inline bool shape_ok(int M, int N, int K, int step_columns, int splits, int per) {
  const int steps = K / step_columns;
  return N > 0 && N % 16 == 0 && K > 0 && K % step_columns == 0 && M >= 1 && M <= 16 && splits >= 1 && per >= 1 &&
         (splits - 1) * per < steps && splits * per >= steps;
}

// A launch of the (N / 16, splits) grid of 4-warp blocks on `stream` of GPU `device` (made this runtime's current
// device first: the library links its own CUDA runtime, whose current device is not torch's), with programmatic
// dependent launch if pdl. `attribute` must outlive the launch call.
inline cudaError_t launch_config(cudaLaunchConfig_t& config, cudaLaunchAttribute& attribute, int N, int splits,
                                 int pdl, int device, void* stream) {
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) return e;
  config = {};
  config.gridDim = dim3(N / 16, splits);
  config.blockDim = dim3(WARPS * 32);
  config.stream = static_cast<cudaStream_t>(stream);
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = pdl ? 1 : 0;
  return cudaSuccess;
}

}  // namespace strip_gemv
