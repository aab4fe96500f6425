import functools

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("tests/gpu need CUDA", allow_module_level=True)

# Default inductor + CUDA graphs: the shipped graph but for max-autotune's GEMM choice, which
# scripts/bench.py exercises; this keeps tests/gpu inside one device call.
COMPILE = {"triton.cudagraphs": True}


@pytest.fixture(scope="session")
def model9b():
    """The real 9B shape, random weights, bf16, optimized once for the session (batch 3, 1024 positions);
    `hf_generate` keeps transformers' own generate. Each test that enables speculation disables it again."""
    import fastqwen
    from fastqwen import presets
    from torch._dynamo.utils import counters

    model = presets.build("qwen3.5-9b", dtype=torch.bfloat16, device="cuda")
    model.hf_generate = type(model).generate.__get__(model)
    fastqwen.optimize(model, max_batch_size=3, max_seq_len=1024, compile_options=COMPILE)
    counters.clear()
    model._fastqwen.warmup()
    assert counters["inductor"]["cudagraph_skips"] == 0, "the decode step must run as a CUDA graph"
    return model


def moe_block_35b():
    """A Qwen3.5-35B-A3B sparse MoE block (256 experts + the shared one) on CUDA, bf16, random weights (seed 0,
    std 0.02: never zero)."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    from fastqwen import presets

    torch.manual_seed(0)
    with torch.device("cuda"):
        block = Qwen3_5MoeSparseMoeBlock(presets.config("qwen3.5-35b-a3b")).to(torch.bfloat16)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return block


def poison_allocator(*shapes, dtype=torch.bfloat16):
    """Fill freed allocator blocks of these shapes with NaN, so an output the op fails to write reads NaN."""
    blocks = [torch.full(s, float("nan"), dtype=dtype, device="cuda") for s in shapes]
    del blocks


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm()).item()


def first_divergence(got, ref, prompt):
    """None if the token rows agree, else (prefix up to the divergence [1, n], ref token, our token)."""
    diff = (got != ref).nonzero()
    if len(diff) == 0:
        return None
    j = int(diff[0])
    return torch.cat([prompt, ref[:j]])[None], int(ref[j]), int(got[j])


def assert_near_ties(model, divergences, preset="qwen3.5-9b"):
    """Each divergence (prefix, reference token, our token) must sit on a near-tie: the exact (fp32) logits
    of the two candidates are closer than HF's own bf16 error there, so the reference's pick is no more
    right than ours."""
    divergences = [d for d in divergences if d is not None]
    if not divergences:
        return
    exact = _fp32_copy(model, preset)
    with torch.no_grad():
        for prefix, ref_tok, our_tok in divergences:
            l32 = exact(prefix).logits[0, -1]
            l16 = type(model).__call__(model, prefix).logits[0, -1].float()
            top = l32.topk(10).indices
            hf_error = (l16[top] - l32[top]).abs().max().item()
            gap = abs(l32[ref_tok] - l32[our_tok]).item()
            print(f"divergence after {prefix.shape[1]} tokens: fp32 gap {gap:.4f}, HF bf16 error {hf_error:.4f}")
            assert gap <= 2 * hf_error, f"not a near-tie: fp32 gap {gap:.4f} > 2 x HF's bf16 error {hf_error:.4f}"


@functools.cache
def _fp32_copy(model, preset):
    """An fp32 model with the same weights (built once per session)."""
    from fastqwen import presets

    exact = presets.build(preset, dtype=torch.float32, device="cuda")
    exact.load_state_dict(model.state_dict())
    return exact
