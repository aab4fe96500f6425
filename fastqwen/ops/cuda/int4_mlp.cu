// A dense gated MLP's int4 decode at one row of bf16 x as one persistent kernel (a candidate, the first step of a
// layer-fused decode step: fastqwen/ops/int4_mlp.py, docs/DESIGN-NOTES.md):
//   gu   = x W_gu^T             fp32 [2I]: the fused gate | up weight (gate rows [0, I), up rows [I, 2I)), all K in
//                               one sum a row (no split-K)
//   h    = bf16(silu(bf16(gate)) · bf16(up))   bf16 [I], as the compiled step rounds it
//   out  = h W_down^T           fp32 partials [C, N]: chunk c the product over h's columns [c I/C, (c + 1) I/C)
// in place of three launches (the gate | up GEMV, the silu·mul kernel, the down GEMV) and their starts and drains.
// Weights in QuantLinear's int4 layout (int4_gemv.cu's header); the decode is the folded kernel's (int4_decode.cuh).
//
// Tasks, in one global order: first the 2I/16 strips of W_gu, chunk by chunk (chunk c's I/16/C gate strips, then its
// up strips), each writing its 16 rows of gu; then W_down's (chunk, strip) tasks, chunk-major. Block b runs tasks b,
// b + G, b + 2G, ... (G blocks, all resident: a cooperative launch). The last strip task of a chunk to finish (an
// arrival count) computes the chunk's h and sets its ready flag; a down task issues its first weight loads, then waits
// for its chunk's flag. A task waits only on tasks of lower index, and every block runs its tasks in increasing
// order with all blocks resident, so the lowest unfinished task can always run: no deadlock. The counts and flags
// (counts[0, C) arrivals, [C, 2C) flags, [2C] blocks done) start at zero and the last block to finish resets them, so
// the next launch (and a CUDA graph's replay) starts from zero.

#include <cuda_bf16.h>

#include "int4_decode.cuh"
#include "strip_gemv.cuh"

