"""Adapter slots (the engine's cap on distinct adapters per batch) in the multi-queue scheduler:
admission passes over a request that needs a slot none is left for without blocking its queue;
the slot squash retracts the adapter cheapest to recompute for the oldest request about to miss
its TTFT SLO, reserves the freed slot for it, and is bounded (never for a resumed request, at most
`max_slot_squashes` times for one victim, one at a time, never when recomputing costs more than the
SLO).

Timing: 1 ms per prompt token and 0.1 s per output token; TTFT SLO 2 s.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from sgl_multilora.sched import (
    MultiQueueScheduler,
    OutputLengthPredictor,
    SchedConfig,
    SchedRequest,
    TimingModel,
    WrsNormalizer,
)
from sgl_multilora.sched.rules.slot_squash import choose_slot_squash, slot_free_in_s
from sgl_multilora.sched.slots import AdapterSlots

TIMING = TimingModel(prefill_s_per_token=0.001, decode_s_per_token=0.1)


def make(**config) -> MultiQueueScheduler:
    """A scheduler with one queue of 100,000 tokens; `config` overrides SchedConfig fields."""
    cfg = SchedConfig(**{"total_tokens": 100_000, "requeue_s": math.inf, "timing": TIMING, "ttft_slo_s": 2.0,
                         "max_squashes": 1, "max_slot_squashes": 1, "initial_norm": WrsNormalizer(1000, 1000, 8), **config})
    s = MultiQueueScheduler(cfg, OutputLengthPredictor(default_out_len=10**6))
    s.set_plan([], [100_000])
    return s


def req(rid, adapter, in_len=10, out_len=100, arrival=0.0) -> SchedRequest:
    return SchedRequest(rid, adapter, in_len, rank=8, max_new_tokens=out_len, arrival=arrival)


def rids(requests):
    return [r.rid for r in requests]


def running_map(s: MultiQueueScheduler) -> dict:
    out: dict = {}
    for r in s.running.values():
        out.setdefault(r.adapter, []).append(r.rid)
    return out


def recompute(r: SchedRequest) -> int:
    return r.in_len + 5  # prompt plus five streamed tokens


def test_a_request_needing_a_slot_none_is_left_for_is_passed_over_not_blocking_its_queue():
    s = make()
    for rid, adapter in [("a1", "a"), ("c1", "c"), ("a2", "a"), ("b1", "b"), ("base", None)]:
        s.add(req(rid, adapter))
    # two slots, "a" running: c1 takes the last one; a2 joins "a"; b1 and the base request are passed over
    batch = s.build_batch(0.0, running_adapters={"a"}, max_adapters=2)
    assert rids(batch) == ["a1", "c1", "a2"]
    assert s.stats().counts["slot_skips"] == 2
    # the base model counts as an adapter, as SGLang counts it
    s2 = make()
    s2.add(req("base", None))
    s2.add(req("a1", "a"))
    assert rids(s2.build_batch(0.0, running_adapters={None}, max_adapters=1)) == ["base"]
    # no cap given: every request goes in (the simulator's engine has none)
    s3 = make()
    for i, adapter in enumerate("abcde"):
        s3.add(req(f"r{i}", adapter))
    assert len(s3.build_batch(0.0)) == 5
    s.check_invariants()


class Memory:
    """A pool holding `capacity` adapters: a load completes at once (as a host copy on a CPU does)
    and evicts the adapter loaded longest ago. Records every load asked for."""

    def __init__(self, resident, capacity, asynchronous=False):
        self.resident, self.capacity, self.asynchronous = list(resident), capacity, asynchronous
        self.loads: list[str] = []

    def is_resident(self, adapter):
        return adapter in self.resident

    def prefetch(self, adapter):
        self.loads.append(adapter)
        if not self.asynchronous:
            self.resident = (self.resident + [adapter])[-self.capacity:]
        return True


def test_no_adapter_is_loaded_for_a_request_that_has_no_slot_in_the_batch():
    s = make()
    for rid, adapter in [("a1", "a"), ("b1", "b"), ("c1", "c"), ("d1", "d")]:
        s.add(req(rid, adapter))
    mem = Memory(resident=["a"], capacity=3)
    # two slots, "x" running: a1 takes the last one; b, c and d are not loaded (each would evict
    # an adapter a request can run on, to serve a request that cannot run now)
    batch = s.build_batch(0.0, None, mem.is_resident, mem.prefetch, {"x"}, 2)
    assert rids(batch) == ["a1"]
    assert mem.loads == []
    assert s.stats().counts["slot_skips"] == 3


def test_an_adapter_loaded_at_once_admits_its_request_in_the_same_batch():
    s = make()
    for rid, adapter in [("b1", "b"), ("a1", "a"), ("c1", "c")]:
        s.add(req(rid, adapter))
    mem = Memory(resident=["a"], capacity=3)
    batch = s.build_batch(0.0, None, mem.is_resident, mem.prefetch, set(), 4)
    assert rids(batch) == ["b1", "a1", "c1"]
    assert mem.loads == ["b", "c"]
    # a load under way (a device copy): passed over, keeping its place, admitted once resident
    s2 = make()
    s2.add(req("b1", "b"))
    s2.add(req("a1", "a"))
    mem2 = Memory(resident=["a"], capacity=3, asynchronous=True)
    assert rids(s2.build_batch(0.0, None, mem2.is_resident, mem2.prefetch, set(), 4)) == ["a1"]
    mem2.resident.append("b")
    assert rids(s2.build_batch(0.1, None, mem2.is_resident, mem2.prefetch, {"a"}, 4)) == ["b1"]
    # each callback once per adapter and batch, however many of its requests the scan meets
    s3 = make()
    for i in range(5):
        s3.add(req(f"c{i}", "c"))
    mem3 = Memory(resident=[], capacity=3, asynchronous=True)
    asked = []
    s3.build_batch(0.0, None, lambda a: asked.append(a) or mem3.is_resident(a), mem3.prefetch, set(), 4)
    assert asked == ["c", "c"] and mem3.loads == ["c"]  # before the load and once after it
    s.check_invariants()
    s2.check_invariants()


def test_slot_skips_spend_no_lookahead_so_a_running_adapter_far_back_still_goes_in():
    s = make(lookahead=2)
    for i in range(10):  # ten requests on adapters that have no slot, then two on the running one
        s.add(req(f"x{i}", f"x{i}", arrival=0.01 * i))
    s.add(req("a1", "a", arrival=0.2))
    s.add(req("a2", "a", arrival=0.3))
    batch = s.build_batch(1.0, running_adapters={"a"}, max_adapters=1)
    assert rids(batch) == ["a1", "a2"]
    assert s.stats().counts["slot_skips"] == 10
    s.check_invariants()


def test_story_slot_squash_picks_the_cheapest_adapter_and_reserves_the_slot():
    s = make()
    # three adapters fill the cap of 3; each decodes 100 tokens (10 s) from t=0
    s.add(req("a1", "a", in_len=500))
    s.add(req("a2", "a", in_len=10))
    s.add(req("b1", "b", in_len=200))
    s.add(req("c1", "c", in_len=50))
    s.add(req("c2", "c", in_len=50))
    assert len(s.build_batch(0.0, running_adapters=set(), max_adapters=3)) == 5
    s.add(req("d1", "d", in_len=10, out_len=5, arrival=0.1))
    s.add(req("e1", "e", in_len=10, out_len=5, arrival=0.2))
    running = running_map(s)
    assert slot_free_in_s({a: [s.running[r] for r in rs] for a, rs in running.items()}, 0.1, TIMING) \
        == pytest.approx(9.95)  # c's requests: 50 prompt + 100 output tokens from t=0

    # d1 just arrived, but a slot frees only in about 10 s: it would miss its 2 s SLO
    sq = s.slot_squashes.choose(0.1, running, 3, recompute)
    assert sq is not None and sq.beneficiary.rid == "d1"
    # recompute cost: a 525, b 205, c 110: c goes, both its requests
    assert sq.adapter == "c" and rids(sq.victims) == ["c1", "c2"]
    assert s.running["c1"].rid == "c1" and "c1" not in s.queues  # nothing changed yet
    s.slot_squashes.commit(sq)
    assert "c1" in s.queues and "c2" in s.queues and s.slot_squashes.reserved_for == "d1"
    assert all(s.queues.get(r).resumed and s.queues.get(r).num_squashes == 1 for r in ("c1", "c2"))
    s.check_invariants()

    # no second squash while d1 waits for its slot, even with every slot taken again
    running = running_map(s)
    assert s.slot_squashes.choose(0.2, {**running, "z": ["a1"]}, 3, recompute) is None
    # the freed slot is d1's: c1 and c2 (older) and e1 must not take it
    batch = s.build_batch(0.2, running_adapters=set(running), max_adapters=3)
    assert rids(batch) == ["d1"] and s.slot_squashes.reserved_for is None
    counts = s.stats().counts
    assert counts["slot_squashes"] == 1 and counts["slot_squashed"] == 2 and counts["squashes"] == 0
    s.check_invariants()


def test_no_squash_while_a_slot_frees_in_time_and_one_once_half_the_slo_is_spent():
    s = make()
    s.add(req("a1", "a", out_len=5))  # finishes in 0.51 s
    s.add(req("b1", "b", out_len=100))
    s.build_batch(0.0, running_adapters=set(), max_adapters=2)
    s.add(req("c1", "c", arrival=0.0))
    assert s.slot_squashes.choose(0.0, running_map(s), 2, recompute) is None  # 0 + 0.51 s <= 2 s
    # the prediction was wrong: a1 is still running at 1 s, half the SLO: squash now
    sq = s.slot_squashes.choose(1.0, running_map(s), 2, recompute)
    assert sq is not None and sq.beneficiary.rid == "c1" and sq.adapter == "a"
    # a free slot: no squash at all
    assert s.slot_squashes.choose(1.0, {"a": ["a1"]}, 2, recompute) is None


@pytest.mark.parametrize("share, fires_at", [(0.25, 0.5), (0.0, 0.0), (1.0, None)])
def test_the_slot_squash_share_sets_how_long_a_request_waits_for_a_slot(share, fires_at):
    """`slot_squash_share` of the 2 s SLO: with a1 predicted to finish in time, the squash fires once c1 has waited
    that share (0: at once; 1: only a predicted miss, never here before 1.9 s)."""
    s = make(slot_squash_share=share)
    s.add(req("a1", "a", out_len=5))
    s.add(req("b1", "b", out_len=100))
    s.build_batch(0.0, running_adapters=set(), max_adapters=2)
    s.add(req("c1", "c", arrival=0.0))
    for t in (0.0, 0.49, 0.5, 1.0, 1.9):
        sq = s.slot_squashes.choose(t, running_map(s), 2, recompute)
        expected = fires_at is not None and t >= fires_at
        assert (sq is not None) is expected, (share, t)
        assert sq is None or (sq.beneficiary.rid, sq.adapter) == ("c1", "a")


def test_slot_squash_share_out_of_range_is_refused():
    with pytest.raises(ValueError, match="slot_squash_share"):
        make(slot_squash_share=1.5)


def test_squash_bounds_resumed_beneficiaries_repeat_victims_excluded_and_costly_adapters():
    s = make()
    s.add(req("a1", "a"))
    s.add(req("b1", "b"))
    s.build_batch(0.0, running_adapters=set(), max_adapters=2)
    s.add(req("c1", "c", arrival=0.0))
    sq = s.slot_squashes.choose(1.5, running_map(s), 2, recompute)
    assert sq.adapter in ("a", "b")
    # excluded (a chunked prefill in progress): the other one goes
    sq2 = s.slot_squashes.choose(1.5, running_map(s), 2, recompute, excluded={sq.adapter})
    assert sq2.adapter == ({"a", "b"} - {sq.adapter}).pop()
    # recomputing costs more than the SLO (2 s at 1 ms per token): not squashed
    assert s.slot_squashes.choose(1.5, running_map(s), 2, lambda r: 2500) is None
    # an adapter whose request was squashed before is not squashed again
    s.running["a1"].num_squashes = 1
    sq3 = s.slot_squashes.choose(1.5, running_map(s), 2, recompute)
    assert sq3.adapter == "b"
    s.running["b1"].num_squashes = 1
    assert s.slot_squashes.choose(1.5, running_map(s), 2, recompute) is None
    # an adapter with a request the scheduler does not know is not squashed
    s.running["b1"].num_squashes = 0
    assert s.slot_squashes.choose(1.5, {"a": ["a1"], "b": ["b1", "ghost"]}, 2, recompute) is None
    # a resumed request is never a beneficiary: its first token is out
    s.queues.get("c1").resumed = True
    assert s.slot_squashes.choose(1.5, running_map(s), 2, recompute) is None


@pytest.mark.parametrize("bound", [0, 1, 2, 3])
def test_a_victim_is_retracted_by_slot_squashes_at_most_the_bound_times(bound):
    """`max_slot_squashes`: an adapter whose running request has been retracted that often is no victim (0: no slot
    squash at all); below the bound it is, however often its request was squashed before."""
    s = make(max_slot_squashes=bound)
    s.add(req("a1", "a"))
    s.build_batch(0.0, running_adapters=set(), max_adapters=1)
    s.add(req("c1", "c", arrival=0.0))
    for times in range(4):
        s.running["a1"].num_squashes = times
        sq = s.slot_squashes.choose(1.5, running_map(s), 1, recompute)
        assert (sq is not None) == (times < bound), (times, bound)
        if sq is not None:
            assert sq.adapter == "a" and sq.beneficiary.rid == "c1"
    with pytest.raises(ValueError, match="max_slot_squashes"):
        make(max_slot_squashes=-1)


def test_the_beneficiary_is_the_oldest_resident_request_needing_a_slot():
    s = make()
    s.add(req("a1", "a"))
    s.build_batch(0.0, running_adapters=set(), max_adapters=1)
    s.add(req("a2", "a", arrival=0.0))  # its adapter runs: needs no slot
    s.add(req("x1", "x", arrival=0.1))  # not resident
    s.add(req("y1", "y", arrival=0.2))
    sq = s.slot_squashes.choose(1.5, running_map(s), 1, recompute, is_resident=lambda a: a != "x")
    assert sq.beneficiary.rid == "y1" and sq.adapter == "a"


def test_the_squash_loads_the_adapter_of_an_older_request_whose_adapter_is_not_resident():
    s = make()
    s.add(req("a1", "a"))
    s.build_batch(0.0, running_adapters=set(), max_adapters=1)
    s.add(req("x1", "x", arrival=0.1))  # older, its adapter not resident (admission loads nothing for it)
    s.add(req("y1", "y", arrival=0.2))
    # the rule does not fire yet (a slot frees before the SLO is spent): no load is asked for
    mem = Memory(resident=["a", "y"], capacity=3)
    early = TimingModel(prefill_s_per_token=0.001, decode_s_per_token=0.001)
    s.config = dataclasses.replace(s.config, timing=early)
    assert s.slot_squashes.choose(0.2, running_map(s), 1, recompute, mem.is_resident, (), mem.prefetch) is None
    assert mem.loads == []
    s.config = dataclasses.replace(s.config, timing=TIMING)
    # it fires: the load completes at once, so x1, the oldest, gets the slot
    sq = s.slot_squashes.choose(1.5, running_map(s), 1, recompute, mem.is_resident, (), mem.prefetch)
    assert sq.beneficiary.rid == "x1" and sq.adapter == "a" and mem.loads == ["x"]
    # a load that does not complete at once: the oldest resident request's squash instead
    mem2 = Memory(resident=["a", "y"], capacity=3, asynchronous=True)
    sq2 = s.slot_squashes.choose(1.5, running_map(s), 1, recompute, mem2.is_resident, (), mem2.prefetch)
    assert sq2.beneficiary.rid == "y1" and mem2.loads == ["x"]
    # without a prefetch callback, the oldest resident one, as before
    assert s.slot_squashes.choose(1.5, running_map(s), 1, recompute, mem2.is_resident).beneficiary.rid == "y1"


def test_a_removed_beneficiary_releases_its_reservation_and_pushed_back_requests_are_not_resumed():
    s = make()
    s.add(req("a1", "a"))
    s.build_batch(0.0, running_adapters=set(), max_adapters=1)
    s.add(req("b1", "b"))
    s.add(req("c1", "c", arrival=0.1))
    sq = s.slot_squashes.choose(1.5, running_map(s), 1, recompute)
    s.slot_squashes.commit(sq)
    assert s.slot_squashes.reserved_for == "b1"
    s.remove("b1")  # aborted while it waited
    assert s.slot_squashes.reserved_for is None
    batch = s.build_batch(1.6, running_adapters=set(), max_adapters=1)
    assert rids(batch) == ["a1"]  # the oldest again, now that nothing is reserved
    s.requeue("a1", pushed_back=True)
    assert s.queues.get("a1").resumed  # squashed before: a push-back does not make it fresh
    fresh = make()
    fresh.add(req("p", "p"))
    fresh.build_batch(0.0)
    fresh.requeue("p", pushed_back=True)  # planned, never run: its first token is still to come
    assert not fresh.queues.get("p").resumed


def test_adapter_slots_rejects_a_cap_below_one_and_counts_the_reservation():
    with pytest.raises(ValueError, match="cap"):
        AdapterSlots(set(), 0)
    slots = AdapterSlots({"a"}, 2, reserved="r1")
    assert not slots.has_slot(req("x", "b")) and slots.has_slot(req("r1", "b"))
    assert slots.has_slot(req("y", "a"))  # its adapter runs
    slots.take(req("r1", "b"))
    assert slots.reserved is None and slots.in_batch == {"a", "b"}


def test_choose_slot_squash_alone_on_unknown_requests():
    cfg = SchedConfig(total_tokens=10, timing=TIMING, ttft_slo_s=2.0)
    r1 = req("r1", "z", arrival=0.0)
    # every running request unknown: nothing predicts a free slot (0 s), no victim is known
    assert choose_slot_squash(r1, {"a": [None]}, 0.0, cfg, recompute) is None
    assert choose_slot_squash(r1, {"a": [None]}, 1.0, cfg, recompute) is None


def test_a_reservation_lasts_one_batch():
    """A beneficiary the next batch cannot take (over the budget) does not hold the freed slot any longer."""
    s = make()
    s.add(req("a1", "a"))
    s.build_batch(0.0, running_adapters=set(), max_adapters=1)
    s.add(req("big", "b", in_len=5000, arrival=0.0))
    s.add(req("c1", "c", arrival=0.1))
    sq = s.slot_squashes.choose(1.5, running_map(s), 1, recompute)
    assert sq.beneficiary.rid == "big"
    s.slot_squashes.commit(sq)
    # over the budget: nothing that needs a slot goes in while it is reserved for "big"
    assert rids(s.build_batch(1.6, budget_tokens=1000, running_adapters=set(), max_adapters=1)) == []
    assert s.slot_squashes.reserved_for is None
    # the next batch: the slot is anyone's (a1, squashed, is oldest)
    assert rids(s.build_batch(1.7, budget_tokens=1000, running_adapters=set(), max_adapters=1)) == ["a1"]
    s.check_invariants()
