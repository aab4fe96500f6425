"""The gated delta rule of Qwen3.5's Gated DeltaNet layers.

Shapes: q, k [B, T, H, K]; v [B, T, HV, V] with HV a multiple of H (key head i serves value heads
i·r … i·r+r-1, r = HV/H); a, b [B, T, HV] are the raw `in_proj_a` / `in_proj_b` outputs; A_log, dt_bias [HV];
state [B, HV, K, V] fp32. Per value head, in fp32, with q and k l2-normalised and q scaled by K^-1/2:

    g = -exp(A_log)·softplus(a + dt_bias);  beta = sigmoid(b)
    S = S·exp(g_t);  u_t = beta_t·(v_t − Sᵀk_t);  S = S + k_t u_tᵀ;  o_t = Sᵀq_t

Both ops return o [B, T, HV, V] in v.dtype and leave the final S in `state` (in place). `gdn_recurrent` is the
decode/verify op (small T), `gdn_chunk` the prefill op. On CUDA they run flash-linear-attention's Triton
kernels; everywhere else, and as the reference in tests, `gdn_reference`. Both are registered custom ops
(mutating `state`), so a compiled step keeps `fullgraph=True` and its CUDA graph.
"""

import torch
import torch.nn.functional as F

from .norm import l2norm


def gdn_reference(q, k, v, a, b, A_log, dt_bias, state):
    """Token-by-token fp32 recurrence; the definition the fast paths are tested against."""
    _, seq, heads, dk = q.shape
    rep = v.shape[2] // heads
    qf = l2norm(q.float()).repeat_interleave(rep, dim=2) * dk**-0.5
    kf = l2norm(k.float()).repeat_interleave(rep, dim=2)
    vf = v.float()
    beta = b.float().sigmoid()
    decay = (-A_log.float().exp() * F.softplus(a.float() + dt_bias.float())).exp()
    s = state.clone()
    out = []
    for t in range(seq):
        s = s * decay[:, t, :, None, None]
        k_t = kf[:, t, :, :, None]  # [B, HV, K, 1]
        u = (vf[:, t] - (s * k_t).sum(-2)) * beta[:, t, :, None]  # [B, HV, V]
        s = s + k_t * u[:, :, None, :]
        out.append((s * qf[:, t, :, :, None]).sum(-2))
    state.copy_(s)
    if not out:
        return torch.empty_like(v)
    return torch.stack(out, dim=1).to(v.dtype)


@torch.library.custom_op("fastqwen::gdn_recurrent", mutates_args=("state",))
def gdn_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
) -> torch.Tensor:
    """Recurrent gated delta rule for small T (decode, verify); updates `state` in place."""
    return gdn_reference(q, k, v, a, b, A_log, dt_bias, state)


@gdn_recurrent.register_kernel("cuda")
def _gdn_recurrent_cuda(q, k, v, a, b, A_log, dt_bias, state):
    # fla's fused recurrent kernel, called directly so the final state is written over the initial one:
    # each program loads its [K, BV] tile of h0 before the time loop and stores the same tile at the end,
    # so h0 and ht may alias. The gate (A_log, dt_bias, softplus), beta's sigmoid and the q/k l2norm all
    # run inside the kernel.
    import triton
    from fla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_fwd_kernel as kernel

    batch, seq, heads, dk = q.shape
    vheads, dv = v.shape[2], v.shape[3]
    q, k, v, a, b = (t.contiguous() for t in (q, k, v, a, b))
    out = torch.empty_like(v)
    block_v = min(8, triton.next_power_of_2(dv))
    grid = (triton.cdiv(dv, block_v) * batch * vheads,)
    kernel[grid](
        q=q, k=k, v=v, g=a, gk=None, gv=None, beta=b, A_log=A_log, dt_bias=dt_bias, o=out,
        h0=state, ht=state, cu_seqlens=None, scale=dk**-0.5, T=seq, H=heads, HV=vheads, K=dk, V=dv,
        BK=triton.next_power_of_2(dk), BV=block_v, IS_BETA_HEADWISE=True, USE_QK_L2NORM_IN_KERNEL=True,
        APPLY_BETA_SIGMOID=True, ALLOW_NEG_EIGVAL=False, STATE_V_FIRST=False, num_warps=1, num_stages=3,
    )
    return out


@gdn_recurrent.register_fake
def _(q, k, v, a, b, A_log, dt_bias, state):
    return torch.empty_like(v)


@torch.library.custom_op("fastqwen::gdn_chunk", mutates_args=("state",))
def gdn_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
) -> torch.Tensor:
    """Chunked gated delta rule for long T (prefill); updates `state` in place."""
    return gdn_reference(q, k, v, a, b, A_log, dt_bias, state)


@gdn_chunk.register_kernel("cuda")
def _gdn_chunk_cuda(q, k, v, a, b, A_log, dt_bias, state):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    out, final = chunk_gated_delta_rule(
        q.contiguous(), k.contiguous(), v.contiguous(), g=g, beta=b.sigmoid().contiguous(),
        initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    state.copy_(final)
    return out


@gdn_chunk.register_fake
def _(q, k, v, a, b, A_log, dt_bias, state):
    return torch.empty_like(v)
