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
// Two kernels (the entry point's `fold`):
//   int4_gemv_rows: a (N/16, splits) grid, each warp loading its own tiles, BATCH groups ahead, straight into
//     registers; BATCH 2 unpipelined was the fastest instance on every 27B layer (H100 and H200);
//   int4_gemv_fold (bf16 x, up to 8 rows; the default there): int4_gemv_rows' BATCH 2 unpipelined instance with the
//     zero taken out of the decode and its position walked as pointers: a 27B int4 step 1.027x faster (H100);
// and, past 8 rows, int4_gemv_pair (int4_cuda.PAIR, the default there: the entry point's `pair`): int4_gemv_rows'
// two column blocks on two strips a block, one load of x for both (12-30% faster at 16 rows, H100).
// Removed after measuring slower (2026-12-05, docs/DESIGN-NOTES.md): a ring kernel (a persistent grid whose producer
// warp fed a shared-memory ring by bulk copies; 1.4-1.5x slower on an H200), a stream kernel (one resident wave
// dealing the strips' groups evenly, optionally holding groups in shared memory before the PDL wait; a 9B step
// 1.23x slower), an async kernel (each warp's groups through shared-memory slots by cp.async; 5-14% slower), and
// instances at 8 blocks an SM or with two MMA chains (slower on every layer); and (2026-12-06) a staged kernel (the
// folded one with x copied into shared memory once a block as B operands with each group's sums of x: 240 SASS
// instructions a loop against 287, yet 0.8-2 µs a 27B layer slower on an H200 and 0.3-1.5 on an H100; on the H200
// 6.00 µs + bytes / 3.46 TB/s against 5.29 + bytes / 3.67: a longer start and no better rate for fewer
// instructions). The kernel is bound by its own load → decode → MMA latency, not by HBM: with its weights resident
// in L2 it reads no faster (H100, 2026-12-05).

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
// l/4 and l/4 + 8; xb: x_operands. The weight is decoded once for the NB column blocks.
template <bool BF16, int NB>
__device__ __forceinline__ void group_mma(float (&c)[NB][4], uint4 a, uint4 b, const uint32_t (&xb)[NB][4][4],
                                          uint32_t za, uint32_t zb, uint32_t magic) {
  const uint32_t wa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo[4] = {pair_minus_zero<BF16>(wa[i], 0, za, magic), pair_minus_zero<BF16>(wb[i], 0, zb, magic),
                            pair_minus_zero<BF16>(wa[i], 1, za, magic), pair_minus_zero<BF16>(wb[i], 1, zb, magic)};
    const uint32_t hi[4] = {pair_minus_zero<BF16>(wa[i], 2, za, magic), pair_minus_zero<BF16>(wb[i], 2, zb, magic),
                            pair_minus_zero<BF16>(wa[i], 3, za, magic), pair_minus_zero<BF16>(wb[i], 3, zb, magic)};
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      strip_gemv::mma<BF16>(c[nb], lo, xb[nb][i][0], xb[nb][i][1]);
      strip_gemv::mma<BF16>(c[nb], hi, xb[nb][i][2], xb[nb][i][3]);
    }
  }
}

template <bool BF16, int NB>
__device__ __forceinline__ void group_dot(float (&c)[NB][4], uint4 a, uint4 b, const uint4 (&xs)[NB][4],
                                          uint32_t za, uint32_t zb, uint32_t magic) {
  uint32_t xb[NB][4][4];
  x_operands<NB>(xs, xb);
  group_mma<BF16, NB>(c, a, b, xb, za, zb, magic);
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
  template <int NB, bool PROBE = false>
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
        group_dot<BF16, NB>(c, ta[t], tb[t], xs, za[t], zb[t], magic);
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
// else each batch is loaded, then decoded. PROBE: loads only (the load path's own rate; out all zeros). (x without
// __restrict__: plain loads, made after the PDL wait, not the read-only path.)
template <bool BF16, int BATCH, bool PIPE, int NB, bool PROBE>
__global__ void __launch_bounds__(WARPS * 32, 4) int4_gemv_rows(const uint16_t* x,
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
      a.template dot<NB>(xcols, has_x, g0, g_end, magic, sums);
      a.load(tiles, scale, zero, N, row_a, g0 + 2 * STRIDE, g_end);
      b.template dot<NB>(xcols, has_x, g0 + STRIDE, g_end, magic, sums);
    }
  } else {
    for (int g0 = g_begin; g0 < g_end; g0 += STRIDE) {
      if (g0 != g_begin) a.load(tiles, scale, zero, N, row_a, g0, g_end);
      a.template dot<NB, PROBE>(xcols, has_x, g0, g_end, magic, sums);
    }
  }
  if constexpr (PROBE) probe_sums(sums, M);
  strip_gemv::write_partials<NB>(sums, 1.f, 1.f, out, M, N, strip, split);  // (the groups' scales: applied)
}

