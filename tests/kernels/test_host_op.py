"""The CPU serving path's LoRA op (`impl="cpu"`, `triton_kernels/host.py`) against per-token float64 math.

Layouts where the adapter tokens are already rows 0..n-1 in slot order (slices instead of a gather) and where they
are not; fused slices; ranks mixed in a batch; adapters that skip the module (rank-0 slots); empty slots; all-base
steps; aLoRA-style tokens before the activation start; a layout refilled between steps; other dtypes (the
references run).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_multilora.segments import NO_ADAPTER, SegmentMeta
from sgl_multilora.triton_kernels import host
from sgl_multilora.triton_kernels.ops import lora_forward, resolve_impl
from sgl_multilora.triton_kernels.weights import LoRAWeights
from tests.kernels.oracle import Problem, assert_close, expected_output, make_problem


def run_cpu(p: Problem, meta: SegmentMeta | None = None) -> torch.Tensor:
    weights = LoRAWeights.from_list(p.lora_a, p.lora_b, p.scalings, p.slice_offsets)
    y = p.y0.clone()
    out = lora_forward(p.x, y, meta or SegmentMeta.build(p.token_slot, len(p.lora_a)), weights, impl="cpu")
    assert out is y
    return y


def test_auto_is_the_host_op_on_a_cpu():
    assert resolve_impl("auto", torch.device("cpu")) == "cpu"


@pytest.mark.parametrize("popularity, ranks, widths", [
    ("identical", [16], [48]),  # one adapter: rows in order, no gather
    ("distinct", [8, 16, 64, 8, 16, 64], [48]),
    ("uniform", [64, None, 8, 16], [48]),  # slot 1 skips this module
    ("zipf:1.5", [8, 16, 64, 16, 8, 64, 16, 8], [64, 32, 32]),  # fused slices (q, k, v)
    ("uniform", [32, 8], [40, 24]),
], ids=["identical", "distinct", "rank0-slot", "zipf-fused", "two-slices"])
def test_matches_per_token_math(popularity, ranks, widths):
    p = make_problem(num_tokens=37, in_features=40, slice_widths=widths, ranks=ranks, popularity=popularity,
                     dtype=torch.float32, seed=len(ranks) + len(widths))
    y = run_cpu(p)
    assert_close(y, expected_output(p))
    base = p.token_slot == NO_ADAPTER
    assert torch.equal(y[base], p.y0[base])  # no-adapter rows untouched, bit for bit


@pytest.mark.parametrize("threads", [1, 2])
def test_wide_steps_and_the_thread_count(threads):
    """A prefill-sized step (more adapter tokens than `SINGLE_THREAD_ROWS`) and a decode-sized one: both exact, and
    the process's thread count is what it was."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for num_tokens in (host.SINGLE_THREAD_ROWS // 2, 3 * host.SINGLE_THREAD_ROWS):
            p = make_problem(num_tokens=num_tokens, in_features=32, slice_widths=[24], ranks=[8, 16, 4],
                             popularity="zipf:1.5", dtype=torch.float32, seed=num_tokens)
            assert_close(run_cpu(p), expected_output(p))
            assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)


def test_grouped_rows_take_slices_and_match():
    """Requests grouped by adapter, adapter tokens first: the rows are in slot order and nothing is gathered."""
    slots = torch.tensor([0, 0, 0, 1, 1, 2, NO_ADAPTER, NO_ADAPTER], dtype=torch.int32)
    p = make_problem(num_tokens=8, in_features=24, slice_widths=[16], ranks=[4, 8, 2], popularity="uniform",
                     dtype=torch.float32, seed=3)
    p.token_slot = slots
    meta = SegmentMeta.build(slots, 3)
    bounds, ids = meta.host_segments()
    assert bounds == [0, 3, 5, 6] and ids is None
    y = run_cpu(p, meta)
    assert_close(y, expected_output(p))
    assert torch.equal(y[6:], p.y0[6:])


def test_interleaved_rows_are_gathered_and_scattered_back():
    slots = torch.tensor([1, NO_ADAPTER, 0, 1, 0, NO_ADAPTER], dtype=torch.int32)
    p = make_problem(num_tokens=6, in_features=24, slice_widths=[16], ranks=[4, 8], popularity="uniform",
                     dtype=torch.float32, seed=4)
    p.token_slot = slots
    meta = SegmentMeta.build(slots, 2)
    bounds, ids = meta.host_segments()
    assert bounds == [0, 2, 4] and ids.tolist() == [2, 4, 0, 3]
    assert_close(run_cpu(p, meta), expected_output(p))


