"""The adapter-aware multi-queue scheduler: Chameleon's Algorithm 1 with quotas, bypass and squash.

Lives here: `MultiQueueScheduler`, the owner of queued and running requests' scheduling state.
Not here: memory (the caller says which adapters are resident and starts loads through callbacks),
SGLang's objects, one queue's admission rules (admission.py) or the fitting of cut-offs and
quotas (plan.py).

Each `build_batch` (reference/seed-chameleon.md, 4.3):
- Memory hold (not in the paper; `config.memory_hold_share`): the request memory-blocked longest
  (its adapter could not be made resident even after evicting every idle adapter), once that is
  `memory_hold_share` of the TTFT SLO ago, goes first: admitted alone if its adapter can be made
  resident now, its slot is free and its cost fits the budget; else, while anything runs, the
  batch takes nothing that would delay it, so that what the running requests free builds up for
  it. It ends the batch either way (the adapter's load took room the budget still counts). Without
  it a stream into another queue that re-admits every freed token keeps the request out for good:
  the bypass and squash rules act within its queue, and promoting its queue wins nothing when
  memory, not the budget, stops it. Backfill (EASY backfilling's rule, with drained room instead of
  predicted end times; only when the caller tells adapter sizes, `adapter_tokens`): while it holds,
  requests on an adapter (or the base model) that a running request uses, so that they load nothing
  and take no adapter slot, go in, oldest first in ascending queue order, while the room left once
  the requests running at the hold's start have drained still covers the held request's cost and
  its adapter's load:

      slack = budget + sum(cost + cached, running before the hold)
              - sum(cost + cached, backfilled) + sum(tokens, adapters only those pin) - need(held)

  (cached: the prefix a running request locks, evictable again once it finishes; a backfilled
  request's cost counted against the slack again though part of it is already out of the budget,
  so that its decode growth is covered). It delays the held request by nothing the budget sees.
  Off by default (`config.memory_hold_backfill`; measured: eval/RESULTS.md, decided off).
- Room reservation (not in the paper; room.py, `config.room_squash_share`), before the memory
  hold: the batch after a room squash admits its beneficiary alone, before the victims (older,
  so first in every phase) could take the room back; if it cannot go in, the batch takes
  nothing. One batch.
- Phase 0, only with `config.overdue_s` set (not in the paper): requests queued that long go
  first, oldest first across queues, each charged to its own queue whatever its quota. If the
  oldest resident one does not fit the budget, the batch takes nothing else (an FCFS hold among
  overdue requests), so no request waits more than `overdue_s` plus the FCFS wait of the overdue
  requests ahead of it (one larger than any budget goes in once nothing runs). Ordering by size
  alone can move the tail onto large requests (measured: eval/RESULTS.md); this bounds it, and
  past the knee, where most requests are overdue, gives FCFS order back.
- Phase 1: queues in ascending WRS order admit FIFO up to their available quota (quota minus the
  tokens their running requests hold).
- Phase 2: queues left empty lend their unused quota; non-empty queues, smallest first, admit
  from their own remainder plus that spare pool. Borrowed tokens are charged to the lenders and
  return to them on finish (the paper leaves this open; charging the borrower would let the held
  tokens exceed the total).
- With the engine's cap on adapters per batch given (`slots`), a request that would need a new
  slot when none is left is passed over in every phase, keeping its place; a slot squash
  (slots.py: the running requests of one adapter retracted so that a request about to miss its
  TTFT SLO gets a slot) reserves the freed slot for its beneficiary in the next batch, and a
  slot drain (slots.py: the running adapter whose drain adds the least waiting takes no new
  request) gets one for a request that has waited `slot_drain_share` of the SLO for a slot,
  retracted ones too.
- `budget_tokens` (what the engine can take this iteration) caps the batch's admitted cost. A
  queue whose stopped request fitted its quota but not the budget in `max_budget_skips` batches is
  promoted: promoted queues go first in phase 1, oldest promotion first, until it is admitted. A
  planned request the engine then does not take (`requeue(pushed_back=True)`) counts the same way
  when it heads its queue: engines have limits of their own (running-request caps, prefill
  backlog) that no token budget expresses.
Starvation bound (tested under adversarial arrivals in tests/unit/test_sched_starvation.py):
within one refresh period, let r head its queue with its adapter resident, and let the queue's
available quota cover r's cost (or nothing of the queue run). Nothing else can take that quota
(lending needs an empty queue, and nothing behind r passes it), so this stays true, and r is
admitted by the first `build_batch` when no budget is given, or within `max_budget_skips + K`
calls when every budget covers the largest queued cost. A memory-blocked r, from
`memory_hold_share` of the SLO after it was first found so, waits only for the requests
memory-blocked before it and for what ran when its hold began to free its adapter's room (at
worst, to finish): requests backfilled meanwhile take only room it does not need.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Collection, Mapping
from itertools import islice, pairwise

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
from sgl_multilora.sched.plan import SchedPlan, fit_plan, fixed_plan, single_queue_plan
from sgl_multilora.sched.predictor import OutputLengthPredictor
from sgl_multilora.sched.queues import QueueSet
from sgl_multilora.sched.quotas import QuotaLedger
from sgl_multilora.sched.request import SchedRequest
from sgl_multilora.sched.room import RoomSquash, RoomVictim, choose_room_squash
from sgl_multilora.sched.slots import (
    AdapterSlots,
    SlotDrain,
    SlotSquash,
    choose_drain_adapter,
    choose_slot_squash,
)
from sgl_multilora.sched.stats import QueueInfo, SchedStats


BACKFILL_SCAN = 256
"""Queued requests a backfill looks at per batch, at most (oldest first in ascending queue order):
a hold's batch stays as cheap as any with a thousand queued."""


