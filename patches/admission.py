"""Hooks on SGLang's admission pass and step loop, shared by the unified pool (`unified_memory.LiveMemory`) and
the multi-queue scheduler (`live_scheduler.LiveScheduler`): each hook translates SGLang's objects and asks the
process's owners (`state.py`), which exist only when their flags are on.

Per admission pass (`Scheduler.get_new_batch_prefill`): before it, the memory pins the adapters of running
requests and runs the idle swapper, the multi-queue scheduler retracts what its squash rules take back (adapter
memory, adapter slots) and plans which waiting requests the pass may take; during it, a request outside the plan
or whose adapter is not resident is skipped (`can_schedule_lora_req`, `PrefillAdder.add_one_req`); after it, the
memory re-reads the running adapters and the scheduler re-queues what SGLang did not admit. Per step
(`process_batch_result`): step statistics, finished requests, test-mode invariants.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from sgl_multilora.patches import flags, remote_admission
from sgl_multilora.patches.state import process_state
from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

from sgl_multilora.admission_gate import InfeasibleRequest

logger = logging.getLogger(__name__)


def _scheduler_owner(scheduler):
    """The process's `LiveScheduler` with `--multilora-scheduler multiqueue` (made on first use), else None."""
    state = process_state()
    if state.scheduler is None and flags.current().scheduler == "multiqueue":
        from sgl_multilora.patches.live_scheduler import LiveScheduler

        state.scheduler = LiveScheduler(scheduler)
    return state.scheduler


def _running(scheduler, running_batch) -> list:
    reqs = [r for r in running_batch.reqs if not r.finished()]
    return reqs + ([scheduler.chunked_req] if scheduler.chunked_req is not None else [])


def get_new_batch_prefill(original, self, running_batch):
    mem, sched = process_state().memory, _scheduler_owner(self)
    if mem is None and sched is None:
        return original(self, running_batch)
    if mem is not None:
        # under the overlap scheduler the last batch's forward may still run: moves wait for its stream
        mem.allow_kv_moves(not flags.current().disable_kv_moves,
                           after=getattr(self, "forward_stream", None) if self.enable_overlap else None)
        mem.before_prefill_pass(_running(self, running_batch), {r.rid for r in self.waiting_queue})
        mem.set_wanted(self.waiting_queue)
    if sched is not None:
        if sched.squash(self, running_batch) and mem is not None:  # the squash rules' retractions
            mem.set_running(_running(self, running_batch))
            mem.set_wanted(self.waiting_queue)
        sched.before_pass(self, _running(self, running_batch), bool(running_batch.batch_is_full))
    plan = None
    try:
        plan = original(self, running_batch)
    finally:  # the plan's requests SGLang did not take go back to their queues, even if the pass raised
        if sched is not None:
            taken = plan.batch_to_run.reqs if plan is not None and plan.batch_to_run is not None else []
            sched.after_pass({r.rid for r in taken})
    if mem is not None:
        new = plan.batch_to_run.reqs if plan.batch_to_run is not None else []
        running = _running(self, plan.running_batch) + list(new)
        mem.set_running(running)
        mem.after_prefill_pass(len(new), len(running), self.waiting_queue)
    return plan


def init_req_max_new_tokens(original, self, req):
    """AROUND `Scheduler.init_req_max_new_tokens(req)`, where SGLang clips a new request's generation to what the
    empty pool holds: with the unified pool, a request on an adapter is measured against the pool less the
    adapter's slots. One that can never fit there is finished at once with HTTP 400 naming the sizes (it is never
    queued, so no hold waits on it); one that set no max_new_tokens has its generation clipped to what fits beside
    its adapter, as SGLang clips a base request's."""
    unset = req.sampling_params.max_new_tokens is None
    original(self, req)
    mem = process_state().memory
    if mem is None or req.lora_id is None or req.finished() or getattr(req, "to_finish", None) is not None:
        return
    identity = process_state().adapters.identity(req.lora_id)
    if identity is None or identity not in mem.residency:
        return  # unknown adapters are answered by ingress with HTTP 400
    prompt_len, params = len(req.origin_input_ids), req.sampling_params
    if unset:
        params.max_new_tokens = max(0, min(params.max_new_tokens, mem.max_new_beside(identity, prompt_len)))
    spec = process_state().adapters.spec(req.lora_id)
    name = spec.name if spec is not None else req.lora_id
    try:
        mem.check_request(name, identity, prompt_len, min(params.max_new_tokens, CLIP_MAX_NEW_TOKENS))
    except InfeasibleRequest as e:
        req.multilora_refusal = str(e)  # answered by `refuse_infeasible` instead of being queued