// A walk over a warp's groups (int4_gemv_fold; int4_gemv_pair with STRIPS 2): at the current
// group g, the lane's words of the tile of each of STRIPS consecutive strips and the scales and zeros of (row l/4,
// g) and (row l/4 + 8, g) of each, in SLOTS slots; load(g0) takes groups g0 and g0 + WARPS (those < g_end) into
// slots 0 and 1, next() steps the walk by SLOTS WARPS groups (pointers, not indices; strip s at a fixed offset from
// the first).
template <int STRIPS = 1, int SLOTS = 2>
struct FoldWalk {
  const uint4* tile;
  const __half* sc;
  const uint8_t* ze;
  size_t step;
  int strip_tiles;  // (G 64 < 2^31)
  int g_end;
  uint4 ta[STRIPS][SLOTS], tb[STRIPS][SLOTS];
  float sa[STRIPS][SLOTS], sb[STRIPS][SLOTS];
  // the zeros of rows l/4 and l/4 + 8: z[s][t][0] and [1] (one strip), or z_a | z_b << 16 in z[s][t][0] (PACKED:
  // one register a tile, so that the pair kernel fits 128 registers; the folded kernels keep the two: no permutes)
  static constexpr bool PACKED = STRIPS > 1;
  uint32_t z[STRIPS][SLOTS][PACKED ? 1 : 2];

  __device__ __forceinline__ FoldWalk(const uint4* w, const __half* scale, const uint8_t* zero, int N, int G,
                                      int strip, int lane, int g_begin, int g_end_)
      : tile(w + ((size_t)strip * G + g_begin) * 64 + lane), step((size_t)WARPS * N), strip_tiles(G * 64),
        g_end(g_end_) {
    const size_t side = (size_t)g_begin * N + strip * 16 + lane / 4;
    sc = scale + side;
    ze = zero + side;
  }

