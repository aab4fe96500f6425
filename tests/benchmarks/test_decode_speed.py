"""pytest-benchmark suite for fastqwen generate: a Qwen3.5-9B GPU benchmark and a tiny CPU smoke variant.

    pytest tests/benchmarks --benchmark-only          # GPU benchmark is skipped without CUDA

Each benchmark times one end-to-end ``model.generate`` call (prefill + NEW_TOKENS decode steps, forced
with ``min_new_tokens``) and records end-to-end tokens/s per sequence in ``benchmark.extra_info``.
For prefill-free decode speed and baselines use ``scripts/bench.py``.
"""

import gc

import pytest
import torch

pytest.importorskip("pytest_benchmark")

NEW_TOKENS = 64


def _model_and_prompt(name: str, dtype: torch.dtype, device: str, prompt_len: int, compile: bool):
    """Random-init preset ``name`` optimized by fastqwen (warmed up), and a random [1, prompt_len] prompt."""
    import fastqwen
    from fastqwen import presets

    model = presets.build(name, dtype=dtype, device=device, seed=0)
    fastqwen.optimize(model, max_batch_size=1, max_seq_len=prompt_len + NEW_TOKENS + 64, compile=compile)
    model._fastqwen.warmup(progress=None)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(model.config.vocab_size, (1, prompt_len), generator=gen).to(device)
    return model, ids


def _bench_generate(benchmark, model, ids: torch.Tensor) -> None:
    """Benchmark one greedy ``NEW_TOKENS``-token generate call; record tokens/s in ``extra_info``."""
    cuda = ids.device.type == "cuda"

    def call() -> torch.Tensor:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False)
        if cuda:
            torch.cuda.synchronize()
        return out

    out = benchmark.pedantic(call, rounds=3, warmup_rounds=1)
    assert out.shape == (1, ids.shape[1] + NEW_TOKENS)
    benchmark.extra_info.update(prompt_len=ids.shape[1], new_tokens=NEW_TOKENS)
    if benchmark.stats:  # None under --benchmark-disable
        benchmark.extra_info["tok_per_s"] = NEW_TOKENS / benchmark.stats.stats.median


@pytest.fixture(scope="module")
def qwen9b():
    """Qwen3.5-9B shapes, bf16 on CUDA, optimized and warmed up once for this module."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    state = dict(zip(("model", "ids"), _model_and_prompt("qwen3.5-9b", torch.bfloat16, "cuda", 512, compile=True)))
    yield state
    state.clear()  # drop the model (and its CUDA graphs) before the next module runs
    gc.collect()
    torch.cuda.empty_cache()


def test_decode_speed_qwen9b_bf16(benchmark, qwen9b):
    """End-to-end generate speed of Qwen3.5-9B (bf16, batch 1, 512-token prompt) on the GPU."""
    _bench_generate(benchmark, qwen9b["model"], qwen9b["ids"])


def test_decode_speed_tiny_cpu(benchmark):
    """CPU smoke variant: the "tiny" preset in float32 without compilation; always runs."""
    model, ids = _model_and_prompt("tiny", torch.float32, "cpu", prompt_len=16, compile=False)
    _bench_generate(benchmark, model, ids)