def refuse_infeasible(original, self, req, *args, **kwargs):
    """AROUND `Scheduler._add_request_to_queue(req)`: a request `init_req_max_new_tokens` found can never fit is
    answered with HTTP 400 now, as SGLang answers a request its full queue refuses, and never queued."""
    message = getattr(req, "multilora_refusal", None)
    if message is None:
        return original(self, req, *args, **kwargs)
    from sglang.srt.managers.scheduler import _make_abort_req

    logger.warning("sgl_multilora: request %s refused: %s", req.rid, message)
    reason = {"type": "abort", "status_code": HTTPStatus.BAD_REQUEST, "message": message}
    self.send_abort_output(_make_abort_req(req, finished_reason=reason), req)
    self._release_aborted_request(req)
    return None


def calc_priority(result, self, waiting_queue, *args, **kwargs):
    """AFTER `SchedulePolicy.calc_priority(waiting_queue)`, which sorts the queue by SGLang's policy: with the
    multi-queue scheduler, the pass meets the plan's requests first and in the plan's order (smaller queues
    first), so a small request the plan puts before large ones is not left behind them when SGLang's own order
    (arrival, prefix length) would spend the pass's prefill budget on the large ones first."""
    sched = process_state().scheduler
    if sched is not None:
        sched.order(waiting_queue)


def prefill_adder_init(result, self, *args, **kwargs):
    """AFTER `PrefillAdder.__init__`: the pass's adder, whose prefill budget bounds what an adapter load may take."""
    process_state().building.adder = self


def can_schedule_lora_req(original, self, req, running_loras):
    sched, mem = process_state().scheduler, process_state().memory
    if sched is not None and not sched.allows(req):
        if mem is not None:
            mem.gate.refusals[req.rid] = "outside the multi-queue scheduler's plan for this pass"
        return False  # outside this pass's plan: keeps its place, and no adapter is loaded for it
    if not original(self, req, running_loras):
        if mem is not None:  # SGLang's per-batch adapter limit (or its LoRA drainer) kept the adapter out
            mem.num_lora_batch_skips += 1
            mem.gate.refusals[req.rid] = "SGLang's adapters-per-batch limit (--max-loras-per-batch)"
        return False
    remote = remote_admission.admission()
    if remote is not None and req.lora_id is not None:  # the adapter's weights live on the LoRA server
        registry = process_state().adapters
        spec = registry.spec(req.lora_id)
        running = {s.name for s in map(registry.spec, running_loras or ()) if s is not None}
        if spec is not None and not remote.admits(spec.name, running):
            if mem is not None:
                mem.gate.refusals[req.rid] = "the LoRA server has no slot for its adapter"
            return False
    if mem is None:
        return True
    identity = process_state().adapters.identity(req.lora_id) if req.lora_id is not None else None
    if req.lora_id is not None and identity is None:
        return True  # unknown adapters are answered by ingress with HTTP 400
    adder = getattr(process_state().building, "adder", None)
    budget = None if adder is None else int(adder.memory_budget.remaining_total)
    max_new = min(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)
    if not mem.admit(req.rid, identity, budget, len(req.origin_input_ids) + len(req.output_ids), max_new):
        return False
    if identity is not None:
        mem.residency.acquire(identity)  # pinned until the pass ends and the counts are read off the batches
    return True


def add_one_req(original, self, req, *args, **kwargs):
    """AROUND `PrefillAdder.add_one_req`: the plan's gate where LoRA is off (no `can_schedule_lora_req` call)."""
    sched = process_state().scheduler
    if sched is not None and not sched.allows(req):
        from sglang.srt.managers.schedule_policy import AddReqResult

        return AddReqResult.CONTINUE
    return original(self, req, *args, **kwargs)


def add_request_to_queue(result, self, req, *args, **kwargs):
    """AFTER `Scheduler._add_request_to_queue`: the request's adapter counts as a visit for the eviction policy;
    the multi-queue scheduler queues it (or re-queues one SGLang retracted); a refused request is neither."""
    if req.finished() or getattr(req, "multilora_refusal", None) is not None:
        return
    lora_id = getattr(req, "lora_id", None)
    identity = process_state().adapters.identity(lora_id) if lora_id is not None else None
    mem = process_state().memory
    if mem is not None and (lora_id is None or identity is not None):
        mem.record_request(identity)
    sched = _scheduler_owner(self)
    if sched is not None:
        sched.on_arrival(req)


def process_batch_result(result, self, batch, *args, **kwargs):
    """AFTER `Scheduler.process_batch_result`: step statistics and finished requests; in test mode the memory's
    and the multi-queue scheduler's invariants."""
    if batch is None:
        return
    mem, sched = process_state().memory, process_state().scheduler
    if mem is not None:
        mem.after_step(batch)
    if sched is not None:
        busy = bool(self.waiting_queue) or (self.running_batch is not None and not self.running_batch.is_empty()) \
            or any(not r.finished() for r in batch.reqs)
        sched.on_step(batch, busy)
    if flags.current().check_invariants:
        if mem is not None:
            mem.check_invariants()
        if sched is not None:
            sched.mq.check_invariants()
