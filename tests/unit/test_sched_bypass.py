"""Adapter-memory bypass and squash: R2 passes a memory-blocked R1 only if T_wait(R1) >
T_exec(R2); R2 is squashed once free memory plus R2's footprint fits R1; never twice.

Timing: no prefill cost and 0.1 s per output token, so T_exec is 0.1 s x predicted output.
"""

from __future__ import annotations

import math

from sgl_multilora.sched import (
    HeldKV,
    MeasuredTerms,
    MultiQueueScheduler,
    OutputLengthPredictor,
    SchedConfig,
    SchedRequest,
    TimingModel,
    WrsNormalizer,
)
from sgl_multilora.sched.bypass import predict_wait_s

TIMING = TimingModel(prefill_s_per_token=0.0, decode_s_per_token=0.1)


def make(quota=2000) -> MultiQueueScheduler:
    cfg = SchedConfig(total_tokens=quota, requeue_s=math.inf, timing=TIMING,
                      initial_norm=WrsNormalizer(1000, 1000, 8))
    s = MultiQueueScheduler(cfg, OutputLengthPredictor(default_out_len=10**6))
    s.set_plan([], [quota])
    return s


def req(rid, in_len, out_len, adapter="a", adapter_tokens=0) -> SchedRequest:
    return SchedRequest(rid, adapter, in_len, rank=8, adapter_tokens=adapter_tokens,
                        max_new_tokens=out_len)


def rids(requests):
    return [r.rid for r in requests]


def blocked_big(adapter):
    return adapter != "big"  # "big" cannot fit even after evicting every idle adapter


def test_predicted_wait_frees_the_soonest_finishing_first():
    running = [req("x", 50, 50), req("y", 50, 100)]  # costs 100 and 150
    for r in running:
        r.cost_tokens, r.admitted_at = r.in_len + r.max_new_tokens, 0.0
        r.pred_out_len = r.max_new_tokens
    r1 = req("r1", 50, 10, "big", adapter_tokens=50)  # needs 100
    assert predict_wait_s(r1, running, 0.0, TIMING) == 5.0  # x alone frees 100 after 5 s
    r1.adapter_tokens = 150  # needs 200: x and y
    assert predict_wait_s(r1, running, 1.0, TIMING) == 9.0
    r1.adapter_tokens = 1000
    assert predict_wait_s(r1, running, 0.0, TIMING) == math.inf


def test_story_bypass_then_squash_then_no_second_squash():
    s = make()
    s.add(req("x", 200, 200))  # running for 20 s, holding 400 tokens
    assert rids(s.build_batch(0.0)) == ["x"]
    s.add(req("r1", 50, 50, "big", adapter_tokens=100))  # needs 150: T_wait = 20 s
    s.add(req("r2", 10, 10))  # T_exec = 1 s < 20 s: may pass
    s.add(req("r3", 300, 300))  # T_exec = 30 s >= 20 s: must wait behind r1
    s.add(req("r4", 10, 10))  # behind r3: FIFO keeps it there
    loads = []

    def prefetch(adapter):
        loads.append(adapter)
        return blocked_big(adapter)

    batch = s.build_batch(0.0, is_resident={"a"}.__contains__, request_prefetch=prefetch)
    assert rids(batch) == ["r2"] and loads == ["big"]
    assert s.bypass.bypassed == {"r2": "r1"} and s.stats().counts["bypasses"] == 1
    s.check_invariants()

    # free memory + r2's 20 tokens must cover r1's 150, and free memory alone must not
    assert s.squash_candidates(free_tokens=100) == []  # 120 < 150: squashing would not help
    assert s.squash_candidates(free_tokens=150) == []  # r1 fits without a squash
    (sq,) = s.squash_candidates(free_tokens=140)
    assert (sq.victim.rid, sq.beneficiary.rid) == ("r2", "r1")
    # the caller may pass the exact tokens a request holds instead of its charged cost
    assert [x.victim.rid for x in s.squash_candidates(0, footprint=lambda r: 150)] == ["r2"]
    # ... and the exact slots a queued request waits for (live: its adapter's, which it is not charged)
    assert s.squash_candidates(free_tokens=140, need=lambda r: 161) == []  # 140 + 20 < 161
    assert s.squash_candidates(free_tokens=130, need=lambda r: 130) == []  # fits without a squash
    assert [x.beneficiary.rid for x in s.squash_candidates(130, need=lambda r: 150)] == ["r1"]

    s.requeue("r2", squash=True)  # the engine aborted it
    assert rids(s.queues.scan(0)) == ["r1", "r2", "r3", "r4"]  # back at its arrival position
    assert s.running.keys() == {"x"} and s.stats().counts["squashes"] == 1
    s.check_invariants()

    # still blocked: r2 passes again, but a request is squashed at most once
    batch = s.build_batch(1.0, is_resident={"a"}.__contains__, request_prefetch=blocked_big)
    assert rids(batch) == ["r2"]
    assert s.squash_candidates(free_tokens=140) == []

    # r1's adapter got in: r1 goes first, then everything that fits
    batch = s.build_batch(2.0, is_resident={"a", "big"}.__contains__)
    assert rids(batch) == ["r1", "r3", "r4"]
    assert s.bypass.bypassed == {}
    s.check_invariants()


