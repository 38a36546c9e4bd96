"""One queue's admission scan in a batch (Algorithm 1's put_batch, with our changes).

Lives here: `BatchContext` (one batch's budget and callback answers), `scan_queue` (which requests
of one queue go in, with their charges; it decides, it does not apply) and `borrow`. Not here:
the phase order, or applying a decision to queues, ledger and running set (multiqueue.py).

Rules, in the order a request meets them (reference/seed-chameleon.md, 4.3 and 4.4):
1. Quota: the cost must fit the tokens left (phase 1: the queue's available quota; phase 2: its
   remainder plus the spare pool), else the queue stops (the paper's strict FIFO). Exception: a
   request larger than its queue's whole quota goes in as the first admission of an idle queue
   (nothing of it running); otherwise it could never run, and it then holds more than the quota.
2. Budget: the cost must fit what is left of the batch budget, else the queue stops
   (rules/promotion.py promotes a queue whose head keeps stopping here).
3. Residency: a request whose adapter is not resident is passed over, keeping its place, and its
   adapter is prefetched; the paper stops the queue at it instead, idling the whole queue for a
   PCIe transfer. At most `lookahead` are passed per queue and batch, so a scan stays short. If
   the prefetch callback answers that the adapter cannot fit even after evicting every idle
   adapter, that request is R1 for the bypass rule. A load that completes at once (a host copy
   on a CPU) admits the request in the same batch.
4. Bypass: after such an R1, a request passes only if T_wait(R1) > T_exec(it); the first that
   fails stops the queue (bypass.py defines both times).
5. Slots (checked first): with the engine's cap on adapters per batch given (slots.py), a request
   that would need a new slot when none is left (or only one reserved for another request) is
   passed over, keeping its place, without a load asked for its adapter (it would evict one a
   runnable request uses) and without stopping its queue or spending `lookahead`: SGLang walks its
   whole waiting queue past such requests, so a request on a running adapter far back in a queue
   must still go in (with the lookahead spent on slot skips, a simulated engine under SGLang's
   cap of 8 needed half as long again as fcfs to serve the same requests). A skip costs one set
   lookup.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from sgl_multilora.sched.bypass import predict_wait_s
from sgl_multilora.sched.request import SchedRequest, TimingModel
from sgl_multilora.sched.slots import AdapterSlots

IsResident = Callable[[str], bool]
"""adapter -> its weights are on the device now."""
RequestPrefetch = Callable[[str], bool]
"""adapter -> True if a load is under way or was started now; False if it cannot fit even after
evicting every idle adapter (the bypass trigger)."""


class BatchContext:
    """One build_batch call's scratch: the budget left, the adapter slots left (None: no cap) and
    each adapter's callback answers (each callback runs at most once per adapter and batch)."""

    def __init__(self, now: float, budget: int | None, is_resident: IsResident | None,
                 prefetch: RequestPrefetch | None, slots: AdapterSlots | None = None) -> None:
        self.now, self.budget, self.slots = now, budget, slots
        self.slot_skips = 0
        self.not_resident = 0  # requests passed over while their adapter loads
        self._is_resident, self._prefetch = is_resident, prefetch
        self._resident: dict[str, bool] = {}
        self._loadable: dict[str, bool] = {}

    def resident(self, adapter: str | None) -> bool:
        if adapter is None or self._is_resident is None:
            return True
        if adapter not in self._resident:
            self._resident[adapter] = self._is_resident(adapter)
        return self._resident[adapter]

    def has_slot(self, r: SchedRequest) -> bool:
        """Whether r has an adapter slot in this batch (a request passed over counts a skip)."""
        if self.slots is None or self.slots.has_slot(r):
            return True
        self.slot_skips += 1
        return False

    def take_slot(self, r: SchedRequest) -> None:
        if self.slots is not None:
            self.slots.take(r)

    def loadable(self, adapter: str) -> bool:
        """Asks for a prefetch; False means memory-blocked."""
        if adapter not in self._loadable:
            self._loadable[adapter] = self._prefetch(adapter) if self._prefetch else True
        return self._loadable[adapter]

    def fetch(self, r: SchedRequest) -> bool:
        """For a request whose adapter is not resident, and which has a slot in this batch (the
        caller checks: an adapter loaded for a request that cannot run now would evict one that
        can, and be evicted again before its request runs): asks for the adapter's load. True
        when the adapter is resident now (a load that completes at once, as a host copy on a CPU
        does): the request is then admitted like any other. Residency is read again once, after
        the first load asked for the adapter in this batch (not for each of its requests)."""
        if r.adapter not in self._loadable:
            self.loadable(r.adapter)
            self._resident[r.adapter] = self._is_resident(r.adapter)
        return self._resident[r.adapter]

    def memory_blocked(self, adapter: str) -> bool:
        """Whether this batch asked for the adapter's load and was told it cannot fit."""
        return not self._loadable.get(adapter, True)


