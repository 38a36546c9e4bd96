"""MELL's online KV-cache packing (paper section VI-C, Fig. 10, Alg. 1) as `MellPacker`.

Lives here: Allocate / Depart / Update and the repairs that restore Theorem 1 after each of them,
within `max_moves_per_op` unit moves per operation. Not here: the state primitives (mell_state.py),
the invariants and their checker (mell_check.py, whose docstring states them), batching and the
KV-vs-recompute choice (base.py, cost.py). Plain Python: no torch, no SGLang.

How the paper's operations map onto this code (decisions where it is silent, seed-mell.md 5.4, 9):
- Allocate T-item: the L- or M-instance with the most free memory that fits it (M-instances only
  without a T-item: P1); else the most recent T-instance if it fits; else a new instance.
  Allocate M/S: the L-instance without companion that fits it (T-items ignored, then the fewest of
  them evicted, largest first) with the most free memory; else the most recent M- (S-) instance
  with room (an M-instance's T-item evicted if it no longer fits); else a new one. Allocate L: a
  new instance, then P4 pulls a companion and P5 pulls T-items.
  Tiny requests join a multi-item with room (needy instances first, then underfull multi-items,
  then the fullest instance), else form a new one, allocated as a T-item.
- Depart: remove; the emptied slot is refilled from the most recent instance of the same label
  (P1, P2, P3) or by a fitting M/S (P4); an instance whose largest request left (its label fell
  from L or M) is emptied, its requests re-allocated, unless it is now the most recent of its label.
- Update (sizes only grow): growth in class that still fits changes nothing. Otherwise: an
  overflow evicts the cheapest set of units that leaves a valid instance (fewest moves: T-items,
  the grown request itself, or a companion); a class change that breaks the instance's composition
  moves the grown request (Depart + Allocate), except M->L in an M-instance, which stays and
  becomes an L-instance with the other M as companion when they fit.
- The migration bound: every repair checks the moves left in the operation first. A repair that
  does not fit is postponed (`pending`) and retried by later operations; a capacity overflow is
  always fixed, if need be by moving the grown unit alone (one move), so `max_moves_per_op >= 1`
  always holds. With the paper's bound of 10 no repair was ever postponed in the tests.
- Priorities: "GPU priority" = most free memory, then fewest units, then oldest; pairwise
  priority ignores distance (the packer knows no topology; cost.py does).
"""

from __future__ import annotations

from collections.abc import Hashable

from sgl_multilora.cluster.base import BasePacker
from sgl_multilora.cluster.cost import MachineOf, MigrationCostModel
from sgl_multilora.cluster.mell_check import check_packing
from sgl_multilora.cluster.mell_repair import RepairRules
from sgl_multilora.cluster.mell_state import Bin, PackedRequest, Packing, Unit
from sgl_multilora.cluster.records import Cls, size_class

L, M, S, T = Cls.L, Cls.M, Cls.S, Cls.T
Snapshot = tuple[dict[Cls, Bin | None], bool]


