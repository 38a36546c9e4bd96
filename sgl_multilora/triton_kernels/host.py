"""The LoRA op on a CPU: the serving path of `--device cpu` (`lora_forward(..., impl="cpu")`).

The torch references (`lora_shrink_ref`, `lora_expand_ref`) are written to be obviously right: per slot they gather
the slot's rows, multiply, and scatter back with advanced indexing, which is 6-9 small tensor ops per slot, slice
and module (~200 us each on a 2-core CPU: a decode step of 8 adapters over SmolLM2's 210 projections spent 4x the
base model's matmul time in them). Here one step's adapter tokens are gathered once, in slot order, every slot's
product is two matmuls (the scaling inside the second) into its contiguous rows of one delta, and one `index_add_`
adds the delta back:

    x (rows in batch order)        xs = x[sorted ids]         delta (same rows)            y
    r0 A |                         A  r0                      A  s_A (r0 A_A^T) B_A^T       y[ids] += delta
    r1 - |  index_select(ids) ->   A  r3      per slot:       A  ...
    r2 X |                         X  r2      2 x mm          X  ...
    r3 A |                        (r1: NO_ADAPTER, left out)

When the adapter tokens already are rows 0..n-1 in slot order (one adapter, or requests grouped by adapter), the
gather and the scatter become slices. Same arithmetic as the references in float32 ((x A^T) B^T, times the scaling,
added to y), so the results agree to the last bit or nearly (matmul blocking may differ with the row count);
other dtypes, and padded layouts, take the references.
"""

from __future__ import annotations

import torch

from sgl_multilora.segments import SegmentMeta
from sgl_multilora.triton_kernels.expand import lora_expand_ref
from sgl_multilora.triton_kernels.shrink import lora_shrink_ref
from sgl_multilora.triton_kernels.weights import LoRAWeights

# Steps of at most this many adapter tokens (decode) run the op on one thread: its GEMMs are a few rows against one
# adapter's weights each, where a second thread costs more than it brings (a decode step of 8 adapters on SmolLM2:
# the LoRA part 0.37-0.41x of the references' time on one thread, 0.47-0.49x on two; prefill steps gain from two).
SINGLE_THREAD_ROWS = 64


def lora_forward_host(x: torch.Tensor, y: torch.Tensor, meta: SegmentMeta, weights: LoRAWeights) -> torch.Tensor:
    """`lora_forward`'s semantics on the host; x (num_tokens, in), y (num_tokens, out) updated in place."""
    if (x.dtype != torch.float32 or y.dtype != torch.float32 or weights.dtype != torch.float32 or meta.padded
            or x.device.type != "cpu"):
        t = torch.empty(x.shape[0], weights.num_slices * weights.max_rank, dtype=torch.float32, device=x.device)
        lora_shrink_ref(x, t, meta, weights)
        lora_expand_ref(t, y, meta, weights)
        return y
    _check(x, y, meta, weights)
    bounds, ids = meta.host_segments()
    n = bounds[-1]
    if n == 0:
        return y
    threads = torch.get_num_threads()
    narrow = threads > 1 and n <= SINGLE_THREAD_ROWS
    if narrow:
        torch.set_num_threads(1)
    try:
        _compute(x, y, weights, bounds, ids, n)
    finally:
        if narrow:
            torch.set_num_threads(threads)
    return y


def _compute(x: torch.Tensor, y: torch.Tensor, weights: LoRAWeights, bounds: list[int], ids: torch.Tensor | None,
             n: int) -> None:
    """The op over the step's `n` adapter tokens: slot s owns rows bounds[s]:bounds[s + 1] of the gathered order."""
    xs = x[:n] if ids is None else x.index_select(0, ids)
    offs = weights.slice_offsets
    one_slice = len(offs) == 2
    delta = torch.empty(n, offs[-1], dtype=torch.float32)
    for slot, rank in enumerate(weights.ranks_cpu):
        begin, end = bounds[slot], bounds[slot + 1]
        if begin == end:
            continue
        rows = delta[begin:end]
        if rank == 0:  # the adapter does not target this module: its tokens get no delta
            rows.zero_()
            continue
        xr, scale = xs[begin:end], weights.scalings_cpu[slot]
        for j, (a, b) in enumerate(zip(weights.a_views[slot], weights.b_views[slot])):
            # alpha scales the product inside the GEMM: the same rounding as (t B^T) * scale, one pass fewer
            if one_slice:
                torch.addmm(rows, torch.mm(xr, a.t()), b.t(), beta=0, alpha=scale, out=rows)
            else:
                rows[:, offs[j] : offs[j + 1]] = torch.mm(torch.mm(xr, a.t()), b.t()).mul_(scale)
    if ids is None:
        y[:n].add_(delta)
    else:
        y.index_add_(0, ids, delta)


def _check(x: torch.Tensor, y: torch.Tensor, meta: SegmentMeta, weights: LoRAWeights) -> None:
    if x.dim() != 2 or x.shape[1] != weights.in_features:
        raise ValueError(f"x has shape {tuple(x.shape)}; expected (num_tokens, {weights.in_features})")
    if y.dim() != 2 or y.shape[1] != weights.out_features or y.shape[0] != x.shape[0]:
        raise ValueError(f"y has shape {tuple(y.shape)}; expected ({x.shape[0]}, {weights.out_features})")
    meta.check_rows(x.shape[0], "x")
    if meta.num_slots != weights.num_slots:
        raise ValueError(f"the layout has {meta.num_slots} slots, the weights {weights.num_slots}")
    if x.device != meta.device:
        raise ValueError(f"x on {x.device}, layout on {meta.device}")
