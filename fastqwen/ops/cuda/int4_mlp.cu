// A dense gated MLP's int4 decode at one row of bf16 x as one persistent kernel (a candidate, the first step of a
// layer-fused decode step: fastqwen/ops/int4_mlp.py, docs/DESIGN-NOTES.md):
//   gate, up = x W_gu^T         fp32 [2I]: the fused gate | up weight (gate rows [0, I), up rows [I, 2I)), all K in
//                               one sum a row (no split-K)
//   h    = bf16(silu(bf16(gate)) · bf16(up))   bf16 [I], as the compiled step rounds it
//   out  = h W_down^T           fp32 partials [C, N]: chunk c the product over h's columns [c I/C, (c + 1) I/C)
// in place of three launches (the gate | up GEMV, the silu·mul kernel, the down GEMV) and their starts and drains.
// Weights in QuantLinear's int4 layout (int4_gemv.cu's header); the decode is the folded kernel's (int4_decode.cuh).
//
// Tasks, in one global order: first the I/16 pair tasks (j: gate strip j and up strip j, 16 rows each, which write
// h's 16 entries [16 j, 16 j + 16) themselves, chunk c = 16 j / (I/C)), then W_down's (chunk, strip) tasks,
// chunk-major. Block b runs task b first, then takes tickets: the next task in order, from a counter (fetched while
// its task runs). A pair task counts its chunk's arrivals when its h is stored (release); a down task issues its
// first weight loads, then waits until its chunk's count is full (acquire). No deadlock: a down task waits only on
// pair tasks, which wait on nothing, and every pair task belongs to a running block (a ticket is taken by a running
// block) or to a first task b < grid, whose block becomes resident once the grid fits the GPU beside what ends on its
// own (the launch asks no more blocks than are resident at once). With PDL the blocks start in the previous kernel's
// tail: first weight loads, then griddepcontrol.wait, and only then a read of x, an atomic or a store.
// counts int32 [C + 2]: [0, C) arrivals, [C] tickets taken, [C + 1] blocks out; they start at zero and the last block
// out resets them, so the next launch (and a CUDA graph's replay) starts from zero.

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

__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// One strip of 16 rows of an [N, K] int4 weight against one row of x over the groups [g_first, g_end) (the warps take
// them in turn), summed over the warps: thread t < 16 returns row t's sum, the others 0. The warps' first weight loads
// are issued before `wait` runs (the PDL wait, a down task's wait for its chunk of x); L2: x read past L1.
template <bool L2, typename Wait>
__device__ __forceinline__ float strip_task(const uint16_t* x, const uint4* w, const __half* scale,
                                            const uint8_t* zero, int N, int K, int strip, int g_first, int g_end,
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
  __shared__ float part[WARPS][16];  // [warp][row]: lanes l % 4 == 0 hold x row 0's sums of rows l/4, l/4 + 8
  if (lane % 4 == 0) {
    part[warp][lane / 4] = sums[0][0];
    part[warp][lane / 4 + 8] = sums[0][2];
  }
  __syncthreads();
  float s = 0.f;
  if (threadIdx.x < 16) {
#pragma unroll
    for (int v = 0; v < WARPS; ++v) s += part[v][threadIdx.x];  // (write_partials' order)
  }
  __syncthreads();  // (read by all before the next strip writes them)
  return s;
}

