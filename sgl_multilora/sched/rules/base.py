"""The interface every rule beyond Chameleon's Algorithm 1 plugs into the multi-queue scheduler by.

Lives here: `BatchRule` and `SchedulerView` (what a rule may use of its scheduler). Not here: the
rules themselves (one module each beside this one) or the algorithm they plug into (multiqueue.py).
"""

from __future__ import annotations

from typing import Protocol

from sgl_multilora.sched.admission import BatchContext, ScanResult, Stop
from sgl_multilora.sched.config import SchedConfig
from sgl_multilora.sched.queues import QueueSet
from sgl_multilora.sched.request import SchedRequest


class SchedulerView(Protocol):
    """What a rule may use of the scheduler that owns it (`MultiQueueScheduler`)."""

    config: SchedConfig
    queues: QueueSet
    counts: dict[str, int]
    last_stops: dict[int, Stop]
    num_batches: int

    @property
    def running(self) -> dict[str, SchedRequest]: ...

    def admit_alone(self, r: SchedRequest, ctx: BatchContext,
                    batch: list[SchedRequest]) -> None: ...

    def requeue(self, rid: str, squash: bool = False, pushed_back: bool = False, *,
                slot_squash: bool = False) -> SchedRequest: ...


class BatchRule:
    """A rule the scheduler calls at fixed points of its life; every hook does nothing by default.

    A rule owns its own state. It reads the scheduler (`mq`: queues, running requests, config) and
    changes it only through `admit_alone`, `requeue`, `counts` and `last_stops`; everything else
    it keeps to itself. Hooks run in the order of `MultiQueueScheduler.rules`."""

    def __init__(self, mq: SchedulerView) -> None:
        self.mq = mq

    def hold(self, ctx: BatchContext, batch: list[SchedRequest]) -> bool:
        """Before phase 1 of a batch: True when the batch ends here (what the rule admitted through
        `mq.admit_alone` is in `batch`); False lets the phases run."""
        return False

    def scanned(self, q: int, result: ScanResult, phase1: bool, now: float) -> None:
        """After queue `q`'s scan in phase 1 or 2 (its admissions already started)."""

    def left_queues(self, r: SchedRequest) -> None:
        """`r` left the queues: admitted, or removed without running."""

    def requeued(self, r: SchedRequest, q: int, pushed_back: bool) -> None:
        """`r` went back to queue `q`: retracted, squashed or `pushed_back` (planned, not taken)."""

    def end_batch(self) -> None:
        """After every `build_batch`, whether it ran the phases or a hold ended it."""

    def reset(self) -> None:
        """A new plan is in: queue numbers changed."""

    def check_invariants(self) -> None:
        """Asserts the rule's own bookkeeping agrees with the scheduler's."""
