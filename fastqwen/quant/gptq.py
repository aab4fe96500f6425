"""GPTQ and AWQ int4 checkpoints → our int4 layout (formats.py), exactly; and our int4 layout → GPTQ (to_gptq).

GPTQ (`quant_method: gptq`): qweight int32 [K/8, N] packs 8 input rows per int32 (row k in bits 4·(k % 8));
qzeros int32 [G, N/8] packs 8 output columns per int32; scales [G, N]; g_idx [K] the group of each input
column (not monotonic with act-order, `desc_act`). The original "gptq" checkpoint format stores zero − 1
("gptq_v2" stores the zero). w[n, k] = scales[g, n] · (q[k, n] − zero[g, n]) with g = g_idx[k].
AWQ (`quant_method: awq`, GEMM): qweight int32 [K, N/8] and qzeros [G, N/8] pack 8 output columns per int32
in the order 0 2 4 6 1 3 5 7; groups are consecutive input columns; zeros stored as is.
Act-order columns are sorted by group, so our groups are contiguous and `perm` records the original columns.
"""

import torch

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column 8c + _AWQ_ORDER[i]


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., M] → uint8 [..., M, 8], nibble i of each word."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return ((packed[..., None] >> shifts) & 0xF).to(torch.uint8)


def from_gptq(qweight, qzeros, scales, g_idx, *, group: int, zero_offset: int = 1):
    """(codes [N, K], scale [N, K/g], zero [N, K/g], perm [K] or None) from GPTQ tensors."""
    K = qweight.shape[0] * 8
    q = _nibbles(qweight).permute(0, 2, 1).reshape(K, -1)  # [K, N]
    zeros = _nibbles(qzeros).reshape(qzeros.shape[0], -1).float() + zero_offset  # [G, N]
    if K % group or scales.shape[0] != K // group:
        raise ValueError(f"GPTQ layer with K={K}, {scales.shape[0]} groups does not match group_size={group}")
    perm = group_order(g_idx, K, group)
    codes = (q if perm is None else q[perm]).t().contiguous()
    return codes, scales.float().t().contiguous(), zeros.t().contiguous(), perm


def group_order(g_idx: torch.Tensor, K: int, group: int) -> torch.Tensor | None:
    """The column order [K] that makes act-order groups contiguous (g_idx [K]: each column's group), None when
    they already are; a ValueError unless every group has `group` columns."""
    g_idx = g_idx.long()
    perm = torch.argsort(g_idx, stable=True)
    if g_idx.shape != (K,) or not torch.equal(g_idx[perm], torch.arange(K, device=g_idx.device) // group):
        raise ValueError("g_idx does not assign group_size columns to every group; cannot convert exactly")
    return None if torch.equal(perm, torch.arange(K, device=perm.device)) else perm


def from_awq(qweight, qzeros, scales, *, group: int):
    """(codes [N, K], scale [N, K/g], zero [N, K/g], None) from AWQ GEMM tensors."""
    order = torch.tensor(_AWQ_ORDER, device=qweight.device)
    unorder = torch.argsort(order)

    def columns(packed):  # [R, N/8] → [R, N] in column order
        return _nibbles(packed)[..., unorder].reshape(packed.shape[0], -1)

    codes = columns(qweight).t().contiguous()
    if codes.shape[1] % group or scales.shape[0] != codes.shape[1] // group:
        raise ValueError(f"AWQ layer with K={codes.shape[1]}, {scales.shape[0]} groups does not match group_size={group}")
    return codes, scales.float().t().contiguous(), columns(qzeros).float().t().contiguous(), None


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., M, 8] (0…15) → int32 [..., M], nibble i of each word from codes[..., i] (_nibbles' inverse)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=codes.device)
    return (codes.to(torch.int32) << shifts).sum(-1, dtype=torch.int32)


def to_gptq(codes, scale, zero, perm, *, group: int, zero_offset: int = 1) -> dict:
    """GPTQ tensors {qweight [K/8, N], qzeros [G, N/8] int32, scales [G, N] fp16, g_idx [K] int32} of codes
    [N, K] (in stored column order: original column perm[j] at j, or in order where perm is None), scale and
    zero [N, K/group]; from_gptq's exact inverse. zero_offset 1 (the "gptq" format) stores zero − 1, so every zero
    must be 1…16; 0 ("gptq_v2") stores the zero, 0…15. N and K multiples of 8."""
    N, K = codes.shape
    stored = zero.round().to(torch.int32) - zero_offset
    if N % 8 or K % 8 or stored.min() < 0 or stored.max() > 15:
        raise ValueError(f"GPTQ packs 8 codes an int32 and stores zero − {zero_offset} in 4 bits: N={N} and K={K} must "
                         f"be multiples of 8 and zeros {zero_offset}…{15 + zero_offset}; got zeros "
                         f"{zero.min().item():g}…{zero.max().item():g}")
    order = torch.arange(K, device=codes.device) if perm is None else perm.long()
    q = torch.empty_like(codes).index_copy_(1, order, codes).t()  # [K, N], original column order
    g_idx = torch.empty(K, dtype=torch.int32, device=codes.device).index_copy_(
        0, order, (torch.arange(K, device=codes.device) // group).to(torch.int32))
    return {"qweight": _pack_nibbles(q.reshape(K // 8, 8, N).transpose(1, 2)),
            "qzeros": _pack_nibbles(stored.t().reshape(K // group, N // 8, 8)),
            "scales": scale.t().to(torch.float16).contiguous(), "g_idx": g_idx}
