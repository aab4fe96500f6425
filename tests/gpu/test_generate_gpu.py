"""bf16 fastqwen generate on the real 9B shape against transformers' static-cache generate.

In bf16 two correct implementations (different kernels, different reduction orders) pick different greedy
tokens where the top candidates nearly tie, and from there the texts differ. So each comparison finds every
divergence and checks that it sits on a near-tie: the exact (fp32) logits of the two candidates must be
closer than HF's own bf16 error there, i.e. HF's pick is no more right than ours.
"""

import torch
from conftest import assert_near_ties, first_divergence

NEW = 32


def divergences_from_hf(model, prompt, n):
    """Walk n greedy tokens after `prompt`: wherever our token differs from HF's, record the divergence
    (prefix, HF's token, ours) and resume both from the prefix extended by HF's token. Returns the
    divergences and the number of tokens that agreed."""
    prefix, left, found = prompt, n, []
    while left > 0:
        ref = model.hf_generate(prefix[None], max_new_tokens=left, do_sample=False, cache_implementation="static",
                                disable_compile=True)[0, len(prefix):]
        got = model.generate(prefix[None], max_new_tokens=left, do_sample=False)[0, len(prefix):]
        d = first_divergence(got, ref, prefix)
        if d is None:
            break
        found.append(d)
        j = d[0].shape[1] - len(prefix)
        prefix, left = torch.cat([prefix, ref[: j + 1]]), left - j - 1
    return found, n - len(found)


def test_greedy_agrees_with_hf_static_cache_up_to_near_ties(model9b):
    """Every one of NEW tokens after three prompts either agrees with HF or sits on a near-tie."""
    torch.manual_seed(0)
    prompts = [torch.randint(0, model9b.config.vocab_size, (n,), device="cuda") for n in (512, 77, 200)]
    walks = [divergences_from_hf(model9b, p, NEW) for p in prompts]
    print(f"tokens equal to HF's: {sum(a for _, a in walks)}/{NEW * len(prompts)}, "
          f"divergences: {sum(len(d) for d, _ in walks)}")
    assert_near_ties(model9b, [d for found, _ in walks for d in found])


def test_ragged_batch_rows_match_rows_alone_and_no_recompile(model9b):
    """Each row of a left-padded batch gives the tokens it gets alone, up to bf16 near-ties (exact in fp32 on
    CPU: tests/test_generate_parity.py); no call recompiles."""
    model = model9b
    torch.manual_seed(1)
    rows = [torch.randint(0, model.config.vocab_size, (n,), device="cuda") for n in (300, 40, 129)]
    L = 300
    ids = torch.zeros(3, L, dtype=torch.long, device="cuda")
    mask = torch.zeros(3, L, dtype=torch.long, device="cuda")
    for b, r in enumerate(rows):
        ids[b, L - len(r):], mask[b, L - len(r):] = r, 1
    with torch._dynamo.config.patch(error_on_recompile=True):
        batch = model.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False)[:, L:]
        alone = [model.generate(r[None], max_new_tokens=32, do_sample=False)[0, len(r):] for r in rows]
    divergences = [first_divergence(batch[b], alone[b], rows[b]) for b in range(3)]
    print(f"rows identical to their single-row runs: {sum(d is None for d in divergences)}/3")
    assert_near_ties(model, [d for d in divergences if d is not None])


def test_sampled_ragged_batch_is_seeded_and_stays_in_vocab(model9b):
    """Sampling (the second compiled graph) on a left-padded batch: seeded runs repeat, tokens are valid."""
    ids = torch.randint(0, model9b.config.vocab_size, (3, 40), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :25] = mask[2, :3] = 0
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        runs.append(model9b.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=True, temperature=0.8,
                                     top_k=50, top_p=0.9))
    assert runs[0].shape == (3, 56) and torch.equal(runs[0], runs[1])
    assert (runs[0][:, 40:] < model9b.config.vocab_size).all()


