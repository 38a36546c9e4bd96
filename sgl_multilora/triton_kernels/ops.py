"""The one call every LoRA layer makes: `lora_forward` (shrink then expand), dispatched by implementation name.

Implementations: `triton` (our kernels), `cpu` (the host op, `host.py`: the CPU serving path), `torch` (the
references, what the others are checked against), `flashinfer` (FlashInfer's segment GEMM, GPU only, imported on
first use), `auto` (triton on CUDA, cpu elsewhere). Not here: the kernels.
"""

from __future__ import annotations

import torch

from sgl_multilora.segments import SegmentMeta
from sgl_multilora.triton_kernels.expand import lora_expand, lora_expand_ref
from sgl_multilora.triton_kernels.host import lora_forward_host
from sgl_multilora.triton_kernels.shrink import lora_shrink, lora_shrink_ref
from sgl_multilora.triton_kernels.weights import LoRAWeights

IMPLS = ("auto", "triton", "cpu", "torch", "flashinfer")

__all__ = ["IMPLS", "LoRAWeights", "lora_forward", "resolve_impl", "shrink_buffer"]


def resolve_impl(impl: str, device: torch.device) -> str:
    """`auto` -> `triton` on CUDA, `cpu` elsewhere; an unknown name raises ValueError listing the choices."""
    if impl not in IMPLS:
        raise ValueError(f"unknown LoRA op implementation {impl!r}; choose one of {', '.join(IMPLS)}")
    if impl == "auto":
        return "triton" if device.type == "cuda" else "cpu"
    return impl


def shrink_buffer(num_tokens: int, weights: LoRAWeights, device: torch.device) -> torch.Tensor:
    """The intermediate t (float32, (num_tokens, num_slices * max_rank)); rows of no-adapter tokens are unused."""
    return torch.empty(num_tokens, weights.num_slices * weights.max_rank, dtype=torch.float32, device=device)


def lora_forward(
    x: torch.Tensor,
    y: torch.Tensor,
    meta: SegmentMeta,
    weights: LoRAWeights,
    impl: str = "auto",
    t: torch.Tensor | None = None,
) -> torch.Tensor:
    """Semantics: for each slot s, slice j and token i of slot s:
        y[i, off_j : off_{j+1}] += scale_s * (x[i] @ A_sj.T) @ B_sj.T

    x: (num_tokens, in); y: (num_tokens, out), same dtype as the weights, updated in place and returned;
    meta: the step layout prepared for x's rows (slot s reads weight entry s); t: optional shrink buffer (see
    `shrink_buffer`), reused to avoid an allocation. Tokens of NO_ADAPTER, and slots of rank 0, are not computed.
    """
    impl = resolve_impl(impl, x.device)
    if impl == "flashinfer":
        from sgl_multilora.triton_kernels.flashinfer import lora_forward_flashinfer

        return lora_forward_flashinfer(x, y, meta, weights)
    if impl == "cpu":
        return lora_forward_host(x, y, meta, weights)
    if t is None:
        t = shrink_buffer(x.shape[0], weights, x.device)
    if impl == "triton":
        lora_shrink(x, t, meta, weights)
        lora_expand(t, y, meta, weights)
    else:
        lora_shrink_ref(x, t, meta, weights)
        lora_expand_ref(t, y, meta, weights)
    return y
