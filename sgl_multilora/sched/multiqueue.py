"""The adapter-aware multi-queue scheduler: Chameleon's Algorithm 1 with quotas, bypass and squash,
plus the rules of rules/ behind one interface.

Lives here: `MultiQueueScheduler`, the owner of queued and running requests' scheduling state.
Not here: memory (the caller says which adapters are resident and starts loads through callbacks),
SGLang's objects, one queue's admission scan (admission.py), the fitting of cut-offs and quotas
(plan.py), or the rules beyond the paper (rules/: memory hold, slot squash, budget promotion).

Plans: the prior plan until the window supports a fit (queues by size against the configured limits), then
fitted ones, with an overflow queue above a one-queue fit (plan.py). Each `build_batch`
(reference/seed-chameleon.md, 4.3):
- Holds: each rule may end the batch before the phases (rules/memory_hold.py).
- Phase 1: queues in ascending WRS order (promoted queues first: rules/promotion.py) admit FIFO up
  to their available quota (quota minus the tokens their running requests hold).
- Phase 2: queues left empty lend their unused quota; non-empty queues, smallest first, admit
  from their own remainder plus that spare pool. Borrowed tokens are charged to the lenders and
  return to them on finish (the paper leaves this open; charging the borrower would let the held
  tokens exceed the total).
- Split: a prefill forward gives every request in it its first token only when the whole forward
  ends, so small requests planned first are not kept in one forward with one far larger. A request
  bringing more than `SPLIT_RATIO` times the new tokens of the largest request planned before it
  (and at least `SPLIT_MIN_TOKENS`: below that a forward's time is mostly its fixed cost) is put
  back at its place for the next batch, once per request.
- `budget_tokens` (what the engine can take this iteration) caps the batch's admitted cost; with
  the engine's cap on adapters per batch given, a request that would need a new slot when none is
  left is passed over in every phase, keeping its place (slots.py; the slot a squash freed is
  reserved for its beneficiary: rules/slot_squash.py).
Starvation bound (tested under adversarial arrivals in tests/unit/test_sched_starvation.py):
within one refresh period, let r head its queue with its adapter resident, and let the queue's
available quota cover r's cost (or nothing of the queue run). Nothing else can take that quota
(lending needs an empty queue, and nothing behind r passes it), so this stays true, and r is
admitted by the second `build_batch` when no budget is given (the first may split it off), or within
`max_budget_skips + K + 1` calls when every budget covers the largest queued cost. A memory-blocked r waits at most as
rules/memory_hold.py bounds.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from itertools import pairwise

from sgl_multilora.sched.admission import (
    BatchContext,
    IsResident,
    QueueView,
    RequestPrefetch,
    Stop,
    scan_queue,
)
from sgl_multilora.sched.bypass import BypassBook, SquashInfo, squash_candidates
from sgl_multilora.sched.config import SchedConfig
from sgl_multilora.sched.plan import FitWindow, SchedPlan, fixed_plan, prior_plan
from sgl_multilora.sched.predictor import OutputLengthPredictor
from sgl_multilora.sched.queues import QueueSet
from sgl_multilora.sched.quotas import QuotaLedger
from sgl_multilora.sched.request import SchedRequest
from sgl_multilora.sched.rules import BatchRule, BudgetPromotion, MemoryHold, SlotSquashRule
from sgl_multilora.sched.slots import AdapterSlots
from sgl_multilora.sched.stats import QueueInfo, SchedStats


SPLIT_RATIO = 8
"""A batch puts off a request bringing more than this many times the new tokens of the largest
planned before it (module docstring, Split)."""
SPLIT_MIN_TOKENS = 512
"""...and at least this many: a forward of fewer tokens costs about its fixed part (weights read
once per forward), so splitting it off would delay it for nothing."""


class MultiQueueScheduler:
    def __init__(self, config: SchedConfig, predictor: OutputLengthPredictor | None = None) -> None:
        self.config = config
        self.predictor = predictor or OutputLengthPredictor()
        self.plan: SchedPlan = prior_plan(config)
        self.queues = QueueSet(self.plan.num_queues)
        self.ledger = QuotaLedger(self.plan.quotas.quotas)
        self.bypass = BypassBook()
        self._running: dict[str, SchedRequest] = {}
        self._window = FitWindow(config)
        self._total_tokens = config.total_tokens
        self._fitted = False
        self._seq = 0
        self.num_batches = 0
        self.memory_hold = MemoryHold(self)
        self.slot_squashes = SlotSquashRule(self)
        """The slot squash: the engine asks it `choose`, retracts, then calls `commit`."""
        self.promotion = BudgetPromotion(self)
        self.rules: tuple[BatchRule, ...] = (self.memory_hold, self.slot_squashes, self.promotion)
        """Rules beyond the paper (rules/), their hooks called in this order."""
        self.counts = {"admitted": 0, "finished": 0, "bypasses": 0, "squashes": 0, "refreshes": 0,
                       "pushed_back": 0, "slot_squashes": 0, "slot_squashed": 0, "slot_skips": 0,
                       "memory_holds": 0, "deferred": 0, "stops_quota": 0, "stops_budget": 0, "stops_lookahead": 0,
                       "stops_bypass": 0, "stops_memory_hold": 0}
        self.last_stops: dict[int, Stop] = {}
        """Queue -> why the last batch admitted nothing more from it (drained queues are absent)."""
        self.last_passes = {"slot": 0, "not_resident": 0}
        """Requests the last batch passed over (keeping their place): for want of an adapter slot,
        and while their adapter loads (a request counts once per scan that met it)."""

    def add(self, r: SchedRequest) -> None:
        """Predicts r's output, prices and routes it, and queues it. Raises ValueError for a rid
        already here or negative sizes."""
        if r.rid in self.queues or r.rid in self._running:
            raise ValueError(f"request {r.rid!r} is already queued or running")
        if min(r.in_len, r.rank, r.adapter_tokens, r.max_new_tokens or 0, r.cached_len) < 0:
            raise ValueError(f"negative size in {r}")
        if r.cached_len > r.in_len:
            raise ValueError(f"{r.cached_len} cached tokens in a prompt of {r.in_len}: {r}")
        pred = self.predictor.predict(r.adapter, r.in_len)
        r.pred_out_len = pred if r.max_new_tokens is None else min(pred, r.max_new_tokens)
        r.cost_tokens = r.new_len + r.pred_out_len + r.adapter_tokens
        r.wrs = self.plan.normalizer.wrs(r.new_len, r.pred_out_len, r.rank, clamp=False)
        r.seq, self._seq = self._seq, self._seq + 1
        self.queues.push(r, self.plan.route(r.wrs))
        self._window.add(r)

    def remove(self, rid: str) -> SchedRequest | None:
        """Takes a queued request out (abort, adapter unloaded); None if it is not queued."""
        r = self.queues.pop(rid)
        if r is not None:
            self.bypass.forget(rid)
            for rule in self.rules:
                rule.left_queues(r)
        return r

    def on_finish(self, rid: str, now: float, out_len: int | None = None) -> SchedRequest:
        """A running request ended: its tokens return to the queues that lent them, and the
        predictor learns `out_len` (None: aborted, nothing to learn). Raises KeyError if `rid` is
        not running (finished twice, or never admitted)."""
        r = self._pop_running(rid)
        r.finished_at = now
        self.counts["finished"] += 1
        if out_len is not None:
            self.predictor.observe(r.adapter, r.in_len, out_len, r.pred_out_len)
        return r

    def requeue(self, rid: str, squash: bool = False, pushed_back: bool = False, *,
                slot_squash: bool = False, overtaken: bool = True) -> SchedRequest:
        """A running request goes back to its arrival position (squashed, retracted by the engine,
        or `pushed_back`: planned by the last `build_batch` but not taken by the engine, whose own
        limits, such as a cap on running requests, the plan does not see) and its tokens return.
        A pushed-back request heading its queue may get it promoted (rules/promotion.py), when it was
        `overtaken`: the engine took other planned requests. A pass the engine spent before any
        planned request (a chunked prefill continuing, a full batch) overtook no one and counts
        nothing: promoting on it would put large queues first exactly while a long prefill blocks
        everything, the head-of-line blocking the queues exist to end. Raises KeyError if it is not
        running."""
        r = self._pop_running(rid)
        r.admitted_at = None
        r.resumed = r.resumed or not pushed_back
        if squash or slot_squash:
            r.num_squashes += 1
            self.counts["slot_squashed" if slot_squash else "squashes"] += 1
        q = self.plan.route(r.wrs)
        self.queues.push_in_order(r, q)
        if pushed_back:
            self.counts["pushed_back"] += 1
            r.num_pushbacks += overtaken
        for rule in self.rules:
            rule.requeued(r, q, pushed_back and overtaken)
        return r

    def _pop_running(self, rid: str) -> SchedRequest:
        r = self._running.pop(rid, None)
        if r is None:
            raise KeyError(f"request {rid!r} is not running: finished twice, or never admitted")
        self.ledger.release(r.charges)
        r.charges = []
        self.bypass.forget(rid)
        return r

    def build_batch(self, now: float, budget_tokens: int | None = None,
                    is_resident: IsResident | None = None,
                    request_prefetch: RequestPrefetch | None = None,
                    running_adapters: Collection[str | None] | None = None,
                    max_adapters: int | None = None) -> list[SchedRequest]:
        """Admits requests for this iteration (Algorithm 1 as above), refreshing the plan first
        when one is due. The returned requests are running from now on: finish each with
        `on_finish` or return it with `requeue`. Without callbacks every adapter is resident;
        without `max_adapters` (the engine's cap on distinct adapters per batch, the base model
        counting as one; `running_adapters`: those of the engine's running requests) there is no
        cap."""
        self.refresh(now)
        self.last_stops = {}
        slots = None
        if max_adapters is not None:
            slots = AdapterSlots(set(running_adapters or ()), max_adapters,
                                 self.slot_squashes.reserved_for)
        ctx = BatchContext(now, budget_tokens, is_resident, request_prefetch, slots)
        batch: list[SchedRequest] = []
        held = any(rule.hold(ctx, batch) for rule in self.rules)
        self.counts["slot_skips"] += ctx.slot_skips
        if not held:
            k = self.queues.num_queues
            for q in self.promotion.order(k):
                self._scan(q, ctx, batch, None)
            lenders = [[q, self.ledger.available(q)] for q in range(k)
                       if not self.queues.len_of(q) and self.ledger.available(q) > 0]
            for q in range(k):
                if not any(spare for _, spare in lenders):
                    break
                if self.queues.len_of(q):
                    self._scan(q, ctx, batch, lenders)
        batch = self._split(batch)
        for stop in self.last_stops.values():
            self.counts["stops_" + stop.reason] += 1
        self.last_passes = {"slot": ctx.slot_skips, "not_resident": ctx.not_resident}
        for rule in self.rules:
            rule.end_batch()
        self.num_batches += 1
        return batch

    def _split(self, batch: list[SchedRequest]) -> list[SchedRequest]:
        """The batch less the requests it puts off (module docstring, Split): each goes back to its
        arrival position, its tokens returned, with no promotion counted (it was not overtaken)."""
        largest, kept = 0, []
        for r in batch:
            if (largest and not r.deferred and r.new_len >= SPLIT_MIN_TOKENS
                    and r.new_len > SPLIT_RATIO * largest):
                r.deferred = True
                self.counts["deferred"] += 1
                self._unstart(r)
                continue
            largest = max(largest, r.new_len)
            kept.append(r)
        return kept

    def _unstart(self, r: SchedRequest) -> None:
        self._pop_running(r.rid)
        r.admitted_at = None
        self.counts["admitted"] -= 1
        q = self.plan.route(r.wrs)
        self.queues.push_in_order(r, q)
        for rule in self.rules:
            rule.requeued(r, q, False)

    def admit_alone(self, r: SchedRequest, ctx: BatchContext, batch: list[SchedRequest]) -> None:
        """Admits queued r charged wholly to its own queue, whatever its quota (a rule's hold)."""
        ctx.take_slot(r)
        r.charges = [(r.queue, r.cost_tokens)] if r.cost_tokens else []
        if ctx.budget is not None:
            ctx.budget -= r.cost_tokens
        self._start(r, ctx.now)
        batch.append(r)

    def _scan(self, q: int, ctx: BatchContext, batch: list[SchedRequest],
              lenders: list[list[int]] | None) -> None:
        view = QueueView(q, self.ledger.available(q), self.ledger.quotas[q],
                         self.ledger.held[q] == 0)
        skips = ctx.slot_skips
        result = scan_queue(self.queues.scan(q), view, ctx, lenders, self._running.values(),
                            self.config.timing, self.config.lookahead)
        self.counts["slot_skips"] += ctx.slot_skips - skips
        if result.stop is not None:
            self.last_stops[q] = result.stop
        elif lenders is not None:
            self.last_stops.pop(q, None)  # phase 2 got past its phase-1 stop
        for rule in self.rules:
            rule.scanned(q, result, lenders is None, ctx.now)
        for r in result.admitted:
            self._start(r, ctx.now)
            batch.append(r)
        for r2, r1 in result.bypasses:
            self.bypass.record(r2, r1)
            self.counts["bypasses"] += 1

    def _start(self, r: SchedRequest, now: float) -> None:
        self.queues.pop(r.rid)
        self.bypass.forget_beneficiary(r.rid)
        for rule in self.rules:
            rule.left_queues(r)
        self.ledger.charge(r.charges)
        r.admitted_at = now
        self._running[r.rid] = r
        self.counts["admitted"] += 1

    def squash_candidates(self, free_tokens: int,
                          footprint: Callable[[SchedRequest], int] | None = None,
                          need: Callable[[SchedRequest], int] | None = None) -> list[SquashInfo]:
        """Running requests to squash now (bypass.py; a live engine passes `MeasuredTerms`').
        Modifies nothing: the caller aborts each victim in the engine, then calls
        `requeue(victim.rid, squash=True)`."""
        return squash_candidates(self.bypass, self._running, self.queues.get, free_tokens,
                                 self.config.max_squashes, footprint, need)

    def refresh(self, now: float, total_tokens: int | None = None, force: bool = False) -> bool:
        """Refits normaliser, cut-offs and quotas when due or when forced, and re-routes queued
        requests. Due: every `requeue_s`; the first time as soon as `min_samples` requests arrived;
        and whenever the window holds twice the requests the current fitted plan was fitted on
        (warm-up: 32, 64, 128, ... up to `window_size`, so the first period's plan does not rest on
        its first 32 requests; in steady state the window does not double). `total_tokens`: a new
        Tok_total, used from this refit on. The current plan stays while the window (requests of
        the last `window_s`) holds fewer than `min_samples`. True if a new plan is in."""
        if total_tokens is not None:
            self._total_tokens = total_tokens
        if not self.config.adaptive and not force:
            return False
        self._window.trim(now)
        if not force and not self._window.due(now, self.plan, self._fitted):
            return False
        plan = self._window.fit(now, self._total_tokens)
        if plan is None:
            return False
        self._install(plan)
        self._fitted = True
        self.counts["refreshes"] += 1
        return True

    def set_plan(self, cutoffs: list[float], quotas: list[int], now: float = 0.0) -> None:
        """Installs fixed cut-offs and quotas (the Static baseline; tests). With `requeue_s` =
        inf they stay; otherwise the next due refresh replaces them. Raises ValueError if they do
        not describe len(cutoffs) + 1 queues."""
        self._install(fixed_plan(self.config, cutoffs, quotas, now))
        self._fitted = True

    def _install(self, plan: SchedPlan) -> None:
        """New plan: WRS recomputed and requests re-routed, queued and running alike; a running
        request's whole cost is re-charged to its new queue (lending ends at a refresh)."""
        self.plan = plan

        def route(r: SchedRequest) -> int:
            r.wrs = plan.normalizer.wrs(r.new_len, r.pred_out_len, r.rank, clamp=False)
            return plan.route(r.wrs)

        self.queues.reroute(plan.num_queues, route)
        for r in self._running.values():
            r.queue = route(r)
            r.charges = [(r.queue, r.cost_tokens)] if r.cost_tokens else []
        self.ledger.reset(plan.quotas.quotas, (r.charges for r in self._running.values()))
        for rule in self.rules:
            rule.reset()

    @property
    def running(self) -> dict[str, SchedRequest]:
        """rid -> running request. Read only."""
        return self._running

    def wanted_adapters(self) -> dict[str, int]:
        """Adapter -> queued requests naming it (input to the pool's eviction tiers). A copy."""
        return self.queues.wanted_adapters()

    def stats(self) -> SchedStats:
        plan, ledger = self.plan, self.ledger
        cuts = plan.clustering.cutoffs  # an overflow queue's cut-off may exceed 1 (plan.py): it takes all above
        bounds = (0.0, *cuts, max(1.0, *cuts) if cuts else 1.0)
        infos = tuple(
            QueueInfo(q, self.queues.len_of(q), ledger.quotas[q], plan.quotas.minima[q],
                      ledger.held[q], bounds[q], bounds[q + 1])
            for q in range(self.queues.num_queues))
        return SchedStats(
            queues=infos, cutoffs=plan.clustering.cutoffs, num_queued=len(self.queues),
            num_running=len(self._running), quotas_feasible=plan.quotas.feasible,
            normalizer=plan.normalizer, predictor=self.predictor.stats(),
            promoted=tuple(self.promotion.promoted), counts=dict(self.counts))

    def check_invariants(self) -> None:
        self.queues.check_invariants()
        k = self.plan.num_queues
        assert self.queues.num_queues == k == len(self.ledger.quotas), "plan and queues disagree"
        cuts = self.plan.clustering.cutoffs
        assert all(a < b for a, b in pairwise(cuts)), f"cut-offs not increasing: {cuts}"
        for q in range(k):
            for r in self.queues.scan(q):
                assert self.plan.route(r.wrs) == q, f"{r} sits in the wrong queue"
        for rid, r in self._running.items():
            assert rid not in self.queues, f"{rid} both queued and running"
            assert r.admitted_at is not None and 0 <= r.queue < k, f"{r} running but not admitted"
            assert sum(t for _, t in r.charges) == r.cost_tokens, f"{r} charges {r.charges}"
        for rule in self.rules:
            rule.check_invariants()
        self.ledger.check_invariants(r.charges for r in self._running.values())
        self.bypass.check_invariants(self._running, self.queues.get)
        self.predictor.check_invariants()
