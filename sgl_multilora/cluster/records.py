"""The cluster packers' value types: size classes, moves, migrations, placements, batch results and
the typed errors of the API edge.

Lives here: records that every packer (MELL and the baselines) and every caller share. Not here: any
placement logic (mell.py, baselines.py) or the choice between KV and token transfer (cost.py).

Sizes are KV tokens (ints): a request's size is the KV it holds, or is planned to hold by the end of
the current epoch; an instance's capacity `C` is the KV tokens its pool holds after weights.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import IntEnum

RequestId = Hashable


class Cls(IntEnum):
    """MELL's size classes, ordered so that `max()` over a bin's units gives its label.

    L: s > C/2; M: C/3 < s <= C/2; S: C/4 < s <= C/3; T: C/8 < s <= C/4; TINY: s <= C/8 (tiny
    requests travel in multi-items, which count as T)."""

    TINY = 0
    T = 1
    S = 2
    M = 3
    L = 4


def size_class(size: int, capacity: int) -> Cls:
    """Exact integer comparisons: no rounding at the class boundaries."""
    if 2 * size > capacity:
        return Cls.L
    if 3 * size > capacity:
        return Cls.M
    if 4 * size > capacity:
        return Cls.S
    if 8 * size > capacity:
        return Cls.T
    return Cls.TINY


class ItemTooLarge(ValueError):
    """A request whose KV exceeds one instance's capacity: no placement can ever hold it."""


class UnknownRequest(KeyError):
    pass


class DuplicateRequest(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Move:
    """One request changing instance in the packing; the KV-vs-token choice is not made yet."""

    rid: RequestId
    src: int
    dst: int
    kv_tokens: int


@dataclass(frozen=True, slots=True)
class Migration:
    """A move as the executor runs it. kind "kv": copy the KV over the link (Llumnix style);
    "recompute": send the token ids and re-prefill at `dst` (ServerlessLLM style). `over_budget`:
    neither the link's nor the destination's per-epoch budget had room, and `kind` is the one with
    the lower estimated time (see cost.py)."""

    rid: RequestId
    src: int
    dst: int
    kv_tokens: int
    kind: str
    over_budget: bool = False


@dataclass(frozen=True, slots=True)
class Placement:
    """What `allocate` returns: the instance the new request runs on, and the migrations the
    allocation caused (MELL may pull a companion into a new instance or evict T-items)."""

    instance: int
    migrations: tuple[Migration, ...] = ()


@dataclass(frozen=True, slots=True)
class BatchResult:
    """One epoch's operations applied together (operation batching).

    placements: instance of every request allocated in the batch, after the whole batch.
    migrations: the moves left after removing unnecessary ones (chains a->b->c become a->c, a->b->a
    disappears, requests allocated in the batch are placed at their final instance instead).
    num_moves_before: request moves the operations made before that removal."""

    placements: dict[RequestId, int]
    migrations: tuple[Migration, ...]
    num_ops: int
    num_moves_before: int


@dataclass(slots=True)
class MoveStats:
    """Moves per operation. A unit move is one item moved as the paper counts it (a multi-item of
    tiny requests counts once); a request move is one request changing instance."""

    num_ops: int = 0
    unit_moves: int = 0
    request_moves: int = 0
    max_unit_moves: int = 0
    hist: dict[int, int] = field(default_factory=dict)

    def record(self, unit_moves: int, request_moves: int) -> None:
        self.num_ops += 1
        self.unit_moves += unit_moves
        self.request_moves += request_moves
        self.max_unit_moves = max(self.max_unit_moves, unit_moves)
        self.hist[unit_moves] = self.hist.get(unit_moves, 0) + 1