  __device__ __forceinline__ void load(int g0) {
#pragma unroll
    for (int s = 0; s < STRIPS; ++s) {
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        if (g0 + t * WARPS < g_end) {
          ta[s][t] = load_weights(tile + s * strip_tiles + t * WARPS * 64);
          tb[s][t] = load_weights(tile + s * strip_tiles + t * WARPS * 64 + 32);
          sa[s][t] = __half2float(sc[t * step + 16 * s]);
          sb[s][t] = __half2float(sc[t * step + 16 * s + 8]);
          if constexpr (PACKED) {
            z[s][t][0] = ze[t * step + 16 * s] | (uint32_t)ze[t * step + 16 * s + 8] << 16;
          } else {
            z[s][t][0] = ze[t * step + 16 * s];
            z[s][t][1] = ze[t * step + 16 * s + 8];
          }
        }
      }
    }
  }

  // The rotating fold's loads (one strip, int4_gemv_fold<NB, SLOTS>): slot t takes group g0 + (SLOTS ahead + t)
  // WARPS of the batch at g0 (ahead 0: this batch, 1: the next), where it is below g_end; its scales stay fp16 (ha,
  // hb: converted where used, so that no conversion waits on a load issued a batch ahead)
  __half ha[SLOTS], hb[SLOTS];
  __device__ __forceinline__ void load_slot(int t, int ahead, int g0) {
    static_assert(STRIPS == 1);
    const int k = SLOTS * ahead + t;
    if (g0 + k * WARPS < g_end) {
      ta[0][t] = load_weights(tile + k * WARPS * 64);
      tb[0][t] = load_weights(tile + k * WARPS * 64 + 32);
      ha[t] = sc[k * step];
      hb[t] = sc[k * step + 8];
      z[0][t][0] = ze[k * step];
      z[0][t][1] = ze[k * step + 8];
    }
  }

  // -(MAGIC + z) in fp32 (MAGIC = 128 = 0x43000000, z < 16 in the mantissa's top bits) of row l/4 (b: l/4 + 8)
  __device__ __forceinline__ float neg_a(int s, int t) const {
    return __uint_as_float(0xC3000000u | z[s][t][0] << 16);
  }
  __device__ __forceinline__ float neg_b(int s, int t) const {
    if constexpr (PACKED) return __uint_as_float(0xC3000000u | (z[s][t][0] & 0xFFFF0000u));
    else return __uint_as_float(0xC3000000u | z[s][t][1] << 16);
  }

  // -(MAGIC + zero) in both halves of a 16-bit pair (pair_minus_zero's neg_zero) of row l/4 (b 0) or l/4 + 8 (b 1)
  template <bool BF16>
  __device__ __forceinline__ uint32_t neg_zeros(int s, int t, int b) const {
    static_assert(PACKED);
    return __byte_perm(z[s][t][0], Pairs<BF16>::NEG_MAGIC >> 8, b ? 0x4242 : 0x4040);
  }

  __device__ __forceinline__ void next() {
    tile += SLOTS * WARPS * 64;
    sc += SLOTS * step;
    ze += SLOTS * step;
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

// The pair kernel (int4_cuda.PAIR, the default; 9 … 16 rows): int4_gemv_rows' BATCH 2 unpipelined instance at two
// column blocks on two strips a block, each warp decoding strips 2 b and 2 b + 1 against one load of x. Past 8 rows
// x's loads outweigh the codes' (a lane's 128 bytes of x a group against 32 of weights) and every strip's block
// reads the whole of its split's x again; two strips a block halve those reads and x's byte permutes. Both strips'
// position walked as pointers (FoldWalk<2>, as int4_gemv_fold; indices recomputed at each load took 169 of an 850-
// instruction 2-group loop), and x loaded by every lane (rows past M read row M - 1, whose sums are not written:
// no 64 registers cleared a batch); the loop is 631 instructions. A (N/32, splits) grid (N % 32 == 0); the same
// group order and arithmetic a strip as int4_gemv_rows, so the same bits at the same split.
template <bool BF16>
__global__ void __launch_bounds__(WARPS * 32, 4) int4_gemv_pair(const uint16_t* x, const uint4* __restrict__ w,
                                                                const __half* scale, const uint8_t* zero,
                                                                float* __restrict__ out, int M, int N, int K,
                                                                int groups_per_split, uint32_t magic) {
  constexpr int NB = 2;
  const int G = K / 128, split = blockIdx.y, strip = 2 * blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g_begin = split * groups_per_split + warp, g_end = min(G, (split + 1) * groups_per_split);
  FoldWalk<2> wk(w, scale, zero, N, G, strip, lane, g_begin, g_end);
  const uint4* xcols[NB];  // (every lane loads: rows past M read row M - 1, no zeros to clear a group)
  strip_gemv::x_columns<NB, 4>(x, M, K, lane, xcols);
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) xcols[nb] += (size_t)g_begin * 16;
  wk.load(g_begin);  // (weights: before the wait)
  asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the previous kernel's output (PDL)
  float sums[2][NB][4] = {};
  for (int g0 = g_begin; g0 < g_end; g0 += 2 * WARPS) {
    if (g0 != g_begin) wk.load(g0);
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      if (g0 + t * WARPS < g_end) {
        uint4 xs[NB][4];
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
          for (int i = 0; i < 4; ++i) xs[nb][i] = xcols[nb][t * WARPS * 16 + i];
        }
        uint32_t xb[NB][4][4];
        x_operands<NB>(xs, xb);
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          float c[NB][4] = {};
          group_mma<BF16, NB>(c, wk.ta[s][t], wk.tb[s][t], xb, wk.template neg_zeros<BF16>(s, t, 0),
                              wk.template neg_zeros<BF16>(s, t, 1), magic);
#pragma unroll
          for (int nb = 0; nb < NB; ++nb) {
            sums[s][nb][0] = fmaf(wk.sa[s][t], c[nb][0], sums[s][nb][0]);
            sums[s][nb][1] = fmaf(wk.sa[s][t], c[nb][1], sums[s][nb][1]);
            sums[s][nb][2] = fmaf(wk.sb[s][t], c[nb][2], sums[s][nb][2]);
            sums[s][nb][3] = fmaf(wk.sb[s][t], c[nb][3], sums[s][nb][3]);
          }
        }
      }
    }
    wk.next();
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) xcols[nb] += 2 * WARPS * 16;
  }
  strip_gemv::write_partials<NB>(sums[0], 1.f, 1.f, out, M, N, strip, split);
  __syncthreads();  // (write_partials' shared sums, used again)
  strip_gemv::write_partials<NB>(sums[1], 1.f, 1.f, out, M, N, strip + 1, split);
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

