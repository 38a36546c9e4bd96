"""Budget promotion: a queue whose head keeps missing the batch budget goes first.

Lives here: `BudgetPromotion` (the skip counts and the promoted queues). Not here: the budget stop
itself (admission.py's scan reports it) or the phase order that reads `order` (multiqueue.py).

The resource. Not in the paper, whose batches have no budget beside the quotas. A queue whose
stopped request fitted its quota but not the batch budget (`budget_tokens`: what the engine can
take this iteration) in `config.max_budget_skips` batches is promoted: promoted queues go first in
phase 1, oldest promotion first, until that request is admitted. A planned request the engine then
does not take (a push-back) counts the same way when it heads its queue: engines have limits of
their own (running-request caps, prefill backlog) that no token budget expresses. A new plan ends
every promotion (the queues are renumbered).
"""

from __future__ import annotations

from sgl_multilora.sched.admission import ScanResult
from sgl_multilora.sched.request import SchedRequest
from sgl_multilora.sched.rules.base import BatchRule, SchedulerView


class BudgetPromotion(BatchRule):
    def __init__(self, mq: SchedulerView) -> None:
        super().__init__(mq)
        self.skips: dict[int, tuple[str, int]] = {}
        """Queue -> (the rid it stopped at for the budget, in how many batches)."""
        self.promoted: dict[int, int] = {}
        """Queue -> the batch number of its promotion."""

    def order(self, num_queues: int) -> list[int]:
        """Phase 1's queue order: promoted queues, oldest promotion first, then the others."""
        promoted = sorted(self.promoted, key=self.promoted.__getitem__)
        return promoted + [q for q in range(num_queues) if q not in self.promoted]

    def scanned(self, q: int, result: ScanResult, phase1: bool, now: float) -> None:
        r = result.budget_stop
        if r is None or not phase1:
            return
        rid, n = self.skips.get(q, (None, 0))
        if rid != r.rid:
            self.promoted.pop(q, None)
            n = 0
        self.skips[q] = (r.rid, n + 1)
        if n + 1 >= self.mq.config.max_budget_skips and q not in self.promoted:
            self.promoted[q] = self.mq.num_batches

    def left_queues(self, r: SchedRequest) -> None:
        entry = self.skips.get(r.queue)
        if entry is not None and entry[0] == r.rid:
            del self.skips[r.queue]
            self.promoted.pop(r.queue, None)

    def requeued(self, r: SchedRequest, q: int, pushed_back: bool) -> None:
        if (pushed_back and self.mq.queues.head(q) is r
                and r.num_pushbacks >= self.mq.config.max_budget_skips):
            # planning it cleared its skip record (`left_queues`): the count lives on the request
            self.skips[q] = (r.rid, r.num_pushbacks)
            self.promoted.setdefault(q, self.mq.num_batches)

    def reset(self) -> None:
        self.skips.clear()
        self.promoted.clear()
