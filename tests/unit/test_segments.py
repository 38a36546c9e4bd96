"""SegmentMeta (the per-step LoRA layout), the op over it, and the CPU LoRA layers that share it."""

from __future__ import annotations

import pytest
import torch

from sgl_multilora.adapters import AdapterSpec, LoadedAdapter
from sgl_multilora.segments import NO_ADAPTER, SegmentMeta
from sgl_multilora.triton_kernels.ops import lora_forward
from sgl_multilora.triton_kernels.weights import LoRAWeights


def test_running_example_from_the_docstring():
    meta = SegmentMeta.make(max_tokens=16, num_slots=3, device="cpu")
    meta.prepare_requests(["A", None, "X", "A"], [3, 2, 3, 2], [0, 0, 1, 0])
    assert meta.num_tokens == 10
    assert meta.token_slot[:10].tolist() == [0, 0, 0, -1, -1, -1, 1, 1, 0, 0]
    assert meta.keys == ("A", "X")
    assert meta.sorted_token_ids[:10].tolist() == [0, 1, 2, 8, 9, 6, 7, 3, 4, 5]
    assert meta.seg_indptr.tolist() == [0, 5, 7, 7]
    assert [meta.slot_rows(s).tolist() for s in range(3)] == [[0, 1, 2, 8, 9], [6, 7], []]
    meta.check_invariants()


def test_refilled_in_place_for_the_next_step():
    meta = SegmentMeta.make(max_tokens=16, num_slots=3, device="cpu")
    buffers = (meta.token_slot, meta.sorted_token_ids, meta.seg_indptr)
    meta.prepare_requests(["A", None, "X", "A"], [3, 2, 3, 2], [0, 0, 1, 0])
    meta.prepare_requests(["X", "B"], [1, 1])  # a decode step on other adapters: slots renumbered
    assert meta.keys == ("X", "B") and meta.num_tokens == 2
    assert meta.seg_indptr.tolist() == [0, 1, 2, 2]
    assert [meta.slot_rows(s).tolist() for s in range(3)] == [[0], [1], []]
    after = (meta.token_slot, meta.sorted_token_ids, meta.seg_indptr)
    assert all(a is b for a, b in zip(buffers, after))  # refilled, not reallocated
    meta.check_invariants()


def test_all_base_and_empty_steps_have_no_adapter_token():
    meta = SegmentMeta.make(max_tokens=8, num_slots=2, device="cpu")
    meta.prepare_requests([None, None], [5, 1])
    assert meta.keys == () and meta.seg_indptr.tolist() == [0, 0, 0]
    meta.prepare_requests([], [])
    assert meta.keys == () and meta.num_tokens == 0
    # an aLoRA whose activation start lies past this chunk contributes no token
    meta.prepare_requests(["X"], [4], [10])
    assert meta.keys == ()
    # ...and one whose start lies in the cached prefix (negative) applies to every new token
    meta.prepare_requests(["X"], [4], [-7])
    assert meta.keys == ("X",) and meta.slot_rows(0).tolist() == [0, 1, 2, 3]
    meta.check_invariants()


def test_capacity_is_checked_and_grown_only_on_request():
    meta = SegmentMeta.make(max_tokens=4, num_slots=2, device="cpu")
    with pytest.raises(ValueError, match="5 tokens exceed the layout's capacity of 4"):
        meta.prepare_requests(["A"], [5])
    with pytest.raises(ValueError, match="more than 2 adapters in one step"):
        meta.prepare_requests(["A", "B", "C"], [1, 1, 1])
    meta.reserve(3)
    assert meta.max_tokens == 4  # fits: nothing reallocated
    meta.reserve(5)
    assert meta.max_tokens == 8
    meta.prepare_requests(["A", "B"], [2, 3])
    assert meta.seg_indptr.tolist() == [0, 2, 5]
    meta.check_invariants()


