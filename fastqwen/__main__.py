"""Demo: `python -m fastqwen [--model NAME | --checkpoint DIR]`.

Builds a random-init model of a real Qwen3.5 shape ("qwen3.5-9b" on a GPU, "tiny" on CPU), or loads a local
checkpoint (bf16, or pre-quantized: FP8, GPTQ, AWQ, compressed-tensors), runs transformers' own generate and
fastqwen's on the same model in one process, and prints decode tok/s for both beside the memory-bandwidth roofline.
"""

import argparse
from pathlib import Path

import torch

from . import bench, presets


def load_checkpoint(path: str, dtype: torch.dtype, device: str):
    """The model of a local checkpoint directory: through fastqwen.from_pretrained when it is quantized (its layers
    stay quantized), else transformers' from_pretrained."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .quant.checkpoints import from_pretrained

    if not Path(path, "config.json").is_file():
        raise SystemExit(f"--checkpoint {path}: no config.json there; pass a local checkpoint directory")
    if getattr(AutoConfig.from_pretrained(path), "quantization_config", None) is not None:
        return from_pretrained(path, dtype=dtype, device=device)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)


def main() -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model", default="qwen3.5-9b" if cuda else "tiny", choices=presets.NAMES)
    which.add_argument("--checkpoint", metavar="DIR", help="a local Qwen3.5 checkpoint in place of random weights")
    p.add_argument("--prompt-len", type=bench.positive_int, default=512 if cuda else 32)
    args = p.parse_args()
    dtype, device = (torch.bfloat16, "cuda") if cuda else (torch.float32, "cpu")
    name, model = args.model, None
    if args.checkpoint:
        name, model = Path(args.checkpoint).name, load_checkpoint(args.checkpoint, dtype, device).eval()
    weights = f"checkpoint {args.checkpoint}" if args.checkpoint else "random weights"
    print(f"fastqwen demo: {name}, {weights}, {'CUDA' if cuda else 'CPU'}, batch 1", flush=True)
    result = bench.run(
        name, model=model, systems=("hf-eager", "fastqwen"), prompt_len=args.prompt_len,
        n_short=32, n_long=160,  # (on CPU too: shorter runs drown in timing noise)
        dtype=dtype, device=device, progress=lambda msg: print(msg, flush=True),
    )
    print()
    print(bench.format_table([result]))


if __name__ == "__main__":
    main()
