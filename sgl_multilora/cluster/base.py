"""The packer interface a router-side caller drives, and what every packer shares: the public
operations, operation batching, the removal of unnecessary moves and the KV-vs-recompute plan.

Lives here: `BasePacker` and `compress_moves`. Not here: any placement rule (mell.py, baselines.py).

Contract of the public operations (all mutate the packing):
- `allocate(rid, kv_tokens) -> Placement`: a new request; raises `DuplicateRequest`, and
  `ItemTooLarge` when kv_tokens exceeds one instance (never placeable);
- `update(rid, new_kv_tokens) -> list[Migration]`: the request's KV grew (sizes never shrink:
  a smaller value raises ValueError);
- `depart(rid) -> list[Migration]`: the request finished;
- `apply_batch(departs, updates, allocates) -> BatchResult`: one epoch's operations in the paper's
  order (all departures, then updates, then allocations), the moves executed once at the end.
Instance ids are ints; an id seen for the first time is an instance to start, and an id missing
from `instances()` afterwards is one to stop. Migrations of one call are a set: the packing after
the call respects capacity, so an executor should run moves out of an instance before moves into it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Mapping

from sgl_multilora.cluster.cost import MachineOf, MigrationCostModel
from sgl_multilora.cluster.records import (
    BatchResult,
    DuplicateRequest,
    ItemTooLarge,
    Migration,
    Move,
    MoveStats,
    Placement,
    UnknownRequest,
)


def compress_moves(moves: list[Move], allocated: set[Hashable], alive: Callable[[Hashable], int | None]
                   ) -> list[Move]:
    """One move per request, from where it was before the batch to where it is after: chains
    a->b->c become a->c, a->b->a disappears, requests allocated in the batch (`allocated`) and
    requests gone after it (`alive(rid)` is None) get none. Ordered by each request's first move.
    `alive(rid)` returns the request's size now, or None."""
    first: dict[Hashable, int] = {}
    last_dst: dict[Hashable, int] = {}
    for m in moves:
        first.setdefault(m.rid, m.src)
        last_dst[m.rid] = m.dst
    out = []
    for rid, src in first.items():
        size = alive(rid)
        if rid in allocated or size is None or src == last_dst[rid]:
            continue
        out.append(Move(rid, src, last_dst[rid], size))
    return out


