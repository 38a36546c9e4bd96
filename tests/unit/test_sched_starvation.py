"""The starvation bound under adversarial arrivals (multiqueue.py states it): a request that heads
its queue with its quota free is admitted by the second batch without a budget (the first may split it off
behind far smaller requests, once), and within `max_budget_skips + K + 1` batches when every budget covers the
largest cost.

Streams: bursts of tiny requests against occasional large ones, everything in one queue, tiny and
large alternating, and random sizes; requests larger than their queue's whole quota included.
A request of size n costs n tokens and has WRS n / 2000 (see test_sched_batch.py).
"""

from __future__ import annotations

import math

from hypothesis import example, given, settings
from hypothesis import strategies as st

from sgl_multilora.sched import (
    MultiQueueScheduler,
    OutputLengthPredictor,
    SchedConfig,
    SchedRequest,
    WrsNormalizer,
)
from sgl_multilora.sched.admission import Stop

PLANS = [([0.1, 0.3], [300, 800, 1000]), ([], [1000]), ([0.05, 0.2, 0.4], [200, 200, 600, 1000])]
TINY, MEDIUM, LARGE = (10, 100), (300, 500), (900, 1500)  # LARGE may exceed a whole quota
C_MAX = LARGE[1]
NUM_ITERS = 40
SKIPS = 3


def sizes_for(pattern: str, it: int, data) -> list[int]:
    draw = data.draw
    if pattern == "tiny_bursts_vs_large":
        burst = draw(st.lists(st.integers(*TINY), min_size=2, max_size=8))
        return burst + ([draw(st.integers(*LARGE))] if it % 5 == 0 else [])
    if pattern == "all_one_queue":
        return draw(st.lists(st.integers(*MEDIUM), max_size=3))
    if pattern == "alternating":
        return [draw(st.integers(*(TINY if it % 2 else LARGE)))]
    return draw(st.lists(st.integers(TINY[0], LARGE[1]), max_size=4))


def make(plan, max_budget_skips=SKIPS, **kw) -> MultiQueueScheduler:
    cutoffs, quotas = plan
    cfg = SchedConfig(total_tokens=sum(quotas), requeue_s=math.inf,
                      initial_norm=WrsNormalizer(1000, 1000, 8), max_budget_skips=max_budget_skips, **kw)
    s = MultiQueueScheduler(cfg, OutputLengthPredictor(default_out_len=10**6))
    s.set_plan(cutoffs, quotas)
    return s


