// A shared-memory ring fed by bulk copies (cp.async.bulk, sm_90): one producer warp copies each stage's bytes
// from global memory and counts them on the stage's `full` mbarrier; consumer warps wait on it, take what they
// need into registers and arrive on the stage's `empty` mbarrier, which the producer waits on before it reuses
// the slot. Stage t of a block's sequence sits in slot t % STAGES and is that slot's phase t / STAGES: `full`
// completes phase p when stage p·STAGES + slot has landed, `empty` when the consumers have let go of it.
// The producer issues no load of a consumer's register and no math, so it runs ahead by up to STAGES stages,
// PDL wait included (it reads weights only, which no earlier kernel writes).

#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace ring {

__device__ __forceinline__ uint32_t smem(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// One thread: a barrier expecting `count` arrivals a phase. Then fence() and a block barrier before any use.
__device__ __forceinline__ void init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem(bar)), "r"(count) : "memory");
}

// The barriers' initialisation made visible to the async (bulk copy) proxy.
__device__ __forceinline__ void fence_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// The producer's arrival on `full`, announcing the bytes its copies of this phase will bring.
__device__ __forceinline__ void arrive_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem(bar)) : "memory");
}

__device__ __forceinline__ bool try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
               : "=r"(done)
               : "r"(smem(bar)), "r"(parity)
               : "memory");
  return done;
}

__device__ __forceinline__ uint64_t nanoseconds() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

constexpr uint64_t STUCK_NS = 10'000'000'000ull;  // a wait this long is a bookkeeping bug, not a slow stage

// Until the phase of parity `parity` has completed. A barrier that never completes (a bookkeeping bug) traps
// after STUCK_NS of wall time (the GPU's global timer) instead of hanging the GPU.
__device__ __forceinline__ void wait(uint64_t* bar, uint32_t parity) {
  if (try_wait(bar, parity)) return;
  const uint64_t start = nanoseconds();
  while (!try_wait(bar, parity))
    if (nanoseconds() - start > STUCK_NS) __trap();
}

// An L2 policy for bytes read once: evicted first, so the step's activations and caches stay.
__device__ __forceinline__ uint64_t evict_first() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// bytes (a multiple of 16; both addresses 16-byte aligned) from global `src` to shared `dst`, counted on `bar`.
__device__ __forceinline__ void copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::
          "r"(smem(dst)),
      "l"(src), "r"(bytes), "r"(smem(bar)), "l"(policy)
      : "memory");
}

// One thread (then fence_init and a block barrier): each stage's `full` barrier expecting the producer's one
// arrival (and the stage's bytes), its `empty` one an arrival from each of `consumers` warps.
template <int STAGES>
__device__ __forceinline__ void init_stages(uint64_t (&full)[STAGES], uint64_t (&empty)[STAGES], uint32_t consumers) {
  for (int s = 0; s < STAGES; ++s) {
    init(&full[s], 1);
    init(&empty[s], consumers);
  }
  fence_init();
}

// The producer, before it fills stage t: stage t - STAGES (the slot's last) let go by every consumer.
template <int STAGES>
__device__ __forceinline__ void producer_acquire(uint64_t (&empty)[STAGES], int t) {
  if (t >= STAGES) wait(&empty[t % STAGES], (t / STAGES - 1) & 1);
}

// A consumer, before it reads stage t: its bytes landed.
template <int STAGES>
__device__ __forceinline__ void consumer_wait(uint64_t (&full)[STAGES], int t) {
  wait(&full[t % STAGES], (t / STAGES) & 1);
}

// A consumer warp done reading stage t (every lane's reads made before it: the arrival releases them).
template <int STAGES>
__device__ __forceinline__ void consumer_release(uint64_t (&empty)[STAGES], int t) {
  __syncwarp();
  if (threadIdx.x % 32 == 0) arrive(&empty[t % STAGES]);
}

// The items [first, last) of block b when `items` are dealt out in contiguous runs of `run`.
__device__ __forceinline__ void block_items(int b, int run, int items, int& first, int& last) {
  first = b * run;
  last = min(first + run, items);
}

// The stages of items [first, last) in order, for the producer and the consumers alike. Items are split-major:
// item i is strip i % strips of split i / strips, so that a run's neighbouring items are neighbouring strips of
// one split, whose tiles of a step share x. A run is walked in segments of at most R neighbouring strips of one
// split; a segment's steps (K groups or chunks) [split · per, min(steps, (split + 1) · per)), WIDTH at a time
// (one a consumer warp), each such block of steps for each strip of the segment in turn: a stage each.
// f(strip, split, s0, n, r, rows, ends) for the stage of steps s0 .. s0 + n - 1 (n <= WIDTH) of strip `strip`,
// the segment's r-th (r a compile-time constant: the loop over a segment's strips is unrolled, so that a
// consumer's sums[r] stay in registers) of `rows` strips; `ends` on a segment's last stage.
template <int WIDTH, int R, class F>
__device__ __forceinline__ void for_each_stage(int first, int last, int strips, int per, int steps, F f) {
  for (int item = first; item < last;) {
    const int split = item / strips, strip0 = item % strips;
    const int rows = min(R, min(last - item, strips - strip0)), end = min(steps, (split + 1) * per);
    for (int s0 = split * per; s0 < end; s0 += WIDTH) {
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (r < rows) f(strip0 + r, split, s0, min(WIDTH, end - s0), r, rows, s0 + WIDTH >= end && r == rows - 1);
    }
    item += rows;
  }
}

// A persistent launch of `kernel` (`threads` a block) over `items` with config (stream, PDL): as many blocks as
// fit on GPU `device` at once (at most blocks_per_sm a multiprocessor), the items dealt out in equal contiguous
// runs (grid ceil(items / run)); the kernel's arguments are `args`, then the run. `fits`: the kernel's blocks a
// multiprocessor, cached by the caller (0: not yet asked).
template <class... Params, class... Args>
cudaError_t launch_persistent(cudaLaunchConfig_t config, void (*kernel)(Params...), int threads, int& fits,
                              int device, int blocks_per_sm, int items, Args... args) {
  if (!fits)
    if (cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fits, kernel, threads, 0); e != cudaSuccess)
      return e;
  int sms = 0;
  if (cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device); e != cudaSuccess) return e;
  const int resident = sms * max(1, min(fits, blocks_per_sm)), run = (items + resident - 1) / resident;
  config.gridDim = dim3((items + run - 1) / run);
  config.blockDim = dim3(threads);
  return cudaLaunchKernelEx(&config, kernel, args..., run);
}

// The ring kernels' instance for (stages, NB column blocks of 8 x rows, strips a segment) as one key: stages 4
// or 8; NB 1 with 1 or 4 strips a segment, NB 2 with 1 or 2; -1 where there is none.
inline int instance_key(int stages, int NB, int strips) {
  const int key = stages * 100 + NB * 10 + strips;
  switch (key) {
    case 411: case 414: case 421: case 422: case 811: case 814: case 821: case 822: return key;
    default: return -1;
  }
}

}  // namespace ring
