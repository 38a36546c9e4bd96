"""The project's multi-queue scheduler (Chameleon) as the simulator's admission policy: the real
`sgl_multilora.sched.MultiQueueScheduler`, not a copy, driven the way `patches/live_scheduler.py` drives it live.

Lives here: `MultiQueueAdmission`, the simulator's owner of one `MultiQueueScheduler` (one `SchedRequest` per
simulated request, by rid). Not here: queues, WRS, quotas, predictor and bypass rules (`sgl_multilora/sched/`),
the pass (engine.py) or memory (the system answers the residency and prefetch callbacks).

As live: a request is priced and queued on arrival (rank = its adapter's, 0 for the base model; its cached_len what
the system's tree holds of its prompt then, as the live hook matches its own tree; adapter_tokens 0,
since the pool charges an adapter once, not per request; max_new_tokens = its output length, which the live
driver sends too, so the prediction is capped by the true length); each pass calls `build_batch(now, budget,
is_resident, prefetch)`; what the engine did not admit after all is re-queued at its arrival position; a finished
request returns its quota and teaches the predictor its output length.
Choices of the simulator, each a departure from the live hook:
- memory squashes (the bypass rule's) are not applied: the engine reserves KV for a request's whole prompt and
  output at admission (engine.py), so a bypassing request never holds memory a blocked one could use later;
- with SGLang's per-batch adapter cap (`SimConfig.max_loras_per_batch`; none by default) the plan counts slots and
  the slot squash (sgl_multilora/sched/rules/slot_squash.py) runs before each pass as live: the victims are decoding requests
  (`EngineView.retract`: their KV so far cached, resumed by prefilling it), never an adapter with a request still
  prefilling (live: the chunked request's adapter);
- the pass walks the plan in the scheduler's order (smallest-WRS queue first), where the live hook can only filter
  SGLang's FCFS walk; the plan is the scheduler's decision, order included (Algorithm 1 builds the batch queue by
  queue);
- the budget is what the engine can take this pass: the memory it can give (free, evictable KV and, on one pool,
  idle adapters' slots: `admission_room`, as live) and at most
  one chunk of prefill backlog (chunk_tokens - backlog) plus the largest request's cost, in cost tokens. The
  engine then applies no backlog limit of its own, so a pass re-queues almost nothing (a re-queue costs
  O(queue length) in `QueueSet.push_in_order`). The extra largest cost keeps every budget above every cost: the
  premise of the scheduler's starvation bound (sgl_multilora/sched/multiqueue.py).
- the scheduler's timing model (T_exec, and D before a queue has finished requests) takes the latency model's
  figures: prefill at its large-batch rate, decode at one adapter request's step time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from eval.sim.admission.base import BaseAdmission
from sgl_multilora.sched import (
    MultiQueueScheduler,
    SchedConfig,
    SchedRequest,
    TimingModel,
    WrsNormalizer,
)

from eval.sim.lora_cost import ALL_GROUPS

if TYPE_CHECKING:
    from eval.sim.systems.request import SimRequest


class MultiQueueAdmission(BaseAdmission):
    name = "multiqueue"
    checks_backlog = False

    def __init__(self, system, lat, config, requests) -> None:
        super().__init__(system, lat, config, requests)
        max_rank = max((a.rank for a in system.adapters.values()), default=0) or 64
        min_rank = min((a.rank for a in system.adapters.values()), default=0) or 8
        # a decode step of one token through the smallest adapter on every module
        timing = TimingModel(prefill_s_per_token=lat.recompute_s_per_token(),
                             decode_s_per_token=lat.step_time(0, 0, 1, 0, [(1, min_rank, ALL_GROUPS, 0)]))
        sched_config = SchedConfig(total_tokens=system.kv_pool.num_slots, ttft_slo_s=config.ttft_slo_s,
                                   initial_norm=WrsNormalizer(max_in_len=4096, max_out_len=1024,
                                                              max_rank=max_rank),
                                   timing=timing, slot_squash_share=config.slot_squash_share,
                                   max_slot_squashes=config.max_slot_squashes)
        self.mq = MultiQueueScheduler(sched_config)
        self.max_cost = max((len(sr.prompt) + len(sr.output) for sr in requests), default=1)
        self.by_rid: dict[str, SimRequest] = {}
        self.planned: list[SimRequest] = []
        self.running_adapters: set[str | None] = set()  # those of the engine's batch (with a slot cap), per pass
        self.num_passes = 0
        self.num_requeued = 0

    def on_arrival(self, sr: SimRequest, now: float) -> None:
        name = sr.req.adapter
        rank = 0 if name is None else self.system.adapters[name].rank
        self.by_rid[sr.req.rid] = sr
        tree = self.system.tree
        cached = 0 if tree is None else tree.match(self.system.key(sr, sr.prompt[:-1]), touch=False).prefix_len
        self.mq.add(SchedRequest(sr.req.rid, name, len(sr.prompt), rank=rank, adapter_tokens=0,
                                 max_new_tokens=len(sr.output), arrival=sr.submit_s, cached_len=cached))

    def before_pass(self, loop, now: float) -> None:
        """The slot squash, with a cap on adapters per batch (module docstring)."""
        cap = self.cfg.max_loras_per_batch
        if cap is None:
            return
        running = loop.running_by_adapter()
        self.running_adapters = set(running)
        if len(running) < cap:
            return
        excluded = {a for a, srs in running.items() if any(sr.decode_seq < 0 for sr in srs)}
        by_rid = {sr.req.rid: sr for srs in running.values() for sr in srs}

        def recompute(r: SchedRequest) -> int:
            sr = by_rid[r.rid]
            return len(sr.prompt) + loop.generated(sr)

        squash = self.mq.slot_squashes.choose(now, {a: [sr.req.rid for sr in srs] for a, srs in running.items()},
                                              cap, recompute, self.system.residency.is_resident, excluded,
                                              self._prefetch)
        if squash is None:
            return
        loop.retract([by_rid[r.rid] for r in squash.victims])
        self.mq.slot_squashes.commit(squash)
        self.running_adapters.discard(squash.adapter)

    def candidates(self, waiting: list[SimRequest], now: float, backlog: int) -> list[SimRequest]:
        system = self.system
        budget = max(0, min(system.admission_room(), self.cfg.chunk_tokens - backlog + self.max_cost))
        cap = self.cfg.max_loras_per_batch
        batch = self.mq.build_batch(now, budget, system.residency.is_resident, self._prefetch,
                                    self.running_adapters if cap is not None else None, cap)
        self.num_passes += 1
        self.planned = [self.by_rid[r.rid] for r in batch]
        return self.planned

    def _prefetch(self, name: str) -> bool:
        """True if `name` is loading or a load started now; False if no room can be made for it now."""
        res = self.system.residency
        return res.is_loading(name) or res.is_resident(name) or self.system.start_load(name)

    def after_pass(self, admitted: set[SimRequest], now: float) -> None:
        for sr in self.planned:
            if sr not in admitted:
                self.mq.requeue(sr.req.rid, pushed_back=True)
                self.num_requeued += 1
        self.planned = []

    def on_finish(self, sr: SimRequest, now: float) -> None:
        self.mq.on_finish(sr.req.rid, now, sr.output_tokens)
        del self.by_rid[sr.req.rid]

    def check_invariants(self, waiting: list[SimRequest]) -> None:
        self.mq.check_invariants()
        queued = {r.rid for q in range(self.mq.queues.num_queues) for r in self.mq.queues.scan(q)}
        assert queued == {sr.req.rid for sr in waiting}, "scheduler queues and the engine's waiting list differ"
        assert set(self.mq.running) | queued == set(self.by_rid), "a request left the scheduler unfinished"

