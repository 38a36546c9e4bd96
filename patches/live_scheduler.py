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
   with LoRA on, the batch's adapter slots are counted as SGLang counts them (`--max-loras-per-batch`
   distinct adapters, the base model one of them): a request that would need a slot none is left for is
   passed over, keeping its place;
3. SGLang's pass considers only those requests (others are skipped for this pass, keeping their place);
4. what SGLang did not admit after all (its own memory or batch limits) is re-queued at its arrival position.
Finished requests return their quota and teach the output-length predictor; a request SGLang retracts (decode out
of memory) is re-queued. The rank of a base-model request is 0; a request's size counts the prompt tokens our tree
did not hold when it arrived (`SchedRequest.cached_len`: a follow-up turn with its history cached is small). The
timing model (T_exec and T_wait of the bypass rule, a queue's service time before any of its requests finished) runs
on this server's measured figures: the time between consecutive steps while busy, per token over recent extend steps
(token-weighted, `MeasuredRates` says why) and per decode step (`TIMING_EMA`), starting from the core's defaults until
the first step of each kind is measured.

Squashes (Chameleon's bypass rule, `sgl_multilora/sched/bypass.py`), before each pass with the unified pool: a
running request R2 that bypassed a queued R1 (R1's adapter could not be made resident even after evicting every
idle adapter) is retracted when free memory is short of what R1 waits for but would cover it without R2. Live, the
rule's terms are measured, not predicted, because requests are priced without their adapter (`adapter_tokens` 0:
the pool charges each resident adapter once):
- free = `LiveMemory.room()`: free slots, unlocked KV and reclaimable adapters (what `make_room` can reach);
- need(R1) = its prompt + its adapter's slots and the swapper's headroom while the adapter is not resident;
- footprint(R2) = `room_without(R2) - room()`: the KV only R2 holds, the tree KV only its lock pins and, when no
  other running request uses it, its adapter.
The retraction is SGLang's own (`ScheduleBatch.release_req`, then `filter_batch`, then `_add_request_to_queue`
as a retracted request), so R2 resumes later by recomputing its prompt and the tokens it already streamed, exactly
as after SGLang's out-of-memory retraction; the core re-queues it at its arrival position and squashes a request
at most `max_squashes` times. Not modelled: whether the freed slots form the runs an adapter load needs (the
loader then frees one more run itself, `Swapper.load`); a squash that did not help is bounded by that limit.

Slot squashes (`sgl_multilora/sched/slots.py`), before each pass with LoRA on: when every adapter slot of the batch
is taken and the oldest queued request that needs a new one would miss its TTFT SLO waiting, the running requests
of the adapter cheapest to recompute (prompt + output tokens) are retracted, and the freed slot is reserved for that
request. Their KV stays in the tree (memory is not what they are retracted for), so resuming recomputes next to
nothing unless it was evicted meanwhile. While every slot is taken, the plan loads no adapter (a load would serve a
request that cannot run); the squash itself loads the adapter of the request it fires for, if that is not resident.
Not squashed: the adapter of a chunked prefill in progress. SGLang's pinned adapters are not modelled (with pinned
adapters its check can refuse what the plan admits; the refused request is pushed back and keeps its place).

Room squashes (`sgl_multilora/sched/room.py`, `--multilora-room-squash-share`), with the unified pool: when the oldest
fresh queued request has waited that share of the SLO and the pool's room (as for the bypass squash) lacks what it
needs (prompt less its cached prefix, predicted output, its adapter while not resident), and the running requests
ending at the measured decode step would not free it within the SLO, the decodes with the most remaining tokens are
retracted, their KV kept in the tree as for a slot squash (so the room they free is evictable cache, reclaimed in
score order), and the next pass admits that request alone.

Queued prefixes (`--multilora-protect-queued-kv`), with the unified pool: while anything runs, the budget a pass plans
with leaves out the unlocked KV that waiting requests' prefixes match (`Swapper.wanted_kv_slots`, the KV the swapper
evicts last), so that a request admitted ahead of a queued follow-up turn does not take its history and make it
recompute what it would have reused; the room comes from running requests ending instead. With nothing running the
whole budget counts (waiting would free nothing). A planned request's own prefix is among those left out, but its
cost does not count it either (it reuses it).

