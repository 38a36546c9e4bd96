"""LoRA shrink: t = x @ A^T per weight slot and output slice (the Triton kernel, its launcher, its torch reference).

Not here: expand (`expand.py`), the weight table (`weights.py`), the step layout (`sgl_multilora.segments`),
dispatch (`ops.py`).
"""

from __future__ import annotations

import torch

from sgl_multilora.segments import SegmentMeta
from sgl_multilora.triton_kernels import tiles
from sgl_multilora.triton_kernels.jit import jit_kernel, tl
from sgl_multilora.triton_kernels.tiles import TARGET_PROGRAMS, token_block
from sgl_multilora.triton_kernels.weights import LoRAWeights

def shrink_config(max_tokens: int, in_features: int, max_rank: int, num_slots: int = 1,
                  num_slices: int = 1) -> dict[str, int]:
    """Launch config by shape. Shrink reads a long A (rank x in_features) per slot and slice, so it is
    bandwidth-bound and needs enough programs streaming A at once: K is split across programs until the launch has
    about TARGET_PROGRAMS busy ones (without the split, a decode on one adapter of `down` runs only a couple of
    programs; measured: eval/RESULTS.md, kernels)."""
    block_r = tiles.rank_tile(max_rank)
    block_m = token_block(max_tokens, num_slots)
    block_k = 128 if block_r <= 32 else 64
    # Busy (slot, token block, rank tile) triples: at least the token blocks, up to one per slot when tokens are
    # spread.
    m_blocks = -(-max_tokens // block_m)
    busy = max(m_blocks, min(num_slots, max_tokens)) * num_slices * -(-max(max_rank, 1) // block_r)
    split_k = 1
    while split_k < 16 and busy * split_k * 2 <= TARGET_PROGRAMS and in_features // (split_k * 2) >= 2 * block_k:
        split_k *= 2
    if max_tokens <= 64 and in_features >= 2048:  # decode on many slots: each program still streams a long A
        split_k = max(split_k, min(8, in_features // 1024))
    return {"BLOCK_M": block_m, "BLOCK_R": block_r, "BLOCK_K": block_k, "SPLIT_K": split_k,
            "ONE_TILE": tiles.one_tile(max_rank)}


def lora_shrink(
    x: torch.Tensor,
    t: torch.Tensor,
    meta: SegmentMeta,
    weights: LoRAWeights,
    config: dict[str, int] | None = None,
) -> None:
    """Semantics: for each slot s and slice j, for tokens i of slot s:
        t[i, j * R : j * R + r_s] = x[i] @ A_sj.T          (R = weights.max_rank; r_s = rank of slot s)

    x: (num_tokens, in), fp16/bf16/fp32, unit column stride; meta: the step layout prepared for x's rows.
    t: (num_tokens, num_slices * R) float32, written in place (zeroed first when the config splits K); entries of
    other tokens and columns >= r_s are left untouched.
    """
    _check(x, t, meta, weights)
    num_rows = x.shape[0]  # the grid depends on the input's rows only (fixed in a captured CUDA graph)
    if num_rows == 0:
        return
    import triton

    cfg = config or shrink_config(num_rows, weights.in_features, weights.max_rank, weights.num_slots,
                                 weights.num_slices)
    if cfg["SPLIT_K"] > 1:
        t.zero_()
    tab = weights.tables()
    num_r = triton.cdiv(max(weights.max_rank, 1), cfg["BLOCK_R"])  # rank tiles per slice
    grid = (triton.cdiv(num_rows, cfg["BLOCK_M"]) * cfg["SPLIT_K"], weights.num_slots, weights.num_slices * num_r)
    jit_kernel(_shrink_kernel)[grid](
        x, t, meta.sorted_token_ids, meta.seg_indptr, tab["ranks"], tab["a_ptrs"], tab["a_row_stride"],
        weights.in_features, x.stride(0), t.stride(0), weights.max_rank, num_r,
        **cfg,
    )


def _shrink_kernel(
    x_ptr, t_ptr, sorted_ids_ptr, seg_indptr_ptr, ranks_ptr, a_ptrs_ptr, a_row_stride_ptr,
    K, stride_xm, stride_tm, t_slice_stride, num_r,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    ONE_TILE: tl.constexpr = False,
):
    pid = tl.program_id(0)
    slot = tl.program_id(1)
    if ONE_TILE:  # every rank of the launch fits one tile (num_r == 1): offset known to be zero
        sl = tl.program_id(2)
        r_begin = 0
    else:
        sl = tl.program_id(2) // num_r
        r_begin = (tl.program_id(2) % num_r) * BLOCK_R  # this program's rank tile
    pid_m = pid // SPLIT_K
    pid_k = pid % SPLIT_K
    rank = tl.load(ranks_ptr + slot).to(tl.int32)
    seg_start = tl.load(seg_indptr_ptr + slot)
    seg_len = tl.load(seg_indptr_ptr + slot + 1) - seg_start
    if (r_begin >= rank) | (pid_m * BLOCK_M >= seg_len):  # past this slot's rank or tokens (or empty): no work
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < seg_len
    rows = tl.load(sorted_ids_ptr + seg_start + offs_m, mask=mask_m, other=0).to(tl.int64)
    a_row_stride = tl.load(a_row_stride_ptr + slot)
    a_ptr = tl.load(a_ptrs_ptr + slot).to(tl.pointer_type(x_ptr.dtype.element_ty))
    a_ptr += sl * rank * a_row_stride  # slice sl: rows [sl * rank, (sl + 1) * rank) of the slot's A
    offs_r = r_begin + tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    acc = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)  # not tl.zeros: a jitted helper (see jit.py)
    # plain integer ceil-divisions, not tl.cdiv (a jitted helper, see jit.py)
    k_per_split = ((K + SPLIT_K - 1) // SPLIT_K + BLOCK_K - 1) // BLOCK_K * BLOCK_K
    k_begin = pid_k * k_per_split
    for k0 in range(0, k_per_split, BLOCK_K):
        offs_k = k_begin + k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        xt = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                     mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        at = tl.load(a_ptr + offs_r[None, :] * a_row_stride + offs_k[:, None],
                     mask=mask_r[None, :] & mask_k[:, None], other=0.0)
        acc += tl.dot(xt, at)
    out = t_ptr + rows[:, None] * stride_tm + sl * t_slice_stride + offs_r[None, :]
    mask = mask_m[:, None] & mask_r[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc, mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask)


def lora_shrink_ref(x: torch.Tensor, t: torch.Tensor, meta: SegmentMeta, weights: LoRAWeights) -> None:
    """The same semantics in plain torch, computed in float32 (the CPU serving path's implementation)."""
    _check(x, t, meta, weights)
    r_max = weights.max_rank
    for slot, rank in enumerate(weights.ranks_cpu):
        if rank == 0:
            continue
        rows = meta.slot_rows(slot)
        if rows.numel() == 0:
            continue
        xs = x.index_select(0, rows).float()
        for j, a in enumerate(weights.a_views[slot]):
            t[rows, j * r_max : j * r_max + rank] = xs @ a.float().t()


def _check(x: torch.Tensor, t: torch.Tensor, meta: SegmentMeta, weights: LoRAWeights) -> None:
    if x.dim() != 2 or x.shape[1] != weights.in_features:
        raise ValueError(f"x has shape {tuple(x.shape)}; expected (num_tokens, {weights.in_features})")
    meta.check_rows(x.shape[0], "x")
    if x.stride(1) != 1:
        raise ValueError(f"x needs unit column stride, got strides {x.stride()}")
    width = weights.num_slices * weights.max_rank
    if t.dtype != torch.float32 or t.dim() != 2 or t.shape[0] < x.shape[0] or t.shape[1] < width or t.stride(1) != 1:
        raise ValueError(f"t must be float32 ({x.shape[0]}, >= {width}) with unit column stride, got "
                         f"{t.dtype} {tuple(t.shape)} strides {t.stride()}")
    if x.dtype != weights.dtype:
        raise ValueError(f"x is {x.dtype} but the LoRA weights are {weights.dtype}")
    if meta.num_slots != weights.num_slots:
        raise ValueError(f"the layout has {meta.num_slots} slots, the weights {weights.num_slots}")
    if x.device != weights.device or x.device != meta.device:
        raise ValueError(f"x on {x.device}, weights on {weights.device}, layout on {meta.device}")