@dataclass(frozen=True)
class Stop:
    """Why a queue's scan admitted nothing past `rid`: "quota" (its cost over the quota left),
    "budget" (over the batch budget left), "lookahead" (too many non-resident adapters passed) or
    "bypass" (T_wait of the memory-blocked request ahead not above its T_exec); and "memory_hold"
    (rules/memory_hold.py: the queue of the request that holds the batch). `cost` and `limit`: the
    request's cost and the tokens left (0 for lookahead, bypass and a memory hold)."""

    reason: str
    rid: str
    cost: int
    limit: int


@dataclass
class ScanResult:
    admitted: list[SchedRequest] = field(default_factory=list)
    """In FIFO order; each with `charges` set."""
    bypasses: list[tuple[SchedRequest, SchedRequest]] = field(default_factory=list)
    """(R2, R1): R2 was admitted past the memory-blocked R1."""
    budget_stop: SchedRequest | None = None
    """The request that fitted the quota but not the budget, if the scan stopped there."""
    stop: Stop | None = None
    """Why the scan stopped before the queue's end (None: it reached the end)."""
    memory_blocked: list[SchedRequest] = field(default_factory=list)
    """Requests passed over because their adapter cannot fit even after evicting every idle one."""


@dataclass(frozen=True)
class QueueView:
    """What the scan needs to know of one queue."""

    index: int
    available: int
    quota: int
    idle: bool
    """Nothing of the queue is running."""


def scan_queue(queue: Iterator[SchedRequest], view: QueueView, ctx: BatchContext,
               lenders: list[list[int]] | None, running: Iterable[SchedRequest],
               timing: TimingModel, lookahead: int) -> ScanResult:
    """Decides admissions from one queue. Phase 1 when `lenders` is None; in phase 2 a request
    draws on its queue's remainder first, then on `lenders` ([queue, spare] entries, smallest
    queue first). Decrements `ctx.budget` and the lenders' spare; sets `charges` on admitted
    requests; changes nothing else."""
    out = ScanResult()
    own = view.available
    cap = max(0, own) + (sum(spare for _, spare in lenders) if lenders else 0)
    blocker: SchedRequest | None = None
    t_wait = 0.0
    passed = 0
    slots = ctx.slots
    # rule 5 without a call per request passed over: while no new slot is open but the reserved one, a request
    # whose adapter is not in the batch is passed over here (what `has_slot` would answer); updated at each take
    in_batch = slots.in_batch if slots is not None else ()
    closed, reserved = (slots.closed_to_new(), slots.reserved) if slots is not None else (False, None)
    for r in queue:
        if slots is not None and r.adapter not in in_batch:
            if closed and r.rid != reserved:
                ctx.slot_skips += 1
                continue
            if not ctx.has_slot(r):
                continue  # rule 5: checked first, and no lookahead is spent on it
        cost = r.cost_tokens
        oversize = lenders is None and view.idle and not out.admitted and cost > view.quota
        if cost > cap and not oversize:
            out.stop = Stop("quota", r.rid, cost, cap)
            break
        if ctx.budget is not None and cost > ctx.budget:
            out.budget_stop = r
            out.stop = Stop("budget", r.rid, cost, ctx.budget)
            break
        if not ctx.resident(r.adapter) and not ctx.fetch(r):
            if ctx.memory_blocked(r.adapter):
                out.memory_blocked.append(r)
                if blocker is None:
                    blocker = r
                    t_wait = predict_wait_s(r, running, ctx.now, timing)
            passed += 1
            ctx.not_resident += 1
            if passed > lookahead:
                out.stop = Stop("lookahead", r.rid, cost, 0)
                break
            continue
        if blocker is not None and t_wait <= timing.request_exec_s(r):
            out.stop = Stop("bypass", r.rid, cost, 0)
            break
        ctx.take_slot(r)
        if slots is not None:
            closed, reserved = slots.closed_to_new(), slots.reserved
        from_own = cost if lenders is None else min(cost, max(0, own))
        r.charges = ([(view.index, from_own)] if from_own else []) + borrow(cost - from_own,
                                                                           lenders)
        own -= from_own
        cap -= cost
        if ctx.budget is not None:
            ctx.budget -= cost
        out.admitted.append(r)
        if blocker is not None:
            out.bypasses.append((r, blocker))
    return out


def borrow(tokens: int, lenders: list[list[int]] | None) -> list[tuple[int, int]]:
    """Takes `tokens` from the lenders in order, decrementing their spare; the charges taken."""
    charges = []
    for entry in lenders or ():
        if tokens <= 0:
            break
        take = min(tokens, entry[1])
        if take:
            charges.append((entry[0], take))
            entry[1] -= take
            tokens -= take
    assert tokens <= 0, "phase 2 admitted more than the spare pool holds"
    return charges
