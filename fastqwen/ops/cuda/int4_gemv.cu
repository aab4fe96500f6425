// int4 weight-streaming GEMV for up to 8 rows of x (a decode step, a short verify block, a small batch), on the
// tensor cores.
//
// y[m, n] = sum_k x[m, k] * (q[n, k] - zero[n, g]) * scale[n, g],  g = k / 128, written as split-K partial sums
// out[s, m, n] over the groups of split s (the caller adds the splits; fastqwen/ops/int4_cuda.py).
//
// Operands, as fastqwen.quant.QuantLinear stores an int4 weight [N, K] (N % 16 == 0, K % 128 == 0):
//   w      uint8 [N/16, K/128, 16, 64]: codes tiled by 16 rows x one group (quant/formats.py tile_int4), each
//          tile one contiguous KB; a byte holds column 2j in its low nibble and 2j + 1 in its high one
//   scale  fp16, zero uint8: logical [N, K/128] stored group-major (element (n, g) at g * N + n)
//   x      bf16 or fp16 [M, K], M <= 8, contiguous; out fp32 [splits, M, N]
//
// A block is 4 warps on one strip of 16 rows; blockIdx.y is the split; the split's groups are dealt to the
// warps in turn. Lane l reads 16 bytes of each tile for row l/4 and 16 for row l/4 + 8 (words 4 (l%4) .. + 3
// of each row, columns 32 (l%4) .. + 31 of the group), which is the A operand of mma.m16n8k16 with the
// group's columns permuted among the k slots: word i's nibble pair (j, j + 4), j = 0..3, decodes to the 16-bit
// pair (q - zero) of columns (8i + j, 8i + j + 4) exactly (a LOP3 puts the code in the mantissa of 128 (bf16)
// or 1024 (fp16), an FMA subtracts 128 + zero). The B operand's column n is x row n (zero for n >= M), which
// lane l supplies for n = l/4 at the same columns (a byte permute of 8 consecutive values); so c0, c1 of lane l
// are strip row l/4 against x rows 2 (l%4) and 2 (l%4) + 1, and c2, c3 strip row l/4 + 8 against them. The
// decode is the same whatever M: rows 2 .. 8 cost their x loads and nothing else.
// Weights and scales are loaded before the PDL wait (they do not depend on the previous kernel); x after it.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int WARPS = 4;  // a block: one strip of 16 rows, the split's groups dealt to 4 warps
// BATCH (a template argument: 2, 4 or 8): groups whose loads a warp issues before it decodes any of them;
// PIPE: the next BATCH's loads in flight while it decodes (with BATCH 2)

