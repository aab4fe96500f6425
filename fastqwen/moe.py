"""The sparse MoE block at decode and verify: route, run only the selected experts, add the shared expert.

`routed_moe` routes as transformers does (softmax over all experts in fp32, top-k, renormalise: ops/router.py,
in one launch with `grouped`). bf16 experts are gathered then multiplied, or with `grouped` read in place by
ops/gemv.py's grouped kernel; quantized experts (quant/experts.py) read only the selected ones their own way.
For the grouped kernel,
`stack_shared_expert` appends the shared expert to the routed experts' weights as expert E, and the
shared-expert gate to the router as row E (when the intermediate sizes match, as in Qwen3.5-35B-A3B): one
matmul then gives the router logits and the shared gate, and one grouped launch per matrix runs the k routed
experts and the shared one, with sigmoid(shared gate) as its weight. Quantized experts (quant/experts.py) take
their quantized shared expert the same way (QuantExperts.stack_shared).
"""

import torch

from .linears import Linears
from .ops.gemv import BF16, expert_gemv, expert_swiglu_gemv
from .ops.router import reference as route_reference
from .ops.router import route, router_route


def stack_shared_expert(mlp) -> bool:
    """Stack `mlp`'s shared expert onto its routed experts (see the module docstring). bf16 experts: gate_up
    [E+1, 2I, H], down [E+1, H, I] and router [E+1, H] in `mlp.fastqwen_stacked`, every HF parameter a view of
    them (state dict and forward unchanged); quantized experts: the router likewise (`fastqwen_stacked` is
    (None, None, router)) and the experts by QuantExperts.stack_shared. Idempotent; returns whether the stack
    is in place. A stack whose parameters were replaced since is dropped; shapes that do not fit get none."""
    stacked = mlp.__dict__.get("fastqwen_stacked")
    if stacked is not None and not (_fits(mlp) and _intact(mlp, stacked)):
        mlp.__dict__.pop("fastqwen_stacked")
        if hasattr(mlp.experts, "stacks"):
            mlp.experts.stacks = None  # (their buffers are read again, not the stale stack)
        stacked = None
    if stacked is not None:
        return True
    if not _fits(mlp):
        return False
    e, shared, E = mlp.experts, mlp.shared_expert, mlp.gate.weight.shape[0]
    with torch.no_grad():
        router = torch.cat([mlp.gate.weight, mlp.shared_expert_gate.weight])
        views = [(mlp.gate.weight, router[:E]), (mlp.shared_expert_gate.weight, router[E:])]
        if hasattr(e, "stack_shared"):  # quantized experts
            e.stack_shared(shared)
            gate_up = down = None
        else:
            inter = shared.gate_proj.out_features
            gate_up = torch.cat([e.gate_up_proj, torch.cat([shared.gate_proj.weight, shared.up_proj.weight])[None]])
            down = torch.cat([e.down_proj, shared.down_proj.weight[None]])
            views += [(e.gate_up_proj, gate_up[:E]), (e.down_proj, down[:E]), (shared.down_proj.weight, down[E]),
                      (shared.gate_proj.weight, gate_up[E, :inter]), (shared.up_proj.weight, gate_up[E, inter:])]
        for p, t in views:  # p stays the model's Parameter (its requires_grad, optimizers' refs), on t's storage
            p.data = t
    for t in (gate_up, down, router):
        if t is not None:
            torch._dynamo.mark_static_address(t)
    mlp.__dict__["fastqwen_stacked"] = (gate_up, down, router)
    return True


def stack_intact(mlp) -> bool:
    """Whether `mlp` has no stack, or one that every parameter it stacked is still a view of."""
    stacked = mlp.__dict__.get("fastqwen_stacked")
    return stacked is None or _intact(mlp, stacked)


def _intact(mlp, stacked) -> bool:
    """Whether every part of the stack is still a view of it (no parameter or buffer replaced since)."""
    gate_up, down, router = stacked
    e, shared = mlp.experts, mlp.shared_expert
    pairs = [(mlp.gate.weight, router), (mlp.shared_expert_gate.weight, router)]
    if hasattr(e, "stack_views"):  # quantized experts
        views = e.stack_views(shared)
        if not views:
            return False
        pairs += views
    else:
        pairs += [(e.gate_up_proj, gate_up), (shared.gate_proj.weight, gate_up), (shared.up_proj.weight, gate_up),
                  (e.down_proj, down), (shared.down_proj.weight, down)]
    return all(p.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr() for p, whole in pairs)