class MultiQueueScheduler:
    def __init__(self, config: SchedConfig, predictor: OutputLengthPredictor | None = None) -> None:
        self.config = config
        self.predictor = predictor or OutputLengthPredictor()
        self.plan: SchedPlan = single_queue_plan(config)
        self.queues = QueueSet(1)
        self.ledger = QuotaLedger(self.plan.quotas.quotas)
        self.bypass = BypassBook()
        self._running: dict[str, SchedRequest] = {}
        self._window: deque[SchedRequest] = deque(maxlen=config.window_size)
        self._total_tokens = config.total_tokens
        self._fitted = False
        self._seq = 0
        self._num_batches = 0
        self._budget_skips: dict[int, tuple[str, int]] = {}  # queue -> (stopped rid, batches)
        self._promoted: dict[int, int] = {}  # queue -> batch number of its promotion
        self._slot_reserved: str | None = None  # the rid a slot squash or drain freed a slot for
        self._room_reserved: str | None = None  # the rid a room squash freed KV room for
        self._drain: SlotDrain | None = None
        self._slot_wait_floor = math.inf  # no queued request has waited for a slot since before this
        self._window_counts: dict[str | None, int] = {}  # adapter -> its requests in the window
        self._memory_blocked: dict[str, SchedRequest] = {}  # queued requests found memory-blocked
        self._hold_for: str | None = None  # the rid the last memory hold held for
        self._backfilled: set[str] = set()  # running requests backfilled during that hold
        self.counts = {"admitted": 0, "finished": 0, "bypasses": 0, "squashes": 0, "refreshes": 0,
                       "pushed_back": 0, "overdue": 0, "slot_squashes": 0, "slot_squashed": 0,
                       "slot_skips": 0, "slot_drains": 0, "memory_holds": 0, "stops_quota": 0,
                       "stops_budget": 0, "stops_lookahead": 0, "stops_bypass": 0,
                       "stops_overdue_hold": 0, "stops_memory_hold": 0, "backfills": 0,
                       "room_squashes": 0, "room_squashed": 0, "room_admits": 0}
        self.last_stops: dict[int, Stop] = {}
        """Queue -> why the last batch admitted nothing more from it (queues it drained are absent)."""
        self.last_passes = {"slot": 0, "not_resident": 0}
        """Requests the last batch passed over (keeping their place): for want of an adapter slot,
        and while their adapter loads (a request counts once per scan that met it)."""

    # ---- arrivals and departures -----------------------------------------------------------------

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
        r.wrs = self.plan.normalizer.wrs(r.new_len, r.pred_out_len, r.rank)
        r.seq, self._seq = self._seq, self._seq + 1
        self.queues.push(r, self.plan.route(r.wrs))
        if len(self._window) == self._window.maxlen:
            self._window_popleft()
        self._window.append(r)
        self._window_counts[r.adapter] = self._window_counts.get(r.adapter, 0) + 1

    def remove(self, rid: str) -> SchedRequest | None:
        """Takes a queued request out (abort, adapter unloaded); None if it is not queued."""
        r = self.queues.pop(rid)
        if r is not None:
            self._memory_blocked.pop(rid, None)
            self.bypass.forget(rid)
            self._clear_skip(r)
            if rid == self._slot_reserved:
                self._slot_reserved = None
            if rid == self._room_reserved:
                self._room_reserved = None
            if self._drain is not None and rid == self._drain.beneficiary:
                self._drain = None
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
                slot_squash: bool = False, room_squash: bool = False) -> SchedRequest:
        """A running request goes back to its arrival position (squashed, retracted by the engine,
        or `pushed_back`: planned by the last `build_batch` but not taken by the engine, whose own
        limits, such as a cap on running requests, the plan does not see) and its tokens return.
        A request heading its queue that has been pushed back `max_budget_skips` times gets its
        queue promoted as a budget stop would, at every push-back until the engine takes it (the
        starvation bound holds whatever the engine's limits). Raises KeyError if it is not
        running."""
        r = self._pop_running(rid)
        r.admitted_at = None
        r.resumed = r.resumed or not pushed_back
        if squash or slot_squash or room_squash:
            r.num_squashes += 1
            self.counts["slot_squashed" if slot_squash else "room_squashed" if room_squash else "squashes"] += 1
        q = self.plan.route(r.wrs)
        self.queues.push_in_order(r, q)
        if pushed_back and r.memory_blocked_since is not None:
            self._memory_blocked[r.rid] = r  # still the request the memory hold waits for
        elif not pushed_back:
            r.memory_blocked_since = None  # it ran: a new wait starts
        if pushed_back:
            self.counts["pushed_back"] += 1
            r.num_pushbacks += 1
            if self.queues.head(q) is r and r.num_pushbacks >= self.config.max_budget_skips:
                # planning it cleared its skip record (`_start`): the count lives on the request
                self._budget_skips[q] = (r.rid, r.num_pushbacks)
                self._promoted.setdefault(q, self._num_batches)
        return r

    def _pop_running(self, rid: str) -> SchedRequest:
        r = self._running.pop(rid, None)
        if r is None:
            raise KeyError(f"request {rid!r} is not running: finished twice, or never admitted")
        self.ledger.release(r.charges)
        r.charges = []
        self.bypass.forget(rid)
        self._backfilled.discard(rid)
        return r

    # ---- batch building --------------------------------------------------------------------------

    def build_batch(self, now: float, budget_tokens: int | None = None,
                    is_resident: IsResident | None = None,
                    request_prefetch: RequestPrefetch | None = None,
                    running_adapters: Collection[str | None] | None = None,
                    max_adapters: int | None = None,
                    adapter_tokens: Callable[[str], int] | None = None) -> list[SchedRequest]:
        """Admits requests for this iteration (Algorithm 1 as above), refreshing the plan first
        when one is due. The returned requests are running from now on: finish each with
        `on_finish` or return it with `requeue`. Without callbacks every adapter is resident;
        without `max_adapters` (the engine's cap on distinct adapters per batch, the base model
        counting as one; `running_adapters`: those of the engine's running requests) there is no
        cap; without `adapter_tokens` (adapter -> the budget tokens its load takes) a memory hold
        backfills nothing."""
        self.refresh(now)
        self.last_stops = {}
        slots = None
        if max_adapters is not None:
            running = set(running_adapters or ())
            self._update_drain(now, running, max_adapters)
            reserved = self._slot_reserved if self._slot_reserved in self.queues else None
            drain = self._drain
            slots = AdapterSlots(running, max_adapters, reserved,
                                 frozenset() if drain is None else frozenset((drain.adapter,)),
                                 None if drain is None else drain.beneficiary)
        ctx = BatchContext(now, budget_tokens, is_resident, request_prefetch, slots)
        batch: list[SchedRequest] = []
        held = (self._room_reservation(ctx, batch) or self._memory_hold(ctx, batch, adapter_tokens)
                or self._admit_overdue(ctx, batch))
        self.counts["slot_skips"] += ctx.slot_skips
        if held:
            self._end_batch(ctx)
            return batch
        k = self.queues.num_queues
        promoted = sorted(self._promoted, key=self._promoted.__getitem__)
        for q in promoted + [q for q in range(k) if q not in self._promoted]:
            self._scan(q, ctx, batch, None)
        lenders = [[q, self.ledger.available(q)] for q in range(k)
                   if not self.queues.len_of(q) and self.ledger.available(q) > 0]
        for q in range(k):
            if not any(spare for _, spare in lenders):
                break
            if self.queues.len_of(q):
                self._scan(q, ctx, batch, lenders)
        self._end_batch(ctx)
        return batch

    def _end_batch(self, ctx: BatchContext) -> None:
        """A slot reservation lasts one batch: the squash freed the slot right before it, so a
        beneficiary not admitted then (its cost over the budget, its adapter evicted meanwhile)
        would only hold the slot from everyone else; it may be squashed for again."""
        for stop in self.last_stops.values():
            self.counts["stops_" + stop.reason] += 1
        self.last_passes = {"slot": ctx.slot_skips, "not_resident": ctx.not_resident}
        if ctx.slot_waits_started:
            self._slot_wait_floor = min(self._slot_wait_floor, ctx.now)
        self._slot_reserved = None
        self._room_reserved = None
        self._num_batches += 1

    def _room_reservation(self, ctx: BatchContext, batch: list[SchedRequest]) -> bool:
        """The batch after a room squash (room.py): its beneficiary goes in alone, before anything else could take
        the room its victims gave back (they are older, so every phase would reach them first); if it cannot (its
        adapter evicted meanwhile, its cost over the budget), the batch takes nothing, and the reservation ends
        with it either way. True when the batch ends here."""
        r = self.queues.get(self._room_reserved) if self._room_reserved is not None else None
        if r is None:
            return False
        fits = ctx.budget is None or r.cost_tokens <= ctx.budget or not self._running
        if ctx.has_slot(r) and (ctx.resident(r.adapter) or ctx.fetch(r)) and fits:
            self._admit_to_own_queue(r, ctx, batch)
            self.counts["room_admits"] += 1
        return True

    def _memory_hold(self, ctx: BatchContext, batch: list[SchedRequest],
                     adapter_tokens: Callable[[str], int] | None = None) -> bool:
        """The memory hold (module docstring): True when the batch ends here, with the request
        memory-blocked longest admitted or held for (and what backfills beside it). False when no
        request has been memory-blocked `memory_hold_share` of the SLO, or when it cannot go in and
        nothing runs (waiting then frees nothing; the phases below go on, and the next batch asks
        again)."""
        if not self._memory_blocked:
            return False
        r = min(self._memory_blocked.values(), key=lambda r: (r.memory_blocked_since, r.seq))
        if ctx.now - r.memory_blocked_since < self.config.memory_hold_share * self.config.ttft_slo_s:
            return False
        if r.rid != self._hold_for:
            self._hold_for = r.rid  # a new hold: what runs now drains for it, backfilled or not
            self._backfilled.clear()
        was_resident = ctx.resident(r.adapter)
        fits = ctx.budget is None or r.cost_tokens <= ctx.budget or not self._running
        if ctx.has_slot(r) and (was_resident or ctx.fetch(r)) and fits:
            self._admit_to_own_queue(r, ctx, batch)
            return True
        if not self._running:
            return False
        self.last_stops[r.queue] = Stop("memory_hold", r.rid, r.cost_tokens, 0)
        self.counts["memory_holds"] += 1
        if adapter_tokens is not None and ctx.budget is not None and self.config.memory_hold_backfill:
            load = 0 if was_resident or r.adapter is None else adapter_tokens(r.adapter)
            self._backfill(r, r.cost_tokens + load, ctx, batch, adapter_tokens)
        return True

    def _backfill(self, held: SchedRequest, need: int, ctx: BatchContext, batch: list[SchedRequest],
                  adapter_tokens: Callable[[str], int]) -> None:
        """Backfill beside a memory hold (module docstring): requests on an adapter (or the base
        model) that a running request uses, oldest first in ascending queue order, while each fits
        the slack and the budget. A request on an adapter that only requests running before the hold
        pin keeps it pinned after they drain: its adapter's tokens count against the slack too; so
        does the cached prefix a request locks while it runs (`cached_len`: room the budget counts as
        evictable until then, and gives back when it finishes)."""
        slack = ctx.budget - need
        before, backfilled = set(), set()
        for x in self._running.values():
            if x.rid in self._backfilled:
                slack -= x.cost_tokens + x.cached_len
                backfilled.add(x.adapter)
            else:
                slack += x.cost_tokens + x.cached_len
                before.add(x.adapter)
        freed = before - backfilled - {None, held.adapter}  # idle, so evictable, once those drain
        slack += sum(adapter_tokens(a) for a in freed)
        if slack <= 0:
            return
        pinned = before | backfilled
        left = BACKFILL_SCAN
        for q in range(self.queues.num_queues):
            found = list(islice(self.queues.scan(q), left))
            left -= len(found)
            for x in found:
                if x is held or x.adapter not in pinned:  # no load, and no adapter slot the held one may need
                    continue
                cost = x.cost_tokens + x.cached_len + (adapter_tokens(x.adapter) if x.adapter in freed else 0)
                if cost > slack or x.cost_tokens > ctx.budget or not ctx.has_slot(x):
                    continue
                self._admit_to_own_queue(x, ctx, batch)
                self._backfilled.add(x.rid)
                freed.discard(x.adapter)
                self.counts["backfills"] += 1
                slack -= cost  # next batch: counted against the slack again, part of it out of the budget
                if slack <= 0:
                    return
            if left <= 0:
                return

    def _note_memory_blocked(self, r: SchedRequest, now: float) -> None:
        if r.memory_blocked_since is None:
            r.memory_blocked_since = now
        self._memory_blocked[r.rid] = r

    def _admit_overdue(self, ctx: BatchContext, batch: list[SchedRequest]) -> bool:
        """Phase 0: overdue requests (queued `config.overdue_s` or longer), oldest first across
        queues, each charged to its own queue whatever its quota says. One whose adapter is not
        resident is passed over (its adapter prefetched), at most `lookahead` of them. True when
        the oldest resident overdue request does not fit the budget: the batch then takes nothing
        else, so that the room freed by finishing requests goes to it rather than to younger
        requests (the FCFS hold, for overdue requests only). The hold lasts until it fits or
        nothing runs: a request whose cost (its predicted output counted) exceeds every budget the
        engine can offer then goes in alone and the engine decides, so the hold cannot stall."""
        if math.isinf(self.config.overdue_s):
            return False
        limit = ctx.now - self.config.overdue_s
        overdue = []
        for q in range(self.queues.num_queues):
            for r in self.queues.scan(q):
                if r.arrival > limit:
                    break
                overdue.append(r)
        if not overdue:
            return False
        overdue.sort(key=lambda r: r.seq)
        passed = 0
        for r in overdue:
            if not ctx.has_slot(r):
                continue  # passed over, spending no lookahead: slots free as adapters drain
            if not ctx.resident(r.adapter) and not ctx.fetch(r):
                if ctx.memory_blocked(r.adapter):
                    self._note_memory_blocked(r, ctx.now)
                passed += 1
                ctx.not_resident += 1
                if passed > self.config.lookahead:
                    return False
                continue
            if ctx.budget is not None and r.cost_tokens > ctx.budget and (self._running or batch):
                self.last_stops[r.queue] = Stop("overdue_hold", r.rid, r.cost_tokens, ctx.budget)
                return True  # nothing running and still too big: it goes in, the engine has all it will have
            self._admit_to_own_queue(r, ctx, batch)
            self.counts["overdue"] += 1
        return False

    def _admit_to_own_queue(self, r: SchedRequest, ctx: BatchContext,
                            batch: list[SchedRequest]) -> None:
        """Admits r charged wholly to its own queue, whatever its quota says (the holds)."""
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
        if result.budget_stop is not None and lenders is None:
            self._note_budget_skip(q, result.budget_stop)
        for r in result.memory_blocked:
            self._note_memory_blocked(r, ctx.now)
        for r in result.admitted:
            self._start(r, ctx.now)
            batch.append(r)
        for r2, r1 in result.bypasses:
            self.bypass.record(r2, r1)
            self.counts["bypasses"] += 1

    def _start(self, r: SchedRequest, now: float) -> None:
        self.queues.pop(r.rid)
        self._memory_blocked.pop(r.rid, None)  # its `memory_blocked_since` stays for a push-back
        if r.rid == self._slot_reserved:
            self._slot_reserved = None
        if self._drain is not None and r.rid == self._drain.beneficiary:
            self._drain = None  # a slot came its way, drained or not
        self.bypass.forget_beneficiary(r.rid)
        self._clear_skip(r)
        self.ledger.charge(r.charges)
        r.admitted_at = now
        r.slot_wait_since = None
        self._running[r.rid] = r
        self.counts["admitted"] += 1

    def _note_budget_skip(self, q: int, r: SchedRequest) -> None:
        rid, n = self._budget_skips.get(q, (None, 0))
        if rid != r.rid:
            self._promoted.pop(q, None)
            n = 0
        self._budget_skips[q] = (r.rid, n + 1)
        if n + 1 >= self.config.max_budget_skips and q not in self._promoted:
            self._promoted[q] = self._num_batches

    def _clear_skip(self, r: SchedRequest) -> None:
        entry = self._budget_skips.get(r.queue)
        if entry is not None and entry[0] == r.rid:
            del self._budget_skips[r.queue]
            self._promoted.pop(r.queue, None)

    def _update_drain(self, now: float, running: set[str | None], cap: int) -> None:
        """Slot drain (slots.py, rule 3), before a batch with the engine's cap: a drain whose
        request left the queues ends; one whose adapter stopped running reserves the freed slot
        for its request (unless another reservation is pending or the slot went to someone else:
        the drain then ends and may start again below); with no drain, every slot taken and no
        reservation pending, the request that has waited longest for a slot, once that is
        `slot_drain_share` of the SLO, gets one. O(queued) only when no drain is under way and the
        earliest slot wait known (a lower bound, exact after each scan) is that old, else O(1)."""
        drain = self._drain
        if drain is not None:
            if drain.beneficiary not in self.queues:
                self._drain = None
            elif drain.adapter not in running:
                self._drain = None
                if len(running) < cap and self._slot_reserved not in self.queues:
                    self._slot_reserved = drain.beneficiary
                    return
        since = now - self.config.slot_drain_share * self.config.ttft_slo_s
        if (self._drain is not None or len(running) < cap or self._slot_reserved in self.queues
                or self._slot_wait_floor > since):
            return
        r1 = None
        waiting: dict[str | None, int] = {}
        floor = math.inf
        for q in range(self.queues.num_queues):
            for r in self.queues.scan(q):
                waiting[r.adapter] = waiting.get(r.adapter, 0) + 1
                if r.slot_wait_since is None:
                    continue
                floor = min(floor, r.slot_wait_since)
                if (r.slot_wait_since <= since and r.adapter not in running
                        and (r1 is None or (r.slot_wait_since, r.seq) < (r1.slot_wait_since, r1.seq))):
                    r1 = r
        self._slot_wait_floor = floor  # exact now; batches lower it as requests start waiting
        if r1 is None:
            return
        by_adapter: dict[str | None, list[SchedRequest | None]] = {a: [] for a in running}
        for r in self._running.values():
            if r.adapter in by_adapter:
                by_adapter[r.adapter].append(r)
        for a, reqs in by_adapter.items():
            if not reqs:
                reqs.append(None)  # the engine runs it, the scheduler knows none of its requests
        chosen = choose_drain_adapter(by_adapter, now, self.config.timing, waiting, self._arrival_rates(now, running))
        if chosen is None:
            return
        self._drain = SlotDrain(chosen[0], r1.rid, now, chosen[1])
        self.counts["slot_drains"] += 1

    def _arrival_rates(self, now: float, adapters: Collection[str | None]) -> dict[str | None, float]:
        """Each of `adapters`' arrival rate (requests per second) over the fitting window, which
        `build_batch`'s refresh has just trimmed to `window_s` (O(len(adapters)))."""
        span = max(now - self._window[0].arrival, 1.0) if self._window else 1.0
        return {a: self._window_counts.get(a, 0) / span for a in adapters}

    def _window_popleft(self) -> None:
        r = self._window.popleft()
        n = self._window_counts[r.adapter] - 1
        if n:
            self._window_counts[r.adapter] = n
        else:
            del self._window_counts[r.adapter]

    @property
    def slot_drain(self) -> SlotDrain | None:
        """The drain under way, if any (slots.py, rule 3)."""
        return self._drain

    # ---- bypass and squash -----------------------------------------------------------------------

    def squash_candidates(self, free_tokens: int,
                          footprint: Callable[[SchedRequest], int] | None = None,
                          need: Callable[[SchedRequest], int] | None = None) -> list[SquashInfo]:
        """Running requests to squash now (bypass.py). Modifies nothing: the caller aborts each
        victim in the engine, then calls `requeue(victim.rid, squash=True)`."""
        return squash_candidates(self.bypass, self._running, self.queues.get, free_tokens,
                                 self.config.max_squashes, footprint, need)

    def slot_squash(self, now: float, running_adapters: Mapping[str | None, Collection[str]],
                    max_adapters: int, recompute_tokens: Callable[[SchedRequest], int],
                    is_resident: IsResident | None = None,
                    excluded: Collection[str | None] = (),
                    request_prefetch: RequestPrefetch | None = None) -> SlotSquash | None:
        """The slot squash to apply now, if any (slots.py): `running_adapters` maps each adapter
        the engine runs (None: the base model) to its running rids, `max_adapters` is the engine's
        cap, `recompute_tokens(r)` what retracting r costs, `excluded` adapters that may not be
        squashed. None while a slot is free, while an earlier squash's beneficiary is still queued,
        or when no queued request qualifies. R1 is the oldest queued request needing a slot whose
        adapter is resident; with `request_prefetch`, an older one whose adapter is not (admission
        asks for no load while no slot is left for its request) is R1 if the rule fires for it and
        the prefetch makes its adapter resident at once; a load that does not complete at once
        leaves the squash for a later pass. At most one prefetch per call. O(queued + running).
        Modifies nothing but what the prefetch loads: the caller retracts the victims in the
        engine, then calls `commit_slot_squash`."""
        if len(running_adapters) < max_adapters or self._slot_reserved in self.queues:
            return None
        oldest = resident = None  # the oldest qualifying request; the oldest whose adapter is resident
        for q in range(self.queues.num_queues):
            for r in self.queues.scan(q):  # arrival order: the first that qualifies is the queue's oldest
                if resident is not None and r.seq > resident.seq:
                    break
                if r.resumed or r.adapter in running_adapters:
                    continue
                if oldest is None or r.seq < oldest.seq:
                    oldest = r
                if is_resident is None or r.adapter is None or is_resident(r.adapter):
                    resident = r
                    break
        if oldest is None:
            return None
        running = {a: [self._running.get(rid) for rid in rids]
                   for a, rids in running_adapters.items()}
        if oldest is not resident and request_prefetch is not None:
            squash = choose_slot_squash(oldest, running, now, self.config, recompute_tokens, excluded)
            if squash is not None and request_prefetch(oldest.adapter) and is_resident(oldest.adapter):
                return squash
        if resident is None:
            return None
        return choose_slot_squash(resident, running, now, self.config, recompute_tokens, excluded)

    def commit_slot_squash(self, squash: SlotSquash) -> None:
        """After the engine retracted `squash.victims`: each goes back to its arrival position
        (`requeue(squash=True)`), and the freed slot is reserved for the beneficiary."""
        for r in squash.victims:
            self.requeue(r.rid, slot_squash=True)
        self._slot_reserved = squash.beneficiary.rid
        self.counts["slot_squashes"] += 1

    def room_squash(self, now: float, room: Callable[[], int], need: Callable[[SchedRequest], int],
                    running: Callable[[], list[RoomVictim]]) -> RoomSquash | None:
        """The room squash to apply now, if any (room.py): R1 is the oldest queued request never resumed, `room()`
        what the engine could free now, `need(r)` the slots r waits for, `running()` the running requests as
        victims (the callbacks are called only once R1 has waited long enough: they cost the caller a look at its
        memory). None when the rule is off, while an earlier squash's beneficiary is still reserved, or when R1 does
        not qualify.
        O(queues + queued requests resumed ahead of each queue's oldest fresh one). Modifies nothing: the caller
        retracts the victims in the engine, then calls `commit_room_squash`."""
        if math.isinf(self.config.room_squash_share) or self._room_reserved in self.queues:
            return None
        r1 = None
        for q in range(self.queues.num_queues):
            for r in self.queues.scan(q):  # arrival order: the first fresh one is the queue's oldest
                if not r.resumed:
                    if r1 is None or r.seq < r1.seq:
                        r1 = r
                    break
        if r1 is None or now - r1.arrival < self.config.room_squash_share * self.config.ttft_slo_s:
            return None
        victims = [v for v in running() if v.request.rid in self._running]
        return choose_room_squash(r1, need(r1), room(), victims, now, self.config)

    def commit_room_squash(self, squash: RoomSquash) -> None:
        """After the engine retracted `squash.victims`: each goes back to its arrival position, and the next batch
        admits the beneficiary first (`_room_reservation`)."""
        for r in squash.victims:
            self.requeue(r.rid, room_squash=True)
        self._room_reserved = squash.beneficiary.rid
        self.counts["room_squashes"] += 1

    @property
    def room_reserved_for(self) -> str | None:
        """The queued rid a room squash reserved the next batch for (None: no reservation)."""
        return self._room_reserved if self._room_reserved in self.queues else None

    @property
    def slot_reserved_for(self) -> str | None:
        """The queued rid a slot squash reserved a slot for (None: no reservation)."""
        return self._slot_reserved if self._slot_reserved in self.queues else None

    # ---- refresh ---------------------------------------------------------------------------------

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
        while self._window and self._window[0].arrival < now - self.config.window_s:
            self._window_popleft()
        if not force and not self._refit_due(now):
            return False
        if len(self._window) < self.config.min_samples:
            return False
        self._install(fit_plan(list(self._window), now, self.config, self._total_tokens))
        self._fitted = True
        self.counts["refreshes"] += 1
        return True

    def _refit_due(self, now: float) -> bool:
        n, plan = len(self._window), self.plan
        if not self._fitted:
            return n >= self.config.min_samples
        grown = plan.num_samples > 0 and n >= 2 * plan.num_samples  # a set_plan plan has 0 samples
        return grown or now >= plan.fitted_at + self.config.requeue_s

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
            r.wrs = plan.normalizer.wrs(r.new_len, r.pred_out_len, r.rank)
            return plan.route(r.wrs)

        self.queues.reroute(plan.num_queues, route)
        for r in self._running.values():
            r.queue = route(r)
            r.charges = [(r.queue, r.cost_tokens)] if r.cost_tokens else []
        self.ledger.reset(plan.quotas.quotas, (r.charges for r in self._running.values()))
        self._budget_skips.clear()
        self._promoted.clear()

    # ---- reading ---------------------------------------------------------------------------------

    @property
    def running(self) -> dict[str, SchedRequest]:
        """rid -> running request. Read only."""
        return self._running

    def wanted_adapters(self) -> dict[str, int]:
        """Adapter -> queued requests naming it (input to the pool's eviction tiers). A copy."""
        return self.queues.wanted_adapters()

    def stats(self) -> SchedStats:
        plan, ledger = self.plan, self.ledger
        bounds = (0.0, *plan.clustering.cutoffs, 1.0)
        infos = tuple(
            QueueInfo(q, self.queues.len_of(q), ledger.quotas[q], plan.quotas.minima[q],
                      ledger.held[q], bounds[q], bounds[q + 1])
            for q in range(self.queues.num_queues))
        return SchedStats(
            queues=infos, cutoffs=plan.clustering.cutoffs, num_queued=len(self.queues),
            num_running=len(self._running), quotas_feasible=plan.quotas.feasible,
            normalizer=plan.normalizer, predictor=self.predictor.stats(),
            promoted=tuple(self._promoted), counts=dict(self.counts))

    def check_invariants(self) -> None:
        self.queues.check_invariants()
        k = self.plan.num_queues
        assert self.queues.num_queues == k == len(self.ledger.quotas), "plan and queues disagree"
        cuts = self.plan.clustering.cutoffs
        assert all(a < b for a, b in pairwise(cuts)), f"cut-offs not increasing: {cuts}"
        for q in range(k):
            for r in self.queues.scan(q):
                assert self.plan.route(r.wrs) == q, f"{r} sits in the wrong queue"
        for rid, r in self._memory_blocked.items():
            assert self.queues.get(rid) is r and r.memory_blocked_since is not None, \
                f"{rid} memory-blocked but not queued"
        assert self._backfilled <= self._running.keys(), "a backfilled request is not running"
        for rid, r in self._running.items():
            assert rid not in self.queues, f"{rid} both queued and running"
            assert r.admitted_at is not None and 0 <= r.queue < k, f"{r} running but not admitted"
            assert sum(t for _, t in r.charges) == r.cost_tokens, f"{r} charges {r.charges}"
        assert self._slot_reserved is None or self._slot_reserved in self.queues, \
            f"a slot reserved for {self._slot_reserved}, which is not queued"
        assert self._room_reserved is None or self._room_reserved in self.queues, \
            f"room reserved for {self._room_reserved}, which is not queued"
        assert self._drain is None or self._drain.beneficiary in self.queues, \
            f"a drain for {self._drain.beneficiary}, which is not queued"
        counts: dict[str | None, int] = {}
        for r in self._window:
            counts[r.adapter] = counts.get(r.adapter, 0) + 1
        assert counts == self._window_counts, "the window's per-adapter counts drifted"
        self.ledger.check_invariants(r.charges for r in self._running.values())
        self.bypass.check_invariants(self._running, self.queues.get)
        self.predictor.check_invariants()