__global__ void __launch_bounds__(WARPS * 32, 7) int4_mlp(const uint16_t* x, const uint4* __restrict__ w_gu,
                                                          const __half* s_gu, const uint8_t* z_gu,
                                                          const uint4* __restrict__ w_dn, const __half* s_dn,
                                                          const uint8_t* z_dn, uint16_t* h, float* out, int* counts,
                                                          int I, int K, int N, int C, uint32_t magic) {
  __shared__ int next;
  const int pairs = I / 16, per_chunk = pairs / C, strips_down = N / 16, tasks = pairs + C * strips_down;
  int* arrivals = counts;
  int ticket = 0;  // (thread 0's next task, taken after the PDL wait: the counts are the previous launch's till then)
  const auto take_ticket = [&] {
    asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the previous kernel's output (PDL)
    if (threadIdx.x == 0) ticket = gridDim.x + atomicAdd(counts + C, 1);
  };
  const auto next_task = [&] {  // (thread 0's ticket to all)
    if (threadIdx.x == 0) next = ticket;
    __syncthreads();
    const int t = next;
    __syncthreads();  // (read by all before thread 0 writes the next)
    return t;
  };
  int task = blockIdx.x;
  for (; task < pairs; task = next_task()) {  // gate and up strips j, then h's 16 entries and the chunk's arrival
    const int j = task;
    float gate = 0.f, up = 0.f;
#pragma unroll 1
    for (int half = 0; half < 2; ++half) {  // (one copy of the walk: two in a row spill)
      const float s = strip_task<false>(x, w_gu, s_gu, z_gu, 2 * I, K, half * pairs + j, 0, K / 128, magic, [&] {
        if (half == 0) take_ticket();
      });
      (half ? up : gate) = s;
    }
    if (threadIdx.x < 16) {
      const float g = bf16_round(gate), u = bf16_round(up);
      const __nv_bfloat16 v = __float2bfloat16_rn(g / (1.f + expf(-g)) * u);
      h[16 * j + threadIdx.x] = *reinterpret_cast<const uint16_t*>(&v);
    }
    __syncthreads();  // (h's stores, then their release by thread 0)
    if (threadIdx.x == 0) add_acq_rel(arrivals + j / per_chunk, 1);
  }
  for (; task < tasks; task = next_task()) {  // strips of down over chunk c of h, once its pairs have all arrived
    const int c = (task - pairs) / strips_down, strip = (task - pairs) % strips_down, groups = I / C / 128;
    const float s = strip_task<true>(h, w_dn, s_dn, z_dn, N, I, strip, c * groups, (c + 1) * groups, magic, [&] {
      take_ticket();
      if (threadIdx.x == 0) {
        while (load_acquire(arrivals + c) < per_chunk) __nanosleep(32);
      }
      __syncthreads();
    });
    if (threadIdx.x < 16) out[(size_t)c * N + strip * 16 + threadIdx.x] = s;
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");  // (a block with no task: the counts are still the last launch's)
  if (threadIdx.x == 0 && add_acq_rel(counts + C + 1, 1) == (int)gridDim.x - 1) {  // the last block out resets
    for (int i = 0; i < C + 2; ++i) counts[i] = 0;                                   // the counts for the next launch
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

// Launches int4_mlp (`blocks` blocks, at most fastqwen_int4_mlp_blocks: the waits need them all resident once what
// runs before ends) on `stream` of GPU `device`, with programmatic dependent launch if pdl; returns the cudaError_t,
// cudaErrorInvalidValue (1) before touching the GPU where the shapes are out of range: I, N multiples of 16, K and
// I / C multiples of 128, C >= 1, blocks >= 1. h bf16 [I] is scratch, counts int32 [C + 2] zero (left zero), out fp32
// [C, N].
extern "C" int fastqwen_int4_mlp(const void* x, const void* w_gu, const void* s_gu, const void* z_gu, const void* w_dn,
                                 const void* s_dn, const void* z_dn, void* h, float* out, int* counts, int I, int K,
                                 int N, int C, int blocks, int pdl, int device, void* stream) {
  if (I <= 0 || I % 16 || K <= 0 || K % 128 || N <= 0 || N % 16 || C < 1 || I % C || (I / C) % 128 || blocks < 1)
    return static_cast<int>(cudaErrorInvalidValue);
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) return static_cast<int>(e);
  if (blocks > fastqwen_int4_mlp_blocks(0, device)) return static_cast<int>(cudaErrorInvalidValue);  // (not resident)
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(WARPS * 32);
  config.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = pdl ? 1 : 0;
  return static_cast<int>(cudaLaunchKernelEx(
      &config, int4_mlp, static_cast<const uint16_t*>(x), static_cast<const uint4*>(w_gu),
      static_cast<const __half*>(s_gu), static_cast<const uint8_t*>(z_gu), static_cast<const uint4*>(w_dn),
      static_cast<const __half*>(s_dn), static_cast<const uint8_t*>(z_dn), static_cast<uint16_t*>(h), out, counts, I,
      K, N, C, Pairs<true>::MAGIC));
}
