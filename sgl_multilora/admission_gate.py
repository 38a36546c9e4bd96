"""The unified pool's admission gate: what can never fit (refused at once), and which waiting request may take
memory in an admission pass so that every request that can fit is admitted within a bound.

Lives here: the feasibility arithmetic (`request_tokens`, `check_request`, `check_adapter`, `max_new_beside`),
`AdmissionGate` (the starvation hold, the reasons a pass refused requests, the stall watchdog)
and its counters. Not here: SGLang's objects (the seam, `patches/unified_memory.py`, reads sizes off a `Req`
and calls these), the eviction order (`swapper.py`), adapter states (`residency.py`).

Feasibility. SGLang admits a request when `extend_len + min(max_new, clip) + page_size < remaining_total` (its
`PrefillAdder`), `remaining_total` being free plus evictable slots; an adapter the request runs on is pinned, so
it is not evictable. With nothing else in the pool a request on an adapter of `a` slots goes in iff

    a + request_tokens < pool_slots,   request_tokens = prompt_len + min(max_new, clip) + RESERVED_TOKENS

(page size 1). A request for which this fails can never run: it is refused when it arrives (HTTP 400 naming the
three sizes), never queued. An adapter for which even the smallest request fails (`MIN_REQUEST_TOKENS`) is
refused when it is loaded.

Progress. A request refused by the memory in a pass (its adapter could not be made resident within the pass's
budget, or its pin did not fit) is "skipped". A request skipped for `starvation_s` becomes the hold: no other
request takes memory until it is in, so that what runs drains and frees its room (under a steady stream of
requests for resident adapters it would otherwise wait for good). Only a feasible request can be the hold (`admit`
checks), so a hold never waits on one that cannot fit.

Bound (tested in tests/unit/test_admission_gate.py on random pools, adapters, policies and arrivals): when the
engine is idle (nothing running, no copy in flight) and requests wait, its next pass admits one or starts the copy
one waits for. With nothing running every slot is reachable (free, unlocked KV, idle adapters whatever the queue
wants: the swapper evicts the adapters queued requests name last, not never), so the hold, or the first request
SGLang's order reaches, fits. A skipped request becomes the hold within `starvation_s` of its first refusal
(unless an older one holds), and is admitted by the first pass after the requests running then have finished.

Watchdog. A pass that admits nothing while nothing runs and requests wait starts a stall; one lasting `stall_s`
counts once in `counters.stalls` and is reported (`end_pass` returns the refusal reasons) for the owner to log.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from sgl_multilora.pool import ExceedsPoolError
from sgl_multilora.residency import AdapterResidency
from sgl_multilora.swapper import Swapper

RESERVED_TOKENS = 1
"""SGLang's admission adds one page (one token at page size 1) to every request's prompt and generation."""
MIN_REQUEST_TOKENS = 1 + 1 + RESERVED_TOKENS
"""The smallest request: one prompt token, one new token, SGLang's reserved page."""
STARVATION_S = 2.0
"""A request skipped this long holds admission until it is in (no starvation under a steady stream of requests for
resident adapters)."""
STALL_S = 5.0
"""Waiting requests with an idle engine for this long are reported as a stall (a log line and a counter)."""


class InfeasibleRequest(ValueError):
    """A request that can never be admitted: its adapter's slots plus its tokens exceed the pool ("never", not
    "not now"). The message names the three sizes."""

    def __init__(self, adapter: str, adapter_slots: int, prompt_len: int, max_new: int, pool_slots: int) -> None:
        self.adapter_slots, self.pool_slots = adapter_slots, pool_slots
        self.request_tokens = request_tokens(prompt_len, max_new)
        longest = longest_request_beside(pool_slots, adapter_slots)
        super().__init__(
            f"this request can never fit in the server's memory: LoRA adapter {adapter!r} takes {adapter_slots} "
            f"token slots and the request {self.request_tokens} ({prompt_len} prompt + {max_new} new + "
            f"{RESERVED_TOKENS} reserved), {adapter_slots + self.request_tokens} in all, while the pool holds "
            f"{pool_slots} (--max-total-tokens). Beside this adapter a request fits with prompt + new tokens <= "
            f"{max(longest, 0)}; lower max_new_tokens, shorten the prompt, or serve with a larger pool")


