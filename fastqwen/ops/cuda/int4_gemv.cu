// int4 weight-streaming GEMV for up to 16 rows of x (a decode step, a verify block, a small batch), on the
// tensor cores.
//
// y[m, n] = sum_k x[m, k] * (q[n, k] - zero[n, g]) * scale[n, g],  g = k / 128, written as split-K partial sums
// out[s, m, n] over the groups of split s (the caller adds the splits; fastqwen/ops/int4_cuda.py).
//
// Operands, as fastqwen.quant.QuantLinear stores an int4 weight [N, K] (N % 16 == 0, K % 128 == 0):
//   w      uint8 [N/16, K/128, 16, 64]: codes tiled by 16 rows x one group (quant/formats.py tile_int4), each
//          tile one contiguous KB; a byte holds column 2j in its low nibble and 2j + 1 in its high one
//   scale  fp16, zero uint8: logical [N, K/128] stored group-major (element (n, g) at g * N + n)
//   x      bf16 or fp16 [M, K], M <= 16, contiguous; out fp32 [splits, M, N]
//
// A block is 4 warps on one strip of 16 rows; blockIdx.y is the split; the split's groups are dealt to the
// warps in turn. Lane l reads 16 bytes of each tile for row l/4 and 16 for row l/4 + 8 (words 4 (l%4) .. + 3
// of each row, columns 32 (l%4) .. + 31 of the group), which is the A operand of mma.m16n8k16 with the
// group's columns permuted among the k slots: word i's nibble pair (j, j + 4), j = 0..3, decodes to the 16-bit
// pair (q - zero) of columns (8i + j, 8i + j + 4) exactly (a LOP3 puts the code in the mantissa of 128 (bf16)
// or 1024 (fp16), an FMA subtracts 128 + zero). The B operand's column n is x row n (zero for n >= M), which
// lane l supplies for n = l/4 at the same columns (a byte permute of 8 consecutive values); so c0, c1 of lane l
// are strip row l/4 against x rows 2 (l%4) and 2 (l%4) + 1, and c2, c3 strip row l/4 + 8 against them. The
// decode is the same whatever M: rows 2 .. 8 cost their x loads and nothing else, rows 9 .. 16 a second block
// of 8 B columns (NB = 2: two more MMAs a word).
// Weights and scales are loaded before the PDL wait (they do not depend on the previous kernel); x after it.
//
// Three ways to feed the warps (the entry point's `stream_blocks` and `async_stages`):
//   registers (int4_gemv_rows): a (N/16, splits) grid, each warp loading its own tiles, BATCH groups
//     ahead, straight into registers;
//   stream (int4_gemv_stream, stream_blocks > 0): the same warps and loads, but a grid of about as many blocks
//     as fit at once dealing the strips' groups as one strip-major sequence, block b the units [b U / B,
//     (b + 1) U / B) of U = N/16 · K/128: every block the same work to within one group, so no last wave of a
//     few blocks and no per-block ramp past the first; a strip's pieces (its groups in one block's range) go to
//     consecutive slots of out (the piece of block b to slot b − the strip's first block), zeros past its last;
//     optionally each warp's first groups held in shared memory before the PDL wait and an early trigger (being
//     one wave, its dependents can launch at its start): the weight stream running through the gaps between
//     kernels of a step;
//   async (int4_gemv_async, async_stages 3 or 6): the register kernel's grid, warps, loads and math, but each
//     warp streams its groups through a ring of its own in shared memory, one group a slot, by cp.async (16-byte
//     copies, L2 to shared memory: no register held while they fly), async_stages - 1 groups ahead of its decode,
//     so a warp keeps that many KB in flight all the time, decode included, at ~the registers of BATCH 1.
// And the register kernel with the zero taken out of its decode: int4_gemv_fold (`fold`; a candidate).
// A fourth way, a ring kernel (a persistent grid whose producer warp fed a shared-memory ring by bulk copies), was
// 1.4-1.5x slower than the register kernel on an H200 and removed (2026-12-05; docs/DESIGN-NOTES.md).

#include <cuda_fp16.h>

#include "strip_gemv.cuh"

namespace {

using strip_gemv::load_weights;
using strip_gemv::WARPS;
// BATCH (a template argument: 2, 4 or 8): groups whose loads a warp issues before it decodes any of them;
// PIPE: the next BATCH's loads in flight while it decodes (with BATCH 2)

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

// (q - zero) of word u's nibble pair (j, j + 4) as a 16-bit pair; neg_zero = -(MAGIC + zero) in both halves.
template <bool BF16>
__device__ __forceinline__ uint32_t pair_minus_zero(uint32_t u, int j, uint32_t neg_zero, uint32_t magic) {
  return Pairs<BF16>::fma(pair_plus_magic(u, j, magic), Pairs<BF16>::ONE, neg_zero);
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

// One group of one warp: c[nb] += the group's sums of (q - zero) x for x rows 8 nb .. 8 nb + 7 (c0, c1:
// strip row l/4 against x rows 8 nb + 2 (l%4) and + 1; c2, c3: row l/4 + 8). a, b: the lane's 16 bytes of rows
// l/4 and l/4 + 8; xb: x_operands. The weight is decoded once for the NB column blocks. CHAINS 2: the hi MMAs
// accumulate apart from the lo ones (two dependent chains of 4 MMAs, added at the end, instead of one of 8).
template <bool BF16, int NB, int CHAINS = 1>
__device__ __forceinline__ void group_mma(float (&c)[NB][4], uint4 a, uint4 b, const uint32_t (&xb)[NB][4][4],
                                          uint32_t za, uint32_t zb, uint32_t magic) {
  const uint32_t wa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {b.x, b.y, b.z, b.w};
  float h[NB][4] = {};
  float (&ch)[NB][4] = CHAINS == 2 ? h : c;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo[4] = {pair_minus_zero<BF16>(wa[i], 0, za, magic), pair_minus_zero<BF16>(wb[i], 0, zb, magic),
                            pair_minus_zero<BF16>(wa[i], 1, za, magic), pair_minus_zero<BF16>(wb[i], 1, zb, magic)};
    const uint32_t hi[4] = {pair_minus_zero<BF16>(wa[i], 2, za, magic), pair_minus_zero<BF16>(wb[i], 2, zb, magic),
                            pair_minus_zero<BF16>(wa[i], 3, za, magic), pair_minus_zero<BF16>(wb[i], 3, zb, magic)};
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      strip_gemv::mma<BF16>(c[nb], lo, xb[nb][i][0], xb[nb][i][1]);
      strip_gemv::mma<BF16>(ch[nb], hi, xb[nb][i][2], xb[nb][i][3]);
    }
  }
  if constexpr (CHAINS == 2) {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
      for (int k = 0; k < 4; ++k) c[nb][k] += h[nb][k];
    }
  }
}

