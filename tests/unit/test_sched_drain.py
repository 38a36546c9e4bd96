"""The slot drain (slots.py, rule 3): a request that has waited `slot_drain_share` of the TTFT SLO
for one of the engine's adapter slots gets one although the running adapters keep receiving
requests (which need no new slot), retracted requests included, for which no slot squash fires.

Time is the batch number (one batch a second); TTFT SLO 2 s; timing 1 ms per prompt token and
0.1 s per output token. The engine is modelled by the test: an admitted request runs until the
batch the test finishes it, and the adapters running are those of the running requests.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_multilora.sched import (
    MultiQueueScheduler,
    OutputLengthPredictor,
    SchedConfig,
    SchedRequest,
    TimingModel,
    WrsNormalizer,
)
from sgl_multilora.sched.slots import AdapterSlots, choose_drain_adapter
from tests.unit.test_sched_slots import running_map

TIMING = TimingModel(prefill_s_per_token=0.001, decode_s_per_token=0.1)
SLO = 2.0


def make(**config) -> MultiQueueScheduler:
    """One queue of 10^6 tokens (no quota ever stops it); the drain on at the whole SLO (off by default); no
    slot squash unless asked for."""
    cfg = SchedConfig(**{"total_tokens": 10**6, "requeue_s": math.inf, "timing": TIMING, "ttft_slo_s": SLO,
                         "max_slot_squashes": 0, "slot_drain_share": 1.0,
                         "initial_norm": WrsNormalizer(1000, 1000, 8), **config})
    s = MultiQueueScheduler(cfg, OutputLengthPredictor(default_out_len=10**6))
    s.set_plan([], [10**6])
    return s


def req(rid: str, adapter: str | None, out_len: int = 100, arrival: float = 0.0, in_len: int = 10) -> SchedRequest:
    return SchedRequest(rid, adapter, in_len, rank=8, max_new_tokens=out_len, arrival=arrival)


def engine_adapters(s: MultiQueueScheduler) -> set:
    return {r.adapter for r in s.running.values()}


def batch(s: MultiQueueScheduler, now: float, cap: int) -> list[str]:
    return [r.rid for r in s.build_batch(now, running_adapters=engine_adapters(s), max_adapters=cap)]


def test_story_a_squashed_request_gets_the_slot_of_the_adapter_finishing_first():
    s = make(max_slot_squashes=1)
    s.add(req("a1", "a", out_len=30))
    s.add(req("b1", "b", out_len=10))
    s.add(req("x1", "x", in_len=5, out_len=5))
    assert batch(s, 0.0, 3) == ["a1", "b1", "x1"]
    s.add(req("c1", "c", arrival=0.5))
    assert batch(s, 0.5, 3) == []
    # c1 has waited half the SLO: a squash retracts x (cheapest to recompute) and reserves its slot for c1
    sq = s.slot_squash(1.5, running_map(s), 3, lambda r: r.in_len)
    assert sq.adapter == "x" and sq.beneficiary.rid == "c1"
    s.commit_slot_squash(sq)
    assert batch(s, 1.5, 3) == ["c1"]
    x1 = s.queues.get("x1")
    assert x1.resumed and x1.slot_wait_since == 1.5  # no squash will ever fire for it
    # every running adapter keeps receiving requests, which need no new slot
    out_len = {"a": 100, "b": 20, "c": 50}
    for t in (2.0, 3.0):
        for a in "abc":
            s.add(req(f"{a}@{t}", a, out_len=out_len[a], arrival=t))
        assert batch(s, t, 3) == [f"a@{t}", f"b@{t}", f"c@{t}"] and s.slot_drain is None
    # 3.5 = 1.5 + the whole SLO: a drain starts. Predicted last finish: a 9.51 s from now (a@3.0's 100
    # tokens), b 1.51 s (b@3.0's 20; b1 and b@2.0 sooner), c 8.01 s (c1's 100); each has one request queued
    # and has received 4 in 3.5 s: b's drain holds up the fewest request-seconds (4.3, against 70.7 and 52.7)
    for a in "abc":
        s.add(req(f"{a}@3.5", a, out_len=out_len[a], arrival=3.5))
    assert batch(s, 3.5, 3) == ["a@3.5", "c@3.5"]  # b takes no new request
    drain = s.slot_drain
    assert (drain.adapter, drain.beneficiary, drain.started_at) == ("b", "x1", 3.5)
    assert abs(drain.finish_s - 1.51) < 1e-9 and s.stats().counts["slot_drains"] == 1
    for rid, t in (("b1", 4.0), ("b@2.0", 4.5)):
        s.on_finish(rid, t)
        assert batch(s, t, 3) == [] and s.slot_drain is drain
    s.on_finish("b@3.0", 5.0)
    # b is gone: its slot is reserved for x1; b@3.5 and d1 cannot take it
    s.add(req("d1", "d", arrival=5.0))
    assert batch(s, 5.0, 3) == ["x1"] and s.slot_drain is None
    assert engine_adapters(s) == {"a", "c", "x"}
    # b@3.5 and d1 now wait for a slot like anyone else, b@3.5 since the drain passed it over
    assert s.queues.get("b@3.5").slot_wait_since == 3.5 and s.queues.get("d1").slot_wait_since == 5.0
    s.check_invariants()


def test_without_the_drain_the_squashed_request_waits_as_long_as_traffic_lasts():
    """The story's start with the drain off (math.inf): x1 never gets a slot back. The hole the drain closes."""
    s = make(max_slot_squashes=1, slot_drain_share=math.inf)
    s.add(req("a1", "a"))
    s.add(req("b1", "b"))
    s.add(req("x1", "x", in_len=5))
    batch(s, 0.0, 3)
    s.add(req("c1", "c", arrival=0.5))
    batch(s, 0.5, 3)
    s.commit_slot_squash(s.slot_squash(1.5, running_map(s), 3, lambda r: r.in_len))
    assert batch(s, 1.5, 3) == ["c1"]
    for t in range(2, 60):
        for a in sorted(engine_adapters(s)):
            s.add(req(f"{a}@{t}", a, out_len=20, arrival=float(t)))
        assert "x1" not in batch(s, float(t), 3)
        for r in [r for r in s.running.values() if r.admitted_at <= t - 2]:
            s.on_finish(r.rid, float(t))  # each adapter keeps its requests of the last two batches running
    assert s.stats().counts["slot_drains"] == 0 and "x1" in s.queues