def request(rid: str, size: int, adapter: str = "a", arrival: float = 0.0) -> SchedRequest:
    return SchedRequest(rid, adapter, in_len=size // 2, rank=8, max_new_tokens=size - size // 2, arrival=arrival)


def step(s: MultiQueueScheduler, it: int, finish_at: dict[str, int], sizes: list[int]) -> None:
    """Batch `it` of a driven run, before building it: the requests due finish, then `sizes` arrive."""
    for rid in [rid for rid, t in finish_at.items() if t == it]:
        s.on_finish(rid, float(it))
        del finish_at[rid]
    for j, size in enumerate(sizes):
        s.add(request(f"{it}.{j}", size, arrival=float(it)))


@settings(max_examples=30, deadline=None)
@given(pattern=st.sampled_from(["tiny_bursts_vs_large", "all_one_queue", "alternating", "random"]),
       plan=st.sampled_from(PLANS),
       durations=st.just([1]) | st.lists(st.integers(1, 6), min_size=1, max_size=8),
       budget_slack=st.none() | st.integers(0, 100),
       data=st.data())
def test_head_with_free_quota_is_admitted_within_the_bound(pattern, plan, durations,
                                                          budget_slack, data):
    s = make(plan)
    k = s.queues.num_queues
    budget = None if budget_slack is None else C_MAX + budget_slack
    bound = 2 if budget is None else SKIPS + k + 1
    ready_since: dict[str, int] = {}
    finish_at: dict[str, int] = {}
    num_admitted = 0
    for it in range(NUM_ITERS):
        step(s, it, finish_at, sizes_for(pattern, it, data))
        for q in range(k):
            head = s.queues.head(q)
            if head and (s.ledger.available(q) >= head.cost_tokens or s.ledger.held[q] == 0):
                ready_since.setdefault(head.rid, it)
        for r in s.build_batch(float(it), budget_tokens=budget):
            if r.rid in ready_since:
                calls = it - ready_since.pop(r.rid) + 1
                assert calls <= bound, f"{r} waited {calls} batches with its quota free"
            finish_at[r.rid] = it + durations[num_admitted % len(durations)]
            num_admitted += 1
        for rid, since in ready_since.items():
            assert it - since + 1 < bound, f"{rid} ready since batch {since}, still queued"
        s.check_invariants()


@settings(max_examples=20, deadline=None)
@given(sizes=st.lists(st.integers(TINY[0], LARGE[1]), min_size=1, max_size=40),
       adapters=st.lists(st.sampled_from("abcd"), min_size=1, max_size=40),
       load_delay=st.integers(0, 5), plan=st.sampled_from(PLANS))
def test_everyone_drains_while_adapters_load(sizes, adapters, load_delay, plan):
    """Non-resident requests are passed over but not forgotten: once loads finish and arrivals
    stop, every request runs."""
    s = make(plan)
    for i, size in enumerate(sizes):
        s.add(request(str(i), size, adapters[i % len(adapters)]))
    requested: dict[str, int] = {}
    resident = {"a"}

    def prefetch(adapter: str) -> bool:
        requested.setdefault(adapter, it)
        return True

    running: list[str] = []
    done = 0
    for it in range(4 * len(sizes) + 20):
        resident |= {a for a, t in requested.items() if it - t >= load_delay}
        for rid in running:
            s.on_finish(rid, float(it))
        done += len(running)
        running = [r.rid for r in s.build_batch(float(it), None, resident.__contains__, prefetch)]
        s.check_invariants()
        if done + len(running) == len(sizes):
            break
    assert done + len(running) == len(sizes) and len(s.queues) == 0


def test_tiny_bursts_cannot_starve_a_large_request_under_a_tight_budget():
    """Without promotion this large request would wait forever: the small queue re-admits 300
    tokens every batch and leaves 1200 of the 1500 budget, below its 1400."""
    s = make(PLANS[0])
    s.add(request("large", 1400))
    admitted_at = None
    for it in range(20):
        for rid in [rid for rid in s.running if rid != "large"]:
            s.on_finish(rid, float(it))  # tiny requests last one batch
        for j in range(4):
            s.add(request(f"{it}.{j}", 100))
        if "large" in {r.rid for r in s.build_batch(float(it), budget_tokens=1500)}:
            admitted_at = it
            break
        s.check_invariants()
    assert admitted_at == SKIPS  # skipped SKIPS times, then its queue went first


def test_engine_pushbacks_cannot_starve_a_large_request():
    """The engine takes at most 4 planned requests per batch, in plan order (a running-request cap
    the token budget does not express), and pushes the rest back. Tiny requests fill the small
    queue's plan every batch, so without counting push-backs the large one (planned after them,
    from a larger queue) would be pushed back forever; counted, its queue is promoted."""
    s = make(PLANS[0])
    s.add(request("large", 900))
    admitted_at = None
    for it in range(20):
        for rid in list(s.running):
            s.on_finish(rid, float(it))  # everything taken lasts one batch
        for j in range(6):
            s.add(request(f"{it}.{j}", 40))
        plan = s.build_batch(float(it))
        taken, pushed = plan[:4], plan[4:]
        for r in pushed:
            s.requeue(r.rid, pushed_back=True)
        s.check_invariants()
        if "large" in {r.rid for r in taken}:
            admitted_at = it
            break
    assert admitted_at == SKIPS, admitted_at  # pushed back SKIPS times, then its queue went first
    assert s.counts["pushed_back"] >= SKIPS


def memory_blocked_run(**kw) -> tuple[MultiQueueScheduler, int | None, float | None]:
    """A request whose adapter cannot be made resident (memory full of running requests) heads the middle queue,
    while small base-model requests stream into the smallest queue, four a batch, each running three batches:
    1200 of the pool's 1300 tokens, 800 at the start of a batch, below the adapter's 700 plus what the stream
    re-admits. The engine, as SGLang's pass, takes the plan in order while it fits (a load the plan asked for may
    take the room the budget counted). Returns the scheduler, the batch that admitted the request (None: never
    in 40) and when a batch first found it memory-blocked."""
    pool, adapter_size, lasts = 1300, 700, 3
    s = make(PLANS[0], **kw)  # q0: size < 200, q1: 200-600
    resident: set[str] = set()
    running: dict[str, tuple[int, int]] = {}  # rid -> (tokens held, batch it finishes)

    def free() -> int:
        return pool - sum(c for c, _ in running.values()) - adapter_size * len(resident)

    def prefetch(adapter: str) -> bool:
        if free() < adapter_size:
            return False
        resident.add(adapter)
        return True

    blocked_since = None
    for it in range(40):
        for rid in [rid for rid, (_, end) in running.items() if end == it]:
            s.on_finish(rid, float(it))
            del running[rid]
        if it == 5:
            s.add(request("blocked", 400, adapter="big", arrival=float(it)))
        for j in range(4):
            s.add(SchedRequest(f"{it}.{j}", None, in_len=50, max_new_tokens=50, arrival=float(it)))
        for r in s.build_batch(float(it), free(), resident.__contains__, prefetch):
            if r.cost_tokens > free():
                s.requeue(r.rid, pushed_back=True)
                continue
            running[r.rid] = (r.cost_tokens, it + lasts)
            if r.rid == "blocked":
                return s, it, blocked_since
        queued = s.queues.get("blocked")
        if queued is not None and blocked_since is None:
            blocked_since = queued.memory_blocked_since
        assert free() >= 0
        s.check_invariants()
    return s, None, blocked_since


def test_a_memory_blocked_request_is_not_starved_by_another_queues_stream():
    """Every finish frees 100 tokens and every batch re-admits them to the stream, so room for the adapter never
    builds up: without the memory hold the request waits forever (bypass and squash act within one queue, and
    its queue's promotion after budget stops gains nothing once memory is what keeps it out). With it, from
    `memory_hold_share` of the SLO after it was first found memory-blocked, the batch takes nothing else, the
    stream's requests drain, the adapter loads and the request goes in."""
    s, admitted_at, since = memory_blocked_run(memory_hold_share=math.inf)
    assert admitted_at is None and since is not None, "the scenario does not starve without the hold"
    s, admitted_at, since = memory_blocked_run()
    assert admitted_at is not None, "the memory-blocked request starved"
    hold_from = math.ceil(since + s.config.memory_hold_share * s.config.ttft_slo_s)
    assert admitted_at <= hold_from + 3, (since, admitted_at)  # one batch per drained finish, at most `lasts`
    assert s.counts["memory_holds"] >= 1 and s.counts["stops_memory_hold"] == s.counts["memory_holds"]


@settings(max_examples=30, deadline=None)
@given(plan=st.sampled_from(PLANS),
       stream=st.lists(st.integers(1, 5), min_size=NUM_ITERS, max_size=NUM_ITERS),
       large=st.lists(st.tuples(st.integers(0, NUM_ITERS - 1), st.sampled_from("xyz"), st.integers(*MEDIUM)),
                      max_size=6),
       durations=st.lists(st.integers(1, 6), min_size=1, max_size=8))
@example(plan=PLANS[2], stream=[1] * 27 + [4] + [5] * 12, durations=[6],  # drains long after the last arrival
         large=[(3, "z", 300), (3, "z", 400), (3, "x", 300), (3, "x", 400), (3, "x", 401), (3, "x", 401)])
def test_the_memory_hold_admits_its_request_once_what_runs_has_drained(plan, stream, large, durations):
    """Adversarial streams against adapters that need most of the pool: every batch a burst of small base-model
    requests, and now and then a request on one of three adapters of 500-700 tokens in a pool of 1300 (each fits
    with its request when little else runs, none beside another). The pool evicts idle adapters (none that a
    running request uses, nor one it loaded for this batch's plan) to load one or to make room for a request,
    and the budget counts them as free, as SGLang's evictable memory does; the engine takes the plan in order
    while each request fits and its adapter is resident, and pushes back the rest. Bound: a request that
    holds the batch (memory-blocked `memory_hold_share` of the SLO ago, the oldest such) is admitted within the
    longest run of a request plus two batches (a push-back when its load took the room its budget counted)."""
    pool, sizes = 1300, {"x": 500, "y": 600, "z": 700}
    s = make(plan)
    hold_after = s.config.memory_hold_share * s.config.ttft_slo_s
    resident: dict[str, int] = {}  # adapter -> size
    running: dict[str, tuple[SchedRequest, int]] = {}  # rid -> (request, batch it finishes)
    pinned: set[str] = set()

    def free() -> int:
        return pool - sum(r.cost_tokens for r, _ in running.values()) - sum(resident.values())

    def idle() -> list[str]:
        busy = {r.adapter for r, _ in running.values()} | pinned
        return [a for a in resident if a not in busy]

    def make_room(tokens: int) -> bool:
        for a in idle():
            if free() >= tokens:
                break
            del resident[a]
        return free() >= tokens

    def prefetch(adapter: str) -> bool:
        if not make_room(sizes[adapter]):
            return False
        resident[adapter] = sizes[adapter]
        pinned.add(adapter)
        return True

    bound = max(durations) + 2
    # the stream may offer more work than the pool serves by the last arrival: the run goes on until it drains,
    # each request within `bound` of the one before at worst (one at a time, nothing else left to hold it back)
    num_requests = sum(stream) + len(large)
    horizon = NUM_ITERS + num_requests * bound
    target_since: dict[str, int] = {}
    n = 0
    for it in range(horizon):
        if it >= NUM_ITERS and not len(s.queues) and not running:
            break
        for rid in [rid for rid, (_, end) in running.items() if end == it]:
            s.on_finish(rid, float(it))
            del running[rid]
        if it < NUM_ITERS:
            for j in range(stream[it]):
                s.add(SchedRequest(f"{it}.{j}", None, in_len=40, max_new_tokens=40, arrival=float(it)))
            for k, (at, adapter, size) in enumerate(large):
                if at == it:
                    s.add(request(f"{it}.{adapter}{k}", size, adapter=adapter, arrival=float(it)))
        blocked = [r for q in range(s.queues.num_queues) for r in s.queues.scan(q)
                   if r.memory_blocked_since is not None and it - r.memory_blocked_since >= hold_after]
        if blocked:
            target_since.setdefault(min(blocked, key=lambda r: (r.memory_blocked_since, r.seq)).rid, it)
        pinned.clear()
        budget = free() + sum(resident[a] for a in idle())
        for r in s.build_batch(float(it), budget, resident.__contains__, prefetch):
            pinned.add(r.adapter)
            if (r.adapter is not None and r.adapter not in resident) or not make_room(r.cost_tokens):
                s.requeue(r.rid, pushed_back=True)
                continue
            running[r.rid] = (r, it + durations[n % len(durations)])
            n += 1
            if r.rid in target_since:
                waited = it - target_since.pop(r.rid)
                assert waited <= bound, f"{r.rid} held the batch {waited} batches before it went in"
        assert free() >= 0
        late = {rid: since for rid, since in target_since.items() if it - since >= bound}
        assert not late, f"holding since {late}, still queued at batch {it}"
        s.check_invariants()
    assert not len(s.queues) and not running, f"work left {horizon - NUM_ITERS} batches after the arrivals stopped"


def test_a_memory_hold_takes_nothing_else_until_its_request_goes_in():
    """A pool of 1000 tokens: adapter a (300) pinned by A1 (200), a base-model request B (100), 400 free. R on
    adapter c (400) costs 300: it needs 700, so it is memory-blocked. While A1 and B run, the hold takes nothing,
    not even requests that would load nothing (base-model ones, one on the pinned a); after the drain R goes in."""
    s = make(PLANS[1], memory_hold_share=0.0)  # one queue; hold from the first batch that finds R blocked
    resident = {"a"}
    s.add(request("A1", 200, adapter="a"))
    s.add(SchedRequest("B", None, in_len=50, max_new_tokens=50))
    assert [r.rid for r in s.build_batch(0.0, 700, resident.__contains__, lambda a: False)] == ["A1", "B"]
    s.add(request("R", 300, adapter="c", arrival=1.0))
    assert s.build_batch(1.0, 400, resident.__contains__, lambda a: False) == []
    assert s.queues.get("R").memory_blocked_since == 1.0
    s.add(SchedRequest("x1", None, in_len=75, max_new_tokens=75, arrival=2.0))
    s.add(request("y", 100, adapter="a", arrival=2.0))
    assert s.build_batch(2.0, 400, resident.__contains__, lambda a: False) == []
    assert s.counts["memory_holds"] == 1 and s.last_stops == {0: Stop("memory_hold", "R", 300, 0)}
    s.on_finish("A1", 4.0)
    s.on_finish("B", 4.0)
    s.check_invariants()

    def load(adapter: str) -> bool:
        resident.add(adapter)
        return True

    assert [r.rid for r in s.build_batch(4.0, 1000, resident.__contains__, load)] == ["R"]
    assert s.counts["memory_holds"] == 1
    s.check_invariants()
