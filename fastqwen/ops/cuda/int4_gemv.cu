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

// One group of one warp: c[nb] += the group's sums of (q - zero) x for x rows 8 nb .. 8 nb + 7 (c0, c1:
// strip row l/4 against x rows 8 nb + 2 (l%4) and + 1; c2, c3: row l/4 + 8). a, b: the lane's 16 bytes of rows
// l/4 and l/4 + 8; xs[nb]: x row 8 nb + l/4 at the lane's 32 columns (8 per word; zero past M). The weight is
// decoded once for the NB column blocks.
template <bool BF16, int NB>
__device__ __forceinline__ void group_dot(float (&c)[NB][4], uint4 a, uint4 b, const uint4 (&xs)[NB][4],
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
      const uint4 v = xs[nb][i];  // x[8i + 0 .. 7] of the lane's columns, two a register
      Pairs<BF16>::mma(c[nb], lo, __byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632));
      Pairs<BF16>::mma(c[nb], hi, __byte_perm(v.y, v.w, 0x5410), __byte_perm(v.y, v.w, 0x7632));
    }
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
  template <int NB>
  __device__ __forceinline__ void dot(const uint4* const (&xcols)[NB], const bool (&has_x)[NB], int g0, int g_end,
                                      uint32_t magic, float (&sums)[NB][4]) const {
#pragma unroll
    for (int t = 0; t < BATCH; ++t) {
      const int g = g0 + t * WARPS;
      if (g < g_end) {
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
// else each batch is loaded, then decoded. (x without __restrict__: plain loads, made after the PDL wait, not
// the read-only path.)
template <bool BF16, int BATCH, bool PIPE, int NB>
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
  // x row 8 nb + l/4 at the lane's 32 columns of group g: + g * 16 (K % 128 == 0: every row 16-byte aligned)
  bool has_x[NB];
  const uint4* xcols[NB];
  float sums[NB][4];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    has_x[nb] = nb * 8 + lane / 4 < M;
    xcols[nb] = reinterpret_cast<const uint4*>(x + (size_t)min(nb * 8 + lane / 4, M - 1) * K) + (lane % 4) * 4;
    sums[nb][0] = sums[nb][1] = sums[nb][2] = sums[nb][3] = 0.f;
  }
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
      a.template dot<NB>(xcols, has_x, g0, g_end, magic, sums);
    }
  }
  __shared__ float part[WARPS][8 * NB][16];  // [warp][x row][strip row]
  const int r = lane / 4, m = 2 * (lane % 4);
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    part[warp][8 * nb + m][r] = sums[nb][0];
    part[warp][8 * nb + m + 1][r] = sums[nb][1];
    part[warp][8 * nb + m][r + 8] = sums[nb][2];
    part[warp][8 * nb + m + 1][r + 8] = sums[nb][3];
  }
  __syncthreads();
  for (int t = threadIdx.x; t < 16 * M; t += WARPS * 32) {
    const int row = t % 16, xrow = t / 16;
    float s = 0.f;
#pragma unroll
    for (int v = 0; v < WARPS; ++v) s += part[v][xrow][row];
    out[((size_t)split * M + xrow) * N + strip * 16 + row] = s;
  }
}

}  // namespace

template <bool BF16, int BATCH, bool PIPE, int NB>
cudaError_t launch(const cudaLaunchConfig_t& config, const void* x, const void* w, const void* scale,
                   const void* zero, float* out, int M, int N, int K, int groups_per_split) {
  // (MAGIC passed as an argument: a register in the kernel, see pair_minus_zero)
  return cudaLaunchKernelEx(&config, int4_gemv_rows<BF16, BATCH, PIPE, NB>, static_cast<const uint16_t*>(x),
                            static_cast<const uint4*>(w), static_cast<const __half*>(scale),
                            static_cast<const uint8_t*>(zero), out, M, N, K, groups_per_split, Pairs<BF16>::MAGIC);
}

// The instance for M rows and (batch, pipe) as one key: one column block of 8 x rows (M <= 8) or two (M <= 16,
// BATCH 2 or 4 unpipelined: the others would spill); -1 where there is none.
static int variant_key(int M, int batch, int pipe) {
  const int key = (M > 8) * 100 + batch * 2 + (pipe != 0);
  switch (key) {
    case 4: case 5: case 8: case 16: case 104: case 108: return key;
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
    default: return cudaErrorInvalidValue;
  }
}

// Launches the kernel on `stream` of GPU `device` (made this runtime's current device first: the library links
// its own CUDA runtime, whose current device is not torch's); returns the cudaError_t, cudaErrorInvalidValue
// (1) before touching the GPU where the arguments are out of the kernel's range: N % 16, K % 128, a split plan
// that leaves a split empty or a group out, M outside 1 .. 16, a (batch, pipe) with no instance for M (batch 2,
// 4 or 8, only 2 or 4 past 8 rows; pipe only with batch 2 and M <= 8). pdl: programmatic dependent launch (the
// kernel waits before reading x).
extern "C" int fastqwen_int4_gemv(const void* x, const void* w, const void* scale, const void* zero, float* out,
                                  int M, int N, int K, int splits, int groups_per_split, int batch, int pipe,
                                  int bf16, int pdl, int device, void* stream) {
  const int G = K / 128, key = variant_key(M, batch, pipe);
  if (N <= 0 || N % 16 || K <= 0 || K % 128 || M < 1 || M > 16 || key < 0 || splits < 1 || groups_per_split < 1 ||
      (splits - 1) * groups_per_split >= G || splits * groups_per_split < G)
    return static_cast<int>(cudaErrorInvalidValue);
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) return static_cast<int>(e);
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(N / 16, splits);
  config.blockDim = dim3(WARPS * 32);
  config.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl ? 1 : 0;
  cudaError_t e = bf16 ? launch_variant<true>(key, config, x, w, scale, zero, out, M, N, K, groups_per_split)
                       : launch_variant<false>(key, config, x, w, scale, zero, out, M, N, K, groups_per_split);
  return static_cast<int>(e);
}
