"""The event loop: continuous batching with chunked prefill over a simulated system, one step at a time.

Lives here: `SimRun` (results + memory samples + summary), `simulate`, `simulate_systems` (several instances
side by side on one clock, for what they share: a LoRA server) and the loop, which is the `EngineView`
(admission/base.py) the admission policies see. Not here: the run's settings (`config.py`; `SimConfig` is
re-exported here), the systems' memory and cache decisions (`systems/`), the order waiting requests are examined in
(`admission/`) or step costs (`latency.py`).

Each step: copies that finished complete; requests that arrived join the waiting queue (a follow-up turn waits
for its parent's reply, as a real client must); waiting requests are admitted in the admission policy's order
(`SimConfig.admission`, fcfs by default: one that waits for its adapter or a slot lets the next go; one that lacks
KV memory stops admission); the batch is the prefill chunks (at most `chunk_tokens` per step) plus one decode
token per decoding request; the clock advances by the latency model's step time. A request whose reused KV is
still being copied in from a host KV tier (`SimRequest.ready_s`) is admitted but prefills only once the copy is
done. When nothing can run, the clock jumps to the next arrival or copy.
Every admitted request reserves KV for its whole prompt and output, so no request is ever preempted.
With a latency model whose `decode_only` is true (moe_latency.py: prefill runs elsewhere and the prompt's KV arrives
with the request), a request's "prefill" is the step that makes its first token: it adds one token to the step's
batch and to its adapter's, and the latency model is told how many requests joined (`prefill_requests`).
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from eval.sim.admission import BaseAdmission, create_admission
from eval.sim.config import SimConfig
from eval.sim.latency import LatencyModel
from eval.sim.memory import pool_bytes
from eval.sim.systems import create_system
from eval.sim.systems.base import BaseSystem
from eval.sim.systems.request import ALORA_INVOCATION_TOKENS, Admit, SimRequest
from eval.sim.tokens import build_tokens
from eval.workloads.records import AdapterInfo, Request, RequestResult


@dataclass
class SimRun:
    arm: str
    results: list[RequestResult]
    samples: list[dict]
    summary: dict = field(default_factory=dict)
    system: BaseSystem | None = None  # the system at the end of the run (tests inspect it)
    admission: BaseAdmission | None = None  # the admission policy at the end of the run (tests inspect it)


def _sim_requests(adapters: tuple[AdapterInfo, ...], requests: tuple[Request, ...],
                  invocation_tokens: int) -> list[SimRequest]:
    tokens = build_tokens(requests)
    index = {a.name: i for i, a in enumerate(adapters)}
    kinds = {a.name: a.kind for a in adapters}
    out = []
    for r in requests:
        if r.adapter is not None and r.adapter not in index:
            raise ValueError(f"request {r.rid} names adapter {r.adapter!r}, not in the workload's adapters")
        prompt, output = tokens[r.rid]
        start = None
        if r.adapter is not None and kinds[r.adapter] == "alora" and r.alora_invocation:
            start = max(0, len(prompt) - invocation_tokens)
        out.append(SimRequest(r, prompt, output, index.get(r.adapter, -1), start, submit_s=r.arrival_s))
    return out


def simulate(arm: str, adapters, requests, experiment: str = "sim", lat: LatencyModel | None = None,
             config: SimConfig = SimConfig(), alora_invocation_tokens: int = ALORA_INVOCATION_TOKENS) -> SimRun:
    """Runs one arm over a workload (its `AdapterInfo`s and `Request`s); deterministic (no randomness).
    Raises ValueError for a malformed workload and RuntimeError if a request can never be admitted."""
    lat = lat or LatencyModel()
    adapters = tuple(adapters)
    system = create_system(arm, adapters, lat, config.pool_bytes or pool_bytes(lat), config.host_kv_bytes)
    reqs = _sim_requests(adapters, tuple(requests), alora_invocation_tokens)
    return _Loop(system, reqs, lat, config, experiment).run()


def simulate_systems(entries, config: SimConfig = SimConfig(), experiment: str = "sim",
                     on_clock=None, alora_invocation_tokens: int = ALORA_INVOCATION_TOKENS) -> list[SimRun]:
    """Runs several instances side by side on one clock: `entries` are (system, adapters, requests, latency
    model), each instance its own loop over its own requests; the loop whose clock is earliest runs its next
    iteration (ties: the one that ran least recently), so what they share (a LoRA server: systems/moe.py) sees
    their steps in time order. `on_clock(now)` is called before each iteration (the shared objects' clock).
    Deterministic. Returns one `SimRun` per entry."""
    loops = []
    for system, adapters, requests, lat in entries:
        reqs = _sim_requests(tuple(adapters), tuple(requests), alora_invocation_tokens)
        loops.append(_Loop(system, reqs, lat, config, experiment))
    gens = [loop.steps() for loop in loops]
    heap = [(0.0, i, i) for i in range(len(loops))]
    heapq.heapify(heap)
    seq = len(loops)

    def external_next(me: int):
        def nxt(now: float) -> float | None:
            later = [loops[j].now for j in live if j != me and loops[j].now > now]
            if later:
                return min(later)
            return now + 1e-3 if any(j != me for j in live) else None  # others at the same time: poll
        return nxt

    live = set(range(len(loops)))
    for i, loop in enumerate(loops):
        loop.external_next = external_next(i)
    while heap:
        now, _, i = heapq.heappop(heap)
        if on_clock is not None:
            on_clock(now)
        try:
            t = next(gens[i])
        except StopIteration:
            live.discard(i)
            continue
        seq += 1
        heapq.heappush(heap, (t, seq, i))
    return [loop.finish_run() for loop in loops]


class _Loop:
    """Decoding requests are kept as aggregates (count, context sum, adapters in use) and a heap of the step
    at which each finishes, so a step costs O(prefilling + finishing requests), not O(running)."""

    def __init__(self, system: BaseSystem, reqs: list[SimRequest], lat: LatencyModel, config: SimConfig,
                 experiment: str) -> None:
        self.system, self.lat, self.cfg, self.experiment = system, lat, config, experiment
        self.admission = create_admission(config.admission, system, lat, config, reqs)
        self.children: dict[str, list[SimRequest]] = {}
        self.arrivals: list[tuple[float, int, SimRequest]] = []
        for i, sr in enumerate(reqs):
            parent = sr.req.parent_rid
            if parent is not None:
                self.children.setdefault(parent, []).append(sr)
            else:
                self.arrivals.append((sr.submit_s, i, sr))
        heapq.heapify(self.arrivals)
        self._seq = len(reqs)
        self.waiting: list[SimRequest] = []
        self.prefilling: list[SimRequest] = []
        self.num_decoding = 0
        self.decode_ctx = 0  # sum of the decoding requests' context lengths
        self.decode_adapters: dict[str, int] = {}  # adapter -> decoding requests using it
        self.finish_heap: list[tuple[int, int, SimRequest]] = []
        self.step_no = 0
        self.num_steps = self.capped_steps = 0  # steps run; of them, at the running-request cap
        self.samples: list[dict] = []
        self.done: list[SimRequest] = []
        self.num_slot_skips = 0  # admissions passed over for SGLang's per-batch adapter cap
        self.num_retracted = 0
        self.external_next = None  # set by simulate_systems (steps())
        self.decode_only = getattr(lat, "decode_only", False)  # moe_latency: prefill runs elsewhere
        self.now = 0.0

    @property
    def num_running(self) -> int:
        return len(self.prefilling) + self.num_decoding

    def run(self) -> SimRun:
        for _ in self.steps():
            pass
        return self.finish_run()

    def finish_run(self) -> SimRun:
        return SimRun(self.system.name, [self._result(sr) for sr in self.done], self.samples, self._summary(),
                      self.system, self.admission)

    def steps(self):
        """The loop, one iteration at a time: yields the clock after each (a step run, or a jump to the next
        event). `external_next(now)`, when set (`simulate_systems`), gives the time another instance may change
        this one's state (a shared LoRA server), so waiting there is not a deadlock."""
        system, now = self.system, 0.0
        self.now = now
        next_sample = 0.0
        while True:
            system.tick(now)
            while self.arrivals and self.arrivals[0][0] <= now:
                sr = heapq.heappop(self.arrivals)[2]
                system.submit(sr)
                self.waiting.append(sr)
                self.admission.on_arrival(sr, now)
            self._admit(now)
            if now >= next_sample:
                self.samples.append({"t_s": now, **system.sample()})
                next_sample = now + self.cfg.sample_period_s
            dt, prefill = self._step()
            if dt == 0.0:
                nxt = [t for t in (self.arrivals[0][0] if self.arrivals else None, system.next_event_s())
                       if t is not None]
                if not nxt and (self.waiting or self.num_running) and self.external_next is not None:
                    ext = self.external_next(now)
                    nxt = [ext] if ext is not None else []
                if not nxt:
                    if self.waiting or self.num_running:
                        head = (self.waiting or self.prefilling)[0].req.rid
                        raise RuntimeError(f"{system.name}: request {head} can never be admitted (its KV or "
                                           f"adapter does not fit in the pool)")
                    break
                now = max(now, min(nxt))
                self.now = now
                yield now
                continue
            system.usage.record_batch(now, self.num_running)
            self.num_steps += 1
            self.capped_steps += self.num_running >= self.cfg.max_running
            now += dt
            system.now = now
            self._advance(now, prefill)
            if self.cfg.check_every_step:
                system.check_invariants()
                self._check_aggregates()
                self.admission.check_invariants(self.waiting)
            self.now = now
            yield now

    def _admit(self, now: float) -> None:
        cfg, system, policy = self.cfg, self.system, self.admission
        if not self.waiting:
            return
        policy.before_pass(self, now)
        system.set_waiting(self.waiting)
        backlog = sum(len(sr.prompt) - sr.computed for sr in self.prefilling)
        if self.num_running >= cfg.max_running or backlog >= cfg.chunk_tokens:
            return  # this pass could admit nothing
        cap = cfg.max_loras_per_batch
        adapters = set(self.running_by_adapter()) if cap is not None else set()
        admitted: set[SimRequest] = set()
        for i, sr in enumerate(policy.candidates(self.waiting, now, backlog)):
            if (i >= cfg.scan_limit or self.num_running >= cfg.max_running
                    or (policy.checks_backlog and backlog >= cfg.chunk_tokens)):
                break
            name = sr.req.adapter
            if cap is not None and name not in adapters and len(adapters) >= cap:
                self.num_slot_skips += 1
                continue  # as SGLang's `can_schedule_lora_req`: the next request may go
            status = system.try_admit(sr)
            if status is Admit.OK:
                sr.admit_s = now
                sr.computed = sr.cached
                self.prefilling.append(sr)
                admitted.add(sr)
                adapters.add(name)
                backlog += len(sr.prompt) - sr.cached
            elif status is Admit.NO_MEMORY:
                break
        policy.after_pass(admitted, now)
        if admitted:
            self.waiting = [sr for sr in self.waiting if sr not in admitted]

    def _step(self) -> tuple[float, list[tuple[SimRequest, int]]]:
        budget = self.cfg.chunk_tokens
        prefill = []
        pairs = 0.0
        lora = dict(self.decode_adapters)  # adapter -> its tokens in this step
        now = self.system.now
        for sr in self.prefilling:
            if budget <= 0:
                break
            if sr.ready_s > now:  # the KV it reuses is still being copied in from the host
                continue
            n = min(budget, len(sr.prompt) - sr.computed)
            budget -= n
            prefill.append((sr, n))
            pairs += n * sr.computed + n * (n + 1) / 2
            name = sr.req.adapter
            if name is not None:  # decode only: a joining request adds its first token, not its prompt
                lora[name] = lora.get(name, 0) + (1 if self.decode_only else n)
        num_prefill = sum(n for _, n in prefill)
        specs, weight_bytes = self.system.lora_specs, self.system.weight_bytes
        batch = [(n, *specs[name], weight_bytes[name]) for name, n in lora.items()]
        if self.decode_only:
            dt = self.lat.step_time(num_prefill, pairs, self.num_decoding, self.decode_ctx, batch,
                                    prefill_requests=len(prefill))
        else:
            dt = self.lat.step_time(num_prefill, pairs, self.num_decoding, self.decode_ctx, batch)
        if dt:
            dt += self.system.take_stall()
        return dt, prefill

    def _advance(self, now: float, prefill: list[tuple[SimRequest, int]]) -> None:
        self.step_no += 1
        self.decode_ctx += self.num_decoding  # every decoding request grew by one token
        finished = []
        while self.finish_heap and self.finish_heap[0][0] <= self.step_no:
            _, seq, sr = heapq.heappop(self.finish_heap)
            if seq != sr.decode_seq:
                continue  # retracted while decoding (a stale entry)
            self._leave_decode(sr)
            finished.append(sr)
        for sr, n in prefill:
            sr.computed += n
            if sr.computed == len(sr.prompt):
                if sr.first_token_s is None:  # a resumed request's first token came out before
                    sr.first_token_s = now
                if len(sr.output) == 1:
                    finished.append(sr)
                else:
                    self._enter_decode(sr)
        if prefill:
            self.prefilling = [sr for sr in self.prefilling if sr.computed < len(sr.prompt)]
        for sr in finished:
            sr.generated = len(sr.output)
            sr.finish_s = now
            self.system.finish(sr)
            self.admission.on_finish(sr, now)
            self.done.append(sr)
            for child in self.children.pop(sr.req.rid, ()):
                child.submit_s = max(child.req.arrival_s, now)
                self._seq += 1
                heapq.heappush(self.arrivals, (child.submit_s, self._seq, child))

    def running_by_adapter(self) -> dict[str | None, list[SimRequest]]:
        """The running requests (prefilling and decoding) by adapter name (None: the base model). O(running)."""
        out: dict[str | None, list[SimRequest]] = {}
        for sr in self.prefilling:
            out.setdefault(sr.req.adapter, []).append(sr)
        for _, seq, sr in self.finish_heap:
            if seq == sr.decode_seq:
                out.setdefault(sr.req.adapter, []).append(sr)
        return out

    def generated(self, sr: SimRequest) -> int:
        """Output tokens a decoding request has so far (its first came out of its prefill)."""
        return 1 + self.step_no - sr.decode_step

    def retract(self, victims: list[SimRequest]) -> None:
        """Retracts decoding requests (a slot squash): each leaves the batch with its KV so far cached, and waits
        again at its arrival position with what it streamed moved into its prompt; resumed, it prefills that
        (mostly a cache hit) and decodes the rest. Its TTFT stays the first one's."""
        for sr in victims:
            assert sr.decode_seq >= 0, f"request {sr.req.rid} is not decoding: only decoding requests retract"
            g = self.generated(sr)
            self._leave_decode(sr, g)
            self.system.retract(sr, g)
            sr.prompt, sr.output = sr.prompt + sr.output[:g], sr.output[g:]
            sr.resumed_tokens += g
            sr.cached = sr.computed = sr.restored = 0
            sr.reserved_slots = 0
            i = len(self.waiting)
            while i and self.waiting[i - 1].submit_s > sr.submit_s:
                i -= 1
            self.waiting.insert(i, sr)
            self.num_retracted += 1

    def _enter_decode(self, sr: SimRequest) -> None:
        """After its first token: decodes the other len(output) - 1 in the next steps."""
        self.num_decoding += 1
        self.decode_ctx += len(sr.prompt) + 1
        self._seq += 1
        sr.decode_step, sr.decode_seq = self.step_no, self._seq
        heapq.heappush(self.finish_heap, (self.step_no + len(sr.output) - 1, self._seq, sr))
        name = sr.req.adapter
        if name is not None:
            self.decode_adapters[name] = self.decode_adapters.get(name, 0) + 1

    def _leave_decode(self, sr: SimRequest, generated: int | None = None) -> None:
        """`generated`: the output tokens it has (all of them when it finishes)."""
        self.num_decoding -= 1
        self.decode_ctx -= len(sr.prompt) + (len(sr.output) if generated is None else generated)
        sr.decode_seq = -1
        name = sr.req.adapter
        if name is not None:
            self.decode_adapters[name] -= 1
            if not self.decode_adapters[name]:
                del self.decode_adapters[name]

    def _check_aggregates(self) -> None:
        """Recomputes the decode aggregates from the heap (each entry: finish step, request)."""
        entries = [(step, sr) for step, seq, sr in self.finish_heap if seq == sr.decode_seq]
        assert len(entries) == self.num_decoding, "decode count out of step"
        ctx = sum(len(sr.prompt) + len(sr.output) - (step - self.step_no) for step, sr in entries)
        assert ctx == self.decode_ctx, f"decode context sum {self.decode_ctx} != {ctx}"
        by_adapter = Counter(sr.req.adapter for _, sr in entries if sr.req.adapter is not None)
        assert by_adapter == self.decode_adapters, "decoding requests per adapter drifted"

    def _result(self, sr: SimRequest) -> RequestResult:
        out = sr.output_tokens
        tpot = (sr.finish_s - sr.first_token_s) / (out - 1) if out > 1 else 0.0
        return RequestResult(
            experiment=self.experiment, arm=self.system.name, rid=sr.req.rid, adapter=sr.req.adapter,
            arrival_s=sr.req.arrival_s, prompt_tokens=sr.prompt_tokens, output_tokens=out,
            cached_tokens=sr.cached, ttft_s=sr.first_token_s - sr.submit_s, tpot_s=tpot,
            e2e_s=sr.finish_s - sr.submit_s,
            extra={"simulated": True, "submit_s": sr.submit_s, "queue_s": sr.admit_s - sr.submit_s,
                   "adapter_was_resident": sr.adapter_was_resident, "host_restored_tokens": sr.restored,
                   "resumed_tokens": sr.resumed_tokens},
        )

    def _summary(self) -> dict:
        ttft = np.array([sr.first_token_s - sr.submit_s for sr in self.done])
        res = [self._result(sr) for sr in self.done]
        tpot = np.array([r.tpot_s for r in res if r.output_tokens > 1])
        prompt = sum(len(sr.prompt) for sr in self.done)
        cached = sum(sr.cached for sr in self.done)
        history = sum(sr.req.history_tokens for sr in self.done)  # conversation history in the prompts
        with_adapter = [sr for sr in self.done if sr.req.adapter is not None]
        kv = sum(s["kv_cached"] for s in self.samples)
        invalid = sum(s["invalid_kv"] for s in self.samples)
        return {
            "arm": self.system.name, "num_requests": len(self.done),
            "ttft_mean_s": float(ttft.mean()) if len(ttft) else None,
            "ttft_p50_s": float(np.percentile(ttft, 50)) if len(ttft) else None,
            "ttft_p99_s": float(np.percentile(ttft, 99)) if len(ttft) else None,
            "tpot_mean_s": float(tpot.mean()) if len(tpot) else None,
            "kv_hit_rate": cached / prompt if prompt else 0.0,
            "kv_host_hit_rate": sum(sr.restored for sr in self.done) / prompt if prompt else 0.0,
            "history_recompute_share": (sum(max(0, sr.req.history_tokens - sr.cached) for sr in self.done)
                                        / history if history else 0.0),
            "adapter_hit_rate": (sum(sr.adapter_was_resident for sr in with_adapter) / len(with_adapter)
                                 if with_adapter else None),
            "invalid_kv_share": invalid / kv if kv else 0.0,
            "num_adapter_loads": self.system.num_loads,
            "num_kv_restores": self.system.num_restores,
            "host_kv_mean_bytes": float(np.mean([s["host_kv"] for s in self.samples])) if self.samples else 0.0,
            "makespan_s": max((sr.finish_s for sr in self.done), default=0.0),
            "running_cap_step_share": self.capped_steps / self.num_steps if self.num_steps else 0.0,
            "running_kv_mean_share": (float(np.mean([s["kv_running"] / total for s in self.samples]))
                                      if self.samples and (total := self.system.num_slots * self.system.kvb)
                                      else 0.0),
        }
