"""A scheduling plan (normaliser, queues and cut-offs, quotas) and how it is fitted to a window of
recent requests at each refresh.

Lives here: `SchedPlan`, `fit_plan` and `single_queue_plan` (pure functions), and `FitWindow`
(the recent requests a refit fits on, and when one is due). Not here: installing a plan
(multiqueue.py).

Per-queue statistics for Tok_min (choices the paper leaves open, section 8.7 of the reference):
the window's requests are routed by the new cut-offs; then per queue S = the largest cost, lambda
= the count over the window's time span, D = the mean measured service time (admission to finish)
of those that finished, or the timing model's T_exec of the queue's mean request while none has.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from sgl_multilora.sched.config import SchedConfig
from sgl_multilora.sched.kmeans import Clustering, choose_clustering
from sgl_multilora.sched.quotas import QueueLoad, QuotaPlan, apportion, plan_quotas
from sgl_multilora.sched.request import SchedRequest
from sgl_multilora.sched.wrs import WrsNormalizer, fit_normalizer

PRIOR_CUTOFFS = (1 / 64, 1 / 16, 1 / 4)
"""The prior plan's WRS cut-offs: geometric, since WRS multiplies a length term by a rank term and spans orders of
magnitude (a one-line question on a rank-8 adapter sits near 0.002 against the server's limits, a 1,500-token
prompt on the largest rank near 0.1)."""
OVERFLOW_FACTOR = 1.5
"""A plan fitted as one queue adds a queue for requests whose WRS exceeds the window's largest by this factor
(`fit_plan`)."""
MIN_SPAN_S = 1.0
"""Arrival rates are counts over at least this span, so a burst in the first instant does not
read as an infinite rate."""


@dataclass(frozen=True)
class SchedPlan:
    normalizer: WrsNormalizer
    clustering: Clustering
    quotas: QuotaPlan
    loads: tuple[QueueLoad, ...]
    fitted_at: float
    num_samples: int

    @property
    def num_queues(self) -> int:
        return self.clustering.k

    def route(self, wrs: float) -> int:
        """Queue index: 0 for WRS < B_1, i for B_i <= WRS < B_(i+1), K-1 for WRS >= B_(K-1)."""
        return bisect.bisect_right(self.clustering.cutoffs, wrs)


class FitWindow:
    """The requests a refit fits on: those that arrived in the last `config.window_s`, at most
    `config.window_size` of them, oldest first."""

    def __init__(self, config: SchedConfig) -> None:
        self.config = config
        self._requests: deque[SchedRequest] = deque(maxlen=config.window_size)

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, r: SchedRequest) -> None:
        self._requests.append(r)  # a full window drops its oldest

    def trim(self, now: float) -> None:
        """Drops the requests that arrived more than `window_s` before `now`."""
        while self._requests and self._requests[0].arrival < now - self.config.window_s:
            self._requests.popleft()

    def due(self, now: float, plan: SchedPlan, fitted: bool) -> bool:
        """Whether a refit is due: the first (`fitted` False) once the window holds `min_samples`;
        then whenever it holds twice the requests `plan` was fitted on, or `requeue_s` after it."""
        n = len(self._requests)
        if not fitted:
            return n >= self.config.min_samples
        grown = plan.num_samples > 0 and n >= 2 * plan.num_samples  # a set_plan plan has 0 samples
        return grown or now >= plan.fitted_at + self.config.requeue_s

    def fit(self, now: float, total_tokens: int) -> SchedPlan | None:
        """A plan fitted on the window; None while it holds fewer than `min_samples`."""
        if len(self._requests) < self.config.min_samples:
            return None
        return fit_plan(list(self._requests), now, self.config, total_tokens)


def single_queue_plan(config: SchedConfig, now: float = 0.0) -> SchedPlan:
    """One queue holding the whole token total (FIFO with one quota)."""
    clustering = Clustering(1, (0.0,), (), (0.0,))
    quotas = QuotaPlan((config.total_tokens,), (0,), True)
    return SchedPlan(config.initial_norm, clustering, quotas, (), now, 0)


def prior_plan(config: SchedConfig, now: float = 0.0) -> SchedPlan:
    """The plan until the window supports a fit: queues by WRS against the configured normaliser (the server's
    own limits: its context, output length and largest rank), cut at `PRIOR_CUTOFFS`, equal quotas. A fresh
    server thus admits small requests before large ones from its first request on (one FIFO queue would admit
    in arrival order); the fitted plan replaces it once `min_samples` requests arrived."""
    k = min(config.max_queues, len(PRIOR_CUTOFFS) + 1)
    if k == 1:
        return single_queue_plan(config, now)
    return fixed_plan(config, PRIOR_CUTOFFS[:k - 1], apportion(config.total_tokens, [1.0] * k), now)


def fixed_plan(config: SchedConfig, cutoffs: Sequence[float], quotas: Sequence[int],
               now: float = 0.0) -> SchedPlan:
    """A plan with given cut-offs and quotas (the paper's Static baseline: 4 queues with equal WRS
    ranges and equal tokens). Raises ValueError unless the cut-offs increase strictly and there is
    one quota per queue, each >= 0."""
    cuts = tuple(float(c) for c in cutoffs)
    if any(a >= b for a, b in pairwise(cuts)) or len(quotas) != len(cuts) + 1:
        raise ValueError(f"need strictly increasing cut-offs and one quota per queue; got "
                         f"{cuts} and {list(quotas)}")
    if min(quotas) < 0:
        raise ValueError(f"quotas must be >= 0, got {list(quotas)}")
    centroids = tuple([0.0] * (len(cuts) + 1))  # not fitted
    clustering = Clustering(len(cuts) + 1, centroids, cuts, ())
    return SchedPlan(config.initial_norm, clustering,
                     QuotaPlan(tuple(quotas), tuple([0] * len(quotas)), True), (), now, 0)


def fit_plan(window: Sequence[SchedRequest], now: float, config: SchedConfig,
             total_tokens: int) -> SchedPlan:
    """Fits a plan on `window` (recent requests, oldest first, at least one). Does not modify the
    requests: their WRS under the new normaliser is computed here, not stored."""
    norm = fit_normalizer([r.new_len for r in window], [r.pred_out_len for r in window],
                          [r.rank for r in window], config.initial_norm, config.norm_quantile)
    values = [norm.wrs(r.new_len, r.pred_out_len, r.rank) for r in window]
    clustering = _with_overflow(choose_clustering(values, config.max_queues, config.min_gain), max(values))
    span = max(MIN_SPAN_S, now - window[0].arrival)
    members: list[list[SchedRequest]] = [[] for _ in range(clustering.k)]
    for r, v in zip(window, values):
        members[bisect.bisect_right(clustering.cutoffs, v)].append(r)
    loads = tuple(_queue_load(m, span, config) for m in members)
    quotas = plan_quotas(total_tokens, loads, config.ttft_slo_s)
    return SchedPlan(norm, clustering, quotas, loads, now, len(window))


def _queue_load(members: Sequence[SchedRequest], span_s: float, config: SchedConfig) -> QueueLoad:
    if not members:
        return QueueLoad(1, config.timing.exec_s(0, 1), 0.0, 0)
    done = [r.finished_at - r.admitted_at for r in members
            if r.finished_at is not None and r.admitted_at is not None]
    if done:
        service_s = sum(done) / len(done)
    else:
        n = len(members)
        service_s = config.timing.exec_s(round(sum(r.new_len for r in members) / n),
                                         round(sum(r.pred_out_len for r in members) / n))
    return QueueLoad(
        max_cost_tokens=max(r.cost_tokens for r in members),
        service_s=service_s,
        arrival_rate=len(members) / span_s,
        demand_tokens=sum(r.cost_tokens for r in members),
    )


def _with_overflow(clustering: Clustering, top: float) -> Clustering:
    """`clustering` (when it is one queue) plus one queue above it for requests whose WRS, unclamped (routing does not cap the terms at
    the normalisers), exceeds `OVERFLOW_FACTOR` x the window's largest (`top`): a window of small requests fits
    one queue, normalised so that they span the whole range, and a large request arriving later would otherwise
    wait behind every small one queued before it in that queue's FIFO (the head-of-line blocking the queues exist
    to end). The overflow queue's quota is the minimum of an empty queue; it admits a request when nothing of it
    runs, and borrows what empty queues lend."""
    cut = OVERFLOW_FACTOR * top
    if clustering.k > 1 or cut <= 0.0:  # a window with sizes apart already has a largest queue with a real quota
        return clustering
    return Clustering(clustering.k + 1, (*clustering.centroids, cut), (*clustering.cutoffs, cut),
                      clustering.wcss_by_k)