class MellPacker(RepairRules, BasePacker):
    name = "mell"

    def __init__(self, capacity_tokens: int, *, max_moves_per_op: int = 10,
                 cost: MigrationCostModel | None = None, machine_of: MachineOf | None = None) -> None:
        super().__init__(capacity_tokens, cost=cost, machine_of=machine_of)
        if max_moves_per_op < 1:
            raise ValueError("max_moves_per_op must be >= 1: fixing an overflow takes one move")
        self.max_moves_per_op = max_moves_per_op
        self.p = Packing(capacity_tokens, self._log_move, self._count_unit_move)
        self.pending: dict[Bin, None] = {}
        """Instances whose repair was postponed by the migration bound (exempt from P1-P5)."""
        self._culprit: Unit | None = None
        self._snap: Snapshot = ({}, False)
        self._changed_class = False

    # ---- queries ---------------------------------------------------------------------------------

    def instance_of(self, rid: Hashable) -> int | None:
        r = self.p.requests.get(rid)
        return None if r is None else self.p.bin_of(r).iid

    def size_of(self, rid: Hashable) -> int | None:
        r = self.p.requests.get(rid)
        return None if r is None else r.size

    def instances(self) -> dict[int, int]:
        return {iid: b.used for iid, b in self.p.bins.items()}

    def labels(self) -> dict[int, str]:
        return {iid: b.label.name for iid, b in self.p.bins.items() if b.label is not None}

    def check_invariants(self) -> None:
        assert not self.p.dirty, f"instances left unrepaired: {list(self.p.dirty)}"
        check_packing(self.p, self.pending)

    # ---- operations ------------------------------------------------------------------------------

    def _allocate(self, rid: Hashable, size: int) -> None:
        self._begin()
        r = PackedRequest(rid, size, size_class(size, self.capacity))
        self.p.requests[rid] = r
        if r.cls != Cls.TINY:
            self._put(r, None)
        elif (host := self._bundle_with_room(size)) is not None:
            self.p.join(r, host)
        else:
            bundle = self.p.new_bundle()
            self.p.join(r, bundle)
            self._put(bundle, None)
        self._repair()

    def _update(self, rid: Hashable, new_size: int) -> None:
        r = self.p.requests[rid]
        if new_size == r.size:
            return
        if self._grows_quietly(r, new_size):
            self.p.grow(r, new_size)
            self.p.dirty.clear()
            self.p.op_labels.clear()
            return
        self._begin()
        old_cls = r.cls
        self.p.grow(r, new_size)
        self._culprit = r.bundle or r
        self._changed_class = r.cls != old_cls
        self._repair()

    def _depart(self, rid: Hashable) -> None:
        self._begin()
        r = self.p.requests.pop(rid)
        if r.bundle is not None:
            self.p.leave(r)
        else:
            self.p.remove(r)
        self._repair()

    def _grows_quietly(self, r: PackedRequest, new_size: int) -> bool:
        """Growth inside the class that keeps the instance within capacity (and a multi-item within
        C/4) breaks no invariant: usage only rises and fits only get harder."""
        C, delta = self.capacity, new_size - r.size
        if self.pending or size_class(new_size, C) != r.cls or self.p.bin_of(r).used + delta > C:
            return False
        return r.bundle is None or 4 * (r.bundle.size + delta) <= C

    def _budget(self) -> int:
        return self.max_moves_per_op - self._op_units

    # ---- repairs ---------------------------------------------------------------------------------

    def _begin(self) -> None:
        self.p.op_labels.clear()
        self._changed_class = False
        self._culprit = None
        self._snap = self._snapshot()

    def _snapshot(self) -> Snapshot:
        return {c: self.p.most_recent(c) for c in (L, M, S, T)}, bool(self.p.pools[T])

    def _lost_exemptions(self, snap: Snapshot, seen: dict[Bin, tuple[bool, bool]]) -> list[Bin]:
        """Instances whose last check may no longer hold: the most recent instance of a label at
        `snap` that no longer is; an instance checked while it was the most recent of its label
        (`seen`: exempt then, T-instances existed then) that no longer is; and every L- and
        M-instance checked, or not touched since `snap`, while no T-instance existed (P5)."""
        recent, had_t = snap
        t_now = bool(self.p.pools[T])
        lost = [old for label, old in recent.items() if old is not None and old.alive
                and old.label == label and not self.p.is_most_recent(old)]
        for b, (was_latest, had_t_then) in seen.items():
            if b.alive and ((was_latest and not self.p.is_most_recent(b))
                            or (t_now and not had_t_then and b.label in (L, M))):
                lost.append(b)
        if t_now and not had_t:
            lost += list(self.p.pools[L]) + list(self.p.pools[M])
        return lost

    def _new_p4_sources(self, touched: set[Bin], was_pending: set[Bin]) -> bool:
        """Whether an M/S-request may sit on an M/S-instance without having passed Allocate's check
        of the L-instances: its instance's label changed, or left `pending`, or it grew into M/S."""
        for b in touched:
            if b.alive and b.label in (M, S) and (self.p.op_labels.get(b, b.label) != b.label
                                                   or b in was_pending):
                return True
        c = self._culprit
        return self._changed_class and c is not None and c.cls in (M, S) and c.bin is not None \
            and c.bin.label in (M, S)

    def _repair(self) -> None:
        for b in self.pending:
            self.p.mark(b)
        was_pending = set(self.pending)
        self.pending = {}
        snap = self._snap
        touched: set[Bin] = set()
        sources_checked = False
        for _ in range(1000):
            seen: dict[Bin, tuple[bool, bool]] = {}
            while self.p.dirty:
                b = next(iter(self.p.dirty))
                del self.p.dirty[b]
                touched.add(b)
                self._repair_bin(b)
                seen[b] = (self.p.is_most_recent(b), bool(self.p.pools[T]))
            lost = self._lost_exemptions(snap, seen)
            if not sources_checked and self._new_p4_sources(touched, was_pending):
                sources_checked = True
                lost += [b for b in self.p.pools[L] if not b.of_class(M, S)]
            if not lost:
                break
            snap = self._snapshot()
            for b in lost:
                self.p.mark(b)
        else:
            raise AssertionError("MELL repairs did not converge")
        self._culprit = None

    def _repair_bin(self, b: Bin) -> None:
        for _ in range(64):
            if not b.alive:
                return
            if b.used > self.capacity:
                self._fix_overflow(b)
                continue
            start = self.p.op_labels.get(b, b.label)
            if start in (L, M) and b.label < start and not self.p.is_most_recent(b):
                if not self._evacuate(b):
                    self.pending[b] = None
                return
            done = self._fix_composition(b)
            if done is None:
                done = self._fix_deficit(b)
            if done is None:
                self.pending.pop(b, None)
                return
            if not done:
                self.pending[b] = None
                return
        raise AssertionError(f"{b}: repairs did not settle")