def test_no_bypass_when_the_blocked_request_would_not_wait_long():
    s = make()
    s.add(req("x", 20, 20))  # frees 40 tokens in 2 s
    s.build_batch(0.0)
    s.add(req("r1", 10, 10, "big", adapter_tokens=20))  # needs 30: T_wait = 2 s
    s.add(req("r2", 10, 30))  # T_exec = 3 s: it would delay r1
    assert s.build_batch(0.0, is_resident={"a"}.__contains__, request_prefetch=blocked_big) == []
    assert s.bypass.bypassed == {}


def test_removing_the_blocked_request_forgets_its_bypasses():
    s = make()
    s.add(req("r1", 10, 10, "big", adapter_tokens=20))
    s.add(req("r2", 10, 10))  # nothing runs: T_wait is infinite, r2 passes
    assert rids(s.build_batch(0.0, is_resident={"a"}.__contains__,
                              request_prefetch=blocked_big)) == ["r2"]
    assert s.bypass.bypassed == {"r2": "r1"}
    s.remove("r1")  # aborted by its client
    assert s.bypass.bypassed == {} and s.squash_candidates(free_tokens=0) == []
    s.check_invariants()


class Pool:
    """A unified pool as a live engine reports it: 60 slots an admission could have now; retracting a request gives
    back the KV only it holds, its adapter when no other running request uses it ("a": 30 slots, used by r2 alone)
    and the cached prefix its lock alone pins ("r2's prefix": 40 slots); "big" needs 50 slots to start."""

    def room(self) -> int:
        return 60

    def room_without(self, adapter, lock, owned_slots: int) -> int:
        return 60 + owned_slots + (30 if adapter == "a" else 0) + (40 if lock == "r2's prefix" else 0)

    def slots_to_start(self, adapter) -> int:
        return 50 if adapter == "big" else 0


def test_measured_terms_price_a_squash_by_what_the_engine_would_give_back():
    """Live, the squash's terms are measured: r2 holds 70 allocated slots, 40 of them its cached prefix, so
    retracting it gives back 30 of its own, adapter a's 30 and the prefix's 40: footprint 100. r1 needs its
    prompt (50) plus big's 50: 100 > 60 free, <= 60 + 100, so r2 goes; a request the engine cannot describe
    (x, between states) gives back nothing."""
    s = make()
    s.add(req("x", 200, 200))
    s.build_batch(0.0)
    s.add(req("r1", 50, 50, "big"))
    s.add(req("r2", 10, 10))
    assert rids(s.build_batch(0.0, is_resident={"a"}.__contains__, request_prefetch=blocked_big)) == ["r2"]
    held = {"r2": HeldKV("a", allocated_len=70, cached_len=40, lock="r2's prefix")}
    terms = MeasuredTerms(Pool(), held.get)
    assert (terms.free, terms.need(s.queues.get("r1")), terms.footprint(s.running["r2"])) == (60, 100, 100)
    assert terms.footprint(s.running["x"]) == 0 and held["r2"].owned_slots == 30
    (sq,) = s.squash_candidates(terms.free, terms.footprint, terms.need)
    assert (sq.victim.rid, sq.beneficiary.rid) == ("r2", "r1")
    held["r2"] = HeldKV("a", allocated_len=40, cached_len=40, lock=None)  # gives back only a's 30: 90 < 100
    assert s.squash_candidates(terms.free, terms.footprint, terms.need) == []