class InfeasibleAdapter(ExceedsPoolError):
    """An adapter that leaves no room for the smallest request beside it in the pool (an `ExceedsPoolError`: every
    caller that refuses an adapter larger than the pool refuses this one too)."""

    def __init__(self, adapter: str, adapter_slots: int, pool_slots: int, slot_bytes: int) -> None:
        self.what, self.num_slots, self.pool_slots = f"LoRA adapter {adapter!r}", adapter_slots, pool_slots
        self.adapter_slots = adapter_slots
        ValueError.__init__(self, 
            f"LoRA adapter {adapter!r} takes {adapter_slots} token slots ({adapter_slots * slot_bytes} B) of the "
            f"pool's {pool_slots} ({pool_slots * slot_bytes} B, --max-total-tokens): with the smallest request "
            f"beside it ({MIN_REQUEST_TOKENS} slots) no request on it could ever run; serve it with a pool of at "
            f"least {adapter_slots + MIN_REQUEST_TOKENS + 1} tokens")


def request_tokens(prompt_len: int, max_new: int) -> int:
    """The slots SGLang's admission counts for a request with nothing cached (`max_new` already clipped as its
    admission clips it)."""
    return prompt_len + max_new + RESERVED_TOKENS


def fits(pool_slots: int, adapter_slots: int, prompt_len: int, max_new: int) -> bool:
    """Whether the request could be admitted into an otherwise empty pool (the module docstring's inequality)."""
    return adapter_slots + request_tokens(prompt_len, max_new) < pool_slots


def longest_request_beside(pool_slots: int, adapter_slots: int) -> int:
    """The most prompt + new tokens a request on an adapter of `adapter_slots` can have (negative: none fits)."""
    return pool_slots - adapter_slots - RESERVED_TOKENS - 1


def max_new_beside(pool_slots: int, adapter_slots: int, prompt_len: int) -> int:
    """The most new tokens a request of `prompt_len` on the adapter can ask for (negative: its prompt alone does
    not fit)."""
    return longest_request_beside(pool_slots, adapter_slots) - prompt_len


def check_request(adapter: str, adapter_slots: int, prompt_len: int, max_new: int, pool_slots: int) -> None:
    """Raises InfeasibleRequest when the request can never be admitted."""
    if not fits(pool_slots, adapter_slots, prompt_len, max_new):
        raise InfeasibleRequest(adapter, adapter_slots, prompt_len, max_new, pool_slots)


def check_adapter(adapter: str, adapter_slots: int, pool_slots: int, slot_bytes: int) -> None:
    """Raises InfeasibleAdapter when even the smallest request cannot run beside the adapter."""
    if adapter_slots + MIN_REQUEST_TOKENS >= pool_slots:
        raise InfeasibleAdapter(adapter, adapter_slots, pool_slots, slot_bytes)


@dataclass(slots=True)
class GateCounters:
    """Lifetime counts: passes that skipped a request while its adapter came in or lacked room
    (`skipped_admissions`), starvation holds taken (`starvation_holds`), passes ended by a pin that did not
    fit the budget (`budget_stops`), requests that reached the gate although they can never fit
    (`infeasible`, 0 when ingress refuses them), stalls reported by the watchdog (`stalls`)."""

    skipped_admissions: int = 0
    starvation_holds: int = 0
    budget_stops: int = 0
    infeasible: int = 0
    stalls: int = 0


