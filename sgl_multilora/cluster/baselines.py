"""The baselines of MELL's evaluation (section VIII-B), behind the same API as `MellPacker`.

Lives here: `FitPacker` (best-fit or worst-fit dispatch, never migrates) and `LlumnixLikePacker`
(worst-fit dispatch plus Llumnix-style load balancing by KV transfer). Not here: MELL (mell.py).

All of them start an instance when no active one fits an arrival and stop an instance that empties,
as the paper states. Decisions the paper leaves open (seed-mell.md 8):
- `reserve_fraction`: an arrival fits an instance only if it leaves this share of C free. Without
  migration nothing else keeps the KV that requests grow into, so the simulator sweeps it and keeps
  each baseline's best value;
- Llumnix-like balancing, once per call (after a whole batch): first every instance over capacity
  sends requests to the emptiest instance that holds them (the smallest request that ends the
  overflow, else the largest that fits; no move bound: overflow repair always runs), then while the
  most and least loaded instances differ by more than `balance_gap_fraction` of C, the request
  closest to half the gap moves from the first to the second, at most `max_moves_per_op` moves.
  Load = KV tokens (Llumnix's "freeness" also divides by batch size; not modelled). No scale-down
  draining: an instance stops when it empties.
"""

from __future__ import annotations

from collections.abc import Hashable

from sgl_multilora.cluster.base import BasePacker
from sgl_multilora.cluster.cost import MachineOf, MigrationCostModel


class FitPacker(BasePacker):
    def __init__(self, capacity_tokens: int, *, fit: str = "best", reserve_fraction: float = 0.0,
                 cost: MigrationCostModel | None = None, machine_of: MachineOf | None = None) -> None:
        super().__init__(capacity_tokens, cost=cost, machine_of=machine_of)
        if fit not in ("best", "worst"):
            raise ValueError(f"fit must be 'best' or 'worst', got {fit!r}")
        if not 0.0 <= reserve_fraction < 1.0:
            raise ValueError(f"reserve_fraction must be in [0, 1), got {reserve_fraction}")
        self.name = f"{fit}-fit"
        self.fit = fit
        self.reserve_fraction = reserve_fraction
        self.limit = capacity_tokens - int(reserve_fraction * capacity_tokens)
        """An arrival fits an instance if its KV stays at or below this."""
        self._reqs: dict[int, dict[Hashable, int]] = {}
        self._used: dict[int, int] = {}
        self._where: dict[Hashable, int] = {}
        self._next_iid = 0

    # ---- queries ---------------------------------------------------------------------------------

    def instance_of(self, rid: Hashable) -> int | None:
        return self._where.get(rid)

    def size_of(self, rid: Hashable) -> int | None:
        iid = self._where.get(rid)
        return None if iid is None else self._reqs[iid][rid]

    def instances(self) -> dict[int, int]:
        return dict(self._used)

    def check_invariants(self) -> None:
        assert set(self._reqs) == set(self._used), "instance tables disagree"
        count = 0
        for iid, reqs in self._reqs.items():
            assert reqs, f"instance {iid} is active but empty (empty instances are stopped)"
            assert self._used[iid] == sum(reqs.values()), f"instance {iid}: used is not its sum"
            for rid in reqs:
                assert self._where.get(rid) == iid, f"request {rid} filed on {iid} but indexed elsewhere"
            count += len(reqs)
        assert count == len(self._where), "a request is indexed but on no instance"

    # ---- operations ------------------------------------------------------------------------------

    def _allocate(self, rid: Hashable, size: int) -> None:
        best, best_key = None, None
        for iid, used in self._used.items():
            if used + size > self.limit:
                continue
            key = (used if self.fit == "best" else -used, -iid)
            if best_key is None or key > best_key:
                best, best_key = iid, key
        if best is None:
            best = self._next_iid
            self._next_iid += 1
            self._reqs[best] = {}
            self._used[best] = 0
        self._reqs[best][rid] = size
        self._used[best] += size
        self._where[rid] = best

    def _update(self, rid: Hashable, new_size: int) -> None:
        iid = self._where[rid]
        self._used[iid] += new_size - self._reqs[iid][rid]
        self._reqs[iid][rid] = new_size

    def _depart(self, rid: Hashable) -> None:
        iid = self._where.pop(rid)
        self._used[iid] -= self._reqs[iid].pop(rid)
        if not self._reqs[iid]:
            del self._reqs[iid], self._used[iid]

    def _move(self, rid: Hashable, dst: int) -> None:
        src = self._where[rid]
        size = self._reqs[src].pop(rid)
        self._log_move(rid, src, dst, size)
        self._count_unit_move()
        self._used[src] -= size
        self._reqs[dst][rid] = size
        self._used[dst] += size
        self._where[rid] = dst
        if not self._reqs[src]:
            del self._reqs[src], self._used[src]


class LlumnixLikePacker(FitPacker):
    def __init__(self, capacity_tokens: int, *, reserve_fraction: float = 0.0,
                 balance_gap_fraction: float = 0.1, max_moves_per_op: int = 10,
                 cost: MigrationCostModel | None = None, machine_of: MachineOf | None = None) -> None:
        super().__init__(capacity_tokens, fit="worst", reserve_fraction=reserve_fraction, cost=cost,
                         machine_of=machine_of)
        self.name = "llumnix"
        self.balance_gap = int(balance_gap_fraction * capacity_tokens)
        self.max_moves_per_op = max_moves_per_op

    def _settle(self) -> None:
        self._repair_overflows()
        for _ in range(self.max_moves_per_op):
            if len(self._used) < 2:
                return
            src = max(self._used, key=lambda i: (self._used[i], -i))
            dst = min(self._used, key=lambda i: (self._used[i], i))
            gap = self._used[src] - self._used[dst]
            if gap <= self.balance_gap:
                return
            room = self.limit - self._used[dst]
            fits = [(abs(2 * s - gap), rid) for rid, s in self._reqs[src].items() if s < gap and s <= room]
            if not fits:
                return
            self._move(min(fits, key=lambda x: x[0])[1], dst)

    def _repair_overflows(self) -> None:
        stuck: set[int] = set()
        while True:
            over = [i for i, u in self._used.items() if u > self.capacity and i not in stuck]
            if not over or len(self._used) < 2:
                return
            src = max(over, key=lambda i: (self._used[i], -i))
            dst = min((i for i in self._used if i != src), key=lambda i: (self._used[i], i))
            excess = self._used[src] - self.capacity
            room = self.capacity - self._used[dst]
            fits = [(s, rid) for rid, s in self._reqs[src].items() if s <= room]
            if not fits:
                stuck.add(src)
                continue
            ending = [f for f in fits if f[0] >= excess]
            self._move((min(ending, key=lambda f: f[0]) if ending else max(fits, key=lambda f: f[0]))[1], dst)