def test_chunked_prefill_gives_the_tokens_of_one_prefill(model9b):
    """A 700-token prompt in chunks of 256 (attention over the cached prefix, GDN state carried) gives the
    tokens of one prefill, up to bf16 near-ties (exact in fp32 on CPU: tests/test_generate_parity.py)."""
    torch.manual_seed(2)
    prompt = torch.randint(0, model9b.config.vocab_size, (700,), device="cuda")
    engine = model9b._fastqwen
    whole = model9b.generate(prompt[None], max_new_tokens=NEW, do_sample=False)[0, len(prompt):]
    budget, engine.prefill_chunk_tokens = engine.prefill_chunk_tokens, 256
    try:
        chunked = model9b.generate(prompt[None], max_new_tokens=NEW, do_sample=False)[0, len(prompt):]
    finally:
        engine.prefill_chunk_tokens = budget
    d = first_divergence(chunked, whole, prompt)
    print(f"chunked prefill: {'identical' if d is None else 'diverged'} over {NEW} tokens")
    assert_near_ties(model9b, [d])


def test_batch_one_engine_matches_hf_in_fp32():
    """The batch-1 engine (max_batch_size=1: the packed GDN decode input, ops/gdn.gdn_decode) at the 9B width
    with 4 layers (3 GDN, 1 attention), fp32 so that greedy tokens must equal transformers' unless the top two
    logits of HF's own fp32 forward lie within 1e-3."""
    import fastqwen
    from fastqwen import presets
    from transformers import Qwen3_5ForCausalLM

    from conftest import COMPILE

    cfg = presets.config("qwen3.5-9b")
    cfg.num_hidden_layers, cfg.layer_types = 4, cfg.layer_types[:4]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3_5ForCausalLM._from_config(cfg, dtype=torch.float32)
    presets.perturb_zero_init(model, std=0.02)
    model.eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, 40), device="cuda")
    ref = model.generate(prompt, max_new_tokens=NEW, do_sample=False)[0, 40:]
    fastqwen.optimize(model, max_batch_size=1, max_seq_len=128, compile_options=COMPILE)
    got = model.generate(prompt, max_new_tokens=NEW, do_sample=False)[0, 40:]
    d = first_divergence(got, ref, prompt[0])
    if d is not None:
        with torch.no_grad():
            top2 = type(model).__call__(model, d[0]).logits[0, -1].topk(2).values
        assert (top2[0] - top2[1]).item() < 1e-3, f"diverged after {d[0].shape[1]} tokens, not on a near-tie"


def test_moe_engine_decodes_as_transformers_up_to_near_ties():
    """The 35B-A3B width with 4 layers (3 GDN, 1 attention; 256 experts and the shared one), bf16, with its
    default decode kernels (grouped experts, the shared expert stacked, the router matmul and routing in one
    launch, the counts they share reserved before capture) in CUDA graphs: every greedy token is the fp32
    model's argmax after our own prefix, or closer to it than HF's own bf16 error there."""
    import copy

    import fastqwen
    from fastqwen import presets
    from torch._dynamo.utils import counters

    from conftest import COMPILE

    model = presets.build("qwen3.5-35b-a3b", dtype=torch.bfloat16, device="cuda", layers=4)
    exact = copy.deepcopy(model).float()
    torch.manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (1, 40), device="cuda")
    fastqwen.optimize(model, max_batch_size=1, max_seq_len=128, compile_options=COMPILE)
    kernels = model._fastqwen.forward.kernels
    assert kernels["route"] == "fused" and kernels["experts"] == "grouped", kernels
    counters.clear()
    got = model.generate(prompt, max_new_tokens=NEW, do_sample=False)
    assert counters["inductor"]["cudagraph_skips"] == 0, "the decode step must run as a CUDA graph"
    with torch.no_grad():
        l32 = exact(got[:, :-1]).logits[0, 39:].float()
        l16 = type(model).__call__(model, got[:, :-1]).logits[0, 39:].float()
    ours = got[0, 40:]
    gap = l32.max(-1).values - l32.gather(1, ours[:, None])[:, 0]
    hf_error = (l16 - l32).abs().max(-1).values
    print(f"argmax agreement {(gap == 0).float().mean().item():.2f}, largest gap {gap.max().item():.4f}")
    assert (gap <= 2 * hf_error).all(), (gap, hf_error)