template <bool BF16, int NB, int CHAINS>
__device__ __forceinline__ void group_dot(float (&c)[NB][4], uint4 a, uint4 b, const uint4 (&xs)[NB][4],
                                          uint32_t za, uint32_t zb, uint32_t magic) {
  uint32_t xb[NB][4][4];
  x_operands<NB>(xs, xb);
  group_mma<BF16, NB, CHAINS>(c, a, b, xb, za, zb, magic);
}

// A loads-only probe's end: its sums hold the bits of what it loaded (so that no load is dead code), zeroed unless
// M < 0, which no launch passes (so the probe writes zeros, and the compiler cannot drop the loads).
template <int NB>
__device__ __forceinline__ void probe_sums(float (&sums)[NB][4], int M) {
  if (M >= 0) {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) sums[nb][0] = sums[nb][1] = sums[nb][2] = sums[nb][3] = 0.f;
  }
}

// One warp's weights of BATCH groups g0, g0 + WARPS, ... (< g_end): the lane's 16 bytes of both rows of each
// tile, their scales and -(MAGIC + zero) pairs. load() issues the loads; dot() adds the groups' sums.
template <bool BF16, int BATCH>
struct Batch {
  uint4 ta[BATCH], tb[BATCH];
  float sa[BATCH], sb[BATCH];
  uint32_t za[BATCH], zb[BATCH];

  __device__ __forceinline__ void load(const uint4* tiles, const __half* scale, const uint8_t* zero, int N,
                                       int row_a, int g0, int g_end) {
#pragma unroll
    for (int t = 0; t < BATCH; ++t) {
      const int g = g0 + t * WARPS;
      if (g < g_end) {
        ta[t] = load_weights(tiles + (size_t)g * 64);
        tb[t] = load_weights(tiles + (size_t)g * 64 + 32);
        sa[t] = __half2float(scale[(size_t)g * N + row_a]);
        sb[t] = __half2float(scale[(size_t)g * N + row_a + 8]);
        za[t] = (Pairs<BF16>::NEG_MAGIC | zero[(size_t)g * N + row_a]) * 0x00010001u;
        zb[t] = (Pairs<BF16>::NEG_MAGIC | zero[(size_t)g * N + row_a + 8]) * 0x00010001u;
      }
    }
  }

  // sums[nb]: strip row l/4 against x rows 8 nb + 2 (l%4) and + 1, then row l/4 + 8 against them; xcols[nb]:
  // x row 8 nb + l/4 at the lane's columns (+ g * 16 for group g), has_x[nb]: whether that row is < M.
  // PROBE: the loads kept (their registers used), nothing decoded or summed (loads_only).
  template <int NB, int CHAINS, bool PROBE = false>
  __device__ __forceinline__ void dot(const uint4* const (&xcols)[NB], const bool (&has_x)[NB], int g0, int g_end,
                                      uint32_t magic, float (&sums)[NB][4]) const {
#pragma unroll
    for (int t = 0; t < BATCH; ++t) {
      const int g = g0 + t * WARPS;
      if (PROBE && g < g_end) {  // (every loaded word folded into sums[0][0]'s bits: no load is dead)
        const uint32_t v = ta[t].x ^ ta[t].y ^ ta[t].z ^ ta[t].w ^ tb[t].x ^ tb[t].y ^ tb[t].z ^ tb[t].w ^
                           __float_as_uint(sa[t]) ^ __float_as_uint(sb[t]) ^ za[t] ^ zb[t];
        sums[0][0] = __uint_as_float(__float_as_uint(sums[0][0]) ^ v);
      } else if (g < g_end) {
        uint4 xs[NB][4];
        float c[NB][4];
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            xs[nb][i] = has_x[nb] ? xcols[nb][(size_t)g * 16 + i] : make_uint4(0, 0, 0, 0);
            c[nb][i] = 0.f;
          }
        }
        group_dot<BF16, NB, CHAINS>(c, ta[t], tb[t], xs, za[t], zb[t], magic);
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
          sums[nb][0] = fmaf(sa[t], c[nb][0], sums[nb][0]);
          sums[nb][1] = fmaf(sa[t], c[nb][1], sums[nb][1]);
          sums[nb][2] = fmaf(sb[t], c[nb][2], sums[nb][2]);
          sums[nb][3] = fmaf(sb[t], c[nb][3], sums[nb][3]);
        }
      }
    }
  }
};