__device__ __forceinline__ uint4 load_weights(const uint4* p) {  // streamed once: keep it out of L1
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

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
  __device__ __forceinline__ static void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
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
  __device__ __forceinline__ static void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// (q - zero) of word u's nibble pair (j, j + 4) as a 16-bit pair; neg_zero = -(MAGIC + zero) in both halves,
// magic = MAGIC in a register: (u & 0x000F000F) | magic is then one LOP3 (ptxas splits it in two where both
// constants are immediates).
template <bool BF16>
__device__ __forceinline__ uint32_t pair_minus_zero(uint32_t u, int j, uint32_t neg_zero, uint32_t magic) {
  uint32_t t;
  asm("lop3.b32 %0, %1, 0x000F000F, %2, 0xea;" : "=r"(t) : "r"(u >> (4 * j)), "r"(magic));
  return Pairs<BF16>::fma(t, Pairs<BF16>::ONE, neg_zero);
}

// One group of one warp: c += the group's sums of (q - zero) x (c0, c1: strip row l/4 against x rows
// 2 (l%4), 2 (l%4) + 1; c2, c3: row l/4 + 8). a, b: the lane's 16 bytes of rows l/4 and l/4 + 8; xs: x row
// l/4 at the lane's 32 columns (8 per word; zero past M).
template <bool BF16>
__device__ __forceinline__ void group_dot(float (&c)[4], uint4 a, uint4 b, const uint4 (&xs)[4], uint32_t za,
                                          uint32_t zb, uint32_t magic) {
  const uint32_t wa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint4 v = xs[i];  // x[8i + 0 .. 7] of the lane's columns, two a register
    const uint32_t x04 = __byte_perm(v.x, v.z, 0x5410), x15 = __byte_perm(v.x, v.z, 0x7632);
    const uint32_t x26 = __byte_perm(v.y, v.w, 0x5410), x37 = __byte_perm(v.y, v.w, 0x7632);
    const uint32_t lo[4] = {pair_minus_zero<BF16>(wa[i], 0, za, magic), pair_minus_zero<BF16>(wb[i], 0, zb, magic),
                            pair_minus_zero<BF16>(wa[i], 1, za, magic), pair_minus_zero<BF16>(wb[i], 1, zb, magic)};
    Pairs<BF16>::mma(c, lo, x04, x15);
    const uint32_t hi[4] = {pair_minus_zero<BF16>(wa[i], 2, za, magic), pair_minus_zero<BF16>(wb[i], 2, zb, magic),
                            pair_minus_zero<BF16>(wa[i], 3, za, magic), pair_minus_zero<BF16>(wb[i], 3, zb, magic)};
    Pairs<BF16>::mma(c, hi, x26, x37);
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

  // sums: strip row l/4 against x rows 2 (l%4), 2 (l%4) + 1, then row l/4 + 8 against them; has_x: l/4 < M.
  __device__ __forceinline__ void dot(const uint4* xcols, bool has_x, int g0, int g_end, uint32_t magic,
                                      float (&sums)[4]) const {
#pragma unroll
    for (int t = 0; t < BATCH; ++t) {
      const int g = g0 + t * WARPS;
      if (g < g_end) {
        uint4 xs[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) xs[i] = has_x ? xcols[(size_t)g * 16 + i] : make_uint4(0, 0, 0, 0);
        float c[4] = {0.f, 0.f, 0.f, 0.f};
        group_dot<BF16>(c, ta[t], tb[t], xs, za[t], zb[t], magic);
        sums[0] = fmaf(sa[t], c[0], sums[0]);
        sums[1] = fmaf(sa[t], c[1], sums[1]);
        sums[2] = fmaf(sb[t], c[2], sums[2]);
        sums[3] = fmaf(sb[t], c[3], sums[3]);
      }
    }
  }
};

// PIPE: two batches in flight, the next one's loads issued before the current one's decode (ping-pong);
// else each batch is loaded, then decoded. (x without __restrict__: plain loads, made after the PDL wait, not
// the read-only path.)
template <bool BF16, int BATCH, bool PIPE>
__global__ void __launch_bounds__(WARPS * 32, 4) int4_gemv_rows(const uint16_t* x,
                                                                const uint4* __restrict__ w,
                                                                const __half* __restrict__ scale,
                                                                const uint8_t* __restrict__ zero,
                                                                float* __restrict__ out, int M, int N, int K,
                                                                int groups_per_split, uint32_t magic) {
  const int G = K / 128, strip = blockIdx.x, split = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row_a = strip * 16 + lane / 4;
  const int g_begin = split * groups_per_split + warp, g_end = min(G, (split + 1) * groups_per_split);
  const uint4* tiles = w + (size_t)strip * G * 64 + lane;  // tile (strip, g) at + g * 64 uint4s
  // x row l/4 at the lane's 32 columns of group g: + g * 16 (K % 128 == 0: every row 16-byte aligned)
  const bool has_x = lane / 4 < M;
  const uint4* xcols = reinterpret_cast<const uint4*>(x + (size_t)min(lane / 4, M - 1) * K) + (lane % 4) * 4;
  constexpr int STRIDE = BATCH * WARPS;
  float sums[4] = {0.f, 0.f, 0.f, 0.f};
  Batch<BF16, BATCH> a;
  a.load(tiles, scale, zero, N, row_a, g_begin, g_end);  // (weights: before the wait)
  asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the previous kernel's output (PDL)
  if constexpr (PIPE) {
    Batch<BF16, BATCH> b;
    for (int g0 = g_begin; g0 < g_end; g0 += 2 * STRIDE) {
      b.load(tiles, scale, zero, N, row_a, g0 + STRIDE, g_end);
      a.dot(xcols, has_x, g0, g_end, magic, sums);
      a.load(tiles, scale, zero, N, row_a, g0 + 2 * STRIDE, g_end);
      b.dot(xcols, has_x, g0 + STRIDE, g_end, magic, sums);
    }
  } else {
    for (int g0 = g_begin; g0 < g_end; g0 += STRIDE) {
      if (g0 != g_begin) a.load(tiles, scale, zero, N, row_a, g0, g_end);
      a.dot(xcols, has_x, g0, g_end, magic, sums);
    }
  }
  __shared__ float part[WARPS][8][16];  // [warp][x row][strip row]
  const int r = lane / 4, m = 2 * (lane % 4);
  part[warp][m][r] = sums[0];
  part[warp][m + 1][r] = sums[1];
  part[warp][m][r + 8] = sums[2];
  part[warp][m + 1][r + 8] = sums[3];
  __syncthreads();
  if (threadIdx.x < 16 * M) {
    const int row = threadIdx.x % 16, xrow = threadIdx.x / 16;
    float s = 0.f;
#pragma unroll
    for (int v = 0; v < WARPS; ++v) s += part[v][xrow][row];
    out[((size_t)split * M + xrow) * N + strip * 16 + row] = s;
  }
}

}  // namespace

