// The int4 decode that fastqwen's int4 kernels share (int4_gemv.cu, int4_mlp.cu): a tile's nibble pairs as 16-bit
// (MAGIC + q) pairs by one LOP3, x as mma.m16n8k16's B operands, and the folded kernels' walk over a warp's groups
// with the zero taken out of the decode (int4_gemv.cu's header comment has the layout and the derivation).

#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

#include "strip_gemv.cuh"

namespace int4_decode {

using strip_gemv::load_weights;
using strip_gemv::WARPS;

template <bool BF16>
struct Pairs;  // the 16-bit pair arithmetic of one x dtype

template <>
struct Pairs<true> {
  static constexpr uint32_t MAGIC = 0x43004300u;     // (128, 128): 128 + q (q < 16) is exact in bf16
  static constexpr uint32_t NEG_MAGIC = 0xC300u;     // -(128 + zero) is 0xC300 | zero
  static constexpr uint32_t ONE = 0x3F803F80u;
  __device__ __forceinline__ static uint32_t fma(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
  }
};

template <>
struct Pairs<false> {
  static constexpr uint32_t MAGIC = 0x64006400u;  // (1024, 1024): 1024 + q is exact in fp16
  static constexpr uint32_t NEG_MAGIC = 0xE400u;  // -(1024 + zero) is 0xE400 | zero
  static constexpr uint32_t ONE = 0x3C003C00u;
  __device__ __forceinline__ static uint32_t fma(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
  }
};

// (MAGIC + q) of word u's nibble pair (j, j + 4) as a 16-bit pair, exactly; magic = MAGIC in a register:
// (u & 0x000F000F) | magic is then one LOP3 (ptxas splits it in two where both constants are immediates).
__device__ __forceinline__ uint32_t pair_plus_magic(uint32_t u, int j, uint32_t magic) {
  uint32_t t;
  asm("lop3.b32 %0, %1, 0x000F000F, %2, 0xea;" : "=r"(t) : "r"(u >> (4 * j)), "r"(magic));
  return t;
}

// x's B operands for one group: xb[nb][i] = the two registers of each of word i's two MMAs (lo: columns
// 8i + (0, 4) and (1, 5); hi: (2, 6) and (3, 7), as the decode pairs them), from xs[nb][i] = x row 8 nb + l/4 at
// the lane's columns 8i .. 8i + 7 (zero past M).
template <int NB>
__device__ __forceinline__ void x_operands(const uint4 (&xs)[NB][4], uint32_t (&xb)[NB][4][4]) {
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint4 v = xs[nb][i];
      xb[nb][i][0] = __byte_perm(v.x, v.z, 0x5410);
      xb[nb][i][1] = __byte_perm(v.x, v.z, 0x7632);
      xb[nb][i][2] = __byte_perm(v.y, v.w, 0x5410);
      xb[nb][i][3] = __byte_perm(v.y, v.w, 0x7632);
    }
  }
}

// A folded kernel's walk over its warp's groups (int4_gemv_fold, int4_gemv_staged): at the current group g, the
// lane's words of its tile and the scales and zeros of (row l/4, g) and (row l/4 + 8, g); load(g0) takes groups g0
// and g0 + WARPS (those < g_end) into registers, next() steps the walk by 2 WARPS groups (pointers, not indices).
struct FoldWalk {
  const uint4* tile;
  const __half* sc;
  const uint8_t* ze;
  size_t step;
  int g_end;
  uint4 ta[2], tb[2];
  float sa[2], sb[2];
  uint32_t za[2], zb[2];

  __device__ __forceinline__ FoldWalk(const uint4* w, const __half* scale, const uint8_t* zero, int N, int G,
                                      int strip, int lane, int g_begin, int g_end_)
      : tile(w + ((size_t)strip * G + g_begin) * 64 + lane), step((size_t)WARPS * N), g_end(g_end_) {
    const size_t side = (size_t)g_begin * N + strip * 16 + lane / 4;
    sc = scale + side;
    ze = zero + side;
  }

  __device__ __forceinline__ void load(int g0) {
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      if (g0 + t * WARPS < g_end) {
        ta[t] = load_weights(tile + t * WARPS * 64);
        tb[t] = load_weights(tile + t * WARPS * 64 + 32);
        sa[t] = __half2float(sc[t * step]);
        sb[t] = __half2float(sc[t * step + 8]);
        za[t] = ze[t * step];
        zb[t] = ze[t * step + 8];
      }
    }
  }

  __device__ __forceinline__ void next() {
    tile += 2 * WARPS * 64;
    sc += 2 * step;
    ze += 2 * step;
  }
};