// The folded kernel (bf16 x, up to 8 rows; int4_cuda.FOLD): int4_gemv_rows' BATCH 2 unpipelined instance with the
// zero folded out of the decode, sum (q - z) x = sum (MAGIC + q) x - (MAGIC + z) sum x (group_fold; fp32 sums ~128x
// the result's size, so a few 1e-6 of relative error where the plain kernel has ~1e-7), and its position walked as
// pointers stepped once a batch (each load a pointer plus a constant) instead of indices recomputed at each load.
// Same grid, split plan and group order as int4_gemv_rows. SLOTS 0: batches of 2 groups, each loaded, then decoded.
// SLOTS 2 or 3 (int4_cuda.FOLD 2 and 3, candidates): rotating loads, batches of SLOTS groups whose registers each
// take the next batch's group in their slot as soon as their group is decoded (FoldWalk::load_slot), so a warp always
// has SLOTS - 1 groups' loads in flight while it decodes one, in the same registers; unrotated, a warp decodes its
// batch with no load of its own in flight (on an H200 the fold reads at 3.52 TB/s where its loads-only probe, at
// the same 7 blocks an SM, reads at 4.20: docs/DESIGN-NOTES.md, 2026-12-07 session f). SLOTS 3 holds a third group's
// registers at 6 blocks an SM (80 registers) where the others keep 7 (72). The same arithmetic in the same order,
// whatever SLOTS: the same bits.
template <int NB, int SLOTS = 0>
__global__ void __launch_bounds__(WARPS * 32, SLOTS == 3 ? 6 : 7) int4_gemv_fold(const uint16_t* x,
                                                                                const uint4* __restrict__ w,
                                                                                const __half* scale,
                                                                                const uint8_t* zero,
                                                                                float* __restrict__ out, int M,
                                                                                int N, int K,
                                                                                int groups_per_split,
                                                                                uint32_t magic) {
  static_assert(SLOTS == 0 || SLOTS == 2 || SLOTS == 3);
  constexpr bool ROTATE = SLOTS > 0;
  constexpr int S = ROTATE ? SLOTS : 2;  // groups a batch
  const int G = K / 128, strip = blockIdx.x, split = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g_begin = split * groups_per_split + warp, g_end = min(G, (split + 1) * groups_per_split);
  FoldWalk<1, S> wk(w, scale, zero, N, G, strip, lane, g_begin, g_end);
  bool has_x[NB];
  const uint4* xcols[NB];
  strip_gemv::x_columns<NB, 4>(x, M, K, lane, has_x, xcols);
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) xcols[nb] += (size_t)g_begin * 16;
  if constexpr (ROTATE) {  // (weights: before the wait)
#pragma unroll
    for (int t = 0; t < S; ++t) wk.load_slot(t, 0, g_begin);
  } else {
    wk.load(g_begin);
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the previous kernel's output (PDL)
  float sums[NB][4] = {};
  for (int g0 = g_begin; g0 < g_end; g0 += S * WARPS) {
    if (!ROTATE && g0 != g_begin) wk.load(g0);
#pragma unroll
    for (int t = 0; t < S; ++t) {
      if (g0 + t * WARPS < g_end) {
        uint4 xs[NB][4];
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
          for (int i = 0; i < 4; ++i) xs[nb][i] = has_x[nb] ? xcols[nb][t * WARPS * 16 + i] : make_uint4(0, 0, 0, 0);
        }
        float c[NB][4] = {}, xsum[NB][4] = {};
        group_fold<NB>(c, xsum, wk.ta[0][t], wk.tb[0][t], xs, magic);
        // -(MAGIC + z) in fp32: MAGIC = 128 = 0x43000000, z < 16 in the mantissa's top bits
        const float neg_a = wk.neg_a(0, t), neg_b = wk.neg_b(0, t);
        const float sa = ROTATE ? __half2float(wk.ha[t]) : wk.sa[0][t];
        const float sb = ROTATE ? __half2float(wk.hb[t]) : wk.sb[0][t];
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
          sums[nb][0] = fmaf(sa, fmaf(neg_a, xsum[nb][0], c[nb][0]), sums[nb][0]);
          sums[nb][1] = fmaf(sa, fmaf(neg_a, xsum[nb][1], c[nb][1]), sums[nb][1]);
          sums[nb][2] = fmaf(sb, fmaf(neg_b, xsum[nb][0], c[nb][2]), sums[nb][2]);
          sums[nb][3] = fmaf(sb, fmaf(neg_b, xsum[nb][1], c[nb][3]), sums[nb][3]);
        }
        if constexpr (ROTATE) wk.load_slot(t, 1, g0);  // (this slot's group decoded: the next batch's in its place)
      }
    }
    wk.next();
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) xcols[nb] += S * WARPS * 16;
  }
  strip_gemv::write_partials<NB>(sums, 1.f, 1.f, out, M, N, strip, split);  // (the groups' scales: applied)
}

}  // namespace

