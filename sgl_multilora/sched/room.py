"""The room squash: running decodes retracted so that a request the KV room cannot take meets its TTFT SLO.

Lives here: `RoomVictim`, `RoomSquash` and `choose_room_squash` (pure). Not here: picking R1 and the reservation
(`MultiQueueScheduler.room_squash`, `commit_room_squash`), the retraction (the engine: live_scheduler.py keeps the
victims' KV in the tree) or the room itself (the caller's memory: `LiveMemory.room()` with the unified pool).

The resource. Not in the paper, whose squash (bypass.py) frees adapter memory for a request that a later one bypassed.
On a server whose decode steps are slow next to a request's life, the room a waiting request needs is held by
running requests for their whole decode: in a burst the slowest first tokens can be requests waiting for KV that
running decodes hold, while alone each would take a fraction of that. Neither a queue order nor a hold serves
them: whatever goes first waits for the same decodes to end. This rule trades some of the running requests'
end-to-end time (they already have their first token) for the waiting one's first token.

Rule (`config.room_squash_share`; off by default). R1 is the oldest queued request with no token out yet (never
resumed) once it has waited that share of the TTFT SLO, whose need (its prompt, its predicted output and, while its
adapter is not resident, the adapter's slots) exceeds the room the engine could free now (free slots, unlocked KV,
idle adapters): the shortfall. Without a squash R1's room comes from running requests ending: the predicted wait is
the time by which the running requests, in order of predicted end, have freed the shortfall (inf if all of them do
not). If R1's age plus that wait is within the SLO, nothing happens. Else the victims are running requests that
decode (a request mid-prefill is never one: its prefill would be lost), squashed fewer than `config.max_squashes`
times, longest predicted remaining time first (they would hold their room longest; ties: the larger footprint),
taken until their footprints cover the shortfall; none if they cannot. The engine retracts them, keeping their KV in
the tree as evictable cache (a victim that resumes before it is evicted recomputes next to nothing), and the next
batch admits R1 alone before anything else (one batch: a beneficiary that cannot go in then must not hold the room).
Bounds: one squash at a time (none while a reservation is pending), a request squashed at most `max_squashes` times,
and a resumed request is never R1 (its first token is out), so squashes cannot cascade or alternate.

Why it is off by default: eval/RESULTS.md, decided off.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sgl_multilora.sched.config import SchedConfig
from sgl_multilora.sched.request import SchedRequest


@dataclass(frozen=True)
class RoomVictim:
    """A running request as the rule sees it: `footprint`, the room (token slots) its retraction would give back;
    `remaining_s`, its predicted time to finish; `decoding`, whether its prefill is done (only then may it go)."""

    request: SchedRequest
    footprint: int
    remaining_s: float
    decoding: bool = True


@dataclass(frozen=True)
class RoomSquash:
    victims: tuple[SchedRequest, ...]
    """Retract each in the engine (keeping its KV as cache), then `commit_room_squash`."""
    beneficiary: SchedRequest
    """R1: queued; the next batch admits it first."""
    shortfall: int
    """Token slots R1 needed beyond the room when the squash fired."""
    wait_s: float
    """Predicted time until running requests ending would have freed the shortfall (inf: they would not)."""


def room_free_in_s(running: Sequence[RoomVictim], shortfall: int) -> float:
    """Predicted time until the running requests, ending in order of their remaining time, have given back
    `shortfall` slots: 0 for none needed, inf when all of them together give back less."""
    if shortfall <= 0:
        return 0.0
    freed = 0
    for v in sorted(running, key=lambda v: v.remaining_s):
        freed += v.footprint
        if freed >= shortfall:
            return v.remaining_s
    return math.inf


def choose_room_squash(r1: SchedRequest, need: int, room: int, running: Sequence[RoomVictim], now: float,
                       config: SchedConfig) -> RoomSquash | None:
    """The room squash the rule calls for now for R1 (module docstring), if any: R1 has waited
    `config.room_squash_share` of the SLO, `need` exceeds `room`, the predicted wait would take it past the SLO,
    and victims that may go cover the shortfall. Modifies nothing."""
    age = now - r1.arrival
    slo = config.ttft_slo_s
    if r1.resumed or age < config.room_squash_share * slo:
        return None
    shortfall = need - room
    if shortfall <= 0:
        return None
    wait = room_free_in_s(running, shortfall)
    if age + wait <= slo:
        return None
    eligible = [v for v in running if v.decoding and v.footprint > 0 and v.request.num_squashes < config.max_squashes]
    eligible.sort(key=lambda v: (-v.remaining_s, -v.footprint, v.request.seq))
    victims, freed = [], 0
    for v in eligible:
        victims.append(v.request)
        freed += v.footprint
        if freed >= shortfall:
            return RoomSquash(tuple(victims), r1, shortfall, wait)
    return None