def _fits(mlp) -> bool:
    e, shared, sgate = mlp.experts, getattr(mlp, "shared_expert", None), getattr(mlp, "shared_expert_gate", None)
    if shared is None or type(sgate) is not torch.nn.Linear or sgate.bias is not None:
        return False
    router = mlp.gate.weight
    if hasattr(e, "shared_fits"):  # quantized experts: theirs and the shared expert's layouts must match
        return (e.shared_fits(shared) and tuple(router.shape) == (e.num_experts, e.hidden)
                and sgate.weight.shape == (1, e.hidden)
                and (router.dtype, router.device) == (sgate.weight.dtype, sgate.weight.device))
    if not isinstance(getattr(e, "gate_up_proj", None), torch.Tensor):
        return False
    linears = [getattr(shared, n, None) for n in ("gate_proj", "up_proj", "down_proj")] + [sgate]
    if not all(type(lin) is torch.nn.Linear and lin.bias is None for lin in linears):
        return False
    E, two_i, H = e.gate_up_proj.shape
    params = [e.gate_up_proj, e.down_proj, router] + [lin.weight for lin in linears]
    return (shared.gate_proj.weight.shape == (two_i // 2, H) and shared.up_proj.weight.shape == (two_i // 2, H)
            and shared.down_proj.weight.shape == (H, two_i // 2) and tuple(e.down_proj.shape) == (E, H, two_i // 2)
            and sgate.weight.shape == (1, H) and tuple(router.shape) == (E, H)
            and len({(p.dtype, p.device) for p in params}) == 1)


def routed_moe(mlp, h: torch.Tensor, grouped: bool = False, lin: Linears | None = None,
               pdl: bool = False, expert_act: str = "separate", route_kernel: str = "argmax") -> torch.Tensor:
    """The MoE block on few tokens h [B, T, H]: each token's top-k experts only, plus the shared expert. pdl
    (with grouped): the routing and the expert launches with programmatic dependent launch. expert_act (with
    grouped, experts whose act_fn is SiLU; "separate": a kernel of its own between the two expert launches):
    "fused", the down launch computes silu(gate)·up from the gate | up launch's partials as it loads them
    (ops/gemv.py expert_swiglu_gemv); quantized experts (QuantExperts.routed, their own kernel launches on
    CUDA) do so in bf16 and fp8, while int4 ones keep a kernel for the activation whatever is asked. route_kernel (with
    grouped): the routing kernel's rounds, "argmax" or "packed" (one-warp packed keys), or "fused": one token's
    router matmul and routing in one launch (packed rounds; ops/router.py router_route; more tokens, or a
    router the kernel does not take, as "packed")."""
    shape = h.shape
    x = h.reshape(-1, shape[-1])
    stacked = mlp.__dict__.get("fastqwen_stacked") if grouped else None
    lin = lin or Linears()
    router = mlp.gate.weight if stacked is None else stacked[2]  # [E (+1: the shared gate), H]
    # [N, k (+1)]; stacked: the shared expert as expert E, weighted by its sigmoid gate. grouped: one launch, which
    # also sums the router matmul's split-K partials
    k, shared = mlp.gate.top_k, stacked is not None
    if grouped and route_kernel == "fused" and x.shape[0] == 1 and router.is_contiguous():
        weights, experts = router_route(x, router, k, shared, lin.pdl)
    elif grouped:
        weights, experts = route(lin.weight_partials(x, router), k, shared, pdl, route_kernel != "argmax", x.dtype)
    else:
        weights, experts = route_reference(lin.weight(x, router), k, shared)
    weights = weights.to(x.dtype)
    if hasattr(mlp.experts, "routed"):  # quantized experts
        out = mlp.experts.routed(x, experts, expert_act, pdl)
    elif grouped:
        gate_up, down = (mlp.experts.gate_up_proj, mlp.experts.down_proj) if stacked is None else stacked[:2]
        N, k = experts.shape
        pair_expert = experts.flatten().int()
        if expert_act == "fused":
            parts = expert_gemv(x, None, pair_expert, BF16, gate_up, None, None, gate_up.shape[1], pdl=pdl)
            out = expert_swiglu_gemv(parts, pair_expert, BF16, down, None, down.shape[1], x.dtype, pdl=pdl).sum(0)
        else:
            parts = expert_gemv(x, None, pair_expert, BF16, gate_up, None, None, gate_up.shape[1], pdl=pdl)
            gate, up = parts.sum(0).chunk(2, -1)
            act = (mlp.experts.act_fn(gate) * up).to(x.dtype)  # [N·k, I]
            out = expert_gemv(act, None, pair_expert, BF16, down, None, None, down.shape[1], pdl=pdl).sum(0)
        out = out.view(N, k, -1).to(x.dtype)
    else:
        gate_up = mlp.experts.gate_up_proj[experts]  # [N, k, 2I, H]
        gate, up = torch.einsum("nh,nkoh->nko", x, gate_up).chunk(2, dim=-1)
        act = mlp.experts.act_fn(gate) * up  # [N, k, I]
        out = torch.einsum("nki,nkhi->nkh", act, mlp.experts.down_proj[experts])
    out = weighted_sum(out, weights)
    if stacked is None:
        out = out + lin.mlp(mlp.shared_expert, x) * torch.sigmoid(mlp.shared_expert_gate(x))
    return out.reshape(shape)


def weighted_sum(out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σⱼ weights[:, j] · out[:, j]: out [N, k, H], weights [N, k] → [N, H] in out's dtype, as
    (out * weights[..., None]).sum(1) computes it (fp32 accumulation), but written as k - 1 adds: inductor
    unrolls reductions of at most 8 terms (unroll_reductions_threshold), and over 9 (35B-A3B's 8 routed experts
    and the stacked shared one) the sum is a launch of its own; as adds it folds into the kernel after it (the
    residual add and the next norm)."""
    acc = (out[:, 0] * weights[:, 0, None]).float()
    for j in range(1, out.shape[1]):
        acc = acc + (out[:, j] * weights[:, j, None]).float()
    return acc.to(out.dtype)
