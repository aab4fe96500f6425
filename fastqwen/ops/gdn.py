"""The gated delta rule of Qwen3.5's Gated DeltaNet layers.

Shapes: q, k [B, T, H, K]; v [B, T, HV, V] with HV a multiple of H (key head i serves value heads
i·r … i·r+r-1, r = HV/H); a, b [B, T, HV] are the raw `in_proj_a` / `in_proj_b` outputs; A_log, dt_bias [HV];
state [B, HV, K, V] fp32. Per value head, in fp32, with q and k l2-normalised and q scaled by K^-1/2:

    g = -exp(A_log)·softplus(a + dt_bias);  beta = sigmoid(b)
    S = S·exp(g_t);  u_t = beta_t·(v_t − Sᵀk_t);  S = S + k_t u_tᵀ;  o_t = Sᵀq_t

`gdn_recurrent` (decode, small T) and `gdn_chunk` (prefill) return o [B, T, HV, V] in v.dtype and leave the
final S in `state` (in place). Speculative decoding splits that in two: `gdn_verify` returns the block's
outputs and leaves the checkpoint state untouched; `gdn_replay` then advances the state over the accepted
positions only (g = beta = 0 elsewhere, which leaves S unchanged), so shapes stay fixed. On CUDA they run
flash-linear-attention's Triton kernels or ours: the walk with its time loop unrolled (`_unrolled_kernel`:
decode, short verifies, the replay) and the block solve (`_block_kernel`: verifies of BLOCK_MIN_T positions
or more); everywhere else, and as the reference in tests, `gdn_reference`. All are registered custom ops
(mutating `state`), so a compiled step keeps `fullgraph=True` and its CUDA graph.
"""

import torch
import torch.nn.functional as F

from .norm import gated_rms_norm, l2norm


def gates(a, b, A_log, dt_bias):
    """(g, beta) [B, T, HV] fp32 from the raw projections: g = -exp(A_log)·softplus(a + dt_bias), beta = sigmoid(b)."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias.float()), b.float().sigmoid()


def recurrence(q, k, v, g, beta, state):
    """The fp32 recurrence with explicit log-decay g and beta [B, T, HV]; q, k are normalised in here.

    Updates `state` in place; returns o [B, T, HV, V] in v.dtype. A position with g = 0 and beta = 0 leaves
    the state unchanged, which is what speculative commit uses to replay only accepted positions.
    """
    _, seq, heads, dk = k.shape
    rep = v.shape[2] // heads
    qf = l2norm(q.float()).repeat_interleave(rep, dim=2) * dk**-0.5
    kf = l2norm(k.float()).repeat_interleave(rep, dim=2)
    vf = v.float()
    decay, beta = g.float().exp(), beta.float()
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
        return _output_like(v)
    return torch.stack(out, dim=1).to(v.dtype)


def _output_like(v):
    """The ops' output: contiguous, shaped and typed as v (which may be a strided view)."""
    return torch.empty(v.shape, dtype=v.dtype, device=v.device)


def gdn_reference(q, k, v, a, b, A_log, dt_bias, state):
    """Token-by-token fp32 recurrence from the raw projections; the definition the fast paths are tested against."""
    return recurrence(q, k, v, *gates(a, b, A_log, dt_bias), state)


