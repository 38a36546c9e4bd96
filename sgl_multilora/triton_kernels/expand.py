"""LoRA expand: y += scale * t @ B^T per weight slot and output slice (the Triton kernel, launcher, torch reference).

All output slices (q/k/v, gate/up) go in one launch. Not here: shrink (`shrink.py`), the step layout
(`sgl_multilora.segments`).
"""

from __future__ import annotations

import torch

from sgl_multilora.segments import SegmentMeta
from sgl_multilora.triton_kernels.jit import jit_kernel, tl
from sgl_multilora.triton_kernels import tiles
from sgl_multilora.triton_kernels.tiles import MIN_BLOCK, token_block
from sgl_multilora.triton_kernels.weights import LoRAWeights


def expand_config(max_tokens: int, max_slice_width: int, max_rank: int, num_slots: int = 1) -> dict[str, int]:
    """Launch config by shape (a heuristic; the token and rank tiles as shrink's: a rank above the tile is looped
    over)."""
    block_r = tiles.rank_tile(max_rank)
    block_m = token_block(max_tokens, num_slots)
    block_n = 128 if max_slice_width >= 128 else max(MIN_BLOCK, 1 << (max_slice_width - 1).bit_length())
    return {"BLOCK_M": block_m, "BLOCK_R": block_r, "BLOCK_N": block_n, "ONE_TILE": tiles.one_tile(max_rank)}


def lora_expand(
    t: torch.Tensor,
    y: torch.Tensor,
    meta: SegmentMeta,
    weights: LoRAWeights,
    config: dict[str, int] | None = None,
) -> None:
    """Semantics: for each slot s and slice j, for tokens i of slot s:
        y[i, off_j : off_{j+1}] += scale_s * t[i, j * R : j * R + r_s] @ B_sj.T

    t: (num_tokens, num_slices * R) float32 (from `lora_shrink`); meta: the step layout prepared for y's rows.
    y: (num_tokens, out) in the weights' dtype, unit column stride, updated in place; rows of no-adapter tokens
    are not touched.
    """
    _check(t, y, meta, weights)
    num_rows = y.shape[0]  # the grid depends on the output's rows only (fixed in a captured CUDA graph)
    if num_rows == 0:
        return
    import triton

    widths = [b - a for a, b in zip(weights.slice_offsets, weights.slice_offsets[1:])]
    cfg = config or expand_config(num_rows, max(widths), weights.max_rank, weights.num_slots)
    tab = weights.tables()
    num_n = triton.cdiv(max(widths), cfg["BLOCK_N"])
    grid = (triton.cdiv(num_rows, cfg["BLOCK_M"]), weights.num_slots, weights.num_slices * num_n)
    jit_kernel(_expand_kernel)[grid](
        t, y, meta.sorted_token_ids, meta.seg_indptr, tab["ranks"], tab["scalings"], tab["b_ptrs"],
        tab["b_row_stride"], tab["slice_offsets"], t.stride(0), y.stride(0), weights.max_rank,
        weights.num_slices, **cfg,
    )