def test_prepare_from_per_token_slots_matches_prepare_requests():
    """The SGLang backend fills per-token slots itself (`prepare`); the layout is the same."""
    by_request = SegmentMeta.make(16, 3, "cpu")
    by_request.prepare_requests(["A", None, "X", "A"], [3, 2, 3, 2], [0, 0, 1, 0])
    by_token = SegmentMeta.make(16, 3, "cpu")
    by_token.prepare(torch.tensor([0, 0, 0, -1, -1, -1, 1, 1, 0, 0], dtype=torch.int32))
    assert by_token.keys == ()
    for name in ("token_slot", "sorted_token_ids", "seg_indptr"):
        assert torch.equal(getattr(by_token, name), getattr(by_request, name)), name


def _op_inputs(meta: SegmentMeta, g: torch.Generator):
    ranks, scale = {"A": 4, "B": 8}, {"A": 0.5, "B": 2.0}
    weights = {k: (torch.randn(r, 16, generator=g), torch.randn(12, r, generator=g))
               for k, r in ranks.items()}
    table = LoRAWeights.from_list(
        [weights[k][0] for k in meta.keys] + [None] * (meta.num_slots - len(meta.keys)),
        [weights[k][1] for k in meta.keys] + [None] * (meta.num_slots - len(meta.keys)),
        [scale[k] for k in meta.keys] + [0.0] * (meta.num_slots - len(meta.keys)),
        (0, 12),
    )
    return weights, scale, table


def test_op_equals_per_token_loop():
    g = torch.Generator().manual_seed(0)
    meta = SegmentMeta.make(32, 3, "cpu")
    meta.prepare_requests(["A", None, "B", "A", "B", None], [3, 2, 4, 1, 2, 3], [0, 0, 2, 0, 0, 0])
    weights, scale, table = _op_inputs(meta, g)
    x = torch.randn(meta.num_tokens, 16, generator=g)
    y0 = torch.randn(meta.num_tokens, 12, generator=g)
    y = lora_forward(x, y0.clone(), meta, table, impl="torch")
    for t in range(meta.num_tokens):
        slot = int(meta.token_slot[t])
        expected = y0[t].clone()
        if slot != NO_ADAPTER:
            key = meta.keys[slot]
            a, b = weights[key]
            expected += scale[key] * (b @ (a @ x[t]))
        torch.testing.assert_close(y[t], expected, rtol=1e-5, atol=1e-5)


def _adapter(name: str, rank: int, g: torch.Generator) -> LoadedAdapter:
    spec = AdapterSpec(name, "", f"identity-{name}", rank, 2.0 * rank, 2.0, ("q_proj",), None)
    return LoadedAdapter(spec, {(0, "q_proj"): (torch.randn(rank, 16, generator=g),
                                                torch.randn(12, rank, generator=g))})


def test_cpu_lora_layer_reads_the_shared_step_and_caches_tables(monkeypatch):
    from sgl_multilora.patches import flags
    from sgl_multilora.patches.lora_linear import LoRAStep, MultiLoRALinear

    monkeypatch.setenv(flags.ENV_VAR, "")
    g = torch.Generator().manual_seed(1)
    adapters = {"a": _adapter("a", 4, g), "b": _adapter("b", 8, g)}
    base = torch.nn.Linear(16, 12, bias=False)
    layer = MultiLoRALinear(base, layer_id=0, module_name="q_proj")
    other = MultiLoRALinear(torch.nn.Linear(16, 12, bias=False), layer_id=1, module_name="q_proj")
    layer.step = other.step = step = LoRAStep()
    for keys, lens in ((["b", None, "a"], [2, 3, 1]), (["b", None, "a"], [1, 1, 1]), ([None], [2])):
        step.prepare(keys, lens, None, adapters, num_slots=4, device="cpu")
        assert step.meta.num_slots == 4
        x = torch.randn(sum(lens), 16, generator=g)
        expected = x @ base.weight.t()
        for i, slot in enumerate(step.meta.token_slot[: sum(lens)].tolist()):
            if slot != NO_ADAPTER:
                a, b = adapters[step.meta.keys[slot]].weights[(0, "q_proj")]
                expected[i] += 2.0 * (b @ (a @ x[i]))
        with torch.no_grad():
            torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
            # no adapter targets layer 1: its output is the base projection's
            torch.testing.assert_close(other(x), x @ other.base.weight.t())
    assert len(layer._tables) == 1  # both adapter steps served ("b", "a"): one table, built once