// PIPE: two batches in flight, the next one's loads issued before the current one's decode (ping-pong);
// else each batch is loaded, then decoded. MINB: blocks a multiprocessor must hold (ptxas caps the registers
// to fit them); CHAINS: group_mma's; PROBE: loads only (the load path's own rate; out all zeros). (x without
// __restrict__: plain loads, made after the PDL wait, not the read-only path.)
template <bool BF16, int BATCH, bool PIPE, int NB, int MINB, int CHAINS, bool PROBE>
__global__ void __launch_bounds__(WARPS * 32, MINB) int4_gemv_rows(const uint16_t* x,
                                                                const uint4* __restrict__ w,
                                                                const __half* scale,  // (coherent loads:
                                                                const uint8_t* zero,  //  before the wait)
                                                                float* __restrict__ out, int M, int N, int K,
                                                                int groups_per_split, uint32_t magic) {
  const int G = K / 128, strip = blockIdx.x, split = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row_a = strip * 16 + lane / 4;
  const int g_begin = split * groups_per_split + warp, g_end = min(G, (split + 1) * groups_per_split);
  const uint4* tiles = w + (size_t)strip * G * 64 + lane;  // tile (strip, g) at + g * 64 uint4s
  // x row 8 nb + l/4 at the lane's 32 columns of group g: + g * 16 (K % 128 == 0: every row 16-byte aligned)
  bool has_x[NB];
  const uint4* xcols[NB];
  strip_gemv::x_columns<NB, 4>(x, M, K, lane, has_x, xcols);
  float sums[NB][4] = {};
  constexpr int STRIDE = BATCH * WARPS;
  Batch<BF16, BATCH> a;
  a.load(tiles, scale, zero, N, row_a, g_begin, g_end);  // (weights: before the wait)
  asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the previous kernel's output (PDL)
  if constexpr (PIPE) {
    Batch<BF16, BATCH> b;
    for (int g0 = g_begin; g0 < g_end; g0 += 2 * STRIDE) {
      b.load(tiles, scale, zero, N, row_a, g0 + STRIDE, g_end);
      a.template dot<NB, CHAINS>(xcols, has_x, g0, g_end, magic, sums);
      a.load(tiles, scale, zero, N, row_a, g0 + 2 * STRIDE, g_end);
      b.template dot<NB, CHAINS>(xcols, has_x, g0 + STRIDE, g_end, magic, sums);
    }
  } else {
    for (int g0 = g_begin; g0 < g_end; g0 += STRIDE) {
      if (g0 != g_begin) a.load(tiles, scale, zero, N, row_a, g0, g_end);
      a.template dot<NB, CHAINS, PROBE>(xcols, has_x, g0, g_end, magic, sums);
    }
  }
  if constexpr (PROBE) probe_sums(sums, M);
  strip_gemv::write_partials<NB>(sums, 1.f, 1.f, out, M, N, strip, split);  // (the groups' scales: applied)
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
    const uint32_t lo[4] = {pair_plus_magic(wa[i], 0, magic), pair_plus_magic(wb[i], 0, magic),
                            pair_plus_magic(wa[i], 1, magic), pair_plus_magic(wb[i], 1, magic)};
    const uint32_t hi[4] = {pair_plus_magic(wa[i], 2, magic), pair_plus_magic(wb[i], 2, magic),
                            pair_plus_magic(wa[i], 3, magic), pair_plus_magic(wb[i], 3, magic)};
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      strip_gemv::mma<true>(c[nb], lo, xb[nb][i][0], xb[nb][i][1]);
      strip_gemv::mma<true>(c[nb], hi, xb[nb][i][2], xb[nb][i][3]);
      strip_gemv::mma<true>(xsum[nb], ONES, xb[nb][i][0], xb[nb][i][1]);
      strip_gemv::mma<true>(xsum[nb], ONES, xb[nb][i][2], xb[nb][i][3]);
    }
  }
}