def test_all_base_and_empty_steps_leave_y_alone():
    p = make_problem(num_tokens=5, in_features=16, slice_widths=[8], ranks=[4], popularity="identical",
                     dtype=torch.float32, seed=5)
    p.token_slot = torch.full((5,), NO_ADAPTER, dtype=torch.int32)
    assert torch.equal(run_cpu(p), p.y0)


def test_alora_tokens_before_the_start_get_no_delta():
    """`prepare_requests` with activation starts: the tokens before k are NO_ADAPTER."""
    p = make_problem(num_tokens=9, in_features=16, slice_widths=[12], ranks=[4, 8], popularity="uniform",
                     dtype=torch.float32, seed=6)
    meta = SegmentMeta.make(16, 2, "cpu")
    meta.prepare_requests(["lora", None, "alora"], [3, 2, 4], [0, 0, 3])
    p.token_slot = meta.token_slot[:9].clone()
    assert p.token_slot.tolist() == [0, 0, 0, -1, -1, -1, -1, -1, 1]
    y = run_cpu(p, meta)
    assert_close(y, expected_output(p))
    assert torch.equal(y[3:8], p.y0[3:8])


def test_refilled_layout_is_not_read_stale():
    """The cached segments belong to one step: the next `prepare` (other adapters, other rows) drops them."""
    meta = SegmentMeta.make(8, 2, "cpu")
    for seed, slots in enumerate(([0, 0, 1, 1], [1, 0, NO_ADAPTER, 1, 0, 0])):
        token_slot = torch.tensor(slots, dtype=torch.int32)
        p = make_problem(num_tokens=len(slots), in_features=16, slice_widths=[8], ranks=[4, 2],
                         popularity="uniform", dtype=torch.float32, seed=seed)
        p.token_slot = token_slot
        meta.prepare(token_slot)
        assert_close(run_cpu(p, meta), expected_output(p))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_other_dtypes_take_the_references(dtype):
    p = make_problem(num_tokens=12, in_features=32, slice_widths=[16, 16], ranks=[8, 16], popularity="uniform",
                     dtype=dtype, seed=7)
    assert_close(run_cpu(p), expected_output(p))


def test_bad_shapes_are_named():
    p = make_problem(num_tokens=4, in_features=16, slice_widths=[8], ranks=[4], popularity="identical",
                     dtype=torch.float32, seed=8)
    weights = LoRAWeights.from_list(p.lora_a, p.lora_b, p.scalings, p.slice_offsets)
    meta = SegmentMeta.build(p.token_slot, 1)
    with pytest.raises(ValueError, match="x has shape"):
        lora_forward(p.x[:, :8], p.y0.clone(), meta, weights, impl="cpu")
    with pytest.raises(ValueError, match="y has shape"):
        lora_forward(p.x, p.y0[:, :4].clone(), meta, weights, impl="cpu")
    with pytest.raises(ValueError, match="rows but the layout"):
        lora_forward(p.x[:3], p.y0[:3].clone(), meta, weights, impl="cpu")


@settings(max_examples=60, deadline=None)
@given(slots=st.lists(st.integers(NO_ADAPTER, 4), min_size=1, max_size=40),
       ranks=st.lists(st.sampled_from([None, 1, 4, 16]), min_size=5, max_size=5).filter(lambda r: any(r)),
       widths=st.sampled_from([[8], [8, 4], [6, 6, 4]]), seed=st.integers(0, 1000))
def test_any_layout_matches_per_token_math(slots, ranks, widths, seed):
    p = make_problem(num_tokens=len(slots), in_features=12, slice_widths=widths, ranks=ranks, popularity="uniform",
                     dtype=torch.float32, seed=seed)
    p.token_slot = torch.tensor(slots, dtype=torch.int32)
    y = run_cpu(p)
    assert_close(y, expected_output(p))
    untouched = [i for i, s in enumerate(slots) if s == NO_ADAPTER or ranks[s] is None]
    assert torch.equal(y[untouched], p.y0[untouched])
