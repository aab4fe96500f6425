"""Split-KV attention of a few queries over a static KV cache that reads only the positions in use.

`attention.attend_cache` (scaled_dot_product_attention with a mask) reads the whole static cache, max_seq_len
positions per row, whatever the rows' lengths: at max_seq_len 128K that is ~8.6 GB a step on the 27B model,
16% of its weights, per row. This kernel reads keys 0 … max(position) of each row only.

Grid (B, Hkv · row blocks, SPLITS). The G = Hq / Hkv query heads of a KV head and the T queries of its row
make G·T rows of the dot; a program takes a block of at most 32 of them (a verify's 6 · 16 = 96 rows on the
27B would otherwise hold a [128, 256] fp32 accumulator: registers spill), splits the row's used keys into
SPLITS equal chunks (the chunk size is computed in the kernel from the positions, so one CUDA graph serves
every length) and runs an online softmax over its chunk in BLOCK_S steps, masking keys after each query's
position. The row blocks of one KV head read the same keys (from L2 when they fit). Each split writes its
partial output and log-sum-exp; `merge_splits`, plain torch traced into the compiled step, merges them
(with kernels={"attn_glue": "fused"}: `merge_gated_op`, one kernel of ours that also applies the layer's output
gate and reads only the splits holding keys: the splits past every row's keys then store their lse only).
The dots take the cache's dtype with fp32 accumulation, as flash attention does (runs in Triton's CPU interpreter,
tests/test_decode_attention.py). The default at every cache length (kernels={"attention": "split"});
scripts/bench_attention.py and `fastqwen+sdpa-attention` runs measure it against attend_cache.
"""

import torch

from .attention import attend_cache

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK_S = 32
MAX_ROWS = 32  # query rows (heads x positions) a program takes