// The folded kernel (a candidate; bf16 x, up to 8 rows): int4_gemv_rows' BATCH 2 unpipelined instance with the
// zero folded out of the decode, sum (q - z) x = sum (MAGIC + q) x - (MAGIC + z) sum x (group_fold; fp32 sums ~128x
// the result's size, so a few 1e-6 of relative error where the plain kernel has ~1e-7), and its position walked as
// pointers stepped once a batch (each load a pointer plus a constant) instead of indices recomputed at each load.
// Same grid, split plan and group order as int4_gemv_rows.
template <int NB>
__global__ void __launch_bounds__(WARPS * 32, 7) int4_gemv_fold(const uint16_t* x, const uint4* __restrict__ w,
                                                                const __half* scale, const uint8_t* zero,
                                                                float* __restrict__ out, int M, int N, int K,
                                                                int groups_per_split, uint32_t magic) {
  const int G = K / 128, strip = blockIdx.x, split = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g_begin = split * groups_per_split + warp, g_end = min(G, (split + 1) * groups_per_split);
  // at the warp's current group g: its tile's words of this lane, the scale and zero of (row l/4, g)
  const uint4* tile = w + ((size_t)strip * G + g_begin) * 64 + lane;
  const size_t side = (size_t)g_begin * N + strip * 16 + lane / 4, step = (size_t)WARPS * N;
  const __half* sc = scale + side;
  const uint8_t* ze = zero + side;
  bool has_x[NB];
  const uint4* xcols[NB];
  strip_gemv::x_columns<NB, 4>(x, M, K, lane, has_x, xcols);
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) xcols[nb] += (size_t)g_begin * 16;
  uint4 ta[2], tb[2];
  float sa[2], sb[2];
  uint32_t za[2], zb[2];
  const auto load = [&](int g0) {  // (groups g0 and g0 + WARPS, at tile, sc, ze)
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
  };
  load(g_begin);  // (weights: before the wait)
  asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the previous kernel's output (PDL)
  float sums[NB][4] = {};
  for (int g0 = g_begin; g0 < g_end; g0 += 2 * WARPS) {
    if (g0 != g_begin) load(g0);
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      if (g0 + t * WARPS < g_end) {
        uint4 xs[NB][4];
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
          for (int i = 0; i < 4; ++i) xs[nb][i] = has_x[nb] ? xcols[nb][t * WARPS * 16 + i] : make_uint4(0, 0, 0, 0);
        }
        float c[NB][4] = {}, xsum[NB][4] = {};
        group_fold<NB>(c, xsum, ta[t], tb[t], xs, magic);
        // -(MAGIC + z) in fp32: MAGIC = 128 = 0x43000000, z < 16 in the mantissa's top bits
        const float neg_a = __uint_as_float(0xC3000000u | (za[t] << 16));
        const float neg_b = __uint_as_float(0xC3000000u | (zb[t] << 16));
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
          sums[nb][0] = fmaf(sa[t], fmaf(neg_a, xsum[nb][0], c[nb][0]), sums[nb][0]);
          sums[nb][1] = fmaf(sa[t], fmaf(neg_a, xsum[nb][1], c[nb][1]), sums[nb][1]);
          sums[nb][2] = fmaf(sb[t], fmaf(neg_b, xsum[nb][0], c[nb][2]), sums[nb][2]);
          sums[nb][3] = fmaf(sb[t], fmaf(neg_b, xsum[nb][1], c[nb][3]), sums[nb][3]);
        }
      }
    }
    tile += 2 * WARPS * 64;
    sc += 2 * step;
    ze += 2 * step;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) xcols[nb] += 2 * WARPS * 16;
  }
  strip_gemv::write_partials<NB>(sums, 1.f, 1.f, out, M, N, strip, split);  // (the groups' scales: applied)
}

// 16 bytes from global `src` to shared `dst` (both 16-byte aligned) by cp.async, around L1 (.cg): its bytes land
// without a register; commit() closes the thread's group of copies, wait<N>() returns once at most N of its
// latest groups are still in flight.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const auto shared = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// One slot of a warp's ring: one group of its strip (the tile's KB, its 16 rows' scales and zeros).
struct alignas(16) GroupSlot {
  uint4 tile[64];
  __half scale[16];
  uint8_t zero[16];
};

// One group from a warp's shared-memory slot: sums[nb] += its products with xs[nb] (x row 8 nb + l/4 at the
// lane's columns of the group), scaled by the slot's scales, in Batch::dot's arithmetic (the same sums bit for bit).
template <bool BF16, int NB>
__device__ __forceinline__ void slot_dot(float (&sums)[NB][4], const GroupSlot& slot, const uint4 (&xs)[NB][4],
                                         int lane, uint32_t magic) {
  const int row = lane / 4;
  const float sa = __half2float(slot.scale[row]), sb = __half2float(slot.scale[row + 8]);
  const uint32_t za = (Pairs<BF16>::NEG_MAGIC | slot.zero[row]) * 0x00010001u;
  const uint32_t zb = (Pairs<BF16>::NEG_MAGIC | slot.zero[row + 8]) * 0x00010001u;
  float c[NB][4] = {};
  group_dot<BF16, NB, 1>(c, slot.tile[lane], slot.tile[lane + 32], xs, za, zb, magic);
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    sums[nb][0] = fmaf(sa, c[nb][0], sums[nb][0]);
    sums[nb][1] = fmaf(sa, c[nb][1], sums[nb][1]);
    sums[nb][2] = fmaf(sb, c[nb][2], sums[nb][2]);
    sums[nb][3] = fmaf(sb, c[nb][3], sums[nb][3]);
  }
}

// A warp's copy of group g of a strip into its slot: lane l its two 16-byte pieces of the tile (tiles: the strip's
// tiles + l), lanes 0, 1 the 16 rows' scales, lane 2 their zeros (scale, zero: at the strip's first row).
__device__ __forceinline__ void copy_group(GroupSlot& slot, const uint4* tiles, const __half* scale,
                                           const uint8_t* zero, int N, int g, int lane) {
  cp_async16(&slot.tile[lane], tiles + (size_t)g * 64);
  cp_async16(&slot.tile[lane + 32], tiles + (size_t)g * 64 + 32);
  if (lane < 2) cp_async16(&slot.scale[8 * lane], scale + (size_t)g * N + 8 * lane);
  else if (lane == 2) cp_async16(slot.zero, zero + (size_t)g * N);
}

// The block holding unit u (a strip's group, strip-major) when U units are dealt to B blocks as [b U / B, (b + 1)
// U / B): the largest b with b U / B <= u. (int4_cuda.stream_slots mirrors it.)
__device__ __forceinline__ int stream_block(long long u, long long U, long long B) {
  return static_cast<int>(((u + 1) * B - 1) / U);
}

constexpr int STREAM_HELD = 6;  // the stream kernel's groups a warp copies into shared memory before the wait (or 0)