template <bool BF16, int BATCH, bool PIPE>
cudaError_t launch(const cudaLaunchConfig_t& config, const void* x, const void* w, const void* scale,
                   const void* zero, float* out, int M, int N, int K, int groups_per_split) {
  // (MAGIC passed as an argument: a register in the kernel, see pair_minus_zero)
  return cudaLaunchKernelEx(&config, int4_gemv_rows<BF16, BATCH, PIPE>, static_cast<const uint16_t*>(x),
                            static_cast<const uint4*>(w), static_cast<const __half*>(scale),
                            static_cast<const uint8_t*>(zero), out, M, N, K, groups_per_split, Pairs<BF16>::MAGIC);
}

template <bool BF16>
cudaError_t launch_variant(int batch, int pipe, const cudaLaunchConfig_t& config, const void* x, const void* w,
                           const void* scale, const void* zero, float* out, int M, int N, int K,
                           int groups_per_split) {
  switch (batch * 2 + (pipe != 0)) {
    case 4: return launch<BF16, 2, false>(config, x, w, scale, zero, out, M, N, K, groups_per_split);
    case 5: return launch<BF16, 2, true>(config, x, w, scale, zero, out, M, N, K, groups_per_split);
    case 8: return launch<BF16, 4, false>(config, x, w, scale, zero, out, M, N, K, groups_per_split);
    case 16: return launch<BF16, 8, false>(config, x, w, scale, zero, out, M, N, K, groups_per_split);
    default: return cudaErrorInvalidValue;  // (batch 4 or 8 pipelined would spill)
  }
}

// Launches the kernel on `stream`; returns the cudaError_t. splits * groups_per_split >= K / 128 and every
// split nonempty (the caller's plan); batch 2, 4 or 8, pipe (two batches in flight) only with batch 2. pdl:
// programmatic dependent launch (the kernel waits before reading x).
extern "C" int fastqwen_int4_gemv(const void* x, const void* w, const void* scale, const void* zero,
                                          float* out, int M, int N, int K, int splits, int groups_per_split,
                                          int batch, int pipe, int bf16, int pdl, void* stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(N / 16, splits);
  config.blockDim = dim3(WARPS * 32);
  config.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl ? 1 : 0;
  if (M < 1 || M > 8) return static_cast<int>(cudaErrorInvalidValue);
  cudaError_t e = bf16 ? launch_variant<true>(batch, pipe, config, x, w, scale, zero, out, M, N, K, groups_per_split)
                       : launch_variant<false>(batch, pipe, config, x, w, scale, zero, out, M, N, K,
                                               groups_per_split);
  return static_cast<int>(e);
}
