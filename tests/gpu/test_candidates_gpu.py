"""Every kernel candidate of optimize(kernels=...) at once on the real 9B shape (bf16): greedy tokens agree
with the default engine's up to near-ties. A candidate becomes a default only after this passes (and measures
faster). Not in `gpu_check.sh tests` (its compile would not fit the call); `gpu_check.sh candidate-tests`."""

import pytest
import torch
from conftest import COMPILE, assert_near_ties, first_divergence

CANDIDATES = {"attention": "sdpa", "linears": "gemv", "gdn": "fla", "launch": "serial", "splitk": "fixup",
              "reductions": "inductor", "attn_glue": "separate", "gdn_norm": "separate"}  # the defaults' alternatives


@pytest.mark.candidates
def test_candidate_kernels_agree_with_the_default_up_to_near_ties(model9b):
    import fastqwen

    torch.manual_seed(2)
    prompts = [torch.randint(0, model9b.config.vocab_size, (n,), device="cuda") for n in (512, 77)]
    default = [model9b.generate(p[None], max_new_tokens=24, do_sample=False)[0, len(p):] for p in prompts]
    fastqwen.optimize(model9b, max_batch_size=3, max_seq_len=1024, compile_options=COMPILE, kernels=CANDIDATES)
    try:
        got = [model9b.generate(p[None], max_new_tokens=24, do_sample=False)[0, len(p):] for p in prompts]
    finally:  # the session's other tests expect the default engine
        fastqwen.optimize(model9b, max_batch_size=3, max_seq_len=1024, compile_options=COMPILE)
        model9b._fastqwen.warmup()
    divergences = [first_divergence(g, d, p) for g, d, p in zip(got, default, prompts)]
    print(f"prompts identical to the default kernels': {sum(d is None for d in divergences)}/{len(prompts)}")
    assert_near_ties(model9b, [d for d in divergences if d is not None])
