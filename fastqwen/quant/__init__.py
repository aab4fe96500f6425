"""Quantized linears: formats, checkpoint conversion and `quantize(model, scheme)`.

formats.py: quantize / dequantize references for fp8 (128×128 blocks, per row) and int4 (group-wise);
gptq.py: GPTQ (incl. act-order) and AWQ int4 checkpoints → our int4 layout, exactly;
linear.py: QuantLinear and `quantize`.
"""

from .linear import SCHEMES, QuantLinear, quantize

__all__ = ["SCHEMES", "QuantLinear", "quantize"]
