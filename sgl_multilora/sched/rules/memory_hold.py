"""The memory hold: a request whose adapter cannot be made resident gets the memory that frees next.

Lives here: `MemoryHold` (which requests are memory-blocked, and the hold). Not here: finding a
request memory-blocked (the admission scan asks the caller's prefetch callback: admission.py) or
memory itself (the caller's).

The resource. Not in the paper. A request is memory-blocked when its adapter could not be made
resident even after evicting every idle adapter. The bypass and squash rules (bypass.py) act within
its queue, and promoting its queue wins nothing when memory, not the budget, stops it, so a stream
into another queue that re-admits every freed token keeps it out for good.

Rule (`config.memory_hold_share`). Once the request memory-blocked longest (oldest first on ties)
was first found so `memory_hold_share` of the TTFT SLO ago, it goes first: admitted alone if its
adapter slot is free, its adapter can be made resident now and its cost fits the budget (or nothing
runs); else, while anything runs, the batch takes nothing, so that what the running requests free
builds up for it. It ends the batch either way (the adapter's load took room the budget still
counts). With nothing running, waiting frees nothing: the phases run, and the next batch asks
again. Bound: a memory-blocked request, from `memory_hold_share` of the SLO after it was first
found so, waits only for the requests memory-blocked before it and for what ran when its hold
began to free its adapter's room (at worst, to finish).
"""

from __future__ import annotations

from sgl_multilora.sched.admission import BatchContext, ScanResult, Stop
from sgl_multilora.sched.request import SchedRequest
from sgl_multilora.sched.rules.base import BatchRule, SchedulerView


class MemoryHold(BatchRule):
    def __init__(self, mq: SchedulerView) -> None:
        super().__init__(mq)
        self.blocked: dict[str, SchedRequest] = {}
        """Queued requests found memory-blocked since they were last queued, by rid."""

    def hold(self, ctx: BatchContext, batch: list[SchedRequest]) -> bool:
        if not self.blocked:
            return False
        mq = self.mq
        r = min(self.blocked.values(), key=lambda r: (r.memory_blocked_since, r.seq))
        if ctx.now - r.memory_blocked_since < mq.config.memory_hold_share * mq.config.ttft_slo_s:
            return False
        resident = ctx.resident(r.adapter)
        fits = ctx.budget is None or r.cost_tokens <= ctx.budget or not mq.running
        if ctx.has_slot(r) and (resident or ctx.fetch(r)) and fits:
            mq.admit_alone(r, ctx, batch)
            return True
        if not mq.running:
            return False
        mq.last_stops[r.queue] = Stop("memory_hold", r.rid, r.cost_tokens, 0)
        mq.counts["memory_holds"] += 1
        return True

    def scanned(self, q: int, result: ScanResult, phase1: bool, now: float) -> None:
        for r in result.memory_blocked:
            if r.memory_blocked_since is None:
                r.memory_blocked_since = now
            self.blocked[r.rid] = r

    def left_queues(self, r: SchedRequest) -> None:
        self.blocked.pop(r.rid, None)  # its `memory_blocked_since` stays for a push-back

    def requeued(self, r: SchedRequest, q: int, pushed_back: bool) -> None:
        if pushed_back and r.memory_blocked_since is not None:
            self.blocked[r.rid] = r  # still the request the hold waits for
        elif not pushed_back:
            r.memory_blocked_since = None  # it ran: a new wait starts

    def check_invariants(self) -> None:
        for rid, r in self.blocked.items():
            assert self.mq.queues.get(rid) is r and r.memory_blocked_since is not None, \
                f"{rid} memory-blocked but not queued"