namespace {

using namespace int4_decode;

__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Release-acquire at GPU scope, by one thread after a CTA barrier (the CTA's earlier stores are in the release, as in
// CUTLASS's semaphores): no full fence (__threadfence is a MEMBAR.SC).
__device__ __forceinline__ int add_acq_rel(int* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

__device__ __forceinline__ void store_release(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// One strip of 16 rows of an [N, K] int4 weight against one row of x over the groups [g_first, g_end) (the warps take
// them in turn), written to out[split, N] (write_partials: once a block). The warps' first weight loads are issued
// before `wait` runs (a down task's wait for its chunk of x); L2: x read past L1.
template <bool L2, typename Wait>
__device__ __forceinline__ void strip_task(const uint16_t* x, const uint4* w, const __half* scale, const uint8_t* zero,
                                           float* out, int N, int K, int strip, int split, int g_first, int g_end,
                                           uint32_t magic, Wait wait) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g_begin = g_first + warp;
  FoldWalk wk(w, scale, zero, N, K / 128, strip, lane, g_begin, g_end);
  wk.load(g_begin);
  wait();
  bool has_x[1];
  const uint4* xcols[1];
  strip_gemv::x_columns<1, 4>(x, 1, K, lane, has_x, xcols);
  xcols[0] += (size_t)g_begin * 16;
  float sums[1][4] = {};
  fold_sums<1, L2>(wk, xcols, has_x, g_begin, magic, sums);
  strip_gemv::write_partials<1>(sums, 1.f, 1.f, out, 1, N, strip, split);
  __syncthreads();  // (write_partials' shared sums read by all before the next task writes them)
}

__global__ void __launch_bounds__(WARPS * 32, 7) int4_mlp(const uint16_t* x, const uint4* __restrict__ w_gu,
                                                          const __half* s_gu, const uint8_t* z_gu,
                                                          const uint4* __restrict__ w_dn, const __half* s_dn,
                                                          const uint8_t* z_dn, float* gu, uint16_t* h, float* out,
                                                          int* counts, int I, int K, int N, int C, uint32_t magic) {
  __shared__ int last;
  const int per_chunk = I / 16 / C, strips_up = 2 * I / 16, strips_down = N / 16;
  const int width = I / C, tasks = strips_up + C * strips_down;
  int* arrivals = counts;
  int* ready = counts + C;
  int task = blockIdx.x;
  for (; task < strips_up; task += gridDim.x) {  // strips of gate | up; a chunk's last strip computes its h
    const int c = task / (2 * per_chunk), j = task % (2 * per_chunk);
    const int strip = j < per_chunk ? c * per_chunk + j : I / 16 + c * per_chunk + j - per_chunk;
    strip_task<false>(x, w_gu, s_gu, z_gu, gu, 2 * I, K, strip, 0, 0, K / 128, magic, [] {});
    if (threadIdx.x == 0)  // (the block's gu stores, ordered by the barrier above, released with its arrival)
      last = add_acq_rel(arrivals + c, 1) == 2 * per_chunk - 1;
    __syncthreads();
    if (last) {
      for (int i = c * width + threadIdx.x; i < (c + 1) * width; i += WARPS * 32) {
        const float g = bf16_round(__ldcg(gu + i)), u = bf16_round(__ldcg(gu + I + i));
        const __nv_bfloat16 v = __float2bfloat16_rn(g / (1.f + expf(-g)) * u);
        h[i] = *reinterpret_cast<const uint16_t*>(&v);
      }
      __syncthreads();
      if (threadIdx.x == 0) store_release(ready + c, 1);
    }
  }
  for (; task < tasks; task += gridDim.x) {  // strips of down over chunk c of h, once the chunk is ready
    const int c = (task - strips_up) / strips_down, strip = (task - strips_up) % strips_down;
    const int groups = width / 128;
    strip_task<true>(h, w_dn, s_dn, z_dn, out, N, I, strip, c, c * groups, (c + 1) * groups, magic, [&] {
      if (threadIdx.x == 0) {
        while (!load_acquire(ready + c)) __nanosleep(32);
      }
      __syncthreads();
    });
  }
  if (threadIdx.x == 0 && add_acq_rel(counts + 2 * C, 1) == (int)gridDim.x - 1) {  // the last block out resets
    for (int i = 0; i <= 2 * C; ++i) counts[i] = 0;                                    // the counts for the next launch
  }
}

}  // namespace

// The blocks int4_mlp runs: as many as fit the GPU at once (its occupancy × the multiprocessors), at most `cap`
// (0: no cap); 0 where the query fails.
extern "C" int fastqwen_int4_mlp_blocks(int cap, int device) {
  int per_sm = 0, sms = 0;
  if (cudaSetDevice(device) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, int4_mlp, WARPS * 32, 0) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return 0;
  return cap > 0 && cap < per_sm * sms ? cap : per_sm * sms;
}

// Launches int4_mlp (a cooperative launch of `blocks` blocks, fastqwen_int4_mlp_blocks) on `stream` of GPU `device`;
// returns the cudaError_t, cudaErrorInvalidValue (1) before touching the GPU where the shapes are out of range: I, N
// multiples of 16, K and I / C multiples of 128, C >= 1, blocks >= 1. gu fp32 [2I] and h bf16 [I] are scratch,
// counts int32 [2C + 1] zero (left zero), out fp32 [C, N].
extern "C" int fastqwen_int4_mlp(const void* x, const void* w_gu, const void* s_gu, const void* z_gu, const void* w_dn,
                                 const void* s_dn, const void* z_dn, float* gu, void* h, float* out, int* counts, int I,
                                 int K, int N, int C, int blocks, int device, void* stream) {
  if (I <= 0 || I % 16 || K <= 0 || K % 128 || N <= 0 || N % 16 || C < 1 || I % C || (I / C) % 128 || blocks < 1)
    return static_cast<int>(cudaErrorInvalidValue);
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) return static_cast<int>(e);
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(WARPS * 32);
  config.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeCooperative;  // (all blocks resident: the waits need it)
  attribute.val.cooperative = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return static_cast<int>(cudaLaunchKernelEx(
      &config, int4_mlp, static_cast<const uint16_t*>(x), static_cast<const uint4*>(w_gu),
      static_cast<const __half*>(s_gu), static_cast<const uint8_t*>(z_gu), static_cast<const uint4*>(w_dn),
      static_cast<const __half*>(s_dn), static_cast<const uint8_t*>(z_dn), gu, static_cast<uint16_t*>(h), out, counts,
      I, K, N, C, Pairs<true>::MAGIC));
}
