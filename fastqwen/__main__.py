"""Demo: `python -m fastqwen [--model NAME]`.

Builds a random-init model of a real Qwen3.5 shape ("qwen3.5-9b" on a GPU, "tiny" on CPU), runs
transformers' own generate and fastqwen's on the same model in one process, and prints decode tok/s for
both beside the memory-bandwidth roofline.
"""

import argparse

import torch

from . import bench, presets


def main() -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3.5-9b" if cuda else "tiny", choices=presets.NAMES)
    p.add_argument("--prompt-len", type=int, default=512 if cuda else 32)
    args = p.parse_args()
    print(f"fastqwen demo: {args.model}, random weights, {'CUDA' if cuda else 'CPU'}, batch 1", flush=True)
    result = bench.run(
        args.model, systems=("hf-eager", "fastqwen"), prompt_len=args.prompt_len,
        n_short=32, n_long=160,  # (on CPU too: shorter runs drown in timing noise)
        dtype=torch.bfloat16 if cuda else torch.float32, device="cuda" if cuda else "cpu",
        progress=lambda msg: print(msg, flush=True),
    )
    print()
    print(bench.format_table([result]))


if __name__ == "__main__":
    main()
