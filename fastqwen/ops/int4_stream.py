"""int4 at one row with the weight streamed by the Tensor Memory Accelerator: y = x · Wᵀ for x [1, K].

The one-row kernel of ops/gemv.py (_row_kernel, HALF2) loads each thread's words of a weight tile itself;
there a program's loads of a step are issued only after the math of the step before, and the tiles stream at
~76% of the copy bandwidth with no arithmetic at all (DESIGN-NOTES, session 19). Here each step's tiles are
one bulk copy (TMA, a tensor descriptor) into a ring of STAGES shared-memory buffers that Triton's software
pipeliner keeps STAGES − 1 steps ahead of the math, so a program keeps STAGES − 1 steps of bytes in flight
whatever its registers; the decode and sums are the HALF2 kernel's (_int4_half2: fp16 pair arithmetic, x
scaled by a power of 2 into fp16 pairs by _half2_prologue; fp32 sums).

Operands as QuantLinear keeps them: codes tiled ([N/16, K/128, 16, 64] uint8, tile_int4), scale fp16 and zero
uint8 [N, K/128] group-major (gemv.group_major). Config (BLOCK_N, SPLIT_K, num_warps, STAGES, KSTEP): a program
owns BLOCK_N rows (a multiple of 16: whole tiles) and walks K/SPLIT_K columns in steps of KSTEP groups.
`reference` is gemv.reference; tests/test_int4_stream.py compares them.
"""

import torch

from . import gemv

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # CPU-only installs: gemv's reference path serves
    triton = None

GROUP = gemv.STEP  # 128 columns: one int4 group, one tile's width

if triton is not None:

    @triton.jit
    def _int4_stream_kernel(x_ptr, w_desc, sz_desc, y_ptr, xp_ptr, N, K, items, SPLITS: tl.constexpr,
                            BLOCK_N: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr, MATH: tl.constexpr = 1):
        """Persistent: the work is `items` = ⌈N / BLOCK_N⌉ · SPLITS items (tile t, split s: rows
        [t·BLOCK_N, +BLOCK_N) over the s-th of SPLITS equal parts of K), item i = t · SPLITS + s, each one's
        partial sums to y[s, 0, rows] (fp32). Program p takes items [p·items/P, (p+1)·items/P) as one loop over
        their groups, so the TMA ring stays full across items. w_desc: the codes as int32 [N/16, K/8 · 16] (row
        t: tile row t's groups, each 256 words: 16 rows × 16 words), block [BLOCK_N/16, 256]: one group of
        BLOCK_N rows; sz_desc: each group's scale and zero as one int32 (pack_scale_zero) group-major
        [K/128, N], block [1, BLOCK_N]. Rows past N read zero codes, scales and zeros (TMA fills out-of-bounds
        boxes with zeros) and are stored nowhere."""
        p = tl.program_id(0)
        P = tl.num_programs(0)
        per_item = K // 128 // SPLITS  # groups an item walks
        if PDL:  # the weight is no kernel's output: only x waits for the kernel before this one
            tl.extra.cuda.gdc_wait()
        x_scale = gemv._half2_prologue(x_ptr, xp_ptr, 0, K, K)
        acc = tl.zeros((BLOCK_N, 16), tl.float32)
        for it in tl.range(p * items // P * per_item, (p + 1) * items // P * per_item, num_stages=STAGES):
            item = it // per_item
            gi = it - item * per_item
            tile = item // SPLITS
            split = item - tile * SPLITS
            g = split * per_item + gi
            u = tl.reshape(w_desc.load([tile * (BLOCK_N // 16), g * 256]), (BLOCK_N, 16))
            sz = tl.reshape(sz_desc.load([g, tile * BLOCK_N]), (BLOCK_N,))
            scale = (sz & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            if MATH:
                part = gemv._half2_products((u, scale, sz >> 16), gemv._half2_x(xp_ptr, g, K // 128, K), 1, ASM)
            else:
                part = (u ^ sz[:, None]).to(tl.float32)
            acc = tl.where(gi == 0, part, acc + part)
            if gi == per_item - 1:
                n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
                tl.store(y_ptr + split * N + n, tl.sum(acc, axis=1) / x_scale, mask=n < N)
        if PDL:  # (after the last store: the next kernel's programs take no SM slot this launch still needs)
            tl.extra.cuda.gdc_launch_dependents()


def _check(x, w, scale, zero, N, config):
    K = x.shape[-1]
    bn, split, warps, stages, per_sm = config
    G = K // GROUP
    if x.dim() != 2 or x.shape[0] != 1 or K % GROUP:
        raise ValueError(f"int4_stream takes one row x [1, K] with K a multiple of {GROUP}; got {tuple(x.shape)}")
    if tuple(w.shape) != (N // 16, G, 16, GROUP // 2) or N % 16 or w.dtype != torch.uint8 or not w.is_contiguous():
        raise ValueError(f"int4_stream takes tiled codes (formats.tile_int4) uint8 [N/16, K/128, 16, 64] for N={N}, "
                         f"K={K}, contiguous; got {tuple(w.shape)} {w.dtype}")
    if scale.stride() != zero.stride() or scale.stride(0) != 1 or scale.dtype != gemv.INT4_SCALE \
            or zero.dtype != gemv.INT4_ZERO:
        raise ValueError("int4_stream takes scale and zero group-major (gemv.group_major) in the stored dtypes, "
                         f"{gemv.INT4_SCALE} and {gemv.INT4_ZERO}; got strides {scale.stride()}, {zero.stride()}")
    if bn % 16 or bn > 16 * 256 or G % split or per_sm < 1:
        raise ValueError(f"config {config}: BLOCK_N must be a multiple of 16 up to 4096, SPLIT_K divide the {G} "
                         "groups and programs a multiprocessor be at least 1")


_SMS = {}


def _multiprocessors(device) -> int:
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return _SMS[device]


def pack_scale_zero(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """int4's scale (fp16) and zero (uint8) [N, K/128] as one int32 each, group-major [K/128, N]: the fp16 bits
    in the low half, the zero in the high half (one 4-byte load a row and group)."""
    bits = scale.t().contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    return bits | (zero.t().to(torch.int32) << 16)


def int4_stream(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, out_features: int,
                config: tuple[int, int, int, int, int], pdl: bool = False, sz=None, math=1) -> torch.Tensor:
    """Split-K partial sums [SPLIT_K, 1, out_features] fp32 of x [1, K] · Wᵀ (their sum is the product)."""
    N = out_features
    _check(x, w, scale, zero, N, config)
    bn, split, warps, stages, per_sm = config
    K = x.shape[1]
    codes = w.view(torch.int32).view(N // 16, K // 8 * 16)
    desc = TensorDescriptor(codes, list(codes.shape), list(codes.stride()), [bn // 16, 256])
    sz = pack_scale_zero(scale, zero) if sz is None else sz
    sz_desc = TensorDescriptor(sz, list(sz.shape), list(sz.stride()), [1, bn])
    y = torch.empty(split, 1, N, dtype=torch.float32, device=x.device)
    xp = torch.empty(K // 2, dtype=torch.int32, device=x.device)  # _half2_prologue's x pairs [4, K / 8]
    items = triton.cdiv(N, bn) * split
    _int4_stream_kernel[(min(items, per_sm * _multiprocessors(x.device)),)](
        x, desc, sz_desc, y, xp, N, K, items, SPLITS=split, BLOCK_N=bn, STAGES=stages,
        PDL=pdl, ASM=not triton.knobs.runtime.interpret, MATH=math, num_warps=warps, launch_pdl=pdl)
    return y
