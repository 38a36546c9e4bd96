"""Segmented LoRA kernels (shrink / expand over per-token adapter segments) with a torch reference beside each.

`ops.lora_forward` is the one entry point (Triton, torch reference or FlashInfer); the ops read the step layout
(`sgl_multilora.segments.SegmentMeta`) and a weight table (`weights.py`). Kernels are compiled by `triton.jit` on
first launch (`jit.py`); without triton only the references run. This package lives inside `sgl_multilora`, never
as a top-level `triton_kernels`: that name is OpenAI's package, which SGLang imports.
"""