// The stream kernel (see the top of the file): each piece loaded, decoded and written as int4_gemv_rows does a
// (strip, split) block, BATCH 2 unpipelined; every piece's first batch is loaded before the PDL wait (the first
// piece's before the previous kernel has finished; later ones find it done). out [slots, M, N]. 7 blocks an SM
// with one column block (72 registers: as many as int4_gemv_rows' 71 allow; its 64-bit unit arithmetic would
// otherwise take 92), 4 with two (118: fewer spill). HELD > 0: before the wait each warp also copies the first
// HELD groups of its first piece into shared memory of its own (cp.async, ~1 KB a group): with 7 blocks an SM,
// 8 groups a warp and ~30 MB over 132 SMs in flight before the previous kernel is done, against 2 and ~7 MB;
// decoded first after the wait, while the first register batch, the groups after them, is in flight (the same
// groups in the same order with the same arithmetic: the same partials). early: every block lets the next kernel
// in the stream launch as it starts (griddepcontrol.launch_dependents; the grid is one wave, so the dependent's
// blocks take no slot any of these blocks wait for, only the slots they leave). Both off by default: a 9B int4
// step was 1.23x slower with them, and a follower that triggers only after its own wait (all of a step's do)
// bounds what any GEMV can hold before its wait (docs/DESIGN-NOTES.md, 2026-12-05).
template <bool BF16, int NB, int HELD>
__global__ void __launch_bounds__(WARPS * 32, NB == 1 ? 7 : 4)
    int4_gemv_stream(const uint16_t* x, const uint4* __restrict__ w, const __half* scale, const uint8_t* zero,
                     float* __restrict__ out, int M, int N, int K, int slots, uint32_t magic, int early) {
  __shared__ GroupSlot held[WARPS][HELD > 0 ? HELD : 1];
  const int G = K / 128, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long long U = static_cast<long long>(N / 16) * G, B = gridDim.x;
  const int lo = static_cast<int>(blockIdx.x * U / B), hi = static_cast<int>((blockIdx.x + 1) * U / B);  // (U < 2^31)
  bool has_x[NB];
  const uint4* xcols[NB];
  strip_gemv::x_columns<NB, 4>(x, M, K, lane, has_x, xcols);
  constexpr int STRIDE = 2 * WARPS;
  if (early) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  bool holds = HELD > 0;  // (the first piece only)
  for (int u = lo; u < hi;) {
    const int strip = u / G, first = u % G, end = min(G, first + (hi - u));
    const int row_a = strip * 16 + lane / 4;
    const uint4* tiles = w + (size_t)strip * G * 64 + lane;
    const int g_held = first + warp, g_regs = holds ? g_held + HELD * WARPS : g_held;  // the warp's first groups
    if (holds) {
#pragma unroll
      for (int j = 0; j < HELD; ++j) {
        if (g_held + j * WARPS < end)
          copy_group(held[warp][j], tiles, scale + strip * 16, zero + strip * 16, N, g_held + j * WARPS, lane);
      }
      cp_async_commit();
    }
    float sums[NB][4] = {};
    Batch<BF16, 2> a;
    a.load(tiles, scale, zero, N, row_a, g_regs, end);  // (weights: before the wait)
    asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the previous kernel's output (PDL)
    if (holds) {
      cp_async_wait<0>();
      __syncwarp();  // (lanes 0 .. 2's scales and zeros landed)
#pragma unroll 1
      for (int j = 0; j < HELD && g_held + j * WARPS < end; ++j) {
        uint4 xs[NB][4];
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
          for (int i = 0; i < 4; ++i)
            xs[nb][i] = has_x[nb] ? xcols[nb][(size_t)(g_held + j * WARPS) * 16 + i] : make_uint4(0, 0, 0, 0);
        }
        slot_dot<BF16, NB>(sums, held[warp][j], xs, lane, magic);
      }
      holds = false;
    }
    for (int g0 = g_regs; g0 < end; g0 += STRIDE) {
      if (g0 != g_regs) a.load(tiles, scale, zero, N, row_a, g0, end);
      a.template dot<NB, 1>(xcols, has_x, g0, end, magic, sums);
    }
    const int slot = blockIdx.x - stream_block(static_cast<long long>(strip) * G, U, B);
    strip_gemv::write_partials<NB, true>(sums, 1.f, 1.f, out, M, N, strip, slot);  // (the groups' scales: applied)
    if (end == G) {  // the strip's last piece: its later slots are zeros
      for (int t = threadIdx.x; t < (slots - 1 - slot) * M * 16; t += WARPS * 32)
        out[((size_t)(slot + 1 + t / (M * 16)) * M + t / 16 % M) * N + strip * 16 + t % 16] = 0.f;
    }
    u += end - first;
  }
}

