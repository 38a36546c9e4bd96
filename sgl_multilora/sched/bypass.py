"""Opportunistic adapter-memory bypass and its squash rule (reference/seed-chameleon.md, 4.4).

Lives here: the T_wait predictor, the record of who bypassed whom (`BypassBook`), the squash
test (`squash_candidates`, pure) and its terms measured on a live engine's memory
(`MeasuredTerms`). Not here: the admission scan that applies the bypass rule
(admission.py) or aborting a running request (the engine does; the scheduler's `requeue` takes
the request back).

The rule. R1 fits its queue's quota but its adapter cannot be brought in even after evicting every
idle adapter (the caller's prefetch callback says so). A younger R2 of the same queue whose adapter
is resident may run first only if T_wait(R1) > T_exec(R2). Squash: while R2 runs, if free memory
is short of R1's need but free memory plus R2's footprint covers it, R2 is aborted and returned to
its arrival position, and R1 goes next.

Predictors (the paper does not give them), in tokens and seconds:
- need(R1) = R1's prompt + its adapter (what must fit for R1 to start).
- footprint(R) = R's charged cost (prompt + predicted output + adapter), unless the caller passes
  the exact tokens R holds.
- T_exec(R2) = the timing model's prefill + decode time (request.py).
- T_wait(R1): memory is full when the rule fires (no idle adapter is left to evict), so R1 waits
  until running requests whose footprints add up to need(R1) have finished, soonest predicted
  finish first: the predicted remaining time of the request at which that sum is reached, or
  infinity if all of them together do not free enough.
- A request is squashed at most `max_squashes` times, so bypass and squash cannot alternate
  forever; a request that may not be squashed again is simply left to finish.
A live engine measures the terms instead (`MeasuredTerms`), since it knows what each request holds:
free = the room an admission could have now; need(R1) = R1's prompt plus what its adapter needs
to start; footprint(R2) = the room with R2 retracted less the room now (the KV only R2 holds, the
tree KV only its lock pins and, when no other running request uses it, its adapter).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from sgl_multilora.sched.request import SchedRequest, TimingModel


@dataclass(frozen=True)
class SquashInfo:
    victim: SchedRequest
    """R2: running, bypassed `beneficiary`; abort it and call `requeue(victim.rid, squash=True)`."""
    beneficiary: SchedRequest
    """R1: still queued; its memory need fits once `victim` is gone."""


def need_tokens(r: SchedRequest) -> int:
    return r.in_len + r.adapter_tokens


def predict_wait_s(r1: SchedRequest, running: Iterable[SchedRequest], now: float,
                   timing: TimingModel) -> float:
    """T_wait(R1) as above. O(R log R) over the running requests."""
    need = need_tokens(r1)
    freed = 0
    for remaining, cost in sorted((timing.remaining_s(r, now), r.cost_tokens) for r in running):
        freed += cost
        if freed >= need:
            return remaining
    return math.inf


class BypassBook:
    """Which running request (R2) bypassed which queued one (R1). Small: entries exist only while
    both are in flight."""

    def __init__(self) -> None:
        self.bypassed: dict[str, str] = {}
        """R2 rid -> R1 rid."""

    def __len__(self) -> int:
        return len(self.bypassed)

    def record(self, r2: SchedRequest, r1: SchedRequest) -> None:
        self.bypassed[r2.rid] = r1.rid

    def forget(self, rid: str) -> None:
        """Drops every entry naming `rid`, as R2 (it finished, left) or as R1 (it was admitted or
        removed)."""
        self.bypassed.pop(rid, None)
        self.forget_beneficiary(rid)

    def forget_beneficiary(self, rid: str) -> None:
        """Drops the entries in which `rid` is R1 (it is being admitted)."""
        for r2 in [r2 for r2, r1 in self.bypassed.items() if r1 == rid]:
            del self.bypassed[r2]

    def check_invariants(self, running: Mapping[str, SchedRequest],
                         queued: Callable[[str], SchedRequest | None]) -> None:
        for r2, r1 in self.bypassed.items():
            assert r2 in running, f"bypass entry for {r2}, which is not running"
            assert queued(r1) is not None, f"bypass entry for {r1}, which is not queued"


def squash_candidates(book: BypassBook, running: Mapping[str, SchedRequest],
                      queued: Callable[[str], SchedRequest | None], free_tokens: int,
                      max_squashes: int,
                      footprint: Callable[[SchedRequest], int] | None = None,
                      need: Callable[[SchedRequest], int] | None = None) -> list[SquashInfo]:
    """Squashes that the rule calls for now, oldest R1 first, youngest R2 first, at most one per
    R1. Each R1 that can start (with or without a squash) is assumed to take its need out of free
    memory before the next is tested. `footprint` and `need` replace the predictors above where
    the caller knows better (a live engine: the slots a retraction gives back, the slots of an
    adapter that is not resident). Modifies nothing."""
    fp = footprint or (lambda r: r.cost_tokens)
    need_of = need or need_tokens
    free = free_tokens
    out: list[SquashInfo] = []
    served: set[str] = set()
    pairs = [(running[r2], queued(r1)) for r2, r1 in book.bypassed.items()]
    for victim, beneficiary in sorted(pairs, key=lambda p: (p[1].seq, -p[0].seq)):
        if beneficiary.rid in served or victim.num_squashes >= max_squashes:
            continue
        need_r1 = need_of(beneficiary)
        if need_r1 <= free:  # R1 starts without a squash and takes its need out of free memory
            free -= need_r1
            served.add(beneficiary.rid)
        elif need_r1 <= free + fp(victim):
            out.append(SquashInfo(victim, beneficiary))
            served.add(beneficiary.rid)
            free += fp(victim) - need_r1
    return out


class RoomView(Protocol):
    """What the measured squash asks of the engine's memory (live: the unified pool)."""

    def room(self) -> int:
        """Slots an admission could have now (free, unlocked KV, idle adapters)."""

    def room_without(self, adapter: str | None, lock: object, owned_slots: int) -> int:
        """`room()` with one running request retracted: its `lock` on a tree node (None: none) and
        its use of `adapter` released, and its `owned_slots` freed. Changes nothing."""

    def slots_to_start(self, adapter: str | None) -> int:
        """Slots a request on `adapter` waits for beyond its own KV (0 once resident or loading)."""


@dataclass(frozen=True, slots=True)
class HeldKV:
    """A running request's KV as the engine holds it: `allocated_len` slots allocated to it, of
    which the first `cached_len` are the cached prefix it shares with the tree (pinned by `lock`,
    the tree node its lock holds; None: none)."""

    adapter: str | None
    allocated_len: int
    cached_len: int
    lock: object = None

    @property
    def owned_slots(self) -> int:
        """Slots only this request holds (freed when it is retracted)."""
        return max(0, self.allocated_len - self.cached_len)


class MeasuredTerms:
    """The squash's free, footprint and need (module docstring) measured on `memory` at one moment:
    pass `free`, `footprint` and `need` to `squash_candidates`. `held(rid)` describes a running
    request's KV, None for one the engine cannot retract now (its footprint is 0: it is not
    squashed). Valid until the engine's memory changes."""

    def __init__(self, memory: RoomView, held: Callable[[str], HeldKV | None]) -> None:
        self.memory, self.held = memory, held
        self.free = memory.room()

    def footprint(self, r: SchedRequest) -> int:
        kv = self.held(r.rid)
        if kv is None:
            return 0
        return self.memory.room_without(kv.adapter, kv.lock, kv.owned_slots) - self.free

    def need(self, r: SchedRequest) -> int:
        return r.in_len + self.memory.slots_to_start(r.adapter)
