import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastqwen import presets  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def fresh(name: str, **kw):
    """A random-init float32 preset model on the CPU (seed 0)."""
    return presets.build(name, dtype=torch.float32, **kw)


def hf_generate(model, ids, mask=None, **kw):
    """transformers' own generate, also after fastqwen.optimize replaced model.generate."""
    return type(model).generate(model, ids, attention_mask=mask, do_sample=False, **kw)


def left_padded(rows, pad_id=0):
    """input_ids and attention_mask [B, L] for a list of 1-D token tensors, left-padded."""
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, L - len(r):] = r
        mask[b, L - len(r):] = 1
    return ids, mask