def _fla_recurrent(q, k, v, g, beta, state, final_state, gate_in_kernel, A_log=None, dt_bias=None, block_v=8,
                   warps=1):
    """fla's fused recurrent kernel, called directly. h0 = state; the final state goes to `final_state`
    (None: not written; `state` itself: in place, safe because each program loads its [K, BV] tile of h0
    before the time loop and stores the same tile at the end). With gate_in_kernel, g and beta are the raw
    a and b and the kernel applies A_log/dt_bias/softplus and the sigmoid; q and k are l2-normalised inside.
    A program owns a [K, block_v] tile of one head's state and walks T serially."""
    import triton
    from fla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_fwd_kernel as kernel

    batch, seq, heads, dk = k.shape
    vheads, dv = v.shape[2], v.shape[3]
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    out = _output_like(v)
    block_v = min(block_v, triton.next_power_of_2(dv))
    grid = (triton.cdiv(dv, block_v) * batch * vheads,)
    kernel[grid](
        q=q, k=k, v=v, g=g, gk=None, gv=None, beta=beta, A_log=A_log, dt_bias=dt_bias, o=out,
        h0=state, ht=final_state, cu_seqlens=None, scale=dk**-0.5, T=seq, H=heads, HV=vheads, K=dk, V=dv,
        BK=triton.next_power_of_2(dk), BV=block_v, IS_BETA_HEADWISE=True, USE_QK_L2NORM_IN_KERNEL=True,
        APPLY_BETA_SIGMOID=gate_in_kernel, ALLOW_NEG_EIGVAL=False, STATE_V_FIRST=False, num_warps=warps,
        num_stages=3,
    )
    return out


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the ops run the reference
    triton = None

