import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastqwen import presets  # noqa: E402


def _share_the_cores():
    """Under pytest-xdist each worker is a process whose torch takes one intra-op thread a core: README's 2 workers
    on CI's 2 cores ran 4 threads, and small ops spun waiting on each other (tests/test_speculative.py took 159 s
    with them, 48 s with one thread a worker; 2026-12-07). Each worker takes its share of the cores, and so do
    the processes it starts. A user's OMP_NUM_THREADS is left as it is."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, torch.get_num_threads() // workers)  # (torch's default: the cores it may use)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


_share_the_cores()


def pytest_addoption(parser):
    parser.addoption("--no-autotune", action="store_true",
                     help="tests/benchmarks: compile with default inductor + CUDA graphs instead of max-autotune "
                          "(minutes less compile; what scripts/bench.py --no-autotune measures)")


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (README's test command: -n 2 --dist loadgroup) on a machine with CUDA, every test that
    takes the GPU (tests/gpu, tests/benchmarks, tests/test_cuda_kernels.py) runs in one worker, one at a time as
    without xdist, so that no two share the GPU's memory; the CPU tests spread over the workers."""
    if not (config.pluginmanager.hasplugin("xdist") and torch.cuda.is_available()):
        return
    for item in items:
        path = item.path
        if {"gpu", "benchmarks"} & set(path.parts[-2:-1]) or path.name == "test_cuda_kernels.py":
            item.add_marker(pytest.mark.xdist_group("gpu"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def fresh(name: str, **kw):
    """A random-init float32 preset model on the CPU (seed 0)."""
    return presets.build(name, dtype=torch.float32, **kw)


def assert_greedy_matches_up_to_a_near_tie(model, ids, got, expected, gap: float):
    """Greedy continuations `got` (fastqwen's) and `expected` (transformers') of one row `ids` [1, L] agree, or first
    differ where transformers' own top-2 logits lie within `gap` of each other (its fp32 forward over the shared
    prefix): for numerics that are discontinuous in their input (the fp8 scheme rounds activations to e4m3), two
    correct fp32 implementations that sum in different orders can flip a near-tie, and only there."""
    same = (got == expected)[0].tolist()
    if all(same):
        return
    first = same.index(False)
    assert first >= ids.shape[1], "the prompt itself differs"
    with torch.no_grad():
        logits = type(model).forward(model, expected[:, :first]).logits[0, -1].float()
    top = logits.topk(2).values
    assert (top[0] - top[1]).item() < gap, (f"greedy decode diverged at position {first} where transformers' top-2 "
                                            f"logits are {(top[0] - top[1]).item():.4f} apart (not a near-tie)")


def hf_generate(model, ids, mask=None, **kw):
    """transformers' own generate, also after fastqwen.optimize replaced model.generate."""
    return type(model).generate(model, ids, attention_mask=mask, do_sample=False, **kw)


def char_tokenizer(vocab_size: int = 512):
    """A tokenizer for the tiny presets' vocabulary, built offline: the 26 letters, then their pairs (ids in that
    order), decoded by concatenation, so that stop strings (which match decoded text) can span tokens."""
    import itertools
    import string

    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = list(string.ascii_lowercase) + ["".join(p) for p in itertools.product(string.ascii_lowercase, repeat=2)]
    tk = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces[:vocab_size])}, merges=[]))
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk)


def left_padded(rows, pad_id=0):
    """input_ids and attention_mask [B, L] for a list of 1-D token tensors, left-padded."""
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, L - len(r):] = r
        mask[b, L - len(r):] = 1
    return ids, mask


def run_in_triton_interpreter(code: str, *more: str, interpret: bool = True) -> str | list[str]:
    """Run `code` in a subprocess with TRITON_INTERPRET=1 (it must be set before any kernel is defined) and
    return its stdout; skip when Triton with numpy < 2.4 (its interpreter needs that) is not available, from
    $FASTQWEN_TRITON_SITE (a pip --target directory, .ci/run fills one: Triton installed beside CPU torch
    breaks torch.compile) or from this environment. `interpret=False`: the same Triton without the
    interpreter, for code that only compiles kernels (Triton ships its own ptxas, so no GPU is needed).
    `more` scripts: each in a subprocess of its own, all at once (the interpreter is one core's work; CI has
    two), and the list of their stdouts, `code`'s first."""
    import subprocess

    tests = os.path.dirname(os.path.abspath(__file__))
    paths = [os.environ.get("FASTQWEN_TRITON_SITE", ""), tests, os.path.dirname(tests), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    probe = "import numpy, triton; assert tuple(map(int, numpy.__version__.split('.')[:2])) < (2, 4)"
    if subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode:
        pytest.skip("needs triton and numpy < 2.4 (set FASTQWEN_TRITON_SITE to a pip --target dir with both)")
    runs = [subprocess.Popen([sys.executable, "-c", c], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for c in (code, *more)]
    outs = []
    for run in runs:
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, err[-3000:]
        outs.append(out)
    return outs if more else outs[0]
