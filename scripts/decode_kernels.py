"""The kernels inductor writes for fastqwen's decode step (or a speculative verify) on a GPU, listed without a GPU.

    python scripts/decode_kernels.py --model tiny
    python scripts/decode_kernels.py --model qwen3.5-9b --layers 4 --kernels conv=separate
    python scripts/decode_kernels.py --model qwen3.5-27b --layers 4 --verify 16 --kernels linears=gemv conv=fused-verify

Needs Triton beside torch (on a CPU-only machine: a `pip install --target` directory on PYTHONPATH, as
tests/conftest.py uses). Inductor's Triton backend is asked to compile the step for CPU tensors: the same
graph passes and mostly the same scheduler and fusion decisions as on a GPU (its realize thresholds are set to
the GPU's here), but not all: inductor reorders loops to fuse only for GPU nodes, and our quantized CUDA
kernels run their dequantizing references off the GPU. So read it as a lower bound on the GPU's launches: in a
27B int4 step on an H100 (2026-12-05 profile) each per-head norm (attention q/k, GDN gated) ran as a reduction
kernel and a pointwise one, where this lists one (launch configs and autotuning aside too). Triton has no CPU backend to compile them, so the kernels are not
compiled and running the step fails after codegen; the script catches that. Prints the decode step's launches
per step, then each inductor kernel with its launches; --names prints only the sorted kernel names (a Python
list, for tests). Our own ops (weight streaming, GDN, conv, attention) run as the graph's extern calls and are
not listed. Use it to check that a change removes launches before spending GPU time on timing it.
"""

import argparse
import ast
import contextlib
import re

import torch


@contextlib.contextmanager
def written_kernels():
    """Inductor's Triton backend writing kernels for CPU tensors, none compiled (no Triton backend compiles for
    CPU: running a compiled function fails after codegen, which the caller catches): yields the list each
    compiled graph's Python source, its Triton kernels included, is appended to."""
    import torch._inductor.config as inductor_config
    import torch.utils._triton as triton_utils
    from torch._inductor.graph import GraphLowering
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    codes = []
    codegen = GraphLowering.codegen

    def keep(self):
        result = codegen(self)
        codes.append(result[0].value)
        return result

    saved = (inductor_config.cpu_backend, inductor_config.fx_graph_cache, triton_utils.triton_hash_with_backend,
             CachingAutotuner.precompile, inductor_config.realize_opcount_threshold,
             inductor_config.realize_acc_reads_threshold)
    inductor_config.cpu_backend, inductor_config.fx_graph_cache = "triton", False
    # (unset, CPU tensors take the CPU's thresholds, 50 and 12: store-or-recompute decisions unlike a GPU's)
    inductor_config.realize_opcount_threshold = inductor_config._realize_opcount_threshold_default
    inductor_config.realize_acc_reads_threshold = inductor_config._realize_acc_reads_threshold_default
    triton_utils.triton_hash_with_backend = lambda: "cpu"  # (it asks the GPU driver)
    CachingAutotuner.precompile = lambda self, *args, **kw: None  # (no Triton backend compiles for CPU)
    GraphLowering.codegen = keep
    try:
        yield codes
    finally:
        (inductor_config.cpu_backend, inductor_config.fx_graph_cache, triton_utils.triton_hash_with_backend,
         CachingAutotuner.precompile, inductor_config.realize_opcount_threshold,
         inductor_config.realize_acc_reads_threshold) = saved
        GraphLowering.codegen = codegen


def kernel_names(fn, *args) -> list[str]:
    """The Triton kernels inductor writes for torch.compile(fn)(*args) (CPU tensors), in launch order."""
    torch._dynamo.reset()
    with written_kernels() as codes:
        try:
            torch.compile(fn)(*args)
        except Exception:  # (the uncompiled kernels)
            pass
    return [name for code in codes for name in re.findall(r"\n\s+(triton_\w+)\.run\(", code)]


def decode_step_code(model: str, layers: int | None, kernels: dict, options: dict | None = None,
                     verify: int = 0) -> str:
    """The Python source inductor generates for the decode step of `model` (a preset, bf16, random weights,
    its first `layers` layers; `options`: inductor options, optimize's compile_options), its Triton kernels
    included; with `verify` T, for the speculative verify of a block of T positions instead (bench_spec's: every
    row marked done, so the step computes and advances nothing)."""
    import fastqwen
    from fastqwen import presets
    from fastqwen.bench import OracleProposer

    built = presets.build(model, dtype=torch.bfloat16, layers=layers)
    with written_kernels() as codes:
        model_ = fastqwen.optimize(built, max_seq_len=64, compile=True, kernels=kernels, compile_options=options)
        try:
            if verify:
                e = model_._fastqwen
                e.enable_speculation(OracleProposer(torch.ones(1, 64, dtype=torch.long), 1.0, built.config.vocab_size),
                                     verify - 1)
                e.state["done"].fill_(True)
                tokens = torch.zeros(e.max_batch_size, verify, dtype=torch.long)
                e.compile(lambda: e.forward.step(tokens, verify=True))()
            else:
                model_.generate(torch.randint(1, 500, (1, 9)), max_new_tokens=3, do_sample=False)
        except Exception:  # (the uncompiled kernels: expected once the step's code exists)
            pass
    marks = ("gdn_verify",) if verify else ("split_kv_partials", "gdn_decode")  # the step's graph
    found = [c for c in codes if any(mark in c for mark in marks)]
    if not found:
        raise RuntimeError(f"no {'verify' if verify else 'decode'} step among the {len(codes)} graphs compiled")
    return found[0]


def launches(code: str) -> dict[str, int]:
    """Each Triton kernel defined in `code` → how many times its graph launches it."""
    calls = re.findall(r"\n\s+(triton_\w+)\.run\(", code)
    return {name: calls.count(name) for name in re.findall(r"def (triton_\w+)\(", code)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="a preset (fastqwen.presets)")
    p.add_argument("--layers", type=int, help="keep only the first LAYERS decoder layers")
    p.add_argument("--kernels", nargs="*", default=["linears=gemv"], metavar="OP=CHOICE",
                   help="optimize's kernels option (default linears=gemv: on CPU 'auto' streams nothing)")
    p.add_argument("--inductor", nargs="*", default=[], metavar="OPTION=VALUE",
                   help="inductor options (Python literals), e.g. score_fusion_memory_threshold=1")
    p.add_argument("--names", action="store_true", help="print only the sorted kernel names, as a Python list")
    p.add_argument("--verify", type=int, default=0, metavar="T",
                   help="a speculative verify of T positions instead of the decode step")
    args = p.parse_args()
    options = {k: ast.literal_eval(v) for k, v in (kv.split("=", 1) for kv in args.inductor)} or None
    counts = launches(decode_step_code(args.model, args.layers, dict(kv.split("=", 1) for kv in args.kernels),
                                       options, args.verify))
    if args.names:
        print(sorted(counts))
        return
    print(f"{sum(counts.values())} inductor launches a {f'verify of {args.verify}' if args.verify else 'decode step'} "
          f"({args.model}"
          f"{f', {args.layers} layers' if args.layers else ''})")
    for name, n in counts.items():
        print(f"{n:4d}  {name}")


if __name__ == "__main__":
    main()