class AdmissionGate:
    """The memory's admission decisions over one pool's residency and swapper (see the module docstring).

    Per pass: `begin_pass(waiting_rids)`, then `admit(...)` for each request SGLang considers (in its order), then
    `end_pass(...)`. `refusals` holds, for the pass, why each refused request was refused."""

    def __init__(self, residency: AdapterResidency, swapper: Swapper, *, starvation_s: float = STARVATION_S,
                 stall_s: float = STALL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.residency, self.swapper, self.pool = residency, swapper, swapper.pool
        self.starvation_s, self.stall_s, self.clock = starvation_s, stall_s, clock
        self.counters = GateCounters()
        self.hold: str | None = None  # the rid every other request waits for
        self.refusals: dict[str, str] = {}
        self._skipped_since: dict[str, float] = {}  # rid -> when memory first refused it
        self._pass_full = False
        self._stalled_since: float | None = None
        self._stall_reported = False

    # ---- per pass ---------------------------------------------------------------------------------------------

    def begin_pass(self, waiting_rids: set[str]) -> None:
        """Forgets requests no longer waiting (admitted elsewhere or aborted) and a hold for one of them."""
        self._pass_full = False
        self.refusals = {}
        for rid in [r for r in self._skipped_since if r not in waiting_rids]:
            del self._skipped_since[rid]
        if self.hold not in self._skipped_since:
            self.hold = None

    def admit(self, rid: str, identity: str | None, budget: int | None, prompt_len: int, max_new: int) -> bool:
        """Whether the request may start now on adapter `identity` (None: the base model), its adapter resident
        (a load is started for it when room can be made within `budget`, the slots the pass may still take; None:
        unbounded). False is "not now"; the reason is in `refusals[rid]`. The caller pins the adapter on True."""
        res = self.residency
        if self._pass_full:
            return self._refuse(rid, "the pass ended at an earlier request whose adapter's pin did not fit")
        if self.hold is not None and rid != self.hold:
            return self._refuse(rid, f"held for request {self.hold} (waiting for memory longest)")
        slots = res.entry(identity).num_slots if identity is not None and identity in res else 0
        if not fits(self.pool.num_slots, slots, prompt_len, max_new):
            self.counters.infeasible += 1  # never the hold: nothing would ever release it
            return self._refuse(rid, f"can never fit: adapter {slots} + request "
                                     f"{request_tokens(prompt_len, max_new)} slots, pool {self.pool.num_slots}")
        if identity is not None and res.is_resident(identity) and not self._pin_fits(identity, budget):
            self._pass_full = True
            self.counters.budget_stops += 1
            return self._refuse(rid, f"its resident adapter ({slots} slots) is evictable and its pin does not "
                                     f"fit the pass's budget ({budget} slots)")
        if identity is None or self.ensure_resident(identity, budget):
            self._skipped_since.pop(rid, None)
            if rid == self.hold:
                self.hold = None
            return True
        now = self.clock()
        since = self._skipped_since.setdefault(rid, now)
        if self.hold is None and now - since > self.starvation_s:
            self.hold = rid
            self.counters.starvation_holds += 1
        loading = res.is_loading(identity)
        return self._refuse(rid, f"its adapter ({slots} slots) is being copied in" if loading else
                            f"its adapter ({slots} slots) cannot be made resident now (reachable "
                            f"{self.swapper.reachable_slots()} slots, pass budget {budget})")

    def end_pass(self, num_admitted: int, num_running: int, num_waiting: int) -> dict | None:
        """Records whether the pass made progress; returns a stall report (once per stall) when requests have
        waited `stall_s` with an idle engine, else None."""
        idle = num_running == 0 and not self.residency.loading_ids()
        if not (idle and num_waiting > 0 and num_admitted == 0):
            self._stalled_since, self._stall_reported = None, False
            return None
        now = self.clock()
        if self._stalled_since is None:
            self._stalled_since = now
        if self._stall_reported or now - self._stalled_since < self.stall_s:
            return None
        self._stall_reported = True
        self.counters.stalls += 1
        return {"stalled_s": now - self._stalled_since, "hold": self.hold, "refusals": dict(self.refusals)}

    def stalled_for(self) -> float:
        """Seconds the current stall has lasted (0 when there is none)."""
        return 0.0 if self._stalled_since is None else self.clock() - self._stalled_since

    def stats(self) -> dict:
        return {**asdict(self.counters), "hold": self.hold, "stalled_s": round(self.stalled_for(), 3),
                "skipped_waiting": len(self._skipped_since)}

    # ---- helpers ----------------------------------------------------------------------------------------------

    def _refuse(self, rid: str, reason: str) -> bool:
        self.refusals[rid] = reason
        return False

    def ensure_resident(self, identity: str, budget: int | None) -> bool:
        """True once the adapter is resident; otherwise makes room (at most `budget` slots of the pass may go to
        it) and starts the copy. False means "not now"."""
        res = self.residency
        if res.is_resident(identity):
            return True
        self.swapper.poll_loads()
        if res.is_resident(identity) or res.is_loading(identity):
            return res.is_resident(identity)
        if budget is not None and res.entry(identity).num_slots > budget:
            self.counters.skipped_admissions += 1
            return False
        if self.swapper.load(identity):
            self.swapper.poll_loads()
        if not res.is_resident(identity):
            self.counters.skipped_admissions += 1
        return res.is_resident(identity)

    def _pin_fits(self, identity: str, budget: int | None) -> bool:
        """Whether a request may start on the resident adapter within `budget`. An adapter no request runs on
        counts as evictable, so pinning it takes its slots out of the pass's budget: it must fit what is left."""
        return (budget is None or not self.swapper.adapter_reclaimable(identity)
                or self.residency.entry(identity).num_slots <= budget)