Slot drains (slots.py, rule 3; `--multilora-slot-drain-share`) live in the plan alone: the drained adapter's queued
requests are not planned, so SGLang's pass does not take them, and nothing is retracted. They serve the requests no
squash serves, above all the squash's own victims: without the drain, under sustained load (every running adapter
receiving requests), a retracted request can wait for a slot as long as the stream lasts.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections import defaultdict

from sgl_multilora.patches import flags
from sgl_multilora.patches.state import process_state
from sgl_multilora.sched.config import SchedConfig
from sgl_multilora.sched.multiqueue import MultiQueueScheduler
from sgl_multilora.sched.request import MeasuredRates, SchedRequest, TimingModel
from sgl_multilora.sched.room import RoomVictim
from sgl_multilora.sched.wrs import WrsNormalizer

logger = logging.getLogger(__name__)

TIMING_EMA = 0.2
"""Weight of the newest step in the measured prefill and decode rates."""
HOLD_LOG_AFTER_S = 1.0
"""A pass that leaves a request queued this long is logged (why each queue stopped), at most once per this many
seconds."""
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
                             requeue_s=args.requeue_s if args.requeue_s > 0 else math.inf,
                             overdue_s=args.overdue_s if args.overdue_s > 0 else math.inf,
                             slot_squash_share=args.slot_squash_share, max_slot_squashes=args.max_slot_squashes,
                             slot_drain_share=args.slot_drain_share if args.slot_drain_share > 0 else math.inf,
                             memory_hold_share=args.memory_hold_share if args.memory_hold_share > 0 else math.inf,
                             memory_hold_backfill=args.hold_backfill,
                             room_squash_share=args.room_squash_share if args.room_squash_share > 0 else math.inf,
                             initial_norm=WrsNormalizer(max_in_len=4096, max_out_len=1024, max_rank=max_rank))
        self.mq = MultiQueueScheduler(config)
        cache = getattr(scheduler, "tree_cache", None)
        self._cached_len = getattr(cache, "cached_len", None)  # our radix cache's; None: another cache
        self.planned: set[str] | None = None  # rids the current pass may admit (None: outside a pass)
        self._planned_order: list[str] = []
        self.num_requeued = 0
        self.num_squashed = 0
        self._pushed_back = 0  # planned requests SGLang did not take in the last pass
        self._last_hold_log = -math.inf
        self._last_step_s: float | None = None  # when the previous step's result came in, if work went on after it
        self._rates = MeasuredRates(TIMING_EMA)
        self._protect_queued_kv = args.protect_queued_kv

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
        if memory is not None and running and self._protect_queued_kv:
            budget = max(0, budget - memory.swapper.wanted_kv_slots())  # module docstring: queued prefixes
        is_resident = None if memory is None else memory.residency.is_resident
        prefetch = None if memory is None else self._prefetch
        cap = self.slot_cap(scheduler)
        adapters = None if cap is None else {self._identity(r) for r in running}
        now = self.now()
        batch = self.mq.build_batch(now, budget, is_resident, prefetch, adapters, cap,
                                    None if memory is None else self._adapter_tokens)
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
        drain = self.mq.slot_drain
        if drain is not None:
            slots += (f", draining adapter {self._label(drain.adapter)} for {drain.beneficiary} "
                      f"({now - drain.started_at:.1f} s)")
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
    def _adapter_tokens(identity: str) -> int:
        """The token slots an adapter takes when resident in the unified pool (the memory hold's backfill counts
        them; the pass's budget counts an idle resident adapter's slots as evictable)."""
        residency = process_state().memory.residency
        return residency.entry(identity).num_slots if identity in residency else 0

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
        taken = self._memory_squash(scheduler, running_batch) + self._slot_squash(scheduler, running_batch)
        return taken or self._room_squash(scheduler, running_batch)  # one reservation for the next pass at most

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
        memory = process_state().memory
        if memory is None or not len(self.mq.bypass):
            return []
        reqs = {r.rid: r for r in running_batch.reqs if not r.finished() and r.kv.holds_kv}
        identity = self._identity
        room = memory.room()

        def footprint(r: SchedRequest) -> int:
            req = reqs.get(r.rid)
            if req is None:
                return 0  # not in the decode batch (a chunked prefill in progress): not squashed
            owned = max(0, int(req.kv.kv_allocated_len) - int(req.kv.cache_protected_len))
            node = req.lock.node if req.lock is not None else None
            return memory.room_without(identity(req), node, owned) - room

        def need(r: SchedRequest) -> int:
            return r.in_len + memory.slots_to_start(r.adapter)

        victims = []
        for sq in self.mq.squash_candidates(room, footprint, need):
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

    def _room_squash(self, scheduler, running_batch) -> list:
        """The room squash (module docstring; `sgl_multilora/sched/room.py`): with the unified pool, room and
        footprints are the pool's, as for the bypass squash; a victim's remaining time is its remaining tokens
        (the predicted output, capped by `max_new_tokens`) at the measured decode step."""
        memory = process_state().memory
        if memory is None or math.isinf(self.mq.config.room_squash_share) or not running_batch.reqs:
            return []
        reqs = {r.rid: r for r in running_batch.reqs
                if not r.finished() and r.kv.holds_kv and r is not scheduler.chunked_req}
        identity, room = self._identity, functools.cache(memory.room)  # read once, and only if a request qualifies
        step_s = self.mq.config.timing.decode_s_per_token

        def need(r: SchedRequest) -> int:
            return r.new_len + r.pred_out_len + memory.slots_to_start(r.adapter)

        def victims() -> list[RoomVictim]:
            out = []
            for rid, sr in self.mq.running.items():
                req = reqs.get(rid)
                if req is None:
                    continue  # not in the decode batch (a chunked prefill in progress, between states)
                produced = len(req.output_ids)
                cap = getattr(req.sampling_params, "max_new_tokens", None)
                left = max(1, sr.pred_out_len - produced)
                if cap is not None:
                    left = max(0, min(left, int(cap) - produced))
                owned = max(0, int(req.kv.kv_allocated_len) - int(req.kv.cache_protected_len))
                node = req.lock.node if req.lock is not None else None
                footprint = memory.room_without(identity(req), node, owned) - room()
                out.append(RoomVictim(sr, footprint, left * step_s, decoding=produced > 0))
            return out

        squash = self.mq.room_squash(self.now(), room, need, victims)
        if squash is None:
            return []
        retracted = [reqs[r.rid] for r in squash.victims]
        self._retract(scheduler, running_batch, retracted, keep_kv=True)
        self.mq.commit_room_squash(squash)  # before SGLang queues them, so `on_arrival` finds them queued
        for req in retracted:
            scheduler._add_request_to_queue(req, is_retracted=True)
        logger.info("sgl_multilora: squashed %d running request(s) for request %s's KV room (%d slots short; "
                    "running requests ending would have freed them in %.1f s)", len(retracted),
                    squash.beneficiary.rid, squash.shortfall, squash.wait_s)
        return retracted

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

        squash = self.mq.slot_squash(self.now(), {a: [r.rid for r in reqs] for a, reqs in by_adapter.items()},
                                     cap, recompute, None if memory is None else memory.residency.is_resident,
                                     excluded, None if memory is None else self._prefetch)
        if squash is None:
            return []
        victims = [by_rid[r.rid] for r in squash.victims]
        if not all(req.kv.holds_kv for req in victims):
            return []  # one of them is between states: the rule is asked again next pass
        self._retract(scheduler, running_batch, victims, keep_kv=True)
        self.mq.commit_slot_squash(squash)  # before SGLang queues them, so `on_arrival` finds them queued
        for req in victims:
            scheduler._add_request_to_queue(req, is_retracted=True)
        logger.info("sgl_multilora: squashed %d request(s) of adapter %s for request %s's adapter slot "
                    "(a slot would have freed in %.1f s)", len(victims), self._label(squash.adapter),
                    squash.beneficiary.rid, squash.wait_s)
        return victims

    def allows(self, req) -> bool:
        """Whether SGLang's current pass may admit `req` from its waiting queue (always outside a pass)."""
        return self.planned is None or req.rid in self.planned

    def after_pass(self, admitted_rids: set[str]) -> None:
        self._pushed_back = 0
        for rid in self._planned_order:
            if rid not in admitted_rids and rid in self.mq.running:
                self.mq.requeue(rid, pushed_back=True)
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
            "slot_squashed": s.counts["slot_squashed"], "slot_reserved_for": self.mq.slot_reserved_for,
            "room_reserved_for": self.mq.room_reserved_for,
            "timing": dataclasses.asdict(self.timing()),
            "last_stops": {str(q): dataclasses.asdict(st) for q, st in sorted(self.mq.last_stops.items())},
            "slot_drain": None if self.mq.slot_drain is None else dataclasses.asdict(self.mq.slot_drain),
        }