// The async kernel (see the top of the file): a (N/16, splits) grid as int4_gemv_rows', each warp the same groups
// in the same order with the same math (so the same partials, bit for bit), but fed through STAGES slots of
// shared memory of its own: group k + STAGES - 1's copies are issued before group k is decoded, the first STAGES -
// 1 before the PDL wait. Lane l copies (and later reads) its own 2 x 16 bytes of a tile; lanes 0, 1 copy the
// strip's 16 scales, lane 2 its 16 zeros, which every lane reads after a warp barrier. Blocks an SM: 8 at 3
// stages (~15 KB of shared memory a block), 5 at 6; 4 with two column blocks. PROBE: the copies and the slot reads
// only, nothing decoded (loads_only; out all zeros).
template <bool BF16, int STAGES, int NB, bool PROBE>
__global__ void __launch_bounds__(WARPS * 32, NB == 2 ? 4 : STAGES <= 3 ? 8 : 5)
    int4_gemv_async(const uint16_t* x, const uint4* __restrict__ w, const __half* scale, const uint8_t* zero,
                    float* __restrict__ out, int M, int N, int K, int groups_per_split, uint32_t magic) {
  __shared__ GroupSlot slots[WARPS][STAGES];
  const int G = K / 128, strip = blockIdx.x, split = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, row = lane / 4;
  const int g_begin = split * groups_per_split + warp, g_end = min(G, (split + 1) * groups_per_split);
  const int n = g_begin < g_end ? (g_end - g_begin + WARPS - 1) / WARPS : 0;  // the warp's groups
  // the next group to copy: its tile words of this lane, and (lanes 0 .. 2) its scales or zeros
  const uint4* tile = w + ((size_t)strip * G + g_begin) * 64 + lane;
  const char* side = lane < 2 ? reinterpret_cast<const char*>(scale + (size_t)g_begin * N + strip * 16 + 8 * lane)
                              : reinterpret_cast<const char*>(zero + (size_t)g_begin * N + strip * 16);
  const size_t side_step = (size_t)WARPS * N * (lane < 2 ? sizeof(__half) : 1);
  GroupSlot* ring = slots[warp];
  int copied = 0, to = 0;  // groups copied, the slot the next goes to
  const auto issue = [&]() {  // the warp's next group into its slot (none past its last)
    if (copied < n) {
      GroupSlot& slot = ring[to];
      cp_async16(&slot.tile[lane], tile);
      cp_async16(&slot.tile[lane + 32], tile + 32);
      if (lane < 3) cp_async16(lane < 2 ? static_cast<void*>(&slot.scale[8 * lane]) : slot.zero, side);
      tile += WARPS * 64;
      side += side_step;
      ++copied;
      to = to + 1 == STAGES ? 0 : to + 1;
    }
    cp_async_commit();  // (an empty group past the last: every iteration's wait counts alike)
  };
#pragma unroll
  for (int k = 0; k < STAGES - 1; ++k) issue();  // (weights: before the wait)
  asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the previous kernel's output (PDL)
  bool has_x[NB];
  const uint4* xg[NB];  // x row 8 nb + l/4 at the lane's columns of the warp's next group
  strip_gemv::x_columns<NB, 4>(x, M, K, lane, has_x, xg);
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) xg[nb] += (size_t)g_begin * 16;
  float sums[NB][4] = {};
  for (int k = 0, from = 0; k < n; ++k, from = from + 1 == STAGES ? 0 : from + 1) {
    __syncwarp();  // (every lane's reads of the slot refilled next, group k - 1's, are done)
    issue();
    cp_async_wait<STAGES - 1>();  // (this lane's copies of group k have landed)
    __syncwarp();                 // (and lanes 0 .. 2's scales and zeros)
    const GroupSlot& slot = ring[from];
    if constexpr (PROBE) {  // (the slot's words folded into sums[0][0]'s bits: no read is dead)
      const uint4 a = slot.tile[lane], b = slot.tile[lane + 32];
      const uint32_t v = a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ __half_as_ushort(slot.scale[row]) ^
                         slot.zero[row];
      sums[0][0] = __uint_as_float(__float_as_uint(sums[0][0]) ^ v);
    } else {
      uint4 xs[NB][4];
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
        for (int i = 0; i < 4; ++i) xs[nb][i] = has_x[nb] ? xg[nb][i] : make_uint4(0, 0, 0, 0);
        xg[nb] += WARPS * 16;
      }
      slot_dot<BF16, NB>(sums, slot, xs, lane, magic);
    }
  }
  cp_async_wait<0>();  // (no copy in flight past the block's end)
  if constexpr (PROBE) probe_sums(sums, M);
  strip_gemv::write_partials<NB>(sums, 1.f, 1.f, out, M, N, strip, split);  // (the groups' scales: applied)
}

}  // namespace

template <bool BF16, int BATCH, bool PIPE, int NB, int MINB = 4, int CHAINS = 1, bool PROBE = false>
cudaError_t launch(const cudaLaunchConfig_t& config, const void* x, const void* w, const void* scale,
                   const void* zero, float* out, int M, int N, int K, int groups_per_split) {
  // (MAGIC passed as an argument: a register in the kernel, see pair_minus_zero)
  return cudaLaunchKernelEx(&config, int4_gemv_rows<BF16, BATCH, PIPE, NB, MINB, CHAINS, PROBE>,
                            static_cast<const uint16_t*>(x), static_cast<const uint4*>(w),
                            static_cast<const __half*>(scale), static_cast<const uint8_t*>(zero), out, M, N, K,
                            groups_per_split, Pairs<BF16>::MAGIC);
}

// The instance for M rows, (batch, pipe), (min_blocks, chains), the loads-only probe and the fold as one key: one
// column block of 8 x rows (M <= 8) or two (M <= 16, BATCH 2 or 4 unpipelined: the others would spill), 4 blocks
// a multiprocessor at least and one MMA chain, but BATCH 2 unpipelined at one column block also at 8 blocks (63
// registers, no spill) and / or two chains, or (4 blocks, one chain) as the probe or as the folded kernel (bf16 x
// only: int4_gemv_fold); -1 where there is none.
static int variant_key(int M, int batch, int pipe, int min_blocks, int chains, int probe, int fold, int bf16) {
  const int key = (M > 8) * 100 + batch * 2 + (pipe != 0);
  const int tuned = (min_blocks == 8) * 1000 + (chains == 2) * 2000 + (fold != 0) * 4000 + (probe != 0) * 8000;
  if ((min_blocks != 4 && min_blocks != 8) || (chains != 1 && chains != 2) || (tuned && key != 4) ||
      (probe && tuned != 8000) || (fold && (tuned != 4000 || !bf16)))
    return -1;
  switch (key) {
    case 4: case 5: case 8: case 16: case 104: case 108: return key + tuned;
    default: return -1;
  }
}

