"""The compiled decode step: same tokens as eager, one graph, no recompilation across calls."""

import torch
from conftest import fresh, left_padded
from torch._dynamo.utils import counters

import fastqwen


def test_compiled_step_matches_eager_and_never_recompiles():
    eager = fastqwen.optimize(fresh("tiny"), max_batch_size=3, max_seq_len=128, compile=False)
    compiled = fastqwen.optimize(fresh("tiny"), max_batch_size=3, max_seq_len=128, compile=True)
    torch._dynamo.reset()
    counters.clear()
    calls = [
        left_padded([torch.randint(1, 500, (n,)) for n in (9, 30)]),
        (torch.randint(1, 500, (1, 70)), None),
        left_padded([torch.randint(1, 500, (n,)) for n in (5, 64, 17)]),
    ]
    for i, (ids, mask) in enumerate(calls):
        expected = eager.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
        if i == 0:
            got = compiled.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
            graphs = counters["stats"]["unique_graphs"]
            assert graphs == 1
        else:
            with torch._dynamo.config.patch(error_on_recompile=True):
                got = compiled.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
        assert torch.equal(got, expected)
    assert counters["stats"]["unique_graphs"] == graphs, "a later call compiled a new graph"
    assert sum(counters["recompiles"].values()) == 0