def test_a_drain_ends_when_its_request_leaves_or_gets_a_slot_another_way():
    s = make()
    for a in "ab":
        s.add(req(f"{a}1", a))
    batch(s, 0.0, 2)
    s.add(req("x1", "x", arrival=0.0))
    s.add(req("y1", "y", arrival=0.5))
    assert batch(s, 1.0, 2) == []
    s.add(req("a2", "a", arrival=3.0))
    # a1 and b1 end together, but a2 is queued for a: b is drained (b takes nothing new; a2 goes)
    assert batch(s, 3.0, 2) == ["a2"] and (s.slot_drain.adapter, s.slot_drain.beneficiary) == ("b", "x1")
    s.remove("x1")  # aborted while queued: the drain ends with it
    assert s.slot_drain is None
    s.check_invariants()
    # the next batch drains b again, for y1 (waiting since 1.0)
    s.add(req("b2", "b", arrival=3.5))
    assert batch(s, 3.5, 2) == [] and (s.slot_drain.adapter, s.slot_drain.beneficiary) == ("b", "y1")
    # a's requests end first: y1 takes a's slot, and the drain of b is over (b2 goes)
    s.on_finish("a1", 4.0)
    s.on_finish("a2", 4.0)
    assert batch(s, 4.0, 2) == ["y1", "b2"] and s.slot_drain is None
    s.check_invariants()


def test_no_drain_while_a_slot_is_free_or_a_squash_reservation_is_pending():
    s = make(max_slot_squashes=1)
    s.add(req("a1", "a"))
    batch(s, 0.0, 1)
    s.add(req("x1", "x"))
    s.add(req("y1", "y"))
    assert batch(s, 0.5, 1) == []
    sq = s.slot_squash(2.6, {"a": ["a1"]}, 1, lambda r: r.in_len)
    assert sq is not None and sq.beneficiary.rid == "x1"
    s.commit_slot_squash(sq)
    # a1 retracted and x1's slot reserved; y1 has waited the SLO, but the reservation goes first
    assert batch(s, 2.6, 1) == ["x1"] and s.slot_drain is None
    # now x runs and the cap is full again: y1 (waiting since 0.5) gets a drain of x
    assert batch(s, 2.7, 1) == [] and s.slot_drain.adapter == "x" and s.slot_drain.beneficiary == "y1"
    s.check_invariants()


