"""Segmented LoRA kernels (shrink / expand over per-token adapter segments) with a torch reference beside each.

`ops.lora_forward` is the one entry point (Triton, torch reference or FlashInfer); `layout.py` holds what the ops
read. Kernels are compiled by `triton.jit` on first launch (`jit.py`); without triton only the references run.
"""
