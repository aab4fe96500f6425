"""Quality proxy for quantization without real weights: logits of a quantized random model against bf16.

    python scripts/quant_quality.py --model qwen3.5-27b --positions 256

Builds the preset (random weights, seed 0) in bf16, takes the logits at `--positions` positions of one random
sequence as the reference, then rebuilds the same weights for each scheme, quantizes (fastqwen.quant.quantize,
lm_head kept in bf16) and reports the logits' relative error (Frobenius) and top-1 agreement with the
reference, and each quantized linear's own output error on Gaussian inputs (median over the linears of the
first and last decoder layers): the format's error, before a random network amplifies it. Random networks
amplify small perturbations far more than trained ones (the tiny presets, with their large init, are
chaotic: fp8's ~3% per linear becomes ~40% at the logits), so the per-linear figure is the one to compare
across schemes; the logit figures are pessimistic proxies. To calibrate them, `--noise` levels ε perturb every
decoder linear's weights by unbiased relative noise, w·(1 + ε·N(0, 1)) (a per-linear error of ε), and report the
same figures: a scheme whose logit error sits at the noise row of its per-linear error adds nothing beyond its
size (no bias), and the noise rows show how much this random network amplifies any perturbation.
"""

import argparse
import copy
import gc
import json
import pathlib
import sys
import warnings

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from fastqwen import presets  # noqa: E402
from fastqwen.quant import SCHEMES, quantize  # noqa: E402


@torch.no_grad()
def logits_of(model, ids) -> torch.Tensor:
    return model(ids).logits[0].float()


@torch.no_grad()
def perturb_linears(model, eps: float) -> None:
    """w ← w·(1 + eps·N(0, 1)) for every nn.Linear of the decoder layers (lm_head kept, as the schemes keep it)."""
    gen = torch.Generator(device=model.device).manual_seed(1)
    for m in model.model.layers.modules():
        if isinstance(m, torch.nn.Linear):
            noise = torch.randn(m.weight.shape, generator=gen, device=m.weight.device, dtype=torch.float32)
            m.weight.copy_(m.weight.float() * (1 + eps * noise))


def main():
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3.5-27b" if cuda else "tiny", choices=presets.NAMES)
    p.add_argument("--positions", type=int, default=256)
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    p.add_argument("--group-size", type=int, default=128 if cuda else 32)
    p.add_argument("--noise", type=float, nargs="*", default=[0.003, 0.01, 0.03],
                   help="relative weight-noise levels to calibrate the logit figures against (none: skip)")
    p.add_argument("--json", type=pathlib.Path)
    args = p.parse_args()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    model = presets.build(args.model, dtype=dtype, device=device)
    ids = torch.randint(model.config.vocab_size, (1, args.positions), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    ref = logits_of(model, ids)
    res = {"model": args.model, "positions": args.positions, "group_size": args.group_size, "schemes": {}}
    for scheme in [*args.schemes, *(f"noise {eps:g}" for eps in args.noise)]:
        del model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        model = presets.build(args.model, dtype=dtype, device=device)  # the same weights (seed 0)
        layers = model.model.layers
        probed = {f"{i}.{n}": copy.deepcopy(m) for i in (0, len(layers) - 1) for n, m in layers[i].named_modules()
                  if isinstance(m, torch.nn.Linear)}  # (copies: noise perturbs the model's in place)
        if scheme.startswith("noise"):
            perturb_linears(model, float(scheme.split()[1]))
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the kept-layer list is printed by quantize() for users, not here
                quantize(model, scheme, group_size=args.group_size)
        quantized = {f"{i}.{n}": m for i in (0, len(layers) - 1) for n, m in layers[i].named_modules()}
        errs = []
        with torch.no_grad():
            for name, linear in probed.items():
                q = quantized[name]
                if not (type(q) is torch.nn.Linear and torch.equal(q.weight, linear.weight)):  # (kept: skipped)
                    x = torch.randn(16, linear.in_features, device=device, dtype=dtype)
                    ref_y = linear(x).float()
                    errs.append(((q(x).float() - ref_y).norm() / ref_y.norm()).item())
        del probed
        got = logits_of(model, ids)
        r = {"linear_rel_err_median": float(torch.tensor(errs).median()) if errs else None,
             "rel_err": ((got - ref).norm() / ref.norm()).item(),
             "top1_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item()}
        res["schemes"][scheme] = r
        print(f"{args.model} {scheme:11s} per-linear error {r['linear_rel_err_median']:.4f}, "
              f"logits relative error {r['rel_err']:.4f}, "
              f"top-1 agreement {r['top1_agreement']:.1%} over {args.positions} positions", flush=True)
        if args.json:
            args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
