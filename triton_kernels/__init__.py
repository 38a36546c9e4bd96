"""Segmented LoRA kernels (shrink / expand over per-token adapter segments) with a torch reference beside each.

Only the Triton launchers import triton, lazily; the references are plain torch and serve the CPU path.
"""
