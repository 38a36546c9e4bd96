"""`--multilora-scheduler multiqueue`: the core's `MultiQueueScheduler` (Chameleon, sgl_multilora/sched/) decides which
waiting requests SGLang's admission pass may take; SGLang still builds the batch, allocates and runs it.

Lives here: `LiveScheduler`, the scheduler process's owner of the multi-queue state (one `SchedRequest` per SGLang
request by rid), and the translation of SGLang's objects into the core's. Not here: any scheduling rule (the core:
queues, quotas, bypass and squash, memory hold, slot squash, the squash's measured terms in `sched/bypass.py`), the
pass-level hooks (`admission.py`) or adapter memory (`unified_memory.py`).

Per admission pass (`before_pass`, `allows`, `after_pass`): requests that left SGLang's waiting queue without
running leave the queues; `build_batch` plans with the budget SGLang's KV pool can take now (free + evictable), the
memory's residency and prefetch callbacks and, with LoRA on, SGLang's adapter-slot cap (`--max-loras-per-batch`,
the base model one of its slots); SGLang's pass considers only the planned requests; what it did not take is
pushed back to its arrival position. Before the pass (`squash`), the squash rules' victims are retracted by
SGLang's own retraction and re-queued by the core before SGLang queues them again (so `on_arrival` finds them
queued): the bypass squash's with the unified pool (terms measured on `LiveMemory`; the victim's KV dropped, the
room being the point), the slot squash's with LoRA on (their KV kept in the tree, so resuming recomputes next to
nothing). Per step (`on_step`): finished requests return their quota and teach the predictor; step times feed the
timing model (`MeasuredRates`). A request's size counts the prompt tokens our tree did not hold when it arrived
(`SchedRequest.cached_len`); a base-model request's rank is 0.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import defaultdict, deque

from sgl_multilora.patches import flags
from sgl_multilora.patches.state import process_state
from sgl_multilora.sched.bypass import HeldKV, MeasuredTerms
from sgl_multilora.sched.config import SchedConfig
from sgl_multilora.sched.multiqueue import MultiQueueScheduler
from sgl_multilora.sched.request import MeasuredRates, SchedRequest, TimingModel
from sgl_multilora.sched.wrs import WrsNormalizer

logger = logging.getLogger(__name__)

TIMING_EMA = 0.2
"""Weight of the newest step in the measured prefill and decode rates."""
HOLD_LOG_AFTER_S = 1.0
"""A pass that leaves a request queued this long is logged (why each queue stopped), at most once per this many
seconds."""
RECENT_BATCHES = 64
"""Admission passes whose admitted requests `stats()` lists (`recent_batches`), newest last."""
TIMING_RESYNC = 0.05
"""The scheduler's timing model follows a measured rate once it has moved this share away from it (not every
step: a step's result should cost next to nothing)."""


