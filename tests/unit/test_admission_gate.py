"""The unified pool's admission gate: feasibility at its exact edges, the holds as stories, and a randomized engine
(pool, residency, swapper, tree and gate driven by SGLang's admission rule) in which every request either completes
or is refused at arrival, within a bound, with the accounting closed after every step.

The engine's admission pass is SGLang's `PrefillAdder` rule written out here, independently of the gate: a request
goes in when `prompt + new + 1 < free + evictable - reserved`, where `evictable` counts unlocked KV and resident
adapters no running request uses, and `reserved` the tokens admitted or running requests may still take; the first
request that does not fit ends the pass. Expected refusals are computed by the test's own arithmetic.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgl_multilora.admission_gate import (
    MIN_REQUEST_TOKENS,
    AdmissionGate,
    InfeasibleAdapter,
    InfeasibleRequest,
    check_adapter,
    check_request,
    fits,
    longest_request_beside,
    max_new_beside,
)
from sgl_multilora.keys import AdapterRef, MatchKey, Namespace
from sgl_multilora.policy import create_policy
from sgl_multilora.policy.usage import UsageStats
from sgl_multilora.pool import ExceedsPoolError, UnifiedPool
from sgl_multilora.residency import AdapterResidency
from sgl_multilora.swapper import Swapper
from sgl_multilora.tree import LoraRadixTree

NS = Namespace("m")


# ---- feasibility at its edges -------------------------------------------------------------------------------------


def test_a_request_fits_exactly_when_adapter_plus_its_tokens_stay_below_the_pool():
    # SGLang admits when prompt + new + 1 < free + evictable; beside a pinned 60-slot adapter a 100-slot pool
    # offers 40: prompt + new + 1 must be at most 39.
    assert fits(100, 60, 30, 8) and not fits(100, 60, 30, 9)
    assert longest_request_beside(100, 60) == 38 and max_new_beside(100, 60, 30) == 8
    assert fits(100, 0, 90, 8) and not fits(100, 0, 90, 9)  # the base model: the whole pool
    with pytest.raises(InfeasibleRequest) as e:
        check_request("big", 60, 30, 9, 100)
    message = str(e.value)
    for size in ("'big' takes 60 token slots", "the request 40 (30 prompt + 9 new + 1 reserved)", "100 in all",
                 "the pool holds 100", "prompt + new tokens <= 38"):
        assert size in message
    check_request("big", 60, 30, 8, 100)  # no error


def test_an_adapter_is_refused_when_not_even_the_smallest_request_fits_beside_it():
    assert MIN_REQUEST_TOKENS == 3
    check_adapter("ok", 96, 100, 10)  # 96 + 3 < 100: a 1-token prompt with 1 new token fits
    with pytest.raises(InfeasibleAdapter, match=r"'huge' takes 97 token slots \(970 B\) of the pool's 100") as e:
        check_adapter("huge", 97, 100, 10)
    assert isinstance(e.value, ExceedsPoolError) and "at least 101 tokens" in str(e.value)


# ---- the engine ---------------------------------------------------------------------------------------------------


class Loader:
    """Copies that finish `delay` steps after they start."""

    def __init__(self, delay: int) -> None:
        self.delay, self.step, self.started = delay, 0, {}

    def start(self, adapter_id, slots) -> None:
        self.started[adapter_id] = self.step

    def is_done(self, adapter_id) -> bool:
        return self.step - self.started[adapter_id] >= self.delay


@dataclass
class Request:
    rid: str
    adapter: str | None
    prompt_len: int
    max_new: int
    arrival: int
    tokens: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    generated: int = 0
    admitted_at: int | None = None
    finished_at: int | None = None


class Engine:
    """SGLang's scheduler loop over the core's pool, residency, swapper, tree and gate (module docstring)."""

    def __init__(self, pool_slots: int, adapters: dict[str, int], *, delay: int = 0, starvation_s: float = 2.0,
                 policy: str = "elora") -> None:
        self.now = 0.0
        self.pool = UnifiedPool(pool_slots, slot_bytes=1)
        self.usage = UsageStats(dict(adapters), 1, 1e-4, lambda num_bytes: num_bytes * 1e-6)
        self.residency = AdapterResidency(self.pool, dict(adapters), self.usage)
        self.policy = create_policy(policy, context=self.usage)
        self.tree = LoraRadixTree(score=self.policy, clock=lambda: self.now)
        self.loader = Loader(delay)
        self.swapper = Swapper(self.tree, self.pool, self.residency, self.policy, self.loader, headroom_frac=0.0)
        self.gate = AdmissionGate(self.residency, self.swapper, starvation_s=starvation_s, stall_s=1.0,
                                  clock=lambda: self.now)
        self.sizes = adapters
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.refused: list[Request] = []
        self.done: list[Request] = []
        self.step_no = 0
        self.idle_passes_without_progress = 0
        self.max_idle_passes_without_progress = 0
        self._token = itertools.count(1)

    def arrive(self, r: Request) -> None:
        """Ingress: refused at once when it can never fit (the seam's `init_req_max_new_tokens` hook)."""
        try:
            check_request(str(r.adapter), self.sizes.get(r.adapter, 0), r.prompt_len, r.max_new,
                          self.pool.num_slots)
        except InfeasibleRequest:
            self.refused.append(r)
            return
        self.queue(r)

    def queue(self, r: Request) -> None:
        r.tokens = [next(self._token) for _ in range(r.prompt_len)]  # no two requests share a prefix
        self.usage.record_request(r.adapter, self.now)
        self.waiting.append(r)

    def room(self, reserved: int) -> int:
        return self.pool.num_free + self.tree.evictable_len() + self.swapper.reclaimable_adapter_slots() - reserved

    def step(self) -> None:
        self.step_no += 1
        self.loader.step += 1
        self.now += 0.1
        self.swapper.poll_loads()
        idle = not self.running and not self.residency.loading_ids() and bool(self.waiting)
        admitted = self.admission_pass()
        if idle and not admitted and not self.residency.loading_ids():  # a copy started is progress too
            self.idle_passes_without_progress += 1
        else:
            self.idle_passes_without_progress = 0
        self.max_idle_passes_without_progress = max(self.max_idle_passes_without_progress,
                                                    self.idle_passes_without_progress)
        self.decode()
        self.check()

    def admission_pass(self) -> list[Request]:
        self.gate.begin_pass({r.rid for r in self.waiting})
        reserved = sum(r.max_new - r.generated for r in self.running)
        admitted = []
        for r in list(self.waiting):
            if not self.gate.admit(r.rid, r.adapter, self.room(reserved), r.prompt_len, r.max_new):
                continue  # "not now": the queue goes on (SGLang's can_schedule_lora_req)
            if r.adapter is not None:
                self.residency.acquire(r.adapter)
            total = r.prompt_len + r.max_new + 1
            if total >= self.room(reserved):  # SGLang's NO_TOKEN: the pass ends here
                if r.adapter is not None:
                    self.residency.release(r.adapter)
                break
            reserved += total
            self.waiting.remove(r)
            admitted.append(r)
        for r in admitted:  # the prefill's KV
            assert self.swapper.make_room(r.prompt_len), f"the budget promised {r.prompt_len} slots to {r.rid}"
            r.slots = self.pool.alloc("kv_running", r.prompt_len).ids()
            r.admitted_at = self.step_no
        self.running += admitted
        self.gate.end_pass(len(admitted), len(self.running), len(self.waiting))
        return admitted

    def decode(self) -> None:
        for r in list(self.running):
            if r.generated < r.max_new:
                assert self.swapper.make_room(1), f"decode of {r.rid} found no slot its admission reserved"
                r.slots += self.pool.alloc("kv_running", 1).ids()
                r.tokens.append(next(self._token))
                r.generated += 1
            if r.generated == r.max_new:
                self.finish(r)

    def finish(self, r: Request) -> None:
        """The request's KV goes to the tree (as SGLang's cache_finished_req), its adapter is unpinned."""
        key = MatchKey(NS, None if r.adapter is None else AdapterRef(r.adapter), r.tokens[:len(r.slots)])
        self.tree.insert(key, list(r.slots))
        self.pool.move("kv_running", "kv_cached", r.slots)
        if r.adapter is not None:
            self.residency.release(r.adapter)
        self.running.remove(r)
        r.finished_at = self.step_no
        self.done.append(r)

    def check(self) -> None:
        self.pool.check_invariants()
        self.swapper.check_invariants()
        self.tree.check_invariants()
        assert self.pool.num_of("kv_cached") == self.tree.total_len()
        assert self.pool.num_of("kv_running") == sum(len(r.slots) for r in self.running)
        assert self.gate.hold is None or self.gate.hold in {r.rid for r in self.waiting}

    def run(self, arrivals: list[Request], max_steps: int) -> None:
        by_step: dict[int, list[Request]] = {}
        for r in arrivals:
            by_step.setdefault(r.arrival, []).append(r)
        while self.step_no < max_steps and (by_step or self.waiting or self.running):
            for r in by_step.pop(self.step_no, []):
                self.arrive(r)
            self.step()


# ---- stories ------------------------------------------------------------------------------------------------------


def test_the_hang_the_small_pool_showed_is_refused_at_once_and_the_rest_completes():
    """A 1,058-slot pool, an 864-slot adapter, six ~230-token requests (the live report): the two on the large
    adapter can never fit and are refused at arrival; the base and small-adapter requests complete."""
    e = Engine(1058, {"bullets": 864, "json": 220, "caps": 45})
    names = [None, "bullets", None, "json", "caps", "bullets"]
    e.run([Request(f"r{i}", a, 230, 16, 0) for i, a in enumerate(names)], max_steps=500)
    assert sorted(r.rid for r in e.refused) == ["r1", "r5"]
    assert sorted(r.rid for r in e.done) == ["r0", "r2", "r3", "r4"]
    assert e.gate.counters.stalls == 0 and e.gate.counters.infeasible == 0


def test_a_request_that_slips_past_ingress_never_takes_the_hold():
    """Without the ingress refusal the old gate made such a request the starvation hold and admitted nothing
    else, forever; now it is refused in every pass (counted), and everything behind it completes."""
    e = Engine(200, {"big": 150, "small": 10}, starvation_s=0.0)
    e.queue(Request("stuck", "big", 60, 8, 0))  # 150 + 69 slots: never fits
    e.run([Request(f"r{i}", "small" if i % 2 else None, 40, 8, 0) for i in range(6)], max_steps=200)
    assert len(e.done) == 6 and [r.rid for r in e.waiting] == ["stuck"]
    assert e.gate.hold is None and e.gate.counters.infeasible > 0
    assert "can never fit" in e.gate.refusals["stuck"]


def test_a_request_kept_out_holds_the_rest_until_running_requests_drain():
    """A steady stream of base requests would keep the large adapter out for good: after `starvation_s` its
    request becomes the hold, the stream stops being admitted, the running ones finish, and it goes in."""
    e = Engine(120, {"big": 70}, starvation_s=0.25)
    arrivals = [Request(f"b{i}", None, 30, 6, i) for i in range(40)]
    arrivals.append(Request("late", "big", 20, 4, 2))
    e.run(arrivals, max_steps=500)
    late = next(r for r in e.done if r.rid == "late")
    assert e.gate.counters.starvation_holds == 1
    assert late.admitted_at < max(r.admitted_at for r in e.done if r.rid != "late")
    assert len(e.done) == 41


def test_the_watchdog_reports_a_stall_once_and_names_the_rule():
    """An engine that cannot make progress (here: a loader that never finishes, so nothing is idle... and then a
    request SGLang never takes) is reported once per stall with each waiting request's reason."""
    e = Engine(100, {"a": 30})
    e.queue(Request("x", "a", 10, 2, 0))
    gate = e.gate
    gate.begin_pass({"x"})
    gate.refusals["x"] = "outside the plan"  # what the seam records for a rule outside the gate
    assert gate.end_pass(0, 0, 1) is None  # a stall begins
    e.now += 0.5
    gate.begin_pass({"x"})
    gate.refusals["x"] = "outside the plan"
    assert gate.end_pass(0, 0, 1) is None  # not yet stall_s (1 s)
    e.now += 0.6
    report = gate.end_pass(0, 0, 1)
    assert report["refusals"] == {"x": "outside the plan"} and report["stalled_s"] == pytest.approx(1.1)
    assert gate.end_pass(0, 0, 1) is None and gate.counters.stalls == 1  # once per stall
    assert gate.stats()["stalled_s"] == pytest.approx(1.1)
    gate.end_pass(1, 1, 0)  # progress ends it
    assert gate.stalled_for() == 0.0 and gate.stats()["stalls"] == 1


# ---- randomized ---------------------------------------------------------------------------------------------------


@st.composite
def worlds(draw):
    pool_slots = draw(st.integers(24, 160))
    num_adapters = draw(st.integers(1, 4))
    # sizes near the feasibility edge included: up to the whole pool
    adapters = {f"a{i}": draw(st.integers(1, pool_slots)) for i in range(num_adapters)}
    names = [None, *adapters]
    requests = []
    for i in range(draw(st.integers(1, 14))):
        prompt = draw(st.integers(1, pool_slots))
        new = draw(st.integers(1, max(1, pool_slots // 3)))
        requests.append(Request(f"r{i}", draw(st.sampled_from(names)), prompt, new, draw(st.integers(0, 12))))
    return pool_slots, adapters, requests, draw(st.integers(0, 2)), draw(st.sampled_from([0.0, 0.3, 5.0]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds(), st.sampled_from(["elora", "lru", "chameleon"]))
def test_every_request_completes_or_is_refused_within_a_bound(world, policy):
    pool_slots, adapters, requests, delay, starvation_s = world
    usable = {a: n for a, n in adapters.items() if n + MIN_REQUEST_TOKENS < pool_slots}  # the load-time rule
    requests = [r for r in requests if r.adapter is None or r.adapter in usable]
    e = Engine(pool_slots, usable, delay=delay, starvation_s=starvation_s, policy=policy)
    work = sum(r.max_new + 2 + delay for r in requests)
    e.run(requests, max_steps=13 + 4 * work)
    expected_refused = {r.rid for r in requests
                        if usable.get(r.adapter, 0) + r.prompt_len + r.max_new + 1 >= pool_slots}
    assert {r.rid for r in e.refused} == expected_refused
    assert {r.rid for r in e.done} == {r.rid for r in requests} - expected_refused, (
        f"left waiting {[(r.rid, e.gate.refusals.get(r.rid)) for r in e.waiting]}, running {e.running}")
    # the bound: an idle engine (nothing running, no copy in flight) with requests waiting admits one, or starts
    # the copy one waits for, in its pass
    assert e.max_idle_passes_without_progress == 0
    assert e.gate.counters.stalls == 0 and e.gate.counters.infeasible == 0
    for r in e.done:  # every output token generated, in order, within the run
        assert r.generated == r.max_new and r.admitted_at is not None and r.finished_at >= r.admitted_at
    e.check()
