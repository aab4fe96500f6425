"""The README's demo (`python -m fastqwen`) on a checkpoint written here: a quantized one loads through
fastqwen.from_pretrained and both systems are timed on it."""

import sys

import pytest
import torch
from conftest import fresh

import fastqwen
from fastqwen.__main__ import main
from fastqwen.quant import quantize


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU demo (a GPU runs the 9B's)")
def test_demo_runs_on_a_quantized_checkpoint(tmp_path, monkeypatch, capsys):
    path = fastqwen.save_pretrained(quantize(fresh("tiny"), "fp8-weight"), tmp_path / "tiny-fp8")
    monkeypatch.setattr(sys, "argv", ["fastqwen", "--checkpoint", str(path), "--prompt-len", "8"])
    main()
    out = capsys.readouterr().out
    assert f"fastqwen demo: tiny-fp8, checkpoint {path}, CPU" in out
    row = next(line for line in out.splitlines() if line.startswith("| tiny-fp8 |"))
    hf, fast = (float(row.split("|")[i]) for i in (4, 6))  # (hf-eager and fastqwen tok/s)
    assert hf > 0 and fast > 0


def test_demo_refuses_a_directory_without_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["fastqwen", "--checkpoint", str(tmp_path)])
    with pytest.raises(SystemExit, match="no config.json there; pass a local checkpoint directory"):
        main()


def test_demo_refuses_a_prompt_length_below_one(monkeypatch, capsys):
    """--prompt-len 0 timed nothing (every system "error"), a negative one crashed in torch.randint after the model
    was built: refused at the command line, as the benchmark scripts' lengths and batch sizes are."""
    for bad in ("0", "-5"):
        monkeypatch.setattr(sys, "argv", ["fastqwen", "--prompt-len", bad])
        with pytest.raises(SystemExit):
            main()
        assert f"--prompt-len: must be a positive int, got {bad}" in capsys.readouterr().err
