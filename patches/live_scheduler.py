"""`--multilora-scheduler multiqueue`: the core's `MultiQueueScheduler` (Chameleon) decides which waiting requests
SGLang's admission pass may take; SGLang still builds the batch, allocates and runs it.

Lives here: `LiveScheduler`, the scheduler process's owner of the multi-queue state (one `SchedRequest` per SGLang
request by rid). Not here: the queues, quotas, WRS, predictor and bypass rules (`sgl_multilora/sched/`, the same
objects the simulator drives), the pass-level hooks (`admission.py`), adapter memory (`unified_memory.py`).

Each admission pass:
1. requests that left SGLang's waiting queue without running (aborts) leave the queues;
2. `build_batch(now, budget)` admits requests queue by queue within their token quotas (smallest WRS first, spare
   quota lent from empty queues), the budget being what SGLang's KV pool can take now (free + evictable); a request
   whose adapter is not resident is passed over without blocking its queue, and its adapter is asked for;
3. SGLang's pass considers only those requests (others are skipped for this pass, keeping their place);
4. what SGLang did not admit after all (its own memory or batch limits) is re-queued at its arrival position.
Finished requests return their quota and teach the output-length predictor; a request SGLang retracts (decode out
of memory) is re-queued. Choices left open: bypass squashes (retracting a running request to let a bypassed one in)
are not applied live. SGLang's retraction could carry one out, but here requests are priced without their adapter
(`adapter_tokens` 0: the pool charges each resident adapter once), so the rule's test "free + footprint(R2) >=
need(R1)" cannot tell whether retracting R2 frees the adapter memory R1 waits for, and would squash on every
bypass. The rank of a base-model request is 0.
"""

from __future__ import annotations

import dataclasses
import math
import time

from sgl_multilora.patches import flags
from sgl_multilora.patches.state import process_state
from sgl_multilora.sched.config import SchedConfig
from sgl_multilora.sched.multiqueue import MultiQueueScheduler
from sgl_multilora.sched.request import SchedRequest
from sgl_multilora.sched.wrs import WrsNormalizer


class LiveScheduler:
    def __init__(self, scheduler) -> None:
        args = flags.current()
        lora = getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)
        manager = getattr(lora, "lora_manager", None)
        max_rank = int(getattr(manager, "max_lora_rank", 0) or 64)
        config = SchedConfig(total_tokens=int(scheduler.max_total_num_tokens), ttft_slo_s=args.ttft_slo_s,
                             requeue_s=args.requeue_s if args.requeue_s > 0 else math.inf,
                             overdue_s=args.overdue_s if args.overdue_s > 0 else math.inf,
                             initial_norm=WrsNormalizer(max_in_len=4096, max_out_len=1024, max_rank=max_rank))
        self.mq = MultiQueueScheduler(config)
        self.planned: set[str] | None = None  # rids the current pass may admit (None: outside a pass)
        self._planned_order: list[str] = []
        self.num_requeued = 0

    @staticmethod
    def now() -> float:
        return time.monotonic()

    # ---- arrivals and departures ----------------------------------------------------------------------------

    def on_arrival(self, req) -> None:
        """A request entered SGLang's waiting queue: a new one is priced and queued; one SGLang retracted (it was
        running) goes back to its arrival position."""
        if req.rid in self.mq.running:
            self.mq.requeue(req.rid)
            self.num_requeued += 1
            return
        if req.rid in self.mq.queues:
            return
        registry = process_state().adapters
        spec = registry.spec(req.lora_id) if getattr(req, "lora_id", None) is not None else None
        max_new = getattr(req.sampling_params, "max_new_tokens", None)
        # adapter_tokens 0: adapter memory is charged once per resident adapter by the pool (and SGLang's budget
        # sees it), not once per request; charging every request its adapter's slots throttled the plan far below
        # what the server could run (eval/results/multiqueue_live.md).
        self.mq.add(SchedRequest(req.rid, None if spec is None else spec.identity, len(req.origin_input_ids),
                                 rank=0 if spec is None else spec.rank, adapter_tokens=0,
                                 max_new_tokens=max_new, arrival=self.now()))

    def on_step(self, batch) -> None:
        for req in batch.reqs:
            if req.finished() and req.rid in self.mq.running:
                aborted = type(req.finished_reason).__name__ == "FINISH_ABORT"  # nothing to learn from
                self.mq.on_finish(req.rid, self.now(), None if aborted else len(req.output_ids))

    # ---- one admission pass -----------------------------------------------------------------------------------

    def before_pass(self, scheduler) -> None:
        waiting = {r.rid for r in scheduler.waiting_queue}
        for r in [r for q in range(self.mq.queues.num_queues) for r in self.mq.queues.scan(q)]:
            if r.rid not in waiting:
                self.mq.remove(r.rid)  # aborted while queued
        budget = int(scheduler.token_to_kv_pool_allocator.available_size() + scheduler.tree_cache.evictable_size())
        memory = process_state().memory
        is_resident = None if memory is None else memory.residency.is_resident
        prefetch = None if memory is None else (lambda identity: memory.ensure_resident(identity, None))
        batch = self.mq.build_batch(self.now(), budget, is_resident, prefetch)
        self._planned_order = [r.rid for r in batch]
        self.planned = set(self._planned_order)

    def allows(self, req) -> bool:
        """Whether SGLang's current pass may admit `req` from its waiting queue (always outside a pass)."""
        return self.planned is None or req.rid in self.planned

    def after_pass(self, admitted_rids: set[str]) -> None:
        for rid in self._planned_order:
            if rid not in admitted_rids and rid in self.mq.running:
                self.mq.requeue(rid, pushed_back=True)
                self.num_requeued += 1
        self.planned, self._planned_order = None, []

    # ---- observation ------------------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Queues (length, quota, held tokens, WRS range), cut-offs, counts and the predictor's accuracy."""
        s = self.mq.stats()
        return {
            "queues": [dataclasses.asdict(q) for q in s.queues], "cutoffs": list(s.cutoffs),
            "num_queued": s.num_queued, "num_running": s.num_running, "quotas_feasible": s.quotas_feasible,
            "promoted": list(s.promoted), "counts": s.counts, "predictor": dataclasses.asdict(s.predictor),
            "requeued_by_engine": self.num_requeued,
        }