if triton is not None:

    @triton.jit
    def _unrolled_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, h0_ptr, ht_ptr, o_ptr, scale,
                         q_row, q_pos, k_row, k_pos, v_row, v_pos, a_row, a_pos, b_row, b_pos, T: tl.constexpr,
                         TP: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         BV: tl.constexpr, GATE_IN: tl.constexpr, WRITE_O: tl.constexpr, WRITE_STATE: tl.constexpr,
                         PDL: tl.constexpr, z_ptr=None, z_row=0, z_pos=0, nw_ptr=None, eps=0.0, cnt_ptr=None,
                         NORM: tl.constexpr = False, ROUND_W: tl.constexpr = False, a_split=0, b_split=0,
                         S_AB: tl.constexpr = 1, ROUND_AB: tl.constexpr = False):
        """The recurrence over T positions with the time loop unrolled (T is a compile-time constant), so the
        loads of every position, which do not depend on the state, can be issued ahead of the serial state
        updates. Nothing is stored inside the loop (a store there could alias the next position's loads and pin
        them behind it): the outputs gather in a [TP, BV] tile (TP = T rounded up to a power of 2) stored once.
        A program owns a [K, BV] tile of one (row, value head)'s state. q, k [B, T, H, K], v [B, T, HV, V] and
        a, b [B, T, HV] have each position's heads (and dims) contiguous, at any row and position strides
        (x_row, x_pos): views of the conv's packed output and of a fused projection's output need no copy. GATE_IN: a, b are the raw projections
        (g = -exp(A_log)·softplus(a + dt_bias), beta = sigmoid(b)); else they are g and beta. PDL (launched with
        programmatic dependent launch): the state tile and the gate parameters, which the previous kernel in the
        stream does not write, load before waiting for it; q, k, v, a, b after. NORM (with WRITE_O): the GDN
        block's gated RMSNorm too, o ← (w·ô)·silu(z) per (row, position, head) over all V: the last of a head's
        V/BV programs to store its tile (an acquire-release count at cnt_ptr[row·HV + hv], set back to 0 after)
        normalises the head's whole output in place, as _gated_norm_tail; ROUND_W: w is 16-bit, so w·ô rounds
        to o's dtype before the gate, as gated_rms_norm computes it. S_AB > 1 or ROUND_AB: a and b are a
        projection's split-K partials (S_AB of them, a_split / b_split apart), summed here in fp32 and (ROUND_AB)
        rounded to q's dtype, as the projection's output would have been: no launch to materialise them."""
        i_v, i_bh = tl.program_id(0), tl.program_id(1)
        row, hv = i_bh // HV, i_bh % HV
        h = hv // (HV // H)
        ok = tl.arange(0, K)
        ov = i_v * BV + tl.arange(0, BV)
        tile = (i_bh * K + ok[:, None]) * V + ov[None, :]
        S = tl.load(h0_ptr + tile)
        if GATE_IN:
            A = -tl.exp(tl.load(A_log_ptr + hv).to(tl.float32))
            dt_bias = tl.load(dt_bias_ptr + hv).to(tl.float32)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        ot = tl.arange(0, TP)
        O = tl.zeros((TP, BV), tl.float32)
        for t in tl.static_range(T):
            kt = tl.load(k_ptr + row * k_row + t * k_pos + h * K + ok).to(tl.float32)
            kt = kt / tl.sqrt(tl.sum(kt * kt) + 1e-6)
            vt = tl.load(v_ptr + row * v_row + t * v_pos + hv * V + ov).to(tl.float32)
            at = tl.load(a_ptr + row * a_row + t * a_pos + hv).to(tl.float32)
            bt = tl.load(b_ptr + row * b_row + t * b_pos + hv).to(tl.float32)
            for s in tl.static_range(1, S_AB):
                at += tl.load(a_ptr + s * a_split + row * a_row + t * a_pos + hv).to(tl.float32)
                bt += tl.load(b_ptr + s * b_split + row * b_row + t * b_pos + hv).to(tl.float32)
            if ROUND_AB:
                at = at.to(q_ptr.dtype.element_ty).to(tl.float32)
                bt = bt.to(q_ptr.dtype.element_ty).to(tl.float32)
            if GATE_IN:
                x = at + dt_bias
                at = A * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
                bt = 1.0 / (1.0 + tl.exp(-bt))
            S = S * tl.exp(at)
            u = (vt - tl.sum(S * kt[:, None], 0)) * bt
            S = S + kt[:, None] * u[None, :]
            if WRITE_O:
                qt = tl.load(q_ptr + row * q_row + t * q_pos + h * K + ok).to(tl.float32)
                qt = qt / tl.sqrt(tl.sum(qt * qt) + 1e-6) * scale
                O = tl.where(ot[:, None] == t, tl.sum(S * qt[:, None], 0)[None, :], O)
        if WRITE_O:
            out = (((row * T + ot) * HV + hv) * V)[:, None] + ov[None, :]
            tl.store(o_ptr + out, O.to(o_ptr.dtype.element_ty), mask=(ot < T)[:, None])
        if WRITE_STATE:
            tl.store(ht_ptr + tile, S)
        if NORM:
            _gated_norm_tail(o_ptr, z_ptr, nw_ptr, cnt_ptr, row, hv, z_row, z_pos, eps, T, TP, HV, V, ROUND_W)

    @triton.jit
    def _gated_norm_tail(o_ptr, z_ptr, nw_ptr, cnt_ptr, row, hv, z_row, z_pos, eps, T: tl.constexpr,
                         TP: tl.constexpr, HV: tl.constexpr, V: tl.constexpr, ROUND_W: tl.constexpr):
        """After a program stored its columns of o [B, T, HV, V]: it counts itself in on its (row, head); the
        last of the head's programs (grid dim 0) reads the head's V outputs back from L2 (.cg: other SMs wrote
        them) and overwrites them with gated_rms_norm's (w·ô in o's dtype)·silu(z), ô = o/rms(o) in fp32 from
        o as stored; then sets the count back to 0 for the next launch."""
        tl.debug_barrier()  # every thread's part of the tile stored before the count
        slot = row * HV + hv
        arrived = tl.atomic_add(cnt_ptr + slot, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(0) - 1:
            ot = tl.arange(0, TP)
            oc = tl.arange(0, V)
            ok = (ot < T)[:, None]
            at = (((row * T + ot) * HV + hv) * V)[:, None] + oc[None, :]
            x = tl.load(o_ptr + at, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            xh = x / tl.sqrt(tl.sum(x * x, 1) / V + eps)[:, None]
            y = tl.load(nw_ptr + oc).to(tl.float32)[None, :] * xh.to(o_ptr.dtype.element_ty).to(tl.float32)
            if ROUND_W:
                y = y.to(o_ptr.dtype.element_ty).to(tl.float32)
            zt = tl.load(z_ptr + row * z_row + ot[:, None] * z_pos + hv * V + oc[None, :], mask=ok,
                         other=0.0).to(tl.float32)
            tl.store(o_ptr + at, (y * zt / (1.0 + tl.exp(-zt))).to(o_ptr.dtype.element_ty), mask=ok)
            tl.atomic_xchg(cnt_ptr + slot, 0)


    @triton.jit
    def _block_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, h0_ptr, o_ptr, scale,
                      q_row, q_pos, k_row, k_pos, v_row, v_pos, a_row, a_pos, b_row, b_pos, T: tl.constexpr,
                      TP: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      BV: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
        """A verify block's outputs with no walk over the state: the block solved at once (the WY form of one
        chunk). With D_t = exp(g_1 + … + g_t), the recurrence unrolls to
            u_t = beta_t·(v_t − D_t·S0ᵀk_t − Σ_{s<t} (D_t/D_s)(k_s·k_t)·u_s),
            o_t = D_t·S0ᵀq_t + Σ_{s≤t} (D_t/D_s)(q_t·k_s)·u_s,
        so S0ᵀk, S0ᵀq and the Gram matrices k·kᵀ, q·kᵀ are dots accumulated over K in steps of BK (of the raw
        q, k: their l2 norms come from the same steps and scale the products after; tf32x3, fp32-accurate on
        tensor cores), and the only serial part is a forward substitution over the TP rows of the [TP, BV]
        tile of u, each step one rank-1 update. Inputs as in _unrolled_kernel (raw gates); rows t ≥ T are zero
        (beta = 0) and change nothing before them. The state is only read. A program owns one (row, value
        head) and BV columns of its state."""
        i_v, i_bh = tl.program_id(0), tl.program_id(1)
        row, hv = i_bh // HV, i_bh % HV
        h = hv // (HV // H)
        ov = i_v * BV + tl.arange(0, BV)
        ot = tl.arange(0, TP)
        t_ok = ot < T
        A = -tl.exp(tl.load(A_log_ptr + hv).to(tl.float32))
        dt_bias = tl.load(dt_bias_ptr + hv).to(tl.float32)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        kk = tl.zeros((TP, TP), tl.float32)  # k·kᵀ, q·kᵀ, kᵀS0, qᵀS0 of the raw q, k; their squared norms
        qk = tl.zeros((TP, TP), tl.float32)
        ks = tl.zeros((TP, BV), tl.float32)
        qs = tl.zeros((TP, BV), tl.float32)
        nk = tl.zeros((TP,), tl.float32)
        nq = tl.zeros((TP,), tl.float32)
        for k0 in tl.range(0, K, BK, num_stages=STAGES):
            oc = k0 + tl.arange(0, BK)
            kc = tl.load(k_ptr + row * k_row + ot[:, None] * k_pos + h * K + oc[None, :], mask=t_ok[:, None],
                         other=0.0).to(tl.float32)
            qc = tl.load(q_ptr + row * q_row + ot[:, None] * q_pos + h * K + oc[None, :], mask=t_ok[:, None],
                         other=0.0).to(tl.float32)
            sc = tl.load(h0_ptr + (i_bh * K + oc[:, None]) * V + ov[None, :])
            kk += tl.dot(kc, tl.trans(kc), input_precision="tf32x3")
            qk += tl.dot(qc, tl.trans(kc), input_precision="tf32x3")
            ks += tl.dot(kc, sc, input_precision="tf32x3")
            qs += tl.dot(qc, sc, input_precision="tf32x3")
            nk += tl.sum(kc * kc, 1)
            nq += tl.sum(qc * qc, 1)
        rk = 1.0 / tl.sqrt(nk + 1e-6)  # l2norm's 1 / ‖k‖
        rq = scale / tl.sqrt(nq + 1e-6)
        vv = tl.load(v_ptr + row * v_row + ot[:, None] * v_pos + hv * V + ov[None, :], mask=t_ok[:, None],
                     other=0.0).to(tl.float32)
        x = tl.load(a_ptr + row * a_row + ot * a_pos + hv, mask=t_ok, other=0.0).to(tl.float32) + dt_bias
        g = tl.where(t_ok, A * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0)))), 0.0)
        bt = tl.load(b_ptr + row * b_row + ot * b_pos + hv, mask=t_ok, other=0.0).to(tl.float32)
        beta = tl.where(t_ok, 1.0 / (1.0 + tl.exp(-bt)), 0.0)
        gam = tl.cumsum(g, 0)  # log D_t
        upto = ot[:, None] >= ot[None, :]  # s ≤ t
        decay = tl.exp(tl.where(upto, gam[:, None] - gam[None, :], -float("inf")))  # D_t / D_s, 0 for s > t
        d = tl.exp(gam)
        r = beta[:, None] * (vv - (d * rk)[:, None] * ks)
        c = tl.where(ot[:, None] > ot[None, :], kk * decay * rk[:, None] * rk[None, :], 0.0) * beta[:, None]
        for s in tl.static_range(T - 1):  # u_s is final: take it out of the later rows
            u_s = tl.sum(tl.where(ot[:, None] == s, r, 0.0), 0)
            c_s = tl.sum(tl.where(ot[None, :] == s, c, 0.0), 1)
            r = r - c_s[:, None] * u_s[None, :]
        m = qk * decay * rq[:, None] * rk[None, :]
        o = (d * rq)[:, None] * qs + tl.dot(m, r, input_precision="tf32x3")
        out = (((row * T + ot) * HV + hv) * V)[:, None] + ov[None, :]
        tl.store(o_ptr + out, o.to(o_ptr.dtype.element_ty), mask=t_ok[:, None])