class LiveScheduler:
    def __init__(self, scheduler) -> None:
        args = flags.current()
        lora = getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)
        manager = getattr(lora, "lora_manager", None)
        max_rank = int(getattr(manager, "max_lora_rank", 0) or 64)
        config = SchedConfig(total_tokens=int(scheduler.max_total_num_tokens), ttft_slo_s=args.ttft_slo_s,
                             slot_squash_share=args.slot_squash_share,
                             memory_hold_share=args.memory_hold_share if args.memory_hold_share > 0 else math.inf,
                             initial_norm=WrsNormalizer(max_in_len=4096, max_out_len=1024, max_rank=max_rank))
        self.mq = MultiQueueScheduler(config)
        cache = getattr(scheduler, "tree_cache", None)
        self._cached_len = getattr(cache, "cached_len", None)  # our radix cache's; None: another cache
        self.planned: set[str] | None = None  # rids the current pass may admit (None: outside a pass)
        self._planned_order: list[str] = []
        self.recent_batches: deque[list[str]] = deque(maxlen=RECENT_BATCHES)  # rids each pass admitted, oldest first
        self.num_requeued = 0
        self.num_squashed = 0
        self._pushed_back = 0  # planned requests SGLang did not take in the last pass
        self._last_hold_log = -math.inf
        self._last_step_s: float | None = None  # when the previous step's result came in, if work went on after it
        self._rates = MeasuredRates(TIMING_EMA)

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
        # what the server could run.
        # cached_len: a follow-up turn whose history is cached brings only its new tokens (request.py)
        in_len = len(req.origin_input_ids)
        cached = min(in_len - 1, self._cached_len(req)) if self._cached_len is not None and in_len else 0
        self.mq.add(SchedRequest(req.rid, None if spec is None else spec.identity, in_len,
                                 rank=0 if spec is None else spec.rank, adapter_tokens=0,
                                 max_new_tokens=max_new, arrival=self.now(), cached_len=cached))

    def on_step(self, batch, busy: bool) -> None:
        """A step's result: finished requests leave (teaching the predictor); the step's time is measured when the
        previous step was `busy` (work went on after it), so idle gaps never count."""
        for req in batch.reqs:
            if req.finished() and req.rid in self.mq.running:
                aborted = type(req.finished_reason).__name__ == "FINISH_ABORT"  # nothing to learn from
                self.mq.on_finish(req.rid, self.now(), None if aborted else len(req.output_ids))
        now = time.perf_counter()
        last, self._last_step_s = self._last_step_s, (now if busy else None)
        if last is None:
            return
        mode = batch.forward_mode
        if mode.is_decode():
            self._rates.observe_decode(now - last)
        elif mode.is_extend():
            self._rates.observe_prefill(now - last, int(getattr(batch, "extend_num_tokens", 0) or 0))
        else:
            return
        applied, measured = self.mq.config.timing, self._rates.rates()
        if any(abs(v - getattr(applied, k)) > TIMING_RESYNC * getattr(applied, k) for k, v in measured.items()):
            self.mq.config = dataclasses.replace(self.mq.config, timing=self.timing())  # only on a real change

    def timing(self) -> TimingModel:
        """The core's timing model on the measured rates (its defaults where none is measured yet)."""
        return dataclasses.replace(TimingModel(), **self._rates.rates())

    # ---- one admission pass -----------------------------------------------------------------------------------

    def _identity(self, req) -> str | None:
        lora_id = getattr(req, "lora_id", None)
        return process_state().adapters.identity(lora_id) if lora_id is not None else None

    @staticmethod
    def slot_cap(scheduler) -> int | None:
        """SGLang's cap on distinct adapters per batch (None with LoRA off)."""
        return int(scheduler.max_loras_per_batch) if getattr(scheduler, "enable_lora", False) else None

    def before_pass(self, scheduler, running: list, batch_full: bool = False) -> None:
        """Plans this pass; `running`: the running batch's unfinished requests and the chunked one; `batch_full`:
        SGLang's running batch is marked full (for the log)."""
        waiting = {r.rid for r in scheduler.waiting_queue}
        for r in [r for q in range(self.mq.queues.num_queues) for r in self.mq.queues.scan(q)]:
            if r.rid not in waiting:
                self.mq.remove(r.rid)  # aborted while queued
        budget = int(scheduler.token_to_kv_pool_allocator.available_size() + scheduler.tree_cache.evictable_size())
        memory = process_state().memory
        is_resident = None if memory is None else memory.residency.is_resident
        prefetch = None if memory is None else self._prefetch
        cap = self.slot_cap(scheduler)
        adapters = None if cap is None else {self._identity(r) for r in running}
        now = self.now()
        batch = self.mq.build_batch(now, budget, is_resident, prefetch, adapters, cap)
        self._planned_order = [r.rid for r in batch]
        self.planned = set(self._planned_order)
        self._log_hold(now, len(batch), budget, len(running), adapters, cap, batch_full)

    def _log_hold(self, now: float, num_planned: int, budget: int, num_running: int, adapters: set | None,
                  cap: int | None, batch_full: bool) -> None:
        """One line, at most every `HOLD_LOG_AFTER_S`, on a pass that leaves a request queued that long: what the
        plan took, what each queue stopped at, what was passed over, and what SGLang refused of the previous plan
        (`batch_full`: SGLang's running batch is marked full, so it takes no one until a request leaves)."""
        queues = self.mq.queues
        heads = [queues.head(q) for q in range(queues.num_queues)]
        oldest = min((r.arrival for r in heads if r is not None), default=None)
        if oldest is None or now - oldest < HOLD_LOG_AFTER_S or now - self._last_hold_log < HOLD_LOG_AFTER_S:
            return
        self._last_hold_log = now
        stops = "; ".join(f"queue {q} {st.reason} at {st.rid} (cost {st.cost}, {st.limit} left)"
                          for q, st in sorted(self.mq.last_stops.items())) or "no queue stopped"
        passes = self.mq.last_passes
        slots = "" if cap is None else f", adapter slots {len(adapters)}/{cap}"
        logger.info("sgl_multilora: multiqueue holds %d queued (oldest %.1f s): planned %d, %d running, budget %d "
                    "tokens%s%s; %s; passed over: %d for a slot, %d while their adapter loads; SGLang refused %d "
                    "of the previous plan", len(queues), now - oldest, num_planned, num_running, budget, slots,
                    ", SGLang's batch full" if batch_full else "", stops, passes["slot"], passes["not_resident"],
                    self._pushed_back)

    @staticmethod
    def _label(identity: str | None) -> str:
        """An adapter as the log names it: its registered name (the identity is a content hash), else the hash's
        first 12 digits; "base" for the base model."""
        if identity is None:
            return "base"
        found = process_state().adapters.find(identity=identity)
        return found[1].name if found is not None else identity[:12]

    @staticmethod
    def _prefetch(identity: str) -> bool:
        """The plan's load of a queued request's adapter: False only when no room can be made (the bypass
        trigger); a load under way is not blocked. An adapter made resident now is pinned until the pass ends
        (`LiveMemory.set_running` then reads the pins off the batches), so that no later load of the same plan
        evicts it before its request is admitted: unpinned, plans that asked for more adapters than fit evicted
        each other's, every pass."""
        memory = process_state().memory
        if memory.ensure_resident(identity, None):
            memory.residency.acquire(identity)
            return True
        return memory.residency.is_loading(identity)

    def squash(self, scheduler, running_batch) -> list:
        """Retracts the running requests the squash rules take back now (module docstring); returns them."""
        if running_batch is None:
            return []
        return self._memory_squash(scheduler, running_batch) + self._slot_squash(scheduler, running_batch)

    def _retract(self, scheduler, running_batch, victims: list, keep_kv: bool = False) -> None:
        """SGLang's retraction of running requests, without evicting for the others' decode. `keep_kv`: their KV
        (prompt and the tokens streamed so far) goes into the tree first, as a finished request's does, so that a
        resumed request matches it and recomputes next to nothing (evictable like any cached KV); SGLang's own
        retraction drops it, which a memory squash wants (the room is the point)."""
        if keep_kv:
            from sglang.srt.mem_cache.common import release_kv_cache

            for req in victims:
                release_kv_cache(req, running_batch.tree_cache, checkpoint=True)
                req.reset_for_retract()
        else:
            for req in victims:
                running_batch.release_req(running_batch.reqs.index(req), 0, offload_kv=False)
        running_batch.filter_batch(reqs_to_exclude=victims)
        running_batch.batch_is_full = False

    def _memory_squash(self, scheduler, running_batch) -> list:
        """The bypass squash with the unified pool: its terms measured on the pool (`MeasuredTerms`). A request
        outside the decode batch (a chunked prefill in progress) is described as None: never a victim."""
        memory = process_state().memory
        if memory is None or not len(self.mq.bypass):
            return []
        reqs = {r.rid: r for r in running_batch.reqs if not r.finished() and r.kv.holds_kv}

        def held(rid: str) -> HeldKV | None:
            req = reqs.get(rid)
            if req is None:
                return None
            return HeldKV(self._identity(req), int(req.kv.kv_allocated_len), int(req.kv.cache_protected_len),
                          req.lock.node if req.lock is not None else None)

        terms = MeasuredTerms(memory, held)
        victims = []
        for sq in self.mq.squash_candidates(terms.free, terms.footprint, terms.need):
            req = reqs.get(sq.victim.rid)
            if req is not None:
                victims.append((req, sq.beneficiary.rid))
        if not victims:
            return []
        self._retract(scheduler, running_batch, [req for req, _ in victims])
        for req, beneficiary in victims:
            self.mq.requeue(req.rid, squash=True)  # before SGLang queues it, so `on_arrival` finds it queued
            self.num_squashed += 1
            scheduler._add_request_to_queue(req, is_retracted=True)
            logger.info("sgl_multilora: squashed request %s (it bypassed %s, whose adapter now fits)",
                        req.rid, beneficiary)
        return [req for req, _ in victims]

    def _slot_squash(self, scheduler, running_batch) -> list:
        cap = self.slot_cap(scheduler)
        if cap is None:
            return []
        by_adapter: dict[str | None, list] = defaultdict(list)
        for req in running_batch.reqs:
            if not req.finished():
                by_adapter[self._identity(req)].append(req)
        excluded = set()
        chunked = scheduler.chunked_req
        if chunked is not None:  # holds its adapter's slot until its prefill and decode end; never squashed
            excluded.add(self._identity(chunked))
            by_adapter[self._identity(chunked)].append(chunked)
        if len(by_adapter) < cap:
            return []
        by_rid = {req.rid: req for reqs in by_adapter.values() for req in reqs}
        memory = process_state().memory

        def recompute(r: SchedRequest) -> int:
            req = by_rid[r.rid]
            return len(req.origin_input_ids) + len(req.output_ids)

        squash = self.mq.slot_squashes.choose(
            self.now(), {a: [r.rid for r in reqs] for a, reqs in by_adapter.items()}, cap, recompute,
            None if memory is None else memory.residency.is_resident, excluded,
            None if memory is None else self._prefetch)
        if squash is None:
            return []
        victims = [by_rid[r.rid] for r in squash.victims]
        if not all(req.kv.holds_kv for req in victims):
            return []  # one of them is between states: the rule is asked again next pass
        self._retract(scheduler, running_batch, victims, keep_kv=True)
        self.mq.slot_squashes.commit(squash)  # before SGLang queues them, so `on_arrival` finds them queued
        for req in victims:
            scheduler._add_request_to_queue(req, is_retracted=True)
        logger.info("sgl_multilora: squashed %d request(s) of adapter %s for request %s's adapter slot "
                    "(a slot would have freed in %.1f s)", len(victims), self._label(squash.adapter),
                    squash.beneficiary.rid, squash.wait_s)
        return victims

    def order(self, waiting_queue: list) -> None:
        """Sorts SGLang's waiting queue in place: this pass's planned requests first, in the plan's order; the
        rest keep SGLang's order after them (a stable sort). Outside a pass, nothing changes."""
        if not self._planned_order:
            return
        rank = {rid: i for i, rid in enumerate(self._planned_order)}
        waiting_queue.sort(key=lambda req: rank.get(req.rid, len(rank)))

    def allows(self, req) -> bool:
        """Whether SGLang's current pass may admit `req` from its waiting queue (always outside a pass)."""
        return self.planned is None or req.rid in self.planned

    def after_pass(self, admitted_rids: set[str]) -> None:
        if admitted_rids:
            self.recent_batches.append(sorted(admitted_rids))
        self._pushed_back = 0
        overtaken = not admitted_rids.isdisjoint(self._planned_order)  # SGLang took some of the plan
        for rid in self._planned_order:
            if rid not in admitted_rids and rid in self.mq.running:
                self.mq.requeue(rid, pushed_back=True, overtaken=overtaken)
                self.num_requeued += 1
                self._pushed_back += 1
        self.planned, self._planned_order = None, []

    # ---- observation ------------------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Queues (length, quota, held tokens, WRS range), cut-offs, counts and the predictor's accuracy."""
        s = self.mq.stats()
        return {
            "queues": [dataclasses.asdict(q) for q in s.queues], "cutoffs": list(s.cutoffs),
            "num_queued": s.num_queued, "num_running": s.num_running, "quotas_feasible": s.quotas_feasible,
            "promoted": list(s.promoted), "counts": s.counts, "predictor": dataclasses.asdict(s.predictor),
            "requeued_by_engine": self.num_requeued, "squashed": self.num_squashed,
            "slot_squashed": s.counts["slot_squashed"], "slot_reserved_for": self.mq.slot_squashes.reserved_for,
            "timing": dataclasses.asdict(self.timing()),
            "last_stops": {str(q): dataclasses.asdict(st) for q, st in sorted(self.mq.last_stops.items())},
            "recent_batches": list(self.recent_batches),
        }
