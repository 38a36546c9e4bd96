"""Adapter weights in KV slots: how many slots an adapter takes, and where each matrix sits.

The placement is checked against real tensors: matrices written through their views into a K and a V buffer must
come back intact (no two overlap, none leaves its run), which is what the live loader relies on.
"""

from __future__ import annotations

import random

import pytest
import torch

from sgl_multilora.pool import UnifiedPool
from sgl_multilora.slot_layout import min_run, place, slots_needed

HALF = 12  # elements of one slot's K (or V) row in one layer: kv_heads x head_dim


def lora_shapes(num_layers: int, rank: int, modules: dict[str, tuple[int, int]]) -> dict:
    out = {}
    for layer in range(num_layers):
        for module, (din, dout) in modules.items():
            out[(layer, module, "A")] = (rank, din)
            out[(layer, module, "B")] = (dout, rank)
    return out


def write_and_read(shapes, runs, placement, num_layers, num_rows):
    """Writes random matrices through their views into fresh buffers and reads them back."""
    k = [torch.zeros(num_rows, HALF) for _ in range(num_layers)]
    v = [torch.zeros(num_rows, HALF) for _ in range(num_layers)]
    ends = {start: start + n for start, n in runs}
    written = {}
    for key, p in placement.items():
        layer = key[0]
        buffer = (k if p.buffer == 0 else v)[layer]
        numel = p.shape[0] * p.shape[1]
        assert p.offset + numel <= (ends[p.run_start] - p.run_start) * HALF, f"{key} leaves its run"
        view = buffer[p.run_start:].view(-1)[p.offset:p.offset + numel].view(p.shape)
        written[key] = torch.randn(p.shape)
        view.copy_(written[key])
    for key, p in placement.items():
        buffer = (k if p.buffer == 0 else v)[key[0]]
        view = buffer[p.run_start:].view(-1)[p.offset:p.offset + p.shape[0] * p.shape[1]].view(p.shape)
        assert torch.equal(view, written[key]), f"{key} was overwritten: matrices overlap"
    return k, v


def test_slots_grow_with_rank_and_targets_never_with_a_maximum():
    small = lora_shapes(2, 4, {"q": (8, 8)})
    assert slots_needed(small, HALF) == 3  # A and B, 32 elements each, one per buffer: 3 slots of 12 hold 32
    ranks = [slots_needed(lora_shapes(2, r, {"q": (8, 8), "up": (8, 24)}), HALF) for r in (2, 4, 8)]
    assert ranks == sorted(ranks) and ranks[2] > ranks[0]
    more = slots_needed(lora_shapes(2, 4, {"q": (8, 8), "up": (8, 24)}), HALF)
    assert more > slots_needed(small, HALF)


def test_a_single_run_holds_every_layer_in_place():
    shapes = lora_shapes(3, 4, {"q": (8, 8), "k": (8, 4), "up": (8, 24), "down": (24, 8)})
    n = slots_needed(shapes, HALF)
    placement = place(shapes, [(5, n)], HALF)
    assert placement is not None and set(placement) == set(shapes)
    write_and_read(shapes, [(5, n)], placement, 3, 5 + n)


def test_fewer_slots_than_needed_do_not_fit():
    shapes = lora_shapes(1, 4, {"q": (8, 8), "up": (8, 24)})
    n = slots_needed(shapes, HALF)
    assert place(shapes, [(0, n - 1)], HALF) is None


@pytest.mark.parametrize("seed", range(20))
def test_runs_from_a_fragmented_pool_place_or_refuse_never_overlap(seed):
    rng = random.Random(seed)
    pool = UnifiedPool(200, 1)
    held = [pool.alloc("kv_running", rng.randint(1, 9)) for _ in range(25)]
    for slots in rng.sample(held, 12):
        pool.release("kv_running", slots)
    shapes = lora_shapes(2, rng.choice([2, 4]), {"q": (8, 8), "up": (8, 24)})
    runs = pool.alloc("adapter", slots_needed(shapes, HALF), contiguous=True)
    if runs is None:
        return
    placement = place(shapes, runs.runs, HALF)
    if placement is not None:
        write_and_read(shapes, runs.runs, placement, 2, 200)
    elif len(runs.runs) == 1:
        pytest.fail("one run of the computed size must always hold the adapter")


@pytest.mark.parametrize("rank", [2, 4, 8])
def test_no_runs_shorter_than_min_run_take_the_adapter_and_a_run_that_long_starts_one(rank):
    """`min_run` is the longest matrix's rows in one buffer: any number of shorter runs is refused, while a run
    that long with enough other room places the adapter (the swapper frees such a run before a whole one)."""
    shapes = lora_shapes(2, rank, {"q": (8, 8), "k": (8, 4), "up": (8, 24), "down": (24, 8)})
    short, n = min_run(shapes, HALF), slots_needed(shapes, HALF)
    assert short == -(-24 * rank // HALF) and short < n  # up's B and down's A (24 x rank) are the longest
    assert place(shapes, [(i * short, short - 1) for i in range(n)], HALF) is None
    runs = [(0, short)] + [(100 + 50 * i, short) for i in range(n)]  # as many more runs of that length as needed
    placement = place(shapes, runs, HALF)
    assert placement is not None
    write_and_read(shapes, runs, placement, 2, 100 + 50 * n)


def test_bad_arguments():
    with pytest.raises(ValueError):
        slots_needed({}, HALF)
    with pytest.raises(ValueError):
        slots_needed(lora_shapes(1, 2, {"q": (8, 8)}), 0)
    with pytest.raises(ValueError):
        min_run({}, HALF)