UNROLLED_MAX_T = 64  # longer blocks (prefill) keep fla's kernels


def _row_pos_strides(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(t, row stride, position stride) of t [B, T, heads(, dim)] as the unrolled kernel reads it: each
    position's heads (and dims) contiguous, rows and positions at any stride. Views of a fused projection's
    output (a verify block's a and b: positions 16480 apart on 27B) and of the conv's packed output (q, k, v)
    are read in place; other layouts are copied first."""
    if t.numel() and not t[0, 0].is_contiguous():
        t = t.contiguous()
    return t, t.stride(0), t.stride(1)


def _unrolled(q, k, v, a, b, state, final_state, gate_in, A_log=None, dt_bias=None, write_o=True, block_v=8,
              pdl=False, warps=None, norm=None):
    """_unrolled_kernel (same contract as _fla_recurrent; q, k, v, a and b read in place where each position's
    heads are contiguous: _row_pos_strides); returns o (or None). norm = (z [B, T, HV·V], weight [V], eps): o
    comes out through the gated RMSNorm (NORM; z read in place at any row and position stride). A [K, 8]
    state tile takes one warp, so the walk's reductions over K are warp shuffles with no barrier (16 columns
    took 2 warps and ~140 barriers at T = 16, sm90 SASS); fla's replay found (8, 1) its best tile too. warps:
    num_warps (default one per 8 columns); scripts/bench_gdn.py times other tiles."""
    batch, seq, heads, dk = k.shape
    vheads, dv = v.shape[2], v.shape[3]
    (q, q_row, q_pos), (k, k_row, k_pos), (v, v_row, v_pos) = (_row_pos_strides(t) for t in (q, k, v))
    partials = {}
    if a.dim() == k.dim():  # [S, B, T, HV] split-K partials of the projection (gdn_decode's contract)
        partials = dict(a_split=a.stride(0), b_split=b.stride(0), S_AB=a.shape[0], ROUND_AB=True)
        assert a[0, 0, 0].is_contiguous() and b[0, 0, 0].is_contiguous() and b.shape[0] == a.shape[0]
        (a, a_row, a_pos), (b, b_row, b_pos) = (a, a.stride(1), a.stride(2)), (b, b.stride(1), b.stride(2))
    else:
        (a, a_row, a_pos), (b, b_row, b_pos) = _row_pos_strides(a), _row_pos_strides(b)
    out = _output_like(v) if write_o else None
    block_v = min(block_v, dv)
    dummy = state  # pointers the kernel does not read under its flags
    fused = {}
    if norm is not None:
        from .gemv import tile_counts

        z, weight, eps = norm
        z, z_row, z_pos = _row_pos_strides(z)
        fused = dict(z_ptr=z, z_row=z_row, z_pos=z_pos, nw_ptr=weight, eps=eps,
                     cnt_ptr=tile_counts(state.device, batch * vheads), NORM=True,
                     ROUND_W=weight.dtype in (torch.bfloat16, torch.float16))
    _unrolled_kernel[(triton.cdiv(dv, block_v), batch * vheads)](
        q, k, v, a, b, dummy if A_log is None else A_log, dummy if dt_bias is None else dt_bias, state,
        dummy if final_state is None else final_state, dummy if out is None else out, dk**-0.5,
        q_row, q_pos, k_row, k_pos, v_row, v_pos, a_row, a_pos, b_row, b_pos, T=seq, TP=triton.next_power_of_2(seq),
        H=heads, HV=vheads, K=dk, V=dv, BV=block_v, GATE_IN=gate_in, WRITE_O=write_o,
        WRITE_STATE=final_state is not None, PDL=pdl, num_warps=warps or max(1, block_v // 8), launch_pdl=pdl,
        **fused, **partials)
    return out


def _block(q, k, v, a, b, state, A_log, dt_bias, block_v=16, warps=1, pdl=False, block_k=16, stages=2):
    """_block_kernel: a verify block's outputs o [B, T, HV, V] from the checkpoint `state` (only read), raw
    gates a, b; q, k, v, a, b read in place as by _unrolled. Tiles of at least 16 rows and columns (the dots'
    least): block_v columns of the state, K in steps of block_k (a loop of `stages` pipeline stages), on `warps`
    warps; scripts/bench_gdn.py times them."""
    batch, seq, heads, dk = k.shape
    vheads, dv = v.shape[2], v.shape[3]
    (q, q_row, q_pos), (k, k_row, k_pos), (v, v_row, v_pos) = (_row_pos_strides(t) for t in (q, k, v))
    (a, a_row, a_pos), (b, b_row, b_pos) = _row_pos_strides(a), _row_pos_strides(b)
    out = _output_like(v)
    block_v = min(block_v, dv)
    _block_kernel[(triton.cdiv(dv, block_v), batch * vheads)](
        q, k, v, a, b, A_log, dt_bias, state, out, dk**-0.5, q_row, q_pos, k_row, k_pos, v_row, v_pos, a_row, a_pos,
        b_row, b_pos, T=seq, TP=max(16, triton.next_power_of_2(seq)), H=heads, HV=vheads, K=dk, V=dv, BV=block_v,
        BK=min(block_k, dk), STAGES=stages, PDL=pdl, num_warps=warps, launch_pdl=pdl)
    return out


@torch.library.custom_op("fastqwen::gdn_recurrent", mutates_args=("state",))
def gdn_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, unrolled: bool = False, pdl: bool = False,
) -> torch.Tensor:
    """Recurrent gated delta rule for small T (decode, verify); updates `state` in place. unrolled: on CUDA,
    our unrolled kernel instead of fla's (kernels={"gdn": "unrolled"}); pdl: it with programmatic dependent
    launch (kernels={"launch": "pdl"}; fla's kernel has no wait for it, so it launches as before)."""
    return gdn_reference(q, k, v, a, b, A_log, dt_bias, state)


@gdn_recurrent.register_kernel("cuda")
def _gdn_recurrent_cuda(q, k, v, a, b, A_log, dt_bias, state, unrolled=False, pdl=False):
    if unrolled and k.shape[1] <= UNROLLED_MAX_T:
        return _unrolled(q, k, v, a, b, state, state, gate_in=True, A_log=A_log, dt_bias=dt_bias, pdl=pdl)
    return _fla_recurrent(q, k, v, a, b, state, state, gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)


@gdn_recurrent.register_fake
def _(q, k, v, a, b, A_log, dt_bias, state, unrolled=False, pdl=False):
    return _output_like(v)


def unpack_qkv(qkv: torch.Tensor, heads_k: int, dk: int, heads_v: int):
    """q, k [B, T, Hk, Dk] and v [B, T, Hv, Dv]: views of the conv's packed output qkv [B, T, 2·Hk·Dk + Hv·Dv]
    (contiguous when B = T = 1)."""
    B, T, _ = qkv.shape
    q, k, v = torch.split(qkv, [heads_k * dk, heads_k * dk, qkv.shape[-1] - 2 * heads_k * dk], dim=-1)
    return q.reshape(B, T, heads_k, dk), k.reshape(B, T, heads_k, dk), v.reshape(B, T, heads_v, -1)


@torch.library.custom_op("fastqwen::gdn_decode", mutates_args=("state",))
def gdn_decode(qkv: torch.Tensor, heads_k: int, dk: int, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
               dt_bias: torch.Tensor, state: torch.Tensor, unrolled: bool = False, pdl: bool = False,
               z: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
               eps: float = 0.0) -> torch.Tensor:
    """gdn_recurrent from the conv's packed output qkv [B, T, 2·Hk·Dk + Hv·Dv] (a, b [B, T, Hv]); returns o
    [B, T, Hv, Dv]. With the split inside the op, a compiled step writes the conv's output as one buffer, where
    handing the op q, k and v had inductor write three (three launches a GDN layer on CUDA). The unrolled
    kernel reads the views in place at any B; fla's only at B = T = 1, where they are contiguous (else the op
    copies them). The packed decode kernels of vLLM and SGLang take the same input. With z [B, T, Hv·Dv] and
    norm_weight [Dv], o comes out through the block's gated RMSNorm, norm.gated_rms_norm(o, z, norm_weight,
    eps): in the unrolled kernel's last program of each head (kernels={"gdn_norm": "fused"}; a launch less a
    GDN layer), where Dv is a power of 2; after the kernel otherwise. a and b may also come as the input
    projection's split-K partials [S, B, T, Hv] fp32 (ops/gemv.py wq_linear; the heads contiguous, views at any
    stride): the op sums them and rounds the sums to qkv's dtype, as the projection's output would be, the
    unrolled kernel as it loads them, so a compiled step launches nothing to materialise a and b (two launches
    a GDN layer)."""
    a, b = _summed(a, qkv), _summed(b, qkv)
    o = gdn_reference(*unpack_qkv(qkv, heads_k, dk, a.shape[-1]), a, b, A_log, dt_bias, state)
    return o if z is None else gated_rms_norm(o, z.reshape(o.shape), norm_weight, eps)


def _summed(x: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
    """a or b as gdn_decode reads it: split-K partials [S, B, T, Hv] summed (fp32) and rounded to qkv's dtype;
    an output [B, T, Hv] as it is."""
    return x.float().sum(0).to(qkv.dtype) if x.dim() == qkv.dim() + 1 else x


@gdn_decode.register_kernel("cuda")
def _gdn_decode_cuda(qkv, heads_k, dk, a, b, A_log, dt_bias, state, unrolled=False, pdl=False, z=None,
                     norm_weight=None, eps=0.0):
    q, k, v = unpack_qkv(qkv, heads_k, dk, a.shape[-1])
    dv, walk = v.shape[-1], unrolled and k.shape[1] <= UNROLLED_MAX_T
    if z is not None and walk and dv & (dv - 1) == 0:
        return _unrolled(q, k, v, a, b, state, state, gate_in=True, A_log=A_log, dt_bias=dt_bias, pdl=pdl,
                         norm=(z, norm_weight, eps))
    if not walk:  # (fla's kernel takes a and b as they are)
        a, b = _summed(a, qkv), _summed(b, qkv)
    o = _gdn_recurrent_cuda(q, k, v, a, b, A_log, dt_bias, state, unrolled, pdl)
    return o if z is None else gated_rms_norm(o, z.reshape(o.shape), norm_weight, eps)


@gdn_decode.register_fake
def _(qkv, heads_k, dk, a, b, A_log, dt_bias, state, unrolled=False, pdl=False, z=None, norm_weight=None, eps=0.0):
    return _output_like(unpack_qkv(qkv, heads_k, dk, a.shape[-1])[2])


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
    return _output_like(v)


@torch.library.custom_op("fastqwen::gdn_verify", mutates_args=())
def gdn_verify(qkv: torch.Tensor, heads_k: int, dk: int, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
               dt_bias: torch.Tensor, state: torch.Tensor, unrolled: bool = False, pdl: bool = False,
               block: bool = False) -> torch.Tensor:
    """Outputs o [B, T, Hv, Dv] of a speculative block from the checkpoint `state`, which is read and left as
    it is; q, k, v from the conv's packed output qkv [B, T, C] as in gdn_decode (our kernels read them in
    place; fla's gets copies). On CUDA fla's kernel, ours unrolled, or with `block` the block solve
    (_block_kernel) for BLOCK_MIN_T ≤ T ≤ 64 (shorter blocks: unrolled); pdl: ours with programmatic dependent
    launch."""
    q, k, v = unpack_qkv(qkv, heads_k, dk, a.shape[-1])
    return gdn_reference(q, k, v, a, b, A_log, dt_bias, state.clone())


# _block's (block_v, num_warps, block_k, stages), and the shortest block it takes: on the H200 (27B shape, one
# layer, scripts/bench_gdn.py, 2026-12-01) it solved T = 16 in 9.7 µs at this tile (8.9 with block_k 32, not yet
# timed in the model) against the unrolled walk's 13.5 (fla: 28.3), but T = 4 in 7.2 against 4.9: the walk grows
# ~0.7 µs a position, the solve hardly at all; they cross near T = 8. In the 27B fp8 DFlash round it took the
# round from 13.80 to 12.80 ms (docs/BENCHMARKS.md)
BLOCK_TILE = (16, 1, 16, 2)
BLOCK_MIN_T = 8


@gdn_verify.register_kernel("cuda")
def _gdn_verify_cuda(qkv, heads_k, dk, a, b, A_log, dt_bias, state, unrolled=False, pdl=False, block=False):
    q, k, v = unpack_qkv(qkv, heads_k, dk, a.shape[-1])
    pow2_16 = lambda d: d >= 16 and d & (d - 1) == 0  # noqa: E731 (the solve's dots and tiles take these)
    if block and BLOCK_MIN_T <= k.shape[1] <= UNROLLED_MAX_T and pow2_16(dk) and pow2_16(v.shape[-1]):
        bv, warps, bk, stages = BLOCK_TILE
        return _block(q, k, v, a, b, state, A_log, dt_bias, block_v=bv, warps=warps, pdl=pdl, block_k=bk,
                      stages=stages)
    if (unrolled or block) and k.shape[1] <= UNROLLED_MAX_T:
        return _unrolled(q, k, v, a, b, state, None, gate_in=True, A_log=A_log, dt_bias=dt_bias, pdl=pdl)
    return _fla_recurrent(q, k, v, a, b, state, None, gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)


@gdn_verify.register_fake
def _(qkv, heads_k, dk, a, b, A_log, dt_bias, state, unrolled=False, pdl=False, block=False):
    return _output_like(unpack_qkv(qkv, heads_k, dk, a.shape[-1])[2])


@torch.library.custom_op("fastqwen::gdn_replay", mutates_args=("state",))
def gdn_replay(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
               unrolled: bool = False, pdl: bool = False) -> None:
    """Advance `state` in place over a block with explicit g, beta [B, T, HV] (zeros where not accepted); k, v
    may be views of a packed buffer (each position's heads contiguous), which the unrolled kernel reads in
    place."""
    recurrence(k, k, v, g, beta, state)


REPLAY_TILE = (8, 1)  # (block_v, num_warps) of the replay launch; scripts/bench_commit.py --tiles times others


@gdn_replay.register_kernel("cuda")
def _gdn_replay_cuda(k, v, g, beta, state, unrolled=False, pdl=False):
    if unrolled and k.shape[1] <= UNROLLED_MAX_T:
        _unrolled(k, k, v, g, beta, state, state, gate_in=False, write_o=False, pdl=pdl)
        return
    _fla_recurrent(k, k, v, g, beta, state, state, gate_in_kernel=False, block_v=REPLAY_TILE[0], warps=REPLAY_TILE[1])


@gdn_replay.register_fake
def _(k, v, g, beta, state, unrolled=False, pdl=False):
    return None