def _expand_kernel(
    t_ptr, y_ptr, sorted_ids_ptr, seg_indptr_ptr, ranks_ptr, scalings_ptr, b_ptrs_ptr, b_row_stride_ptr,
    slice_offsets_ptr, stride_tm, stride_ym, t_slice_stride, num_slices,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ONE_TILE: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    slot = tl.program_id(1)
    sl = tl.program_id(2) % num_slices
    pid_n = tl.program_id(2) // num_slices
    rank = tl.load(ranks_ptr + slot).to(tl.int32)
    seg_start = tl.load(seg_indptr_ptr + slot)
    seg_len = tl.load(seg_indptr_ptr + slot + 1) - seg_start
    n_begin = tl.load(slice_offsets_ptr + sl)
    width = tl.load(slice_offsets_ptr + sl + 1) - n_begin
    if (rank == 0) | (pid_m * BLOCK_M >= seg_len) | (pid_n * BLOCK_N >= width):  # no work here
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < seg_len
    rows = tl.load(sorted_ids_ptr + seg_start + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < width
    b_ptr = tl.load(b_ptrs_ptr + slot * num_slices + sl).to(tl.pointer_type(y_ptr.dtype.element_ty))
    b_row_stride = tl.load(b_row_stride_ptr + slot)
    if ONE_TILE:  # every rank of the launch fits one tile: no loop
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        tt = tl.load(t_ptr + rows[:, None] * stride_tm + sl * t_slice_stride + offs_r[None, :],
                     mask=mask_m[:, None] & mask_r[None, :], other=0.0)
        bt = tl.load(b_ptr + offs_n[None, :] * b_row_stride + offs_r[:, None],
                     mask=mask_r[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(tt.to(y_ptr.dtype.element_ty), bt)
    else:
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for r_begin in range(0, rank, BLOCK_R):  # this slot's own rank tiles only
            offs_r = r_begin + tl.arange(0, BLOCK_R)
            mask_r = offs_r < rank
            tt = tl.load(t_ptr + rows[:, None] * stride_tm + sl * t_slice_stride + offs_r[None, :],
                         mask=mask_m[:, None] & mask_r[None, :], other=0.0)
            bt = tl.load(b_ptr + offs_n[None, :] * b_row_stride + offs_r[:, None],
                         mask=mask_r[:, None] & mask_n[None, :], other=0.0)
            acc += tl.dot(tt.to(y_ptr.dtype.element_ty), bt)
    acc = acc * tl.load(scalings_ptr + slot)
    out = y_ptr + rows[:, None] * stride_ym + n_begin + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y_old = tl.load(out, mask=mask, other=0.0)
    tl.store(out, (y_old.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def lora_expand_ref(t: torch.Tensor, y: torch.Tensor, meta: SegmentMeta, weights: LoRAWeights) -> None:
    """The same semantics in plain torch, computed in float32 (the CPU serving path's implementation)."""
    _check(t, y, meta, weights)
    r_max, offs = weights.max_rank, weights.slice_offsets
    for slot, rank in enumerate(weights.ranks_cpu):
        if rank == 0:
            continue
        rows = meta.slot_rows(slot)
        if rows.numel() == 0:
            continue
        scale = weights.scalings_cpu[slot]
        for j, b in enumerate(weights.b_views[slot]):
            delta = (t[rows, j * r_max : j * r_max + rank] @ b.float().t()) * scale
            y[rows, offs[j] : offs[j + 1]] = (y[rows, offs[j] : offs[j + 1]].float() + delta).to(y.dtype)


def _check(t: torch.Tensor, y: torch.Tensor, meta: SegmentMeta, weights: LoRAWeights) -> None:
    width = weights.num_slices * weights.max_rank
    if t.dtype != torch.float32 or t.dim() != 2 or t.shape[1] < width or t.stride(1) != 1:
        raise ValueError(f"t must be float32 (num_tokens, >= {width}) with unit column stride, got "
                         f"{t.dtype} {tuple(t.shape)}")
    if y.dim() != 2 or y.shape[1] != weights.out_features or y.stride(1) != 1:
        raise ValueError(f"y has shape {tuple(y.shape)} strides {y.stride()}; expected (num_tokens, "
                         f"{weights.out_features}) with unit column stride")
    meta.check_rows(y.shape[0], "y")
    if t.shape[0] < y.shape[0]:
        raise ValueError(f"t has {t.shape[0]} rows, fewer than y's {y.shape[0]}")
    if y.dtype != weights.dtype:
        raise ValueError(f"y is {y.dtype} but the LoRA weights are {weights.dtype}")
    if meta.num_slots != weights.num_slots:
        raise ValueError(f"the layout has {meta.num_slots} slots, the weights {weights.num_slots}")
    if y.device != weights.device or y.device != meta.device or t.device != y.device:
        raise ValueError(f"t on {t.device}, y on {y.device}, weights on {weights.device}, layout on {meta.device}")
