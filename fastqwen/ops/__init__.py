"""Ops of the Qwen3.5 forward: each file holds a plain torch reference and, where one pays, a CUDA fast path.

- norm.py: RMSNorm (`1 + w`), gated RMSNorm, l2norm: torch code that inductor fuses into the neighbouring ops.
- conv.py: causal depthwise conv1d with a rolling state: torch code that inductor fuses (kernel width 4).
- gdn.py: the gated delta rule: registered custom ops over flash-linear-attention's Triton kernels on CUDA.
- attention.py: attention over the static KV cache with per-row positions, via scaled_dot_product_attention.
"""