template <bool BF16>
cudaError_t launch_variant(int key, const cudaLaunchConfig_t& config, const void* x, const void* w,
                           const void* scale, const void* zero, float* out, int M, int N, int K,
                           int groups_per_split) {
  switch (key) {
    case 4: return launch<BF16, 2, false, 1>(config, x, w, scale, zero, out, M, N, K, groups_per_split);
    case 5: return launch<BF16, 2, true, 1>(config, x, w, scale, zero, out, M, N, K, groups_per_split);
    case 8: return launch<BF16, 4, false, 1>(config, x, w, scale, zero, out, M, N, K, groups_per_split);
    case 16: return launch<BF16, 8, false, 1>(config, x, w, scale, zero, out, M, N, K, groups_per_split);
    case 104: return launch<BF16, 2, false, 2>(config, x, w, scale, zero, out, M, N, K, groups_per_split);
    case 108: return launch<BF16, 4, false, 2>(config, x, w, scale, zero, out, M, N, K, groups_per_split);
    case 1004: return launch<BF16, 2, false, 1, 8, 1>(config, x, w, scale, zero, out, M, N, K, groups_per_split);
    case 2004: return launch<BF16, 2, false, 1, 4, 2>(config, x, w, scale, zero, out, M, N, K, groups_per_split);
    case 3004: return launch<BF16, 2, false, 1, 8, 2>(config, x, w, scale, zero, out, M, N, K, groups_per_split);
    case 8004:
      return launch<BF16, 2, false, 1, 4, 1, true>(config, x, w, scale, zero, out, M, N, K, groups_per_split);
    case 4004:  // (the folded kernel: bf16 x only, variant_key)
      if constexpr (BF16)
        return cudaLaunchKernelEx(&config, int4_gemv_fold<1>, static_cast<const uint16_t*>(x),
                                  static_cast<const uint4*>(w), static_cast<const __half*>(scale),
                                  static_cast<const uint8_t*>(zero), out, M, N, K, groups_per_split,
                                  Pairs<true>::MAGIC);
      return cudaErrorInvalidValue;
    default: return cudaErrorInvalidValue;
  }
}

// Slots the stream kernel needs for an [N, K] weight dealt to `blocks` blocks: the most pieces any strip has.
static int stream_slots(int N, int K, int blocks) {
  const long long G = K / 128, U = static_cast<long long>(N / 16) * G, B = blocks;
  int most = 0;
  for (long long s = 0; s < N / 16; ++s) {
    const long long b0 = ((s * G + 1) * B - 1) / U, b1 = (((s + 1) * G) * B - 1) / U;
    most = static_cast<int>(b1 - b0 + 1 > most ? b1 - b0 + 1 : most);
  }
  return most;
}

template <bool BF16>
cudaError_t launch_stream(cudaLaunchConfig_t config, int blocks, int held, int early, const void* x, const void* w,
                          const void* scale, const void* zero, float* out, int M, int N, int K, int slots) {
  config.gridDim = dim3(blocks);
  const auto* x16 = static_cast<const uint16_t*>(x);
  const auto* w4 = static_cast<const uint4*>(w);
  const auto* s16 = static_cast<const __half*>(scale);
  const auto* z8 = static_cast<const uint8_t*>(zero);
  const uint32_t magic = Pairs<BF16>::MAGIC;
#define FASTQWEN_STREAM(NB, H)                                                                                      \
  if ((M > 8) == (NB == 2) && held == H)                                                                            \
    return cudaLaunchKernelEx(&config, int4_gemv_stream<BF16, NB, H>, x16, w4, s16, z8, out, M, N, K, slots, magic, \
                              early);
  FASTQWEN_STREAM(1, 0) FASTQWEN_STREAM(2, 0) FASTQWEN_STREAM(1, STREAM_HELD) FASTQWEN_STREAM(2, STREAM_HELD)
#undef FASTQWEN_STREAM
  return cudaErrorInvalidValue;
}

// A loads-only probe's extra (dynamic, unused) shared memory a block, so that as many of its blocks fit a
// multiprocessor as of the kernel it probes, whose registers allow fewer than the probe's own ~40: 228 KB an SM,
// ~1 KB a block reserved; the register kernel (BATCH 2: 71 registers) 7 blocks, so 30 KB a block in all; the async
// kernel 8 at 3 slots (64 registers: 26 KB), 7 at 6 (its shared memory: 30 KB).
static size_t probe_bytes(int async_stages) {
  constexpr size_t part = WARPS * 8 * 16 * sizeof(float), slot = sizeof(GroupSlot);  // (static shared memory)
  if (!async_stages) return 30 * 1024 - part;
  return (async_stages <= 3 ? 26 : 30) * 1024 - part - WARPS * async_stages * slot;
}

