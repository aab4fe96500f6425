"""The decoder's linears as the compiled steps run them.

`fuse_linears` gives a module's input projections one weight (GDN qkv+z+b+a, attention q+k+v, MLP gate+up):
one matmul instead of two to four, same bytes, the HF parameters becoming views of it. `Linears` is the
per-engine policy the forward calls every linear through: fused or separate projections, and cuBLAS or the
weight-streaming kernel (ops/gemv.py) for bf16 linears at decode and verify.
"""

import torch

from .ops.gemv import (BF16, STEP, TILE_ROWS, add_splits, gemv_beats_cublas, gpu_table, swiglu_linear, untile_int4,
                       wq_linear)

MLP_IN = ("gate_proj", "up_proj")  # a gated MLP's input projections

GEMV_ROWS = 16  # bf16 at more rows stays with cuBLAS (the kernel's bf16 configs are swept at ≤ 16 rows)


def fuse_linears(module, names) -> None:
    """Give `module`'s bias-free linears `names` one linear `module.fastqwen_fused` with their weights stacked
    by rows ([ΣN, K]), so one matmul serves them all (fewer launches per decode step, same bytes); each
    linear's weight becomes a row slice of it, so the module's own forward and state dict are unchanged.
    bf16 nn.Linear of one dtype, or QuantLinear of one scheme and group (their stored tensors stacked; fp8
    128×128 blocks need every part but the last to be whole blocks of rows; no act-order permutation). When
    only a prefix of `names` can fuse (fp8 blocks: the 27B GDN block's 48-row b before a), that prefix is, and
    `fastqwen_fused_sizes` says how many. Idempotent; a fused linear whose parts were replaced since (quantized,
    say) is dropped, and rebuilt if the new parts fuse. The fused linear is not a registered submodule: it
    holds no tensors of its own."""
    linears = [getattr(module, n, None) for n in names]
    fused = module.__dict__.get("fastqwen_fused")
    if fused is not None and not _views_of(fused, linears[:len(module.__dict__["fastqwen_fused_sizes"])]):
        for attr in ("fastqwen_fused", "fastqwen_fused_sizes"):
            module.__dict__.pop(attr)
        fused = None
    count = max((p for p in range(len(linears), 1, -1) if _fusable(linears[:p])), default=0)
    if fused is not None or count < 2:
        return
    linears = linears[:count]
    with torch.no_grad():
        if type(linears[0]) is torch.nn.Linear:
            fused = torch.nn.Linear(linears[0].in_features, sum(lin.out_features for lin in linears), bias=False,
                                    device="meta")
            fused.weight = torch.nn.Parameter(torch.cat([lin.weight for lin in linears]), requires_grad=False)
        else:
            first = linears[0]
            tensors = {name: torch.cat([lin.get_buffer(name) for lin in linears]) for name, _ in
                       first.named_buffers(recurse=False)}
            fused = type(first)(first.scheme, first.in_features, sum(lin.out_features for lin in linears), tensors,
                                group=first.group)
            if fused.qweight.dim() != first.qweight.dim():  # int4 parts in row order (a part's rows no multiple of 16)
                fused._buffers["qweight"] = untile_int4(fused.qweight)
    start = 0
    for lin in linears:
        n = lin.out_features
        if type(lin) is torch.nn.Linear:
            lin.weight.data = fused.weight[start:start + n]  # (the same Parameter: requires_grad, optimizers' refs)
        else:
            for name, t in fused.named_buffers(recurse=False):
                rows = (slice(start // STEP, -(-(start + n) // STEP)) if name == "scale_inv" and lin.scheme == "fp8"
                        else slice(start // TILE_ROWS, (start + n) // TILE_ROWS) if name == "qweight" and t.dim() == 4
                        else slice(start, start + n))  # (int4 codes tiled by 16 rows: tile_int4)
                lin._buffers[name] = t[rows]
        start += n
    for t in (*fused.parameters(), *fused.buffers()):
        torch._dynamo.mark_static_address(t)
    module.__dict__["fastqwen_fused"] = fused
    module.__dict__["fastqwen_fused_sizes"] = tuple(lin.out_features for lin in linears)


def fusion_intact(module, names) -> bool:
    """Whether the fused linear that fuse_linears(module, names) gave `module` (if any) still holds its linears'
    weights: one replaced since (load_state_dict(assign=True), say) leaves the fused copy with the old ones."""
    fused = module.__dict__.get("fastqwen_fused")
    return fused is None or _views_of(fused, [getattr(module, n, None)
                                              for n in names[:len(module.__dict__["fastqwen_fused_sizes"])]])


def _fusable(linears) -> bool:
    from .quant.linear import QuantLinear

    if all(type(lin) is torch.nn.Linear and lin.bias is None for lin in linears):
        return len({(lin.in_features, lin.weight.dtype, lin.weight.device) for lin in linears}) == 1
    if not all(type(lin) is QuantLinear and lin.bias is None and getattr(lin, "perm", None) is None
               for lin in linears):
        return False
    whole_blocks = linears[0].scheme != "fp8" or all(lin.scale_inv.shape[0] * STEP == lin.out_features
                                                     for lin in linears[:-1])
    return whole_blocks and len({(lin.scheme, lin.group, lin.in_features, lin.qweight.device, lin.qweight.dim())
                                 for lin in linears}) == 1  # (int4 tiled or not: tile_int4)


def _main_weight(linear):
    return getattr(linear, "weight", None) if type(linear) is torch.nn.Linear else getattr(linear, "qweight", None)


def _views_of(fused, linears) -> bool:
    """Whether the linears are still of the fused linear's type and their weights its consecutive row slices."""
    whole, start = _main_weight(fused), 0
    for lin in linears:
        w = _main_weight(lin) if type(lin) is type(fused) else None
        if (w is None or w.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr()
                or w.storage_offset() != whole.storage_offset() + start * whole.stride(0)):
            return False
        start += w.shape[0]
    return start == whole.shape[0]


class Linears:
    """How the compiled steps run the model's linears. `fused`: a module's input projections as one matmul by
    the fused linear fuse_linears gave it (else one call each). `gemv` True: a bias-free floating-point
    nn.Linear on at most GEMV_ROWS rows (decode, verify) through the weight-streaming kernel (ops/gemv.py,
    launch configs per shape from gemv_configs.json) instead of F.linear (cuBLAS on a GPU); "auto": only
    where this GPU's sweep measured the kernel faster than cuBLAS at that shape; more rows, quantized and
    other modules run as they are. `pdl`: the weight-streaming kernel (bf16 here, quantized in QuantLinear)
    launches with programmatic dependent launch; `fixup`: it sums its split-K partials itself (wq_linear).
    `fused_act`: a SiLU-gated MLP on one row whose fused gate | up and down weights both take the kernel runs
    its down projection on the gate | up partials, computing silu(gate)·up as it loads them (swiglu_linear):
    no activation kernel between the two. `cuda`: the quantization schemes whose QuantLinears' few-row products
    take the CUDA C++ kernels (QuantLinear.partials)."""

    def __init__(self, fused: bool = False, gemv: bool | str = False, pdl: bool = False, fixup: bool = False,
                 fused_act: bool = False, cuda: tuple = ()):
        from .quant.linear import QuantLinear  # (here: quant.linear imports model, which imports this module)

        self.fused, self.gemv, self.pdl, self.fixup, self.quant_linear = fused, gemv, pdl, fixup, QuantLinear
        self.fused_act, self.cuda = fused_act, cuda
        self.table = gpu_table() if gemv == "auto" else {}  # read here: not inside a traced step

    def __call__(self, module, x: torch.Tensor) -> torch.Tensor:
        if type(module) is torch.nn.Linear and module.bias is None:
            return self.weight(x, module.weight)
        if isinstance(module, self.quant_linear):
            return module(x, pdl=self.pdl, fixup=self.fixup, cuda=self.cuda)
        return module(x)

    def weight(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x @ wᵀ for a floating-point weight w [N, K] (a bias-free linear's, or a raw one: the MoE router's):
        the weight-streaming kernel where the policy says so, else F.linear."""
        rows, (N, K) = x.numel() // x.shape[-1], w.shape
        if not self._streams(x, N, K, rows):
            return torch.nn.functional.linear(x, w)
        y = add_splits(wq_linear(x.reshape(rows, -1), BF16, w, None, None, False, N, self.pdl, self.fixup))
        return y.to(x.dtype).view(*x.shape[:-1], N)

    def weight_partials(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """`weight` for a consumer that sums the product itself (a custom op, which inductor cannot fuse the
        add into): [S, rows, N], the weight-streaming kernel's split-K partials in fp32 (their sum, in x's
        dtype, is `weight`), or F.linear's product [1, rows, N] in x's dtype where the policy takes cuBLAS."""
        rows, (N, K) = x.numel() // x.shape[-1], w.shape
        if not self._streams(x, N, K, rows):
            return torch.nn.functional.linear(x.reshape(1, rows, -1), w)
        return wq_linear(x.reshape(rows, -1), BF16, w, None, None, False, N, self.pdl, self.fixup)

    def _streams(self, x: torch.Tensor, N: int, K: int, rows: int) -> bool:
        """Whether the policy runs an [N, K] floating-point weight on `rows` rows of x through the kernel."""
        return bool(self.gemv and rows <= GEMV_ROWS and (K % STEP == 0 or not x.is_cuda)  # (off CUDA: the reference)
                    and (self.gemv is True or gemv_beats_cublas(self.table, N, K, rows)))

    def partials(self, module, x: torch.Tensor) -> torch.Tensor | None:
        """A bias-free linear's (or a QuantLinear's) product on x as the weight-streaming kernel's split-K
        partials [S, ..., N] fp32 (their sum, in x's dtype, is the output), or None where the policy does not
        stream it."""
        if isinstance(module, self.quant_linear) and module.bias is None:
            return module.partials(x, self.pdl, self.fixup, cuda=self.cuda)
        if type(module) is torch.nn.Linear and module.bias is None:
            rows, (N, K) = x.numel() // x.shape[-1], module.weight.shape
            if self._streams(x, N, K, rows):
                parts = wq_linear(x.reshape(rows, -1), BF16, module.weight, None, None, False, N, self.pdl, self.fixup)
                return parts.view(parts.shape[0], *x.shape[:-1], N)
        return None

    def project(self, module, h, names, raw=()):
        """The outputs of `module`'s linears `names` on h; those named in `raw` as split-K partials [S, ..., n]
        fp32 instead, where their linear streams (for a consumer that sums them itself: ops/gdn.py gdn_decode's a
        and b), else as outputs too."""
        fused = module.__dict__.get("fastqwen_fused") if self.fused else None
        sizes = module.__dict__["fastqwen_fused_sizes"] if fused is not None else ()
        parts = self.partials(fused, h) if fused is not None and set(raw) & set(names[:len(sizes)]) else None
        if fused is None:
            outs = []
        elif parts is None:
            outs = list(self(fused, h).split(sizes, dim=-1))
        else:
            outs = [p if n in raw else add_splits(p).to(h.dtype) for n, p in zip(names, parts.split(sizes, dim=-1))]
        for n in names[len(outs):]:
            linear = getattr(module, n)
            p = self.partials(linear, h) if n in raw else None
            outs.append(self(linear, h) if p is None else p)
        return outs

    def heads(self, module, o: torch.Tensor) -> torch.Tensor:
        """module on o [B, T, H, D] flattened to [B, T, H·D] → [B, T, N]. Where the weight-streaming op takes it
        (a streamed bias-free linear or QuantLinear), o reaches the op as [B·T, H, D] and the op flattens it: in a
        compiled step o's producer then stays per head, so inductor fuses a per-head reduction and its pointwise
        tail (the GDN gated norm) into one kernel; reshaped before the op, the tail's [B·T, H·D] indexing does
        not match the reduction's and they run as two."""
        lead, rows = o.shape[:2], o.shape[:2].numel()
        if isinstance(module, self.quant_linear) and module.bias is None:
            parts = module.partials(o, self.pdl, self.fixup, in_dims=2, cuda=self.cuda)
            if parts is not None:
                return add_splits(parts).to(o.dtype)
        elif type(module) is torch.nn.Linear and module.bias is None and self._streams(o, *module.weight.shape, rows):
            parts = wq_linear(o.reshape(rows, *o.shape[2:]), BF16, module.weight, None, None, False,
                              module.weight.shape[0], self.pdl, self.fixup)
            return add_splits(parts).to(o.dtype).view(*lead, -1)
        return self(module, o.reshape(*lead, -1))

    def mlp(self, mlp, h):
        """A dense gated MLP (transformers' Qwen3.5 MLP, or a MoE layer's shared expert): down(act(gate)·up)."""
        fused = mlp.__dict__.get("fastqwen_fused") if self.fused and self.fused_act else None
        down, rows = mlp.down_proj, h.numel() // h.shape[-1]
        if (fused is not None and rows == 1 and len(mlp.__dict__["fastqwen_fused_sizes"]) == 2
                and all(type(m) is torch.nn.Linear and m.bias is None for m in (fused, down))
                and self._streams(h, *fused.weight.shape, 1) and self._streams(h, *down.weight.shape, 1)):
            parts = wq_linear(h.reshape(1, -1), BF16, fused.weight, None, None, False, fused.weight.shape[0], self.pdl,
                              self.fixup)  # [S, 1, 2I]: gate | up
            y = add_splits(swiglu_linear(parts, down.weight, down.weight.shape[0], self.pdl, self.fixup))
            return y.to(h.dtype).view(*h.shape[:-1], -1)
        gate, up = self.project(mlp, h, MLP_IN)
        return self(mlp.down_proj, mlp.act_fn(gate) * up)
