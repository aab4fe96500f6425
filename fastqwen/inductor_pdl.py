"""Inductor's kernels letting the next kernel launch at their start (kernels={"launch": "pdl-early"}).

Under triton.enable_pdl inductor writes each kernel's `gdc_wait()` before its first read of what the previous
kernel wrote, and its `gdc_launch_dependents()` after its last load (torch/_inductor/codegen/triton.py,
_handle_pdl_after_load), which follows the wait. So the kernel after it launches only once its wait has
returned, i.e. once the kernel before it has completed: in a decode step a weight-streaming GEMV after a norm or
an activation gets, before its own wait, only that kernel's last ~1-2 µs to load weights in, whatever its own
prefetch depth (docs/DESIGN-NOTES.md, 2026-12-05). Here every inductor kernel starts with
`gdc_launch_dependents(); gdc_wait()` and has no other PDL line: the next kernel launches as soon as this one's
programs have started, and this one touches no memory before the kernel before it has completed. Ordering is
as sound as serial launch: every wait returns only once its predecessor, which waited for its own, has
completed, while inductor's own placement lets a kernel read what a kernel two back wrote before its wait.
What it asks of the kernels launched with PDL: as a chain of kernels that trigger at their start can all be
launched while the kernel before the chain still runs, a load issued before a kernel's wait must read nothing
an earlier kernel of the same graph writes: weights (the GEMVs', the conv's, the routers'), or a layer's GDN
state, which in a step graph only that layer's walk (decode) or, in a round, its verify reads and its commit
writes after its own wait.

`trigger_at_start()` holds while fastqwen compiles (Engine.generate); the code inductor writes meanwhile for
a CUDA device with PDL on gets the two lines at its start. The compiled step's cache key carries the choice
(generate.compile_cache_tag's tag), so neither placement is served from the other's cache.
"""

import contextlib

WAIT = "tl.extra.cuda.gdc_wait()"
LAUNCH = "tl.extra.cuda.gdc_launch_dependents()"

_early = False  # whether codegen now puts the trigger and the wait at each kernel's start


def at_start(lines: list) -> list:
    """A kernel body's lines (IndentedBuffer._lines: strings and markers) without its PDL lines, the trigger and
    the wait put first."""
    kept = [line for line in lines if not (isinstance(line, str) and (WAIT in line or LAUNCH in line))]
    return [LAUNCH, WAIT] + kept


@contextlib.contextmanager
def trigger_at_start(on: bool = True):
    """While held (on), inductor's PDL kernels are written with the trigger and the wait at their start."""
    global _early
    if on:
        _install()
    before, _early = _early, on
    try:
        yield
    finally:
        _early = before


def _install() -> None:
    """Wraps inductor's TritonKernel._filter_pdl (once): after its own filtering, at_start where asked for."""
    from torch._inductor.codegen.triton import TritonKernel

    if getattr(TritonKernel._filter_pdl, "_fastqwen", False):
        return
    filter_pdl = TritonKernel._filter_pdl

    def _filter(self, code):
        filter_pdl(self, code)
        if _early and self._enable_pdl_codegen():
            code._lines = at_start(code._lines)

    _filter._fastqwen = True
    TritonKernel._filter_pdl = _filter
