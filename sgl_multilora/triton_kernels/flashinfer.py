"""The LoRA op on FlashInfer's segment GEMM (`flashinfer.gemm.SegmentGEMMWrapper`): GPU only, imported on first use.

Selected with `--multilora-lora-ops flashinfer` (or `impl="flashinfer"`). It needs SGLang-style stacked per-slot
buffers (`LoRAWeights.from_stacked`): FlashInfer multiplies whole max-rank weight matrices, so each slice's columns
are picked out of the shrink output by the row's rank and the rest masked to zero.
Not here: our own kernels (`shrink.py`, `expand.py`).
"""

from __future__ import annotations

import torch

from sgl_multilora.segments import SegmentMeta
from sgl_multilora.triton_kernels.weights import LoRAWeights

_WORKSPACE_BYTES = 128 * 1024 * 1024
_wrappers: dict[torch.device, object] = {}


def available() -> bool:
    """True when flashinfer imports and a CUDA device is present."""
    if not torch.cuda.is_available():
        return False
    try:
        import flashinfer.gemm  # noqa: F401
    except ImportError:
        return False
    return True


def _wrapper(device: torch.device):
    if device not in _wrappers:
        try:
            from flashinfer.gemm import SegmentGEMMWrapper
        except ImportError as e:
            raise RuntimeError("--multilora-lora-ops flashinfer needs the flashinfer package (not installed)") from e
        workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.int8, device=device)
        _wrappers[device] = SegmentGEMMWrapper(workspace)
    return _wrappers[device]


def lora_forward_flashinfer(
    x: torch.Tensor, y: torch.Tensor, meta: SegmentMeta, weights: LoRAWeights
) -> torch.Tensor:
    """Semantics as `ops.lora_forward`: y[i, off_j:off_{j+1}] += scale_s * (x[i] @ A_sj.T) @ B_sj.T, in place.

    Gathers the adapter tokens in slot order, runs one segment GEMM for the shrink of all slices and one per slice
    for the expand, and scatters the result back with index_add_. Syncs once to size the gathered batch.
    """
    if x.device.type != "cuda":
        raise RuntimeError(f"the flashinfer LoRA path runs on CUDA only (x is on {x.device})")
    stacked = weights._tables.get("stacked")
    if stacked is None or stacked[0] is None or stacked[1] is None:
        raise ValueError("the flashinfer LoRA path needs stacked per-slot buffers (LoRAWeights.from_stacked)")
    a_buf, b_buf = stacked
    seg = weights.tables()
    num_rows = int(meta.seg_indptr[-1])  # the one sync: FlashInfer sizes its problems on the host
    if num_rows == 0:
        return y
    rows = meta.sorted_token_ids[:num_rows].long()
    seg_indptr = meta.seg_indptr.long()
    slots = torch.arange(weights.num_slots, device=x.device, dtype=torch.int64)
    gemm = _wrapper(x.device)
    x_sorted = x.index_select(0, rows)
    # shrink of every slice at once: (n, in) x (S * R, in)^T per slot
    t = gemm.run(x_sorted, a_buf, weights.num_slots, True, seg_indptr=seg_indptr, weight_indices=slots)
    slot_of_row = torch.repeat_interleave(slots, seg_indptr[1:] - seg_indptr[:-1], output_size=num_rows)
    rank_of_row = seg["ranks"].long()[slot_of_row][:, None]
    t = t.float() * seg["scalings"][slot_of_row][:, None]
    r_max, offs = weights.max_rank, weights.slice_offsets
    cols = torch.arange(r_max, device=x.device)[None, :]
    delta = torch.empty(num_rows, weights.out_features, dtype=y.dtype, device=y.device)
    for j in range(weights.num_slices):
        # slice j of a row's shrink output sits at columns [j * rank, (j + 1) * rank) (A packed at the rank)
        idx = (j * rank_of_row + cols).clamp(max=t.shape[1] - 1)
        t_j = torch.where(cols < rank_of_row, t.gather(1, idx), 0.0).to(x.dtype).contiguous()
        full = gemm.run(t_j, b_buf, weights.num_slots, True, seg_indptr=seg_indptr, weight_indices=slots)
        delta[:, offs[j] : offs[j + 1]] = full[:, offs[j] : offs[j + 1]]
    y.index_add_(0, rows, delta)
    return y