class BasePacker(ABC):
    name: str = "base"

    def __init__(self, capacity_tokens: int, *, cost: MigrationCostModel | None = None,
                 machine_of: MachineOf | None = None) -> None:
        if capacity_tokens < 1:
            raise ValueError(f"capacity_tokens must be >= 1, got {capacity_tokens}")
        self.capacity = capacity_tokens
        self.cost = cost or MigrationCostModel()
        self.machine_of = machine_of
        """Instance id -> machine, for the KV-vs-recompute plan (the caller knows where it started
        each instance); None: ids numbered machine by machine."""
        self.op_stats = MoveStats()
        """Moves per allocate / update / depart operation, before batching."""
        self.settle_stats = MoveStats()
        """Moves of the end-of-call step (the Llumnix-like rebalancing); MELL has none."""
        self._moves: list[Move] = []
        self._op_units = 0

    # ---- what subclasses implement ---------------------------------------------------------------

    @abstractmethod
    def _allocate(self, rid: Hashable, kv_tokens: int) -> None: ...

    @abstractmethod
    def _update(self, rid: Hashable, new_kv_tokens: int) -> None: ...

    @abstractmethod
    def _depart(self, rid: Hashable) -> None: ...

    @abstractmethod
    def instance_of(self, rid: Hashable) -> int | None:
        """The instance `rid` runs on, or None if unknown. Modifies nothing."""

    @abstractmethod
    def size_of(self, rid: Hashable) -> int | None:
        """`rid`'s KV tokens as last reported, or None if unknown."""

    @abstractmethod
    def instances(self) -> dict[int, int]:
        """Active instance id -> KV tokens on it (planned sizes). A copy."""

    @abstractmethod
    def check_invariants(self) -> None: ...

    def _settle(self) -> None:
        """Runs once at the end of every public call (after a whole batch); may move requests."""

    # ---- queries ---------------------------------------------------------------------------------

    @property
    def num_instances(self) -> int:
        return len(self.instances())

    def overflowing(self) -> list[int]:
        """Instances holding more than the capacity (possible only for packers that never migrate)."""
        return [i for i, used in self.instances().items() if used > self.capacity]

    # ---- public operations -----------------------------------------------------------------------

    def allocate(self, rid: Hashable, kv_tokens: int) -> Placement:
        moves = self._op(self._allocate, rid, self._checked_new(rid, kv_tokens)) + self._settled()
        placed = self.instance_of(rid)
        assert placed is not None, f"allocate left {rid} unplaced"
        return Placement(placed, tuple(self._plan(moves, {rid})))

    def update(self, rid: Hashable, new_kv_tokens: int) -> list[Migration]:
        moves = self._op(self._update, rid, self._checked_update(rid, new_kv_tokens))
        return self._plan(moves + self._settled(), set())

    def depart(self, rid: Hashable) -> list[Migration]:
        if self.size_of(rid) is None:
            raise UnknownRequest(rid)
        return self._plan(self._op(self._depart, rid) + self._settled(), set())

    def apply_batch(self, departs: Iterable[Hashable] = (),
                    updates: Mapping[Hashable, int] | Iterable[tuple[Hashable, int]] = (),
                    allocates: Mapping[Hashable, int] | Iterable[tuple[Hashable, int]] = ()
                    ) -> BatchResult:
        """One epoch. Validates nothing it has not checked per operation: an error in the middle
        leaves the operations before it applied."""
        moves: list[Move] = []
        num_ops = 0
        for rid in departs:
            if self.size_of(rid) is None:
                raise UnknownRequest(rid)
            moves += self._op(self._depart, rid)
            num_ops += 1
        for rid, size in _pairs(updates):
            moves += self._op(self._update, rid, self._checked_update(rid, size))
            num_ops += 1
        allocated = []
        for rid, size in _pairs(allocates):
            moves += self._op(self._allocate, rid, self._checked_new(rid, size))
            allocated.append(rid)
            num_ops += 1
        moves += self._settled()
        placements = {rid: self.instance_of(rid) for rid in allocated}
        migrations = self._plan(moves, set(allocated))
        return BatchResult(placements, tuple(migrations), num_ops, len(moves))  # type: ignore[arg-type]

    # ---- plumbing --------------------------------------------------------------------------------

    def _checked_new(self, rid: Hashable, kv_tokens: int) -> int:
        if self.size_of(rid) is not None:
            raise DuplicateRequest(f"request {rid!r} is already placed")
        if kv_tokens < 1:
            raise ValueError(f"kv_tokens must be >= 1, got {kv_tokens} for {rid!r}")
        if kv_tokens > self.capacity:
            raise ItemTooLarge(f"{rid!r}: {kv_tokens} KV tokens exceed one instance "
                               f"({self.capacity} tokens)")
        return kv_tokens

    def _checked_update(self, rid: Hashable, new_kv_tokens: int) -> int:
        old = self.size_of(rid)
        if old is None:
            raise UnknownRequest(rid)
        if new_kv_tokens < old:
            raise ValueError(f"{rid!r}: KV shrinks from {old} to {new_kv_tokens}; sizes only grow")
        if new_kv_tokens > self.capacity:
            raise ItemTooLarge(f"{rid!r}: {new_kv_tokens} KV tokens exceed one instance "
                               f"({self.capacity} tokens)")
        return new_kv_tokens

    def _log_move(self, rid: Hashable, src: int, dst: int, kv_tokens: int) -> None:
        self._moves.append(Move(rid, src, dst, kv_tokens))

    def _count_unit_move(self) -> None:
        self._op_units += 1

    def _op(self, fn: Callable[..., None], *args) -> list[Move]:
        self._moves, self._op_units = [], 0
        fn(*args)
        self.op_stats.record(self._op_units, len(self._moves))
        return self._moves

    def _settled(self) -> list[Move]:
        self._moves, self._op_units = [], 0
        self._settle()
        if self._moves:
            self.settle_stats.record(self._op_units, len(self._moves))
        return self._moves

    def _plan(self, moves: list[Move], allocated: set[Hashable]) -> list[Migration]:
        return self.cost.plan(compress_moves(moves, allocated, self.size_of), self.machine_of)


def _pairs(x: Mapping[Hashable, int] | Iterable[tuple[Hashable, int]]) -> Iterable[tuple[Hashable, int]]:
    return x.items() if isinstance(x, Mapping) else x
