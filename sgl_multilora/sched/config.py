"""The multi-queue scheduler's settings, one frozen record with the reason for each default.

Lives here: `SchedConfig`. Not here: any state (multiqueue.py) or the fitting (plan.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sgl_multilora.sched.request import TimingModel
from sgl_multilora.sched.wrs import WrsNormalizer


@dataclass(frozen=True)
class SchedConfig:
    """Raises ValueError on out-of-range settings."""

    total_tokens: int
    """Tok_total: tokens the quotas share (a hook passes the KV pool's token capacity)."""
    ttft_slo_s: float = 5.0
    """The SLO in Tok_min = S D (1/SLO + lambda); 5 s is the paper's Splitwise TTFT SLO."""
    requeue_s: float = 300.0
    """Refit cut-offs and quotas this often (the paper's T_refresh). math.inf: never refit (a
    static plan, see `MultiQueueScheduler.set_plan`)."""
    window_s: float = 300.0
    """Requests that arrived longer ago leave the fitting window: one refresh period of history."""
    window_size: int = 2000
    """At most this many recent requests in the window, bounding the refit's cost."""
    min_samples: int = 32
    """A refit needs this many requests in the window. Until the first refit the prior plan queues
    by size against `initial_norm` (plan.py, `prior_plan`); the first refit runs as soon as the
    window holds `min_samples` requests, not after a whole `requeue_s`."""
    max_queues: int = 4
    """K_max (the paper's 4)."""
    min_gain: float = 0.06
    """Elbow rule: one more queue must remove this share of the window's WRS variance (kmeans.py
    says where 6% sits)."""
    norm_quantile: float = 0.99
    """MaxIn and MaxOut are this quantile of the window (wrs.py says why)."""
    initial_norm: WrsNormalizer = field(
        default_factory=lambda: WrsNormalizer(max_in_len=4096, max_out_len=1024, max_rank=64))
    """Normaliser before the first refit; its max_rank is the configured maximum LoRA rank and its
    base_rank the rank a base-model request counts as."""
    lookahead: int = 32
    """Per queue and batch, at most this many requests whose adapter is not resident are passed
    over, so one batch never scans a long run of loading requests."""
    max_budget_skips: int = 4
    """After this many batches in which a queue's head fitted its quota but not the batch budget,
    the queue goes first (the starvation bound in multiqueue.py)."""
    max_squashes: int = 1
    """A request is squashed at most this often (no livelock between bypass and squash)."""
    slot_squash_share: float = 0.5
    """With a cap on adapters per batch, a queued request that has waited this share of the TTFT
    SLO for a slot is squashed for whatever the prediction says (rules/slot_squash.py); before that only a
    predicted SLO miss fires the squash. Lower squashes sooner: shorter first-token waits, longer
    end-to-end times for the requests retracted (0.25 against 0.5 measured: eval/RESULTS.md)."""
    max_slot_squashes: int = 1
    """With a cap on adapters per batch, a request is retracted by slot squashes at most this often
    (its memory squashes counted too); 0: no slot squash. Each squash serves a request that has
    produced no token yet and a retracted request is never served by one, so squashes cannot
    cycle whatever the bound; a higher bound keeps victims available when every running adapter
    holds a request squashed before (rules/slot_squash.py)."""
    memory_hold_share: float = 0.5
    """A queued request whose adapter could not be made resident even after evicting every idle
    adapter (memory-blocked), this share of the TTFT SLO ago, holds the batch: it goes first, and
    until it is admitted the batch takes nothing else while anything runs, so that the memory the
    running requests free builds up for its adapter instead of going to requests of other queues
    (rules/memory_hold.py). Without it, a stream into another queue that re-admits every freed token
    starves the request for good: the bypass and squash rules act within one queue, and a
    promoted queue gains nothing when memory, not the budget, keeps its head out
    (tests/unit/test_sched_starvation.py). Half the SLO, as `slot_squash_share`: the rest is left
    for the drain and the prefill. math.inf: never hold (the published algorithm)."""
    timing: TimingModel = field(default_factory=TimingModel)

    def __post_init__(self) -> None:
        checks = {
            "total_tokens >= 0": self.total_tokens >= 0,
            "ttft_slo_s > 0": self.ttft_slo_s > 0,
            "requeue_s > 0": self.requeue_s > 0,
            "window_s > 0": self.window_s > 0,
            "window_size >= min_samples >= 1": self.window_size >= self.min_samples >= 1,
            "1 <= max_queues": self.max_queues >= 1,
            "0 <= min_gain <= 1": 0 <= self.min_gain <= 1,
            "0 < norm_quantile <= 1": 0 < self.norm_quantile <= 1,
            "lookahead >= 0": self.lookahead >= 0,
            "max_budget_skips >= 1": self.max_budget_skips >= 1,
            "max_squashes >= 0": self.max_squashes >= 0,
            "0 <= slot_squash_share <= 1": 0 <= self.slot_squash_share <= 1,
            "max_slot_squashes >= 0": self.max_slot_squashes >= 0,
            "memory_hold_share >= 0": self.memory_hold_share >= 0,
        }
        failed = [name for name, ok in checks.items() if not ok]
        if failed:
            raise ValueError(f"SchedConfig out of range: {', '.join(failed)} ({self})")

    @property
    def adaptive(self) -> bool:
        return not math.isinf(self.requeue_s)
