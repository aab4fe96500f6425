// A shared-memory ring fed by bulk copies (cp.async.bulk, sm_90): one producer warp copies each stage's bytes
// from global memory and counts them on the stage's `full` mbarrier; consumer warps wait on it, take what they
// need into registers and arrive on the stage's `empty` mbarrier, which the producer waits on before it reuses
// the slot. Stage t of a block's sequence sits in slot t % STAGES and is that slot's phase t / STAGES: `full`
// completes phase p when stage p·STAGES + slot has landed, `empty` when the consumers have let go of it.
// The producer issues no load of a consumer's register and no math, so it runs ahead by up to STAGES stages,
// PDL wait included (it reads weights only, which no earlier kernel writes).

#pragma once

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

// Until the phase of parity `parity` has completed. A barrier that never completes (a bookkeeping bug) traps
// after ~2^28 polls (seconds) instead of hanging the GPU.
__device__ __forceinline__ void wait(uint64_t* bar, uint32_t parity) {
  for (uint32_t polls = 0;; ++polls) {
    uint32_t done;
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(smem(bar)), "r"(parity)
        : "memory");
    if (done) return;
    if (polls == (1u << 28)) __trap();
  }
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

// The items [first, last) of block b when `items` are dealt out in contiguous runs of `per` (the host's grid:
// blocks = ceil(items / per)).
__host__ __device__ inline void block_items(int b, int per, int items, int& first, int& last) {
  first = b * per;
  last = first + per < items ? first + per : items;
}

}  // namespace ring
