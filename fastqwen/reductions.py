"""Which of the compiled steps' reductions inductor keeps whole in registers: optimize's kernels["reductions"].

Inductor writes a reduction over a row of more than 1024 elements (an INNER reduction: the residual add + RMSNorm
over the 27B's 5120 hidden values, with the 8 split-K partials of the GEMV before it added in) as a looped kernel:
one program a row, which at one decode row loads its inputs once for the sum of squares and once more for the
output. In a 16-layer 27B int4 step on an H100 that kernel took 4.9 µs, 29 times (2026-12-05, docs/BENCHMARKS.md),
and inductor's `triton.multi_kernel` (each reduction compiled both ways, the faster kept) made the whole step
1.030× faster. "persistent" asks for the one-pass kernel directly, only where the step's rows are few: reductions
of up to MAX_ELEMENTS elements over up to MAX_ROWS rows (decode, a verify block, a small batch), whatever their
size against inductor's 1024; prefill's many rows keep inductor's choice.
"""

import torch
from torch._inductor.choices import InductorChoices
from torch._inductor.runtime.hints import ReductionHint
from torch._inductor.virtualized import V

MAX_ELEMENTS = 8192  # a row of up to this many elements is held in registers (27B hidden 5120, 9B 4096, 35B 2048)
MAX_ROWS = 16  # on up to this many rows


class PersistentRows(InductorChoices):
    """Inductor's heuristics, but an INNER reduction of ≤ MAX_ELEMENTS over ≤ MAX_ROWS rows is persistent."""

    @staticmethod
    def should_use_persistent_reduction(features, cooperative_reduction) -> bool:
        if InductorChoices.should_use_persistent_reduction(features, cooperative_reduction):
            return True
        sizes = V.graph.sizevars
        return bool(torch._inductor.config.triton.persistent_reductions and not cooperative_reduction
                    and features.get_reduction_hint() == ReductionHint.INNER
                    and sizes.statically_known_leq(features.reduction_numel, MAX_ELEMENTS)
                    and sizes.statically_known_leq(features.numel, MAX_ROWS))


def compiled_under(fn, choice: str):
    """fn (a torch.compile'd function) run with `choice`'s heuristics in force, so that whatever it compiles
    (its first call, a recompile) is written under them: as is for "inductor", else each call inside
    V.set_choices_handler (thread-local, restored after the call: other compiles in the process keep
    inductor's own)."""
    if choice == "inductor":
        return fn
    choices = PersistentRows()

    def run(*args, **kwargs):
        with V.set_choices_handler(choices):
            return fn(*args, **kwargs)

    return run


def tag(choice: str) -> str:
    """The suffix the compiled steps' cache tag takes for `choice` (inductor's cache keys do not see the choices
    handler: without it a step compiled under one heuristic would be served under the other)."""
    return "" if choice == "inductor" else f"-reductions-{choice}"