template <bool BF16, int BATCH, bool PIPE, int NB, bool PROBE = false>
cudaError_t launch(const cudaLaunchConfig_t& config, const void* x, const void* w, const void* scale,
                   const void* zero, float* out, int M, int N, int K, int groups_per_split) {
  // (MAGIC passed as an argument: a register in the kernel, see pair_minus_zero)
  return cudaLaunchKernelEx(&config, int4_gemv_rows<BF16, BATCH, PIPE, NB, PROBE>,
                            static_cast<const uint16_t*>(x), static_cast<const uint4*>(w),
                            static_cast<const __half*>(scale), static_cast<const uint8_t*>(zero), out, M, N, K,
                            groups_per_split, Pairs<BF16>::MAGIC);
}

// The instance for M rows, (batch, pipe), the loads-only probe and the fold as one key: one column block of 8 x
// rows (M <= 8) or two (M <= 16, BATCH 2 or 4 unpipelined: the others would spill); the probe and the folded
// kernel (fold 1: int4_gemv_fold; fold 2 and 3: its rotating loads over 2 and 3 slots; bf16 x only) with BATCH 2
// unpipelined at one column block only; pair: two column blocks' BATCH 2 instance as int4_gemv_pair (two strips a
// block); -1 where there is none.
static int variant_key(int M, int batch, int pipe, int probe, int fold, int bf16, int pair) {
  const int key = (M > 8) * 100 + batch * 2 + (pipe != 0);
  if (fold < 0 || fold > 3 || ((probe || fold) && (key != 4 || (probe && fold) || (fold && !bf16))) ||
      (pair && key != 104))
    return -1;
  switch (key) {
    case 104: return pair ? 32104 : key;
    case 4: case 5: case 8: case 16: case 108:
      return key + (fold == 1) * 4000 + (fold == 2) * 16000 + (fold == 3) * 20000 + (probe != 0) * 8000;
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
    case 32104:
      return cudaLaunchKernelEx(&config, int4_gemv_pair<BF16>, static_cast<const uint16_t*>(x),
                                static_cast<const uint4*>(w), static_cast<const __half*>(scale),
                                static_cast<const uint8_t*>(zero), out, M, N, K, groups_per_split, Pairs<BF16>::MAGIC);
    case 8004: return launch<BF16, 2, false, 1, true>(config, x, w, scale, zero, out, M, N, K, groups_per_split);
    case 4004: case 16004: case 20004:  // (the folded kernel, 16004 / 20004 rotating over 2 / 3 slots: bf16 x only)
      if constexpr (BF16)
        return cudaLaunchKernelEx(&config, key == 4004    ? int4_gemv_fold<1>
                                           : key == 16004 ? int4_gemv_fold<1, 2>
                                                          : int4_gemv_fold<1, 3>,
                                  static_cast<const uint16_t*>(x), static_cast<const uint4*>(w),
                                  static_cast<const __half*>(scale), static_cast<const uint8_t*>(zero), out, M, N,
                                  K, groups_per_split, Pairs<true>::MAGIC);
      return cudaErrorInvalidValue;
    default: return cudaErrorInvalidValue;
  }
}

