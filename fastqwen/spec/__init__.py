"""Speculative decoding: draft k tokens, verify them in one target step, accept a prefix, commit it.

verify.py: acceptance (greedy and rejection sampling), batched, on device.
loop.py: one speculative round over static buffers (compiled as one graph on CUDA).
"""
