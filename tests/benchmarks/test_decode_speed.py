"""pytest-benchmark suite for fastqwen generate: Qwen3.5-9B GPU benchmarks (plain, and speculative with the real
MTP or DFlash drafting compute at a fixed acceptance) and tiny CPU smoke variants.

    pytest tests/benchmarks --benchmark-only          # GPU benchmark is skipped without CUDA
    pytest tests/benchmarks --benchmark-only --no-autotune   # the GPU module compiled without max-autotune

Each benchmark times one end-to-end ``model.generate`` call (prefill + NEW_TOKENS decode steps, forced
with ``min_new_tokens``) and records end-to-end tokens/s per sequence in ``benchmark.extra_info``.
For prefill-free decode speed and baselines use ``scripts/bench.py`` and ``scripts/bench_spec.py``. The
speculative benchmarks impose the acceptance (``bench.OracleProposer(impose=True)``: random weights have none of
their own), so they guard the cost of a round, not acceptance; ``extra_info`` records the rounds and tokens a
round the call ran at. (Before 2026-12-07 session j the imposed counts' first round accepted every draft: the
baselines 0001 and 0002 ran DFlash's 64 tokens in 8 rounds, 7.9 tokens a round, not τ = 6.5's ~10; MTP's at 3.0.)
"""

import gc

import pytest
import torch

pytest.importorskip("pytest_benchmark")

NEW_TOKENS = 64


def _model_and_prompt(name: str, dtype: torch.dtype, device: str, prompt_len: int, compile: bool,
                      no_autotune: bool = False):
    """Random-init preset ``name`` optimized by fastqwen (warmed up), and a random [1, prompt_len] prompt;
    no_autotune: inductor's default compile with CUDA graphs instead of the engine's max-autotune."""
    import fastqwen
    from fastqwen import presets

    model = presets.build(name, dtype=dtype, device=device, seed=0)
    fastqwen.optimize(model, max_batch_size=1, max_seq_len=prompt_len + NEW_TOKENS + 64, compile=compile,
                      compile_options={"triton.cudagraphs": True} if no_autotune else None)
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
    spec = model._fastqwen.spec
    if spec is not None:  # (the last call's: every call of one length runs the same imposed rounds)
        benchmark.extra_info.update(rounds=int(spec.rounds[0]), tokens_per_round=spec.acceptance_length(1))


def _speculate(model, preset: str, k: int, tau: float, drafter: str | None) -> None:
    """Switch `model` to speculative decoding with k drafts a round and imposed mean acceptance tau, paying for
    `drafter`'s real compute ("mtp", "dflash") with random weights of its real shape, or for none."""
    from fastqwen import bench

    e = model._fastqwen
    reference = torch.zeros(1, NEW_TOKENS + k + 2, dtype=torch.long, device=e.device)
    oracle = bench.OracleProposer(reference, bench.miss_for_tau(tau, k), model.config.vocab_size, impose=True)
    e.enable_speculation(oracle, k)
    if drafter is not None:
        oracle.inner = bench.random_proposer(drafter, model, e, preset)


@pytest.fixture(scope="module")
def qwen9b(request):
    """Qwen3.5-9B shapes, bf16 on CUDA, optimized and warmed up once for this module."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    built = _model_and_prompt("qwen3.5-9b", torch.bfloat16, "cuda", 512, compile=True,
                              no_autotune=request.config.getoption("--no-autotune"))
    state = dict(zip(("model", "ids"), built))
    yield state
    state.clear()  # drop the model (and its CUDA graphs) before the next module runs
    gc.collect()
    torch.cuda.empty_cache()


def test_decode_speed_qwen9b_bf16(benchmark, qwen9b):
    """End-to-end generate speed of Qwen3.5-9B (bf16, batch 1, 512-token prompt) on the GPU."""
    _bench_generate(benchmark, qwen9b["model"], qwen9b["ids"])


def test_speculative_speed_qwen9b_mtp_k3_tau3(benchmark, qwen9b):
    """MTP k=3 at τ=3 on Qwen3.5-9B (bf16, batch 1). Runs after the plain benchmark (file order): it switches the
    shared model to speculative decoding."""
    _speculate(qwen9b["model"], "qwen3.5-9b", k=3, tau=3.0, drafter="mtp")
    _bench_generate(benchmark, qwen9b["model"], qwen9b["ids"])


def test_speculative_speed_qwen9b_dflash_k15_tau65(benchmark, qwen9b):
    """DFlash k=15 at τ=6.5 on Qwen3.5-9B with a random draft of the real 9B-draft shape (after the MTP one)."""
    _speculate(qwen9b["model"], "qwen3.5-9b", k=15, tau=6.5, drafter="dflash")
    _bench_generate(benchmark, qwen9b["model"], qwen9b["ids"])


def test_decode_speed_tiny_cpu(benchmark):
    """CPU smoke variant: the "tiny" preset in float32 without compilation; always runs."""
    model, ids = _model_and_prompt("tiny", torch.float32, "cpu", prompt_len=16, compile=False)
    _bench_generate(benchmark, model, ids)


def test_speculative_speed_tiny_cpu(benchmark):
    """CPU smoke variant of the speculative loop: tiny, 4 drafts a round at τ = 2.5, no drafting model."""
    model, ids = _model_and_prompt("tiny", torch.float32, "cpu", prompt_len=16, compile=False)
    _speculate(model, "tiny", k=4, tau=2.5, drafter=None)
    _bench_generate(benchmark, model, ids)
