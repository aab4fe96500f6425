"""Quantized linears: formats, checkpoint conversion and `quantize(model, scheme)`.

formats.py: quantize / dequantize references for fp8 (128×128 blocks, per row) and int4 (group-wise);
gptq.py: GPTQ (incl. act-order) and AWQ int4 checkpoints → our int4 layout, exactly, and back to GPTQ;
checkpoints.py: from_pretrained (Qwen's FP8, GPTQ and AWQ checkpoints) and save_pretrained (FP8, GPTQ);
linear.py: QuantLinear, `quantize` (a model's decoder) and `quantize_modules` (any module: speculative drafts);
experts.py: QuantExperts, a MoE layer's 3-D routed experts in the same formats.
"""

__all__ = ["SCHEMES", "QuantLinear", "quantize", "quantize_modules"]


def __getattr__(name):
    """Import linear.py on first use: ops/gemv.py (which linear.py uses) imports formats.py from here."""
    if name in __all__:
        from . import linear

        return getattr(linear, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
