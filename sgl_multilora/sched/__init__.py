"""Adapter-aware scheduling (Chameleon): WRS, output-length prediction, k-means queues, quotas,
multi-queue batch building with bypass and squash.

Lives here: the engine-agnostic core, plain Python (no sglang, no torch), driven by a live SGLang
hook and by the simulator alike. Not here: memory or adapter loading (callers answer "is this
adapter resident" and start prefetches through callbacks) and SGLang's request objects.
Module map: request (SchedRequest, TimingModel, MeasuredRates), wrs, predictor, kmeans, quotas, plan, queues,
admission (one queue's scan), bypass (Chameleon's bypass and squash), slots (the adapter-slot cap), config, stats,
multiqueue (MultiQueueScheduler: Algorithm 1), rules/ (the rules beyond the paper: memory hold, slot squash,
budget promotion).
"""

from __future__ import annotations

from sgl_multilora.sched.admission import IsResident, RequestPrefetch
from sgl_multilora.sched.bypass import HeldKV, MeasuredTerms, RoomView, SquashInfo
from sgl_multilora.sched.config import SchedConfig
from sgl_multilora.sched.kmeans import Clustering, choose_clustering, kmeans_1d
from sgl_multilora.sched.multiqueue import MultiQueueScheduler
from sgl_multilora.sched.plan import SchedPlan, fit_plan
from sgl_multilora.sched.predictor import OutputLengthPredictor, PredictorStats
from sgl_multilora.sched.quotas import QueueLoad, QuotaPlan, plan_quotas
from sgl_multilora.sched.request import MeasuredRates, SchedRequest, TimingModel
from sgl_multilora.sched.stats import QueueInfo, SchedStats
from sgl_multilora.sched.wrs import WrsNormalizer, fit_normalizer

__all__ = [
    "Clustering", "HeldKV", "IsResident", "MeasuredRates", "MeasuredTerms", "MultiQueueScheduler",
    "OutputLengthPredictor", "PredictorStats", "QueueInfo", "QueueLoad", "QuotaPlan", "RequestPrefetch", "RoomView", "SchedConfig", "SchedPlan",
    "SchedRequest", "SchedStats", "SquashInfo", "TimingModel", "WrsNormalizer",
    "choose_clustering", "fit_normalizer", "fit_plan", "kmeans_1d", "plan_quotas",
]