// The async kernel's launch: the register kernel's grid (config), STAGES 3 or 6, one or two column blocks; probe:
// its loads-only instance (one column block only).
template <bool BF16>
cudaError_t launch_async(const cudaLaunchConfig_t& config, int stages, int probe, const void* x, const void* w,
                         const void* scale, const void* zero, float* out, int M, int N, int K, int groups_per_split) {
  const auto* x16 = static_cast<const uint16_t*>(x);
  const auto* w4 = static_cast<const uint4*>(w);
  const auto* s16 = static_cast<const __half*>(scale);
  const auto* z8 = static_cast<const uint8_t*>(zero);
  const uint32_t magic = Pairs<BF16>::MAGIC;
#define FASTQWEN_ASYNC(S, NB, P)                                                                                 \
  if (stages == S && (M > 8) == (NB == 2) && (probe != 0) == P)                                                  \
    return cudaLaunchKernelEx(&config, int4_gemv_async<BF16, S, NB, P>, x16, w4, s16, z8, out, M, N, K,         \
                              groups_per_split, magic);
  FASTQWEN_ASYNC(3, 1, false) FASTQWEN_ASYNC(3, 2, false) FASTQWEN_ASYNC(6, 1, false) FASTQWEN_ASYNC(6, 2, false)
  FASTQWEN_ASYNC(3, 1, true) FASTQWEN_ASYNC(6, 1, true)
#undef FASTQWEN_ASYNC
  return cudaErrorInvalidValue;
}

// Launches the kernel on `stream` of GPU `device`; returns the cudaError_t, cudaErrorInvalidValue (1) before
// touching the GPU where the arguments are out of the kernel's range: N % 16, K % 128, a split plan that leaves a
// split empty or a group out, M outside 1 .. 16, a (batch, pipe) with no instance for M (batch 2, 4 or 8, only 2 or
// 4 past 8 rows; pipe only with batch 2 and M <= 8). min_blocks (4 or 8), chains (1 or 2): the register kernel's
// (variant_key). fold (0 or 1): the folded kernel instead (int4_gemv_fold: BATCH 2 unpipelined, 4 blocks, one
// chain, up to 8 rows of bf16 x). loads_only: the kernel's probe of its load path (out all zeros): the async
// kernel's (up to 8 rows), the register kernel's (BATCH 2 unpipelined, 4 blocks, one chain, up to 8 rows).
// stream_blocks > 0: the stream kernel on that many blocks (at most N/16 · K/128), out [splits, M, N] with splits
// the slots it needs (stream_slots, exactly; the other split and instance arguments unused; no probe, no async);
// stream_held 0 or STREAM_HELD: the groups a warp copies into shared memory before the PDL wait; stream_early 0 or
// 1: whether its blocks let the next kernel launch at their start (both stream kernel only). async_stages 3 or 6:
// the async kernel with that many slots a warp (the register kernel's split plan; its instance arguments unused),
// 0: not. pdl: programmatic dependent launch (the kernel waits before reading x).
extern "C" int fastqwen_int4_gemv(const void* x, const void* w, const void* scale, const void* zero, float* out,
                                  int M, int N, int K, int splits, int groups_per_split, int batch, int pipe,
                                  int min_blocks, int chains, int fold, int loads_only, int stream_blocks,
                                  int stream_held, int stream_early, int async_stages, int bf16, int pdl, int device,
                                  void* stream) {
  if ((stream_held != 0 && stream_held != STREAM_HELD) || (stream_early != 0 && stream_early != 1) ||
      ((stream_held || stream_early) && !stream_blocks))
    return static_cast<int>(cudaErrorInvalidValue);
  if (stream_blocks) {
    if (N <= 0 || N % 16 || K <= 0 || K % 128 || M < 1 || M > 16 || stream_blocks < 1 ||
        stream_blocks > static_cast<long long>(N / 16) * (K / 128) ||
        static_cast<long long>(N / 16) * (K / 128) > INT32_MAX || splits != stream_slots(N, K, stream_blocks) ||
        loads_only || async_stages)
      return static_cast<int>(cudaErrorInvalidValue);
    cudaLaunchConfig_t config;
    cudaLaunchAttribute attribute;
    if (cudaError_t e = strip_gemv::launch_config(config, attribute, N, 1, pdl, device, stream); e != cudaSuccess)
      return static_cast<int>(e);
    return static_cast<int>(bf16 ? launch_stream<true>(config, stream_blocks, stream_held, stream_early, x, w, scale,
                                                       zero, out, M, N, K, splits)
                                 : launch_stream<false>(config, stream_blocks, stream_held, stream_early, x, w, scale,
                                                        zero, out, M, N, K, splits));
  }
  const int key = async_stages ? (loads_only && M > 8 ? -1 : 0)
                               : variant_key(M, batch, pipe, min_blocks, chains, loads_only, fold, bf16);
  if (!strip_gemv::shape_ok(M, N, K, 128, splits, groups_per_split) || key < 0 ||
      (async_stages != 0 && async_stages != 3 && async_stages != 6))
    return static_cast<int>(cudaErrorInvalidValue);
  cudaLaunchConfig_t config;
  cudaLaunchAttribute attribute;
  if (cudaError_t e = strip_gemv::launch_config(config, attribute, N, splits, pdl, device, stream); e != cudaSuccess)
    return static_cast<int>(e);
  if (loads_only) {  // (a probe: as many blocks an SM as the kernel it probes, see probe_bytes)
    config.dynamicSmemBytes = probe_bytes(async_stages);
  }
  cudaError_t e;
  if (async_stages)
    e = bf16 ? launch_async<true>(config, async_stages, loads_only, x, w, scale, zero, out, M, N, K, groups_per_split)
             : launch_async<false>(config, async_stages, loads_only, x, w, scale, zero, out, M, N, K,
                                   groups_per_split);
  else
    e = bf16 ? launch_variant<true>(key, config, x, w, scale, zero, out, M, N, K, groups_per_split)
             : launch_variant<false>(key, config, x, w, scale, zero, out, M, N, K, groups_per_split);
  return static_cast<int>(e);
}
