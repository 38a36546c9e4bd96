"""The segmented LoRA op over `SegmentMeta` token groups in plain torch (shrink then expand), kept as an oracle.

The serving path calls `ops.lora_forward` (its torch reference on a CPU, the Triton kernels on a GPU).

Semantics: for each token group g (tokens T_g, adapter weights A_g: (r_g, in), B_g: (out, r_g), scale s_g):
    y[T_g] += s_g * (x[T_g] @ A_g.T) @ B_g.T
Tokens in no group are untouched and cost nothing. Ranks may differ between groups (no padding to a maximum rank).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def lora_shrink_expand_ref(
    x: torch.Tensor,
    y: torch.Tensor,
    token_index: Sequence[torch.Tensor],
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    scalings: Sequence[float],
) -> None:
    """Adds the LoRA delta of every group into `y` in place.

    x: (num_tokens, in); y: (num_tokens, out), written in place; token_index[g]: int64 row indices of group g;
    lora_a[g]: (r_g, in); lora_b[g]: (out, r_g); scalings[g]: float. All tensors on one device, x/y/weights one dtype.
    """
    for rows, a, b, scale in zip(token_index, lora_a, lora_b, scalings):
        if rows.numel() == 0:
            continue
        if rows.numel() == x.shape[0]:  # the whole batch on one adapter: no gather / scatter
            y.addmm_(x @ a.t(), b.t(), alpha=scale)
        else:
            y.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t(), alpha=scale)
