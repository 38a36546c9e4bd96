"""Triton shrink / expand (interpreter, CPU) and their torch references against plain per-token torch math.

Covers ranks {8, 16, 64} mixed in one batch, fused output slices, popularity identical / distinct / uniform / zipf,
no-adapter tokens, empty and rank-0 slots, an all-base batch, 1 to 64 adapters, the embedded model's and
Llama-3-8B's projection sizes (a few tokens), SGLang-style padded stacked buffers, and a fixed-capacity layout
refilled with another adapter set (the CUDA-graph pattern; tests/gpu replays real graphs).
"""

from __future__ import annotations

import pytest
import torch

from sgl_multilora.segments import NO_ADAPTER, SegmentMeta
from sgl_multilora.triton_kernels.ops import lora_forward
from sgl_multilora.triton_kernels.shrink import lora_shrink, lora_shrink_ref, shrink_config
from sgl_multilora.triton_kernels.weights import LoRAWeights
from tests.kernels.oracle import assert_close, expected_output, make_problem

DTYPES = [torch.float32, torch.float16]


def run_both(p, meta=None):
    """(triton result, reference result) for problem p."""
    weights = LoRAWeights.from_list(p.lora_a, p.lora_b, p.scalings, p.slice_offsets)
    meta = meta or SegmentMeta.build(p.token_slot, len(p.lora_a))
    y_triton, y_ref = p.y0.clone(), p.y0.clone()
    lora_forward(p.x, y_triton, meta, weights, impl="triton")
    lora_forward(p.x, y_ref, meta, weights, impl="torch")
    return y_triton, y_ref


def test_layout_groups_tokens_by_slot():
    meta = SegmentMeta.build(torch.tensor([-1, 2, 0, -1, 2, 2], dtype=torch.int32), num_slots=3)
    assert meta.seg_indptr.tolist() == [0, 1, 1, 4]
    assert meta.sorted_token_ids[:4].tolist() == [2, 1, 4, 5]
    meta.check_invariants()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("popularity, ranks", [
    ("identical", [16]),
    ("distinct", [8, 16, 64, 8, 16, 64]),
    ("uniform", [64, None, 8, 16]),  # slot 1: an adapter that does not target this module
    ("zipf:1.5", [8, 16, 64, 16, 8, 64, 16, 8]),
], ids=["identical", "distinct", "uniform", "zipf"])
def test_fused_slices_mixed_ranks(dtype, popularity, ranks):
    p = make_problem(num_tokens=24, in_features=64, slice_widths=[64, 32, 32], ranks=ranks,
                     popularity=popularity, dtype=dtype, seed=len(ranks))
    expected = expected_output(p)
    y_triton, y_ref = run_both(p)
    assert_close(y_triton, expected)
    assert_close(y_ref, expected)
    base = p.token_slot == NO_ADAPTER
    assert torch.equal(y_triton[base], p.y0[base])  # no-adapter rows untouched, bit for bit


def test_sixty_four_adapters_decode_batch():
    p = make_problem(num_tokens=64, in_features=32, slice_widths=[32], ranks=[8] * 64, popularity="distinct",
                     dtype=torch.float16, base_fraction=0.1)
    y_triton, y_ref = run_both(p)
    expected = expected_output(p)
    assert_close(y_triton, expected)
    assert_close(y_ref, expected)