if triton is not None:

    @triton.jit
    def _split_kv_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, lse_ptr, scale, sp_b, sp_t,
                         sq_b, sq_h, sq_t, sk_b, sk_h, sk_s, so_b, so_h, so_s, so_r, sl_b, sl_h, sl_s,
                         T: tl.constexpr, G: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
                         BLOCKS: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                         SKIP_EMPTY: tl.constexpr = False):
        b, hk, sp = tl.program_id(0), tl.program_id(1) // BLOCKS, tl.program_id(2)
        r = (tl.program_id(1) % BLOCKS) * ROWS + tl.arange(0, ROWS)  # this program's rows of the G·T
        r_ok = r < G * T
        g, t = r // T, r % T
        d = tl.arange(0, D)
        pos = tl.load(pos_ptr + b * sp_b + t * sp_t, mask=r_ok, other=-1)
        n_keys = tl.max(pos, axis=0) + 1
        chunk = tl.cdiv(tl.cdiv(n_keys, SPLITS), BLOCK_S) * BLOCK_S
        start = sp * chunk
        end = tl.minimum(start + chunk, n_keys)
        # the dots take the cache's dtype (bf16: tensor cores at full rate, products exact, fp32 accumulation;
        # p rounded to it for p·v, as flash attention does), softmax statistics and the output stay fp32
        q = tl.load(q_ptr + b * sq_b + (hk * G + g)[:, None] * sq_h + t[:, None] * sq_t + d[None, :],
                    mask=r_ok[:, None], other=0.0).to(k_ptr.dtype.element_ty)
        m_i = tl.full((ROWS,), float("-inf"), tl.float32)
        l_i = tl.zeros((ROWS,), tl.float32)
        acc = tl.zeros((ROWS, D), tl.float32)
        kv = b * sk_b + hk * sk_h
        for s0 in tl.range(start, end, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            s_ok = s < end
            k = tl.load(k_ptr + kv + s[:, None] * sk_s + d[None, :], mask=s_ok[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k)) * scale
            qk = tl.where((s[None, :] <= pos[:, None]) & s_ok[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(qk - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            v = tl.load(v_ptr + kv + s[:, None] * sk_s + d[None, :], mask=s_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), float("-inf"))
        o_ok = r_ok
        if SKIP_EMPTY:  # a split without keys stores its lse only
            o_ok = o_ok & (start < end)
        tl.store(o_ptr + b * so_b + hk * so_h + sp * so_s + r[:, None] * so_r + d[None, :], out, mask=o_ok[:, None])
        tl.store(lse_ptr + b * sl_b + hk * sl_h + sp * sl_s + r, lse, mask=r_ok)


def splits_for(batch: int, kv_heads: int) -> int:
    """Splits per (row, KV head or KV head's row block): about two waves of programs on an H200 (132 SMs),
    at most 64."""
    return max(1, min(64, 264 // (batch * kv_heads)))


def _partials_shape(q, k_cache) -> tuple[int, int, int]:
    """(splits, row blocks, rows a block) of the kernel's launch for q [B, Hq, T, D] over k_cache [B, Hkv, S, D]."""
    B, Hq, T, _ = q.shape
    Hkv = k_cache.shape[1]
    rows = min(MAX_ROWS, max(16, triton.next_power_of_2(Hq // Hkv * T)))
    blocks = triton.cdiv(Hq // Hkv * T, rows)
    return splits_for(B, Hkv * blocks), blocks, rows


def split_kv_partials(q, k_cache, v_cache, positions, scale: float, splits: int | None = None,
                      skip_empty: bool = False):
    """The kernel's per-split results for q [B, Hq, T, D] at positions [B, T] (any integer dtype and strides)
    over caches [B, Hkv, S, D]: outputs o [B, Hkv, SPLITS, R, D] and log-sum-exps lse [B, Hkv, SPLITS, R],
    fp32, with rows r = g·T + t for the G = Hq / Hkv query heads of a KV head (R ≥ G·T: rows past it are
    unwritten); splits past a row's keys have lse = -inf (and, with skip_empty, splits past all the rows' keys
    an unwritten o: for a merge that reads only splits of finite lse, merge_gated's kernel)."""
    B, Hq, T, D = q.shape
    Hkv = k_cache.shape[1]
    default_splits, blocks, rows = _partials_shape(q, k_cache)
    splits = splits or default_splits
    o = torch.empty(B, Hkv, splits, blocks * rows, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, Hkv, splits, blocks * rows, dtype=torch.float32, device=q.device)
    k, v = k_cache, v_cache
    _split_kv_kernel[(B, Hkv * blocks, splits)](
        q, k, v, positions, o, lse, scale, positions.stride(0), positions.stride(1),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        o.stride(0), o.stride(1), o.stride(2), o.stride(3), lse.stride(0), lse.stride(1), lse.stride(2),
        T=T, G=Hq // Hkv, D=D, ROWS=rows, BLOCKS=blocks, SPLITS=splits, BLOCK_S=BLOCK_S, SKIP_EMPTY=skip_empty,
        num_warps=8 if D * rows > 4096 else 4)
    return o, lse


def merge_splits(o, lse, q):
    """attend_cache's result [B, Hq, T, D] in q's dtype from split_kv_partials' o and lse: a softmax of lse
    over the splits weighs their outputs. Plain torch, so a compiled step fuses it with the output's consumer."""
    B, Hq, T, D = q.shape
    Hkv = o.shape[1]
    o, lse = o[:, :, :, : Hq // Hkv * T], lse[:, :, :, : Hq // Hkv * T]
    weight = torch.softmax(lse, dim=2)  # splits past a row's keys have lse = -inf: weight 0
    merged = (o * weight[..., None]).sum(2)  # [B, Hkv, G·T, D], rows ordered (g, t)
    return merged.view(B, Hkv, Hq // Hkv, T, D).reshape(B, Hq, T, D).to(q.dtype)


def attend_cache_split(q, k_cache, v_cache, positions, scale: float, splits: int | None = None) -> torch.Tensor:
    """attend_cache's result (q [B, Hq, T, D] at positions [B, T] over caches [B, Hkv, S, D]) from the split-KV
    kernel, reading keys 0 … max(positions[b]) of each row only. Output in q's dtype."""
    return merge_splits(*split_kv_partials(q, k_cache, v_cache, positions, scale, splits), q)


@torch.library.custom_op("fastqwen::split_kv_partials", mutates_args=())
def split_kv_partials_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                         scale: float, skip_empty: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """split_kv_partials on CUDA. Elsewhere attend_cache (the reference) as one split with lse 0, which
    merge_splits returns unchanged."""
    if q.is_cuda and triton is not None:
        return split_kv_partials(q, k_cache, v_cache, positions, scale, skip_empty=skip_empty)
    B, Hq, T, D = q.shape
    Hkv = k_cache.shape[1]
    o = attend_cache(q, k_cache, v_cache, positions, scale).float().reshape(B, Hkv, 1, Hq // Hkv * T, D)
    return o, torch.zeros(B, Hkv, 1, Hq // Hkv * T, device=q.device)


@split_kv_partials_op.register_fake
def _(q, k_cache, v_cache, positions, scale, skip_empty=False):
    B, Hq, T, D = q.shape
    Hkv = k_cache.shape[1]
    if q.device.type == "cuda" and triton is not None:
        splits, blocks, rows = _partials_shape(q, k_cache)
        R = blocks * rows
    else:
        splits, R = 1, Hq // Hkv * T
    return (q.new_empty(B, Hkv, splits, R, D, dtype=torch.float32),
            q.new_empty(B, Hkv, splits, R, dtype=torch.float32))


def attend_cache_split_op(q, k_cache, v_cache, positions, scale: float) -> torch.Tensor:
    """kernels={"attention": "split"}: the kernel as a registered op (compile and CUDA-graph safe), its splits
    merged by traced torch ops that inductor fuses into the output's consumer (merged inside the op, they were
    four eager launches a layer, and the positions' int32 copy a fifth)."""
    return merge_splits(*split_kv_partials_op(q, k_cache, v_cache, positions, scale), q)


def merge_gated(o, lse, q, gate_in) -> torch.Tensor:
    """The attention layer's output before o_proj, [B, T, Hq·D] in q's dtype: merge_splits' result times
    sigmoid(gate), gate the q | gate projection's second half of each head (gate_in [B, T, Hq·2D], or its
    split-K partials [S, B, T, Hq·2D] fp32, summed and rounded as the projection's output would be)."""
    from .attention_prep import summed

    B, Hq, T, D = q.shape
    gate = summed(gate_in, q.dtype).reshape(B, T, Hq, 2 * D)[..., D:]
    return merge_splits(o, lse, q).transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate.reshape(B, T, -1))


@torch.library.custom_op("fastqwen::merge_gated", mutates_args=())
def merge_gated_op(o: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, gate_in: torch.Tensor,
                   pdl: bool = False) -> torch.Tensor:
    """merge_gated as a registered op; on CUDA one kernel of ours (kernels={"attn_glue": "fused"}), which reads
    only the splits of finite lse (split_kv_partials' skip_empty). pdl: launched with programmatic dependent
    launch."""
    return merge_gated(o, lse, q, gate_in).contiguous()


@merge_gated_op.register_fake
def _(o, lse, q, gate_in, pdl=False):
    B, Hq, T, D = q.shape
    return q.new_empty(B, T, Hq * D)


MERGE_CHUNK = 8  # splits a step of the merge kernel's loop


if triton is not None:

    @triton.jit
    def _merge_kernel(o_ptr, lse_ptr, g_ptr, out_ptr, so_b, so_h, so_s, so_r, sl_b, sl_h, sl_s, g_split, g_row,
                      g_pos, T: tl.constexpr, G: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                      BD: tl.constexpr, SPLITS: tl.constexpr, BS: tl.constexpr, SG: tl.constexpr,
                      CHUNK: tl.constexpr, PDL: tl.constexpr):
        """Program (b·HKV + hk, r), r = g·T + t of the KV head's G·T rows: the softmax of the row's SPLITS lse
        weighs its splits' outputs (fp32; the splits of lse -inf weigh 0 and are not read), rounded to out's
        dtype, times sigmoid(gate) (the gate's SG partials summed in fp32 and rounded, its sigmoid rounded: eager's
        bf16 ops), rounded; out [B, T, HKV·G, D] contiguous."""
        bh, r = tl.program_id(0), tl.program_id(1)
        b, hk = bh // HKV, bh % HKV
        g, t = r // T, r % T
        hq = hk * G + g
        d = tl.arange(0, BD)
        d_ok = d < D
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        DTYPE: tl.constexpr = out_ptr.dtype.element_ty
        lse_row = lse_ptr + b * sl_b + hk * sl_h + r
        s = tl.arange(0, BS)
        lse = tl.load(lse_row + s * sl_s, mask=s < SPLITS, other=float("-inf"))
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        total = tl.sum(tl.exp(lse - m), 0)
        acc = tl.zeros([BD], tl.float32)
        o_row = o_ptr + b * so_b + hk * so_h + r * so_r
        for s0 in tl.static_range(0, SPLITS, CHUNK):
            sc = s0 + tl.arange(0, CHUNK)
            lc = tl.load(lse_row + sc * sl_s, mask=sc < SPLITS, other=float("-inf"))
            live = lc > float("-inf")
            oc = tl.load(o_row + sc[:, None] * so_s + d[None, :], mask=live[:, None] & d_ok[None, :], other=0.0)
            acc += tl.sum(oc * (tl.exp(lc - m) / total)[:, None], 0)
        gate = g_ptr + b * g_row + t * g_pos + hq * 2 * D + D + d
        gv = tl.load(gate, mask=d_ok, other=0.0).to(tl.float32)
        for p in tl.static_range(1, SG):
            gv += tl.load(gate + p * g_split, mask=d_ok, other=0.0).to(tl.float32)
        gv = gv.to(DTYPE).to(tl.float32)
        sg = (1.0 / (1.0 + tl.exp(-gv))).to(DTYPE).to(tl.float32)
        y = (acc.to(DTYPE).to(tl.float32) * sg).to(DTYPE)
        tl.store(out_ptr + ((b * T + t) * HKV * G + hq) * D + d, y, mask=d_ok)


@merge_gated_op.register_kernel("cuda")
def _merge_gated_cuda(o, lse, q, gate_in, pdl=False):
    B, Hq, T, D = q.shape
    Hkv, splits = o.shape[1], o.shape[2]
    if triton is None or o.stride(-1) != 1 or gate_in.stride(-1) != 1:
        return merge_gated(o, lse, q, gate_in).contiguous()
    parts = gate_in if gate_in.dim() == 4 else gate_in[None]
    out = q.new_empty(B, T, Hq * D)
    _merge_kernel[(B * Hkv, Hq // Hkv * T)](
        o, lse, parts, out, o.stride(0), o.stride(1), o.stride(2), o.stride(3), lse.stride(0), lse.stride(1),
        lse.stride(2), parts.stride(0), parts.stride(1), parts.stride(2), T=T, G=Hq // Hkv, HKV=Hkv, D=D,
        BD=triton.next_power_of_2(D), SPLITS=splits, BS=triton.next_power_of_2(splits), SG=parts.shape[0],
        CHUNK=MERGE_CHUNK, PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out
