"""Kernel-level A/B of a MoE decode layer's kernels: the routed experts' gated MLP as two launches (ops/gemv.py
expert_gemv, then expert_swiglu_gemv with the activation on load: "fused") without PDL, the reference form,
against the same with PDL; and one token's router matmul and routing in two launches (the weight-streaming
kernel's split-K partials, then ops/router.py route, packed) against one (router_route), with and without PDL.
(The one-launch MLP and the activation in the gate | up launch's epilogue were measured with it and removed:
both faster here, slower in the step; docs/DESIGN-NOTES.md.)

    python scripts/bench_expert_mlp.py --layers 40

Builds --layers layers of 35B-A3B-shaped experts (257: 256 routed + the shared one stacked as expert 256), random
and distinct per layer so that every layer's weights are cold, in fp8-weight and bf16; each layer routes one token to
9 of them (8 random + the shared one). Each form's launches for all the layers are captured in one CUDA graph and
replayed in alternating order; prints µs a layer (the minimum over rounds) and each form's relative difference from
the reference form. The router table likewise: --layers routers of 35B-A3B's shape (257 × 2048 bf16: 256 experts and
the stacked shared gate), cold, one token; --router-configs (RN:RK:WARPS) times the one launch at other tiles.
"""

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from fastqwen.linears import Linears  # noqa: E402
from fastqwen.ops.gemv import BF16, FP8_ROW, expert_gemv, expert_swiglu_gemv  # noqa: E402
from fastqwen.ops.router import FUSED_CONFIG, fused_launch, route  # noqa: E402
from fastqwen.quant.formats import quantize_fp8_rows  # noqa: E402


def stored(w: torch.Tensor, fmt: int):
    """(weights, scales) of experts w [E, N, K] in format fmt (scales None for bf16)."""
    if fmt == BF16:
        return w, None
    q, s = quantize_fp8_rows(w.reshape(-1, w.shape[-1]))
    return q.view(w.shape), s.view(w.shape[:2])


def captured(fn):
    """(fn captured in a CUDA graph after 3 warm-up calls, its outputs)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def replay_us(graph, reps: int = 10) -> float:
    """µs a replay of `graph`, over reps replays after one."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1000


def timed(graphs: dict, rounds: int) -> dict:
    """{form: min µs a replay} over `rounds` rounds of replays in alternating order."""
    times = {form: [] for form in graphs}
    for r in range(rounds):
        for form in list(graphs) if r % 2 == 0 else list(graphs)[::-1]:
            times[form].append(replay_us(graphs[form][0]))
    return {form: min(t) for form, t in times.items()}


def router_table(layers: int, rounds: int, configs: list):
    """The router A/B: two launches (partials, route) against router_route, each with and without PDL."""
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    routers = [torch.randn(257, 2048, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(layers)]
    forms = {}
    for pdl in (False, True):
        lin = Linears(gemv=True, pdl=pdl)
        forms[f"two launches, pdl {pdl}"] = lambda lin=lin, pdl=pdl: [
            route(lin.weight_partials(x, r), 8, True, pdl, True, x.dtype)[1] for r in routers]
        for c in configs:
            forms[f"one launch {':'.join(map(str, c))}, pdl {pdl}"] = lambda c=c, pdl=pdl: [
                fused_launch(x, r, 8, True, pdl, c)[1] for r in routers]
    graphs = {form: captured(fn) for form, fn in forms.items()}
    best = timed(graphs, rounds)
    want = torch.stack(graphs["two launches, pdl False"][1])
    print("| router form | µs a layer | same experts as two launches |")
    print("|---|---|---|")
    for form, us in best.items():
        print(f"| {form} | {us / layers:.2f} | {torch.equal(torch.stack(graphs[form][1]), want)} |")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tables", nargs="+", default=["experts", "router"], choices=["experts", "router"])
    p.add_argument("--router-configs", nargs="*", default=[], metavar="RN:RK:WARPS",
                   help="also time the one-launch router at these tiles")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    E, H, I, L = 257, 2048, 512, args.layers
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    for name, fmt in (("fp8-weight", FP8_ROW), ("bf16", BF16)) if "experts" in args.tables else ():
        if fmt == FP8_ROW:
            print("| form | two launches µs a layer | the form's µs a layer | form / two | relative difference |")
            print("|---|---|---|---|---|")
        layers = []
        for _ in range(L):
            w1 = stored(torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02, fmt)
            w2 = stored(torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02, fmt)
            exp = torch.randperm(E - 1, device="cuda", generator=g)[:9].int()
            exp[8] = E - 1
            layers.append((w1, w2, exp))

        def two():  # (the down launch's split-K partials: a decode step sums them inside the combine's kernel)
            return [expert_swiglu_gemv(expert_gemv(x, None, exp, fmt, *w1, None, 2 * I), exp, fmt, *w2, H,
                                       torch.bfloat16) for w1, w2, exp in layers]

        def fused(pdl):
            return lambda: [expert_swiglu_gemv(expert_gemv(x, None, exp, fmt, *w1, None, 2 * I, False, pdl), exp, fmt,
                                               *w2, H, torch.bfloat16, False, pdl) for w1, w2, exp in layers]

        forms = {f"{name} fused, pdl {pdl}": fused(pdl) for pdl in (False, True)}
        graphs = {"two": captured(two), **{form: captured(fn) for form, fn in forms.items()}}
        best = timed(graphs, args.rounds)
        a = torch.stack([parts.sum(0) for parts in graphs["two"][1]])
        two_us = best["two"] / L
        for form in forms:
            diff = ((torch.stack([parts.sum(0) for parts in graphs[form][1]]) - a).norm() / a.norm()).item()
            print(f"| {form} | {two_us:.2f} | {best[form] / L:.2f} | {best[form] / L / two_us:.3f} | {diff:.1e} |")
        del layers, graphs
        torch.cuda.empty_cache()
    asked = [tuple(int(v) for v in c.split(":")) for c in args.router_configs]
    if "router" in args.tables:
        router_table(L, args.rounds, [FUSED_CONFIG] + [c for c in dict.fromkeys(asked) if c != FUSED_CONFIG])


if __name__ == "__main__":
    main()