def test_choose_drain_adapter_weighs_the_time_to_finish_by_the_requests_held_up():
    now = 0.0
    a, b = req("a", "a", out_len=30), req("b", "b", out_len=10)
    a.admitted_at = b.admitted_at = 0.0
    s = make()
    for r in (a, b):
        s.add(r)
    assert choose_drain_adapter({"a": [a], "b": [b]}, now, TIMING) == ("b", b.admitted_at + TIMING.request_exec_s(b))
    assert choose_drain_adapter({"a": [a], "b": [b, None]}, now, TIMING)[0] == "a"
    assert choose_drain_adapter({None: [None], "a": [a]}, now, TIMING)[0] == "a"
    assert choose_drain_adapter({"a": [a]}, now, TIMING, exclude={"a"}) is None
    # weighed by the requests the drain holds up: b ends 2 s sooner, but three of its requests are queued
    # (1.01 s x 4 = 4.04 request-seconds against a's 3.01 x 1), or it receives two a second (1.01 + 2 x 1.01^2 / 2
    # = 2.03 against a's 3.01: b still; at four a second 3.05: a)
    assert choose_drain_adapter({"a": [a], "b": [b]}, now, TIMING, waiting={"b": 3})[0] == "a"
    assert choose_drain_adapter({"a": [a], "b": [b]}, now, TIMING, rates={"b": 2.0})[0] == "b"
    assert choose_drain_adapter({"a": [a], "b": [b]}, now, TIMING, rates={"b": 4.0})[0] == "a"
    slots = AdapterSlots({"a", "b"}, 3, draining=frozenset({"a"}))
    assert not slots.has_slot(a) and slots.has_slot(b) and slots.has_slot(req("z", "z"))


CAP, D, THRESHOLD = 3, 4, SLO  # adapter slots; most batches a request runs; the drain threshold (share 1)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), retract_every=st.integers(2, 7), num_iters=st.integers(10, 40))
def test_every_request_waiting_for_a_slot_gets_one_within_the_bound(data, retract_every, num_iters):
    """Adversarial arrivals: every batch, each running adapter receives a request (it never drains
    on its own) and new adapters' requests arrive at random; the engine retracts a running request
    now and then (it resumes, so no squash serves it). Every request that waits for a slot gets one
    within the threshold plus, per request that was already waiting when it started and for itself,
    D + 2 batches (a drain: D for the drained adapter's last request to end, one to reserve the
    slot, one to start the next)."""
    s = make()
    finish_at: dict[str, int] = {}
    waiting_since: dict[str, float] = {}
    ahead: dict[str, int] = {}
    n = 0
    for it in range(num_iters + 200):
        now = float(it)
        for rid in [rid for rid, t in finish_at.items() if t <= it]:
            del finish_at[rid]
            s.on_finish(rid, now)
        if it < num_iters:
            for a in sorted(engine_adapters(s), key=str):
                s.add(req(f"{n}", a, arrival=now))
                n += 1
            for a in data.draw(st.lists(st.sampled_from("pqrstuvw"), max_size=2)):
                s.add(req(f"{n}", a, arrival=now))
                n += 1
            if it % retract_every == 0 and finish_at:
                rid = data.draw(st.sampled_from(sorted(finish_at)))
                del finish_at[rid]
                s.requeue(rid)
        for r in s.build_batch(now, running_adapters=engine_adapters(s), max_adapters=CAP):
            finish_at[r.rid] = it + data.draw(st.integers(1, D))
            if r.rid in waiting_since:
                waited = now - waiting_since.pop(r.rid)
                bound = THRESHOLD + (ahead.pop(r.rid) + 1) * (D + 2)
                assert waited <= bound, f"{r} waited {waited} s for a slot, bound {bound}"
        for q in range(s.queues.num_queues):
            for r in s.queues.scan(q):
                if r.slot_wait_since is not None and r.rid not in waiting_since:
                    waiting_since[r.rid] = r.slot_wait_since
                    ahead[r.rid] = sum(1 for o in waiting_since.values() if o <= r.slot_wait_since) - 1
        for rid, since in waiting_since.items():
            assert now - since <= THRESHOLD + (ahead[rid] + 1) * (D + 2), f"{rid} waiting since {since}"
        s.check_invariants()
        if it >= num_iters and not len(s.queues) and not finish_at:
            break
    assert not len(s.queues), f"{len(s.queues)} requests never admitted"