@pytest.mark.parametrize("name, in_features, widths, rank, dtype", [
    ("embedded-qkv", 576, [576, 192, 192], 16, torch.float16),
    ("embedded-gate-up", 576, [1536, 1536], 8, torch.float16),
    ("embedded-down", 1536, [576], 64, torch.float32),
    ("llama3-8b-qkv", 4096, [4096, 1024, 1024], 16, torch.float16),
])
def test_real_model_sizes(name, in_features, widths, rank, dtype):
    p = make_problem(num_tokens=3, in_features=in_features, slice_widths=widths, ranks=[rank, rank // 2 or 8],
                     popularity="distinct", dtype=dtype, base_fraction=0.0)
    y_triton, y_ref = run_both(p)
    expected = expected_output(p)
    assert_close(y_triton, expected)
    assert_close(y_ref, expected)


def test_all_base_batch_and_empty_slots_change_nothing():
    p = make_problem(num_tokens=16, in_features=32, slice_widths=[32], ranks=[8, 16, 64],
                     popularity="uniform", dtype=torch.float32, base_fraction=1.0)
    assert bool((p.token_slot == NO_ADAPTER).all())
    y_triton, y_ref = run_both(p)
    assert torch.equal(y_triton, p.y0) and torch.equal(y_ref, p.y0)


def test_empty_batch():
    p = make_problem(num_tokens=0, in_features=32, slice_widths=[32], ranks=[8], popularity="uniform",
                     dtype=torch.float32)
    y_triton, y_ref = run_both(p)
    assert y_triton.shape == (0, 32) and y_ref.shape == (0, 32)


def test_split_k_shrink_matches_reference():
    p = make_problem(num_tokens=8, in_features=96, slice_widths=[16, 16], ranks=[16, 8], popularity="uniform",
                     dtype=torch.float32)
    weights = LoRAWeights.from_list(p.lora_a, p.lora_b, p.scalings, p.slice_offsets)
    meta = SegmentMeta.build(p.token_slot, 2)
    t_split, t_ref = torch.zeros(8, 32), torch.zeros(8, 32)
    cfg = {**shrink_config(8, 96, 16), "SPLIT_K": 3, "BLOCK_K": 16}
    lora_shrink(p.x, t_split, meta, weights, cfg)
    lora_shrink_ref(p.x, t_ref, meta, weights)
    torch.testing.assert_close(t_split, t_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("split_k", [1, 2])
def test_ranks_above_the_rank_tile_are_split_into_tiles(monkeypatch, split_k):
    """Ranks wider than the tile (RANK_CHUNK lowered to 16 here; 32 in use, so rank 128 takes four tiles): shrink
    spreads a slot's rank over programs, expand loops over it, a partial last tile (40 = 16 + 16 + 8) included,
    beside slots of one tile and of none."""
    from sgl_multilora.triton_kernels import tiles

    monkeypatch.setattr(tiles, "RANK_CHUNK", 16)
    p = make_problem(num_tokens=30, in_features=64, slice_widths=[32, 16, 16], ranks=[40, 8, None, 64, 16],
                     popularity="zipf:1.0", dtype=torch.float32, seed=3)
    weights = LoRAWeights.from_list(p.lora_a, p.lora_b, p.scalings, p.slice_offsets)
    meta = SegmentMeta.build(p.token_slot, 5)
    cfg = shrink_config(30, 64, weights.max_rank, 5, 3)
    assert cfg["BLOCK_R"] == 16 < weights.max_rank
    t_tiled, t_ref = torch.zeros(30, 3 * 64), torch.zeros(30, 3 * 64)
    lora_shrink(p.x, t_tiled, meta, weights, {**cfg, "SPLIT_K": split_k, "BLOCK_K": 16})
    lora_shrink_ref(p.x, t_ref, meta, weights)
    torch.testing.assert_close(t_tiled, t_ref, atol=1e-5, rtol=1e-5)
    y_triton, y_ref = run_both(p, meta)
    expected = expected_output(p)
    assert_close(y_triton, expected)
    assert_close(y_ref, expected)


@pytest.mark.parametrize("one_tile_path", [True, False])
def test_launches_within_one_rank_tile_take_either_path(monkeypatch, one_tile_path):
    """Ranks within one tile (8, 16, an empty slot): the one-tile path (no rank loop, offset zero) and the general
    path both give the reference's output; the config says which one a launch takes."""
    from sgl_multilora.triton_kernels import tiles

    monkeypatch.setattr(tiles, "ONE_TILE_PATH", one_tile_path)
    p = make_problem(num_tokens=24, in_features=64, slice_widths=[32, 16, 16], ranks=[16, 8, None, 12],
                     popularity="zipf:1.0", dtype=torch.float32, seed=5)
    weights = LoRAWeights.from_list(p.lora_a, p.lora_b, p.scalings, p.slice_offsets)
    meta = SegmentMeta.build(p.token_slot, 4)
    assert shrink_config(24, 64, weights.max_rank, 4, 3)["ONE_TILE"] is one_tile_path
    assert tiles.one_tile(tiles.RANK_CHUNK + 1) is False  # a rank over the tile always loops
    y_triton, y_ref = run_both(p, meta)
    expected = expected_output(p)
    assert_close(y_triton, expected)
    assert_close(y_ref, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_sglang_stacked_buffers_read_only_each_slots_rank(dtype):
    """SGLang's pool sizes every slot for the max rank; NaN in the unused rows / columns proves they are not read."""
    p = make_problem(num_tokens=20, in_features=48, slice_widths=[32, 16, 16], ranks=[16, 8, None, 4],
                     popularity="uniform", dtype=dtype)
    r_max, n_sl, offs = 16, 3, p.slice_offsets
    a_buf = torch.full((4, n_sl * r_max, 48), float("nan"), dtype=dtype)
    b_buf = torch.full((4, offs[-1], r_max), float("nan"), dtype=dtype)
    ranks = []
    for s, (a, b) in enumerate(zip(p.lora_a, p.lora_b)):
        r = 0 if a is None else b.shape[1]
        ranks.append(r)
        if r:  # SGLang's layout: A slices packed at the adapter's rank, B columns [0, r)
            a_buf[s, : n_sl * r] = a
            b_buf[s, :, :r] = b
    weights = LoRAWeights.from_stacked(a_buf, b_buf, offs, ranks, p.scalings)
    meta = SegmentMeta.build(p.token_slot, 4)
    expected = expected_output(p)
    for impl in ("triton", "torch"):
        y = p.y0.clone()
        lora_forward(p.x, y, meta, weights, impl=impl)
        assert_close(y, expected)


def test_fixed_capacity_layout_refilled_with_another_adapter_set():
    """The CUDA-graph pattern: buffers and launch grid fixed, contents refilled; the second step's adapters differ."""
    meta = SegmentMeta.make(max_tokens=16, num_slots=4, device="cpu")
    for seed, popularity in ((1, "identical"), (2, "distinct")):
        p = make_problem(num_tokens=16, in_features=32, slice_widths=[32, 16], ranks=[8, 16, 8, 16],
                         popularity=popularity, dtype=torch.float32, seed=seed)
        meta.prepare(p.token_slot)
        meta.check_invariants()
        y_triton, _ = run_both(p, meta)
        assert_close(y_triton, expected_output(p))


def test_padded_layout_serves_fewer_rows():
    """A CUDA graph captured for 8 rows serves a batch of 5: rows past the batch are NO_ADAPTER."""
    p = make_problem(num_tokens=5, in_features=32, slice_widths=[32], ranks=[8, 16], popularity="uniform",
                     dtype=torch.float32, base_fraction=0.0)
    meta = SegmentMeta.make(max_tokens=8, num_slots=2, device="cpu")
    padded = torch.full((8,), NO_ADAPTER, dtype=torch.int32)
    padded[:5] = p.token_slot
    meta.prepare(padded, padded=True)
    y_triton, y_ref = run_both(p, meta)
    assert_close(y_triton, expected_output(p))
    assert_close(y_ref, expected_output(p))
    meta.prepare(padded)  # not padded: the rows must match exactly
    with pytest.raises(ValueError, match="x has 5 rows"):
        run_both(p, meta)


def test_bad_inputs_are_named():
    p = make_problem(num_tokens=4, in_features=32, slice_widths=[32], ranks=[8], popularity="uniform",
                     dtype=torch.float32)
    weights = LoRAWeights.from_list(p.lora_a, p.lora_b, p.scalings, p.slice_offsets)
    meta = SegmentMeta.build(p.token_slot, 1)
    with pytest.raises(ValueError, match="token 2 has slot 5"):
        SegmentMeta.build(torch.tensor([0, -1, 5, 0], dtype=torch.int32), num_slots=1)
    with pytest.raises(ValueError, match="x has 3 rows"):
        lora_forward(p.x[:3], p.y0[:3], meta, weights, impl="triton")
    with pytest.raises(ValueError, match="x is torch.float16"):
        lora_forward(p.x.half(), p.y0, meta, weights, impl="triton")
    with pytest.raises(ValueError, match="the layout has 2 slots, the weights 1"):
        lora_forward(p.x, p.y0, SegmentMeta.build(p.token_slot, 2), weights, impl="torch")
    with pytest.raises(ValueError, match=r"lora_b\[0\] has shape"):
        LoRAWeights.from_list(p.lora_a, [p.lora_b[0][:, :4]], p.scalings, p.slice_offsets)
    with pytest.raises(ValueError, match="unknown LoRA op implementation 'cuda'"):
        lora_forward(p.x, p.y0, meta, weights, impl="cuda")


@pytest.mark.parametrize("one_tile", [False, True])
def test_kernels_compile_for_a_hopper_gpu_without_one(monkeypatch, one_tile):
    """Triton's compiler front and back end (to PTX and a cubin for sm_90) run without a GPU: this catches kernel
    code the interpreter accepts but the compiler rejects (both rank paths: the rank loop and the one tile)."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sgl_multilora.triton_kernels.expand import _expand_kernel
    from sgl_multilora.triton_kernels.jit import jit_kernel
    from sgl_multilora.triton_kernels.shrink import _shrink_kernel

    monkeypatch.delenv("TRITON_INTERPRET")
    ptrs = {"sorted_ids_ptr": "*i32", "seg_indptr_ptr": "*i32", "ranks_ptr": "*i32"}
    shrink = ASTSource(jit_kernel(_shrink_kernel), {
        "x_ptr": "*bf16", "t_ptr": "*fp32", **ptrs, "a_ptrs_ptr": "*i64", "a_row_stride_ptr": "*i64",
        "K": "i32", "stride_xm": "i32", "stride_tm": "i32", "t_slice_stride": "i32", "num_r": "i32",
        "BLOCK_M": "constexpr", "BLOCK_R": "constexpr", "BLOCK_K": "constexpr", "SPLIT_K": "constexpr",
        "ONE_TILE": "constexpr",
    }, constexprs={"BLOCK_M": 16, "BLOCK_R": 32, "BLOCK_K": 64, "SPLIT_K": 4, "ONE_TILE": one_tile})
    expand = ASTSource(jit_kernel(_expand_kernel), {
        "t_ptr": "*fp32", "y_ptr": "*bf16", **ptrs, "scalings_ptr": "*fp32", "b_ptrs_ptr": "*i64",
        "b_row_stride_ptr": "*i64", "slice_offsets_ptr": "*i32", "stride_tm": "i32", "stride_ym": "i32",
        "t_slice_stride": "i32", "num_slices": "i32",
        "BLOCK_M": "constexpr", "BLOCK_R": "constexpr", "BLOCK_N": "constexpr", "ONE_TILE": "constexpr",
    }, constexprs={"BLOCK_M": 64, "BLOCK_R": 16, "BLOCK_N": 128, "ONE_TILE": one_tile})
    for src in (shrink, expand):
        compiled = triton_compile(src, target=GPUTarget("cuda", 90, 32))
        assert ".entry" in compiled.asm["ptx"] and compiled.asm["cubin"]
