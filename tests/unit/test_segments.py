"""SegmentMeta (per-step LoRA layout) and the torch reference op, against a per-token loop."""

from __future__ import annotations

import torch

from sgl_multilora.segments import NO_ADAPTER, SegmentMeta
from sgl_multilora.triton_kernels.lora_ref import lora_shrink_expand_ref


def test_running_example_from_the_docstring():
    meta = SegmentMeta.build(["base" and None, "A", "X"], [3, 4, 2], [0, 0, 1])
    assert meta.num_tokens == 9
    assert meta.token_adapter.tolist() == [-1, -1, -1, 0, 0, 0, 0, -1, 1]
    assert [g.key for g in meta.groups] == ["A", "X"]
    assert meta.groups[0].token_index.tolist() == [3, 4, 5, 6]
    assert meta.groups[1].token_index.tolist() == [8]


def test_same_adapter_in_several_requests_is_one_group():
    meta = SegmentMeta.build(["A", None, "A"], [2, 1, 3])
    assert len(meta.groups) == 1 and meta.groups[0].token_index.tolist() == [0, 1, 3, 4, 5]


def test_all_base_and_empty_batches_have_no_lora():
    assert not SegmentMeta.build([None, None], [5, 1]).has_lora
    assert not SegmentMeta.build([], []).has_lora
    # an aLoRA whose activation start lies past this chunk contributes no token
    assert not SegmentMeta.build(["X"], [4], [10]).has_lora
    # ...and one whose start lies in the cached prefix (negative) applies to every new token
    assert SegmentMeta.build(["X"], [4], [-7]).groups[0].token_index.tolist() == [0, 1, 2, 3]


def test_reference_op_equals_per_token_loop():
    g = torch.Generator().manual_seed(0)
    adapters = ["A", None, "B", "A", "B", None]
    lens = [3, 2, 4, 1, 2, 3]
    starts = [0, 0, 2, 0, 0, 0]
    meta = SegmentMeta.build(adapters, lens, starts)
    ranks = {"A": 4, "B": 8}
    weights = {k: (torch.randn(r, 16, generator=g), torch.randn(12, r, generator=g)) for k, r in ranks.items()}
    scale = {"A": 0.5, "B": 2.0}
    x = torch.randn(meta.num_tokens, 16, generator=g)
    y0 = torch.randn(meta.num_tokens, 12, generator=g)
    y = y0.clone()
    lora_shrink_expand_ref(
        x, y,
        [grp.token_index for grp in meta.groups],
        [weights[grp.key][0] for grp in meta.groups],
        [weights[grp.key][1] for grp in meta.groups],
        [scale[grp.key] for grp in meta.groups],
    )
    for t in range(meta.num_tokens):
        group = int(meta.token_adapter[t])
        expected = y0[t].clone()
        if group != NO_ADAPTER:
            key = meta.groups[group].key
            a, b = weights[key]
            expected += scale[key] * (b @ (a @ x[t]))
        torch.testing.assert_close(y[t], expected, rtol=1e-5, atol=1e-5)
