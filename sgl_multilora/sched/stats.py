"""The scheduler's read-only report: queues, cut-offs, quotas, predictor accuracy, counters.

Lives here: `SchedStats` and `QueueInfo` (frozen records). Not here: how they are computed
(`MultiQueueScheduler.stats`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sgl_multilora.sched.predictor import PredictorStats
from sgl_multilora.sched.wrs import WrsNormalizer


@dataclass(frozen=True)
class QueueInfo:
    index: int
    num_queued: int
    quota_tokens: int
    min_tokens: int
    """Tok_min of the plan (0 for a single-queue or fixed plan)."""
    held_tokens: int
    """Held by running requests: the queue's own and those it lent to in phase 2."""
    wrs_low: float
    wrs_high: float


@dataclass(frozen=True)
class SchedStats:
    queues: tuple[QueueInfo, ...]
    cutoffs: tuple[float, ...]
    num_queued: int
    num_running: int
    quotas_feasible: bool
    normalizer: WrsNormalizer
    predictor: PredictorStats
    promoted: tuple[int, ...]
    """Queues going first because their head kept missing the batch budget (rules/promotion.py)."""
    counts: dict[str, int]
    """Since start: admitted, finished, bypasses, squashes (requests retracted for adapter
    memory), slot_squashes (slot squashes) and slot_squashed (requests they retracted),
    slot_skips (times a batch passed over a request for want of an adapter slot; one request can
    count in many batches), refreshes, pushed_back, memory_holds (batches that took nothing while
    a memory-blocked request waited for room: rules/memory_hold.py), and stops_<reason>
    (batches in which a queue's scan stopped at a request it could not admit: quota, budget,
    lookahead, bypass or memory_hold; one per queue and batch)."""