// A loads-only probe's extra (dynamic, unused) shared memory a block, so that as many of its blocks fit a
// multiprocessor as of the register kernel it probes (BATCH 2: 71 registers, 7 blocks), whose registers allow fewer
// than the probe's own ~40: 228 KB an SM, ~1 KB a block reserved, so 30 KB a block in all.
constexpr size_t PROBE_BYTES = 30 * 1024 - WARPS * 8 * 16 * sizeof(float);  // (less write_partials' static part)

// Launches the kernel on `stream` of GPU `device`; returns the cudaError_t, cudaErrorInvalidValue (1) before
// touching the GPU where the arguments are out of the kernel's range: N % 16, K % 128, a split plan that leaves a
// split empty or a group out, M outside 1 .. 16, a (batch, pipe) with no instance for M (batch 2, 4 or 8, only 2 or
// 4 past 8 rows; pipe only with batch 2 and M <= 8). fold (0 … 3): 1 the folded kernel instead (int4_gemv_fold:
// BATCH 2 unpipelined, up to 8 rows of bf16 x), 2 and 3 the same with rotating loads over 2 and 3 slots. loads_only: the register kernel's probe of its load path (BATCH 2
// unpipelined, up to 8 rows; out all zeros). pdl: programmatic dependent launch (the kernel waits before reading x).
// pair: two strips a block (int4_gemv_pair: 9 … 16 rows, BATCH 2 unpipelined, N % 32 == 0; a grid of N / 32 blocks
// by splits).
extern "C" int fastqwen_int4_gemv(const void* x, const void* w, const void* scale, const void* zero, float* out,
                                  int M, int N, int K, int splits, int groups_per_split, int batch, int pipe,
                                  int fold, int loads_only, int bf16, int pair, int pdl, int device,
                                  void* stream) {
  const int key = variant_key(M, batch, pipe, loads_only, fold, bf16, pair);
  if (!strip_gemv::shape_ok(M, N, K, 128, splits, groups_per_split) || key < 0 || (pair && N % 32))
    return static_cast<int>(cudaErrorInvalidValue);
  cudaLaunchConfig_t config;
  cudaLaunchAttribute attribute;
  if (cudaError_t e = strip_gemv::launch_config(config, attribute, N, splits, pdl, device, stream); e != cudaSuccess)
    return static_cast<int>(e);
  if (pair) config.gridDim.x = N / 32;
  if (loads_only) config.dynamicSmemBytes = PROBE_BYTES;  // (as many blocks an SM as the kernel it probes)
  return static_cast<int>(bf16 ? launch_variant<true>(key, config, x, w, scale, zero, out, M, N, K, groups_per_split)
                               : launch_variant<false>(key, config, x, w, scale, zero, out, M, N, K,
                                                       groups_per_split));
}
