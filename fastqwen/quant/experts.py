"""QuantExperts: a MoE layer's routed experts (3-D weights) held in a quantized format.

transformers keeps the experts of a Qwen3.5 MoE layer as two 3-D parameters, gate_up_proj [E, 2I, H] and
down_proj [E, H, I]. QuantExperts stores each expert's two matrices in `scheme`'s layout (quantize_weight,
stacked on a leading expert dimension) and replaces the experts module in place:
  forward(hidden_states, top_k_index, top_k_weights)  transformers' experts contract (prefill): the experts
      dequantized a group at a time, each group's tokens multiplied by one grouped matmul per matrix;
  routed(x, experts) -> [N, k, H]  decode and verify (fastqwen.model.routed_moe): only the selected experts
      are read; on CUDA by the grouped weight-streaming kernel (ops/gemv.py), else by the reference.
`stack_shared` appends the layer's (quantized) shared expert as expert E, as fastqwen.moe does for bf16
experts, so that `routed` runs it in the same two launches as the routed ones.
"""

import torch
from torch import nn

from ..ops.gemv import FORMATS, INT4, STEP, expert_gemv, expert_swiglu_gemv
from .formats import dequantize_weight, fake_quantize_fp8_activations, quantize_weight, tile_int4

_MATRICES = ("gate_up", "down")
# experts dequantized at once in prefill: 32 of 35B-A3B's (3 · 512 · 2048 weights each) take 200 MB in bf16
PREFILL_EXPERTS = 32


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [P, K] (rows sorted by group), w [G, N, K], offs [G] int32 (each group's end row) → [P, N]: each group's
    rows times its wᵀ. torch's grouped matmul where it takes the dtype (bf16 on CUDA, any on CPU), else a loop."""
    grouped = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if grouped is not None and (x.dtype == torch.bfloat16 or not x.is_cuda):
        return grouped(x, w.transpose(-2, -1), offs=offs)
    ends = offs.tolist()
    return torch.cat([x[a:b] @ w[g].t() for g, (a, b) in enumerate(zip([0] + ends[:-1], ends))])


def _experts_rows(q: torch.Tensor) -> tuple[int, int]:
    """(experts, rows) of stacked codes [E, N, …], or of int4 codes tiled [E, N/16, K/128, 16, 64]."""
    return (q.shape[0], q.shape[1] * q.shape[3]) if q.dim() == 5 else tuple(q.shape[:2])


def kernel_path(scheme: str, act: str) -> str:
    """The launches QuantExperts.routed runs on CUDA for `scheme` and the asked activation `act`: "fused" (the
    down launch computes the activation: fp8 schemes) or "separate" (int4, and what is asked)."""
    if act not in ("separate", "fused"):
        raise ValueError(f"expert activation {act!r}: choose 'separate' or 'fused'")
    return "separate" if FORMATS[scheme] == INT4 else act


class QuantExperts(nn.Module):
    """Buffers `{gate_up,down}_{key}` [E, …] for each stored tensor key of the scheme (qweight, scale or
    scale_inv, zero); see the module docstring for the two entry points."""

    def __init__(self, experts: nn.Module, scheme: str, group: int = 128, stored: dict | None = None):
        """Quantize transformers' `experts` (gate_up_proj [E, 2I, H], down_proj [E, H, I], act_fn) in `scheme`;
        or, with `stored` ({"gate_up" | "down": {key: [E, …]}}, a checkpoint's tensors already in the scheme's
        layout), hold those and take only act_fn from `experts`."""
        super().__init__()
        self.scheme, self.group, self.act_fn = scheme, group, experts.act_fn
        if stored is None:
            stored = {}
            for m in _MATRICES:
                w = getattr(experts, f"{m}_proj").detach()
                parts = [quantize_weight(w[e], scheme, group) for e in range(w.shape[0])]
                stored[m] = {key: torch.stack([p[key] for p in parts]) for key in parts[0]}
        if scheme == "int4":  # codes tiled by 16 rows × a group where the rows allow (tile_int4), as QuantLinear's
            stored = {m: {**stored[m], "qweight": tile_int4(stored[m]["qweight"], experts=True)} for m in _MATRICES}
        self.keys = tuple(stored["down"])
        self.num_experts, self.hidden = _experts_rows(stored["down"]["qweight"])
        self.inter = _experts_rows(stored["gate_up"]["qweight"])[1] // 2
        for m in _MATRICES:
            for key in self.keys:
                self.register_buffer(f"{m}_{key}", stored[m][key])
        self.stacks = None  # {matrix: {key: [E+1, …]}} once the shared expert is stacked (stack_shared)

    def shared_fits(self, shared) -> bool:
        """Whether `shared` (a MoE layer's shared expert) can be stacked: its gate_proj, up_proj and down_proj
        are bias-free QuantLinears in this scheme (and int4 group) with one routed expert's sizes, holding the
        same stored tensors and no act-order permutation."""
        shapes = {"gate_proj": (self.inter, self.hidden), "up_proj": (self.inter, self.hidden),
                  "down_proj": (self.hidden, self.inter)}
        for name, shape in shapes.items():
            lin = getattr(shared, name, None)
            if (getattr(lin, "scheme", None) != self.scheme or lin.group != self.group or lin.bias is not None
                    or (lin.out_features, lin.in_features) != shape or getattr(lin, "perm", None) is not None
                    or any(not hasattr(lin, key) for key in self.keys)):
                return False
        return self.scheme != "fp8" or self.inter % 128 == 0  # (whole 128-row scale blocks per matrix)

    def stack_shared(self, shared) -> None:
        """Store `shared` (shared_fits) as expert E: each stored tensor becomes the [:E] view of an [E+1, …] stack
        in `stacks`, and each of the shared linears' tensors a view of row E, so nothing is stored twice and the
        state dict keeps its shapes."""
        E, self.stacks = self.num_experts, {}
        with torch.no_grad():
            for m, parts in (("gate_up", (shared.gate_proj, shared.up_proj)), ("down", (shared.down_proj,))):
                self.stacks[m] = {}
                for key in self.keys:
                    whole = torch.cat([getattr(self, f"{m}_{key}"), torch.cat([getattr(p, key) for p in parts])[None]])
                    torch._dynamo.mark_static_address(whole)
                    self.stacks[m][key] = whole
                    setattr(self, f"{m}_{key}", whole[:E])
                    start = 0
                    for p in parts:
                        rows = getattr(p, key).shape[0]  # (int4 codes tiled alike: in tiles of 16 rows)
                        setattr(p, key, whole[E, start:start + rows])
                        start += rows

    def stack_views(self, shared) -> list:
        """(tensor, stack) for every tensor that must be a view of a stack for `stacks` to hold (empty when
        nothing is stacked)."""
        if self.stacks is None:
            return []
        parts = {"gate_up": (shared.gate_proj, shared.up_proj), "down": (shared.down_proj,)}
        return [(t, self.stacks[m][key]) for m in _MATRICES for key in self.keys
                for t in (getattr(self, f"{m}_{key}"), *(getattr(p, key) for p in parts[m]))]

    def stored(self, m: str, e=None) -> dict:
        """Matrix m's stored tensors, of all experts [E, …] (E+1 with the shared expert stacked) or of expert e
        (an int or a 0-dim tensor; a tensor is read by index_select, which torch.compile traces without a
        data-dependent int)."""
        stacked = self.stacks[m] if self.stacks else {key: getattr(self, f"{m}_{key}") for key in self.keys}
        if e is None:
            return stacked
        if isinstance(e, torch.Tensor):
            return {key: t.index_select(0, e.reshape(1))[0] for key, t in stacked.items()}
        return {key: t[e] for key, t in stacked.items()}

    def weight(self, m: str, e) -> torch.Tensor:
        """Expert e's matrix m, dequantized (fp32)."""
        return dequantize_weight(self.scheme, self.stored(m, e))

    def _inputs(self, x):
        """x as the matmul sees it: rounded to fp8 per 128 columns under the "fp8" scheme."""
        return fake_quantize_fp8_activations(x, STEP) if self.scheme == "fp8" else x

    def forward(self, hidden_states, top_k_index, top_k_weights):
        """transformers' experts contract (prefill): hidden_states [N, H], top_k_index / top_k_weights [N, k] →
        the weighted mixture [N, H]. The token-expert pairs are sorted by expert; the experts are dequantized to
        the input dtype PREFILL_EXPERTS at a time, and each such group's pairs run as one grouped matmul per
        matrix (one host sync a call, for the group boundaries)."""
        N, k = top_k_index.shape
        order = top_k_index.flatten().argsort(stable=True)
        token = order // k
        counts = torch.bincount(top_k_index.flatten(), minlength=self.num_experts)
        ends = [0] + counts.cumsum(0).tolist()
        x, y = hidden_states[token], hidden_states.new_empty(N * k, self.hidden)
        for lo in range(0, self.num_experts, PREFILL_EXPERTS):
            hi = min(lo + PREFILL_EXPERTS, self.num_experts)
            a, b = ends[lo], ends[hi]
            if a == b:
                continue
            offs = counts[lo:hi].cumsum(0).int()
            gate_up = _grouped_mm(self._inputs(x[a:b]), self._dequantized("gate_up", lo, hi, x.dtype), offs)
            gate, up = gate_up.chunk(2, -1)
            y[a:b] = _grouped_mm(self._inputs(self.act_fn(gate) * up), self._dequantized("down", lo, hi, x.dtype), offs)
        weighted = y * top_k_weights.flatten()[order, None].to(y.dtype)
        return torch.zeros_like(hidden_states).index_add_(0, token, weighted)

    def _dequantized(self, m: str, lo: int, hi: int, dtype) -> torch.Tensor:
        """Experts lo … hi-1 of matrix m, dequantized to dtype [hi-lo, N, K]."""
        stored = {key: t[lo:hi] for key, t in self.stored(m).items()}
        return dequantize_weight(self.scheme, stored).to(dtype)

    def kernel_fits(self) -> bool:
        """Whether the grouped weight-streaming kernel takes these experts (on CUDA): sizes divisible by 128 and,
        for int4, stored groups of 128 (quantized in groups of a multiple of 128: formats.int4_kernel_groups)."""
        return self.hidden % STEP == 0 and self.inter % STEP == 0 and (
            self.scheme != "int4" or self.hidden // self.gate_up_scale.shape[-1] == STEP)

    def routed(self, x: torch.Tensor, experts: torch.Tensor, act: str = "separate", pdl: bool = False) -> torch.Tensor:
        """x [N, H], experts [N, k] → each pair's expert output [N, k, H] (unweighted), reading only those experts.
        act (act_fn SiLU; "separate": a kernel of its own): "fused", on CUDA the down launch computes
        silu(gate)·up from the gate | up launch's partials as it loads them (expert_swiglu_gemv), a launch less
        (fp8 schemes; int4 keeps it separate). pdl (kernels experts "grouped-pdl"): the weight-streaming launches
        with programmatic dependent launch."""
        N, k = experts.shape
        pair_expert = experts.flatten()
        if x.is_cuda and self.kernel_fits():
            fmt, quant_x = FORMATS[self.scheme], self.scheme == "fp8"  # (fp8: activations rounded to e4m3 too)
            pe = pair_expert.int()  # (token-major pairs, k a token: expert_gemv's tok None)
            gu, dn = self.stored("gate_up"), self.stored("down")
            path = kernel_path(self.scheme, act)
            gu_scale = gu.get("scale_inv", gu.get("scale"))
            down = dn["qweight"], dn.get("scale_inv", dn.get("scale"))
            parts = expert_gemv(x, None, pe, fmt, gu["qweight"], gu_scale, gu.get("zero"), 2 * self.inter, quant_x,
                                pdl)
            if path == "fused":
                y = expert_swiglu_gemv(parts, pe, fmt, *down, self.hidden, x.dtype, quant_x, pdl)
            else:
                gate, up = parts.sum(0).chunk(2, dim=-1)
                h = (self.act_fn(gate) * up).to(x.dtype)
                y = expert_gemv(h, None, pe, fmt, *down, dn.get("zero"), self.hidden, quant_x, pdl)
            return y.sum(0).view(N, k, self.hidden).to(x.dtype)
        rows = []
        for p in range(N * k):  # the reference: one pair at a time (CPU, small N·k)
            e, xi = pair_expert[p], self._inputs(x[p // k])
            gate, up = (xi @ self.weight("gate_up", e).to(x.dtype).t()).chunk(2, dim=-1)
            rows.append(self._inputs(self.act_fn(gate) * up) @ self.weight("down", e).to(x.dtype).t())
        return torch.stack(rows).view(N, k, self.hidden)