// Words u (row l/4) and v (row l/4 + 8) of a lane's tile as the A operands of their two MMAs in (MAGIC + q) pairs,
// the folded kernels' decode: lo the nibble pairs 0 and 1, hi 2 and 3.
__device__ __forceinline__ void plus_magic_operands(uint32_t u, uint32_t v, uint32_t magic, uint32_t (&lo)[4],
                                                    uint32_t (&hi)[4]) {
  lo[0] = pair_plus_magic(u, 0, magic), lo[1] = pair_plus_magic(v, 0, magic);
  lo[2] = pair_plus_magic(u, 1, magic), lo[3] = pair_plus_magic(v, 1, magic);
  hi[0] = pair_plus_magic(u, 2, magic), hi[1] = pair_plus_magic(v, 2, magic);
  hi[2] = pair_plus_magic(u, 3, magic), hi[3] = pair_plus_magic(v, 3, magic);
}

// One group of the folded kernel: c[nb] += the group's sums of (MAGIC + q) x (c0, c1: strip row l/4 against x
// rows 8 nb + 2 (l%4) and + 1; c2, c3: row l/4 + 8), xsum[nb] += its sums of x (an all-ones A: every row alike,
// c0 and c1 against those x rows): the decode is one LOP3 a pair, the zeros come off after (int4_gemv_fold).
template <int NB>
__device__ __forceinline__ void group_fold(float (&c)[NB][4], float (&xsum)[NB][4], uint4 a, uint4 b,
                                           const uint4 (&xs)[NB][4], uint32_t magic) {
  uint32_t xb[NB][4][4];
  x_operands<NB>(xs, xb);
  const uint32_t wa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {b.x, b.y, b.z, b.w};
  constexpr uint32_t ONES[4] = {Pairs<true>::ONE, Pairs<true>::ONE, Pairs<true>::ONE, Pairs<true>::ONE};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t lo[4], hi[4];
    plus_magic_operands(wa[i], wb[i], magic, lo, hi);
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      strip_gemv::mma<true>(c[nb], lo, xb[nb][i][0], xb[nb][i][1]);
      strip_gemv::mma<true>(c[nb], hi, xb[nb][i][2], xb[nb][i][3]);
      strip_gemv::mma<true>(xsum[nb], ONES, xb[nb][i][0], xb[nb][i][1]);
      strip_gemv::mma<true>(xsum[nb], ONES, xb[nb][i][2], xb[nb][i][3]);
    }
  }
}

// One warp's folded sums over its groups g_begin, g_begin + WARPS, ... < wk.g_end, the walk's first batch already
// loaded (wk.load(g_begin), before a PDL wait): sums[nb] += each group's scale × (sum (MAGIC + q) x − (MAGIC + z)
// sum x) (c0, c1: strip row l/4 against x rows 8 nb + 2 (l%4) and + 1; c2, c3: row l/4 + 8). xcols[nb]: x row
// 8 nb + l/4 at the lane's columns of group g_begin (strip_gemv::x_columns, + g_begin × 16), stepped along; has_x
// its row < M. L2: x read past L1 (ld.global.cg), for x written by other blocks of the running kernel.
template <int NB, bool L2 = false>
__device__ __forceinline__ void fold_sums(FoldWalk& wk, const uint4* (&xcols)[NB], const bool (&has_x)[NB],
                                          int g_begin, uint32_t magic, float (&sums)[NB][4]) {
  for (int g0 = g_begin; g0 < wk.g_end; g0 += 2 * WARPS) {
    if (g0 != g_begin) wk.load(g0);
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      if (g0 + t * WARPS < wk.g_end) {
        uint4 xs[NB][4];
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const uint4* p = xcols[nb] + t * WARPS * 16 + i;
            xs[nb][i] = !has_x[nb] ? make_uint4(0, 0, 0, 0) : L2 ? __ldcg(p) : *p;
          }
        }
        float c[NB][4] = {}, xsum[NB][4] = {};
        group_fold<NB>(c, xsum, wk.ta[t], wk.tb[t], xs, magic);
        // -(MAGIC + z) in fp32: MAGIC = 128 = 0x43000000, z < 16 in the mantissa's top bits
        const float neg_a = __uint_as_float(0xC3000000u | (wk.za[t] << 16));
        const float neg_b = __uint_as_float(0xC3000000u | (wk.zb[t] << 16));
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
          sums[nb][0] = fmaf(wk.sa[t], fmaf(neg_a, xsum[nb][0], c[nb][0]), sums[nb][0]);
          sums[nb][1] = fmaf(wk.sa[t], fmaf(neg_a, xsum[nb][1], c[nb][1]), sums[nb][1]);
          sums[nb][2] = fmaf(wk.sb[t], fmaf(neg_b, xsum[nb][0], c[nb][2]), sums[nb][2]);
          sums[nb][3] = fmaf(wk.sb[t], fmaf(neg_b, xsum[nb][1], c[nb][3]), sums[nb][3]);
        }
      }
    }
    wk.next();
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) xcols[nb] += 2 * WARPS * 16;
  }
}

}  // namespace int4_decode
