"""MELL's Allocate rules: where a new or evicted unit goes, and which units it pushes out there.

Lives here: `AllocateRules`, a mixin of `MellPacker` (mell.py) over its `Packing`. Not here: when a
unit must move (mell_repair.py) or the operations themselves (mell.py). The rules, with the choices
the paper leaves open, are listed in mell.py's docstring.
"""

from __future__ import annotations

from sgl_multilora.cluster.mell_state import Bin, Bundle, Packing, Unit
from sgl_multilora.cluster.records import Cls

L, M, S, T = Cls.L, Cls.M, Cls.S, Cls.T


class AllocateRules:
    """Needs `p`, `capacity` and `_budget()` (moves left in the current operation) from its host."""

    p: Packing
    capacity: int
    pending: dict[Bin, None]

    def _budget(self) -> int:
        raise NotImplementedError

    def _put(self, u: Unit, exclude: Bin | None, reserve: int = 0) -> Bin:
        """Places new unit `u`, or moves it off `exclude`, by the Allocate rules. Evictions at the
        destination use only moves beyond `reserve` (kept for the caller's next moves)."""
        spare = self._budget() - (u.bin is not None) - reserve
        dst, evict = self._home(u, exclude, spare)
        if dst is None:
            dst = self.p.new_bin()
        for e in evict:
            self._put(e, dst)
        if u.bin is None:
            self.p.add(u, dst)
        else:
            self.p.move(u, dst)
        return dst

    def _home(self, u: Unit, exclude: Bin | None, spare: int) -> tuple[Bin | None, list[Unit]]:
        C, c = self.capacity, u.cls
        if c == L:
            return None, []
        if c == T:
            return self._t_home(u, exclude), []
        found = self._lonely_l_for(u, exclude, spare)
        if found is not None:
            return found
        k = self.p.most_recent(c)
        if k is None or k is exclude or k is u.bin or k.of_class(S if c == M else T):
            return None, []
        if c == S:
            return (k, []) if k.count(S) < 3 and k.used + u.size <= C else (None, [])
        if k.count(M) != 1:
            return None, []
        evict = [] if k.used + u.size <= C else k.of_class(T)
        return (k, evict) if len(evict) <= spare else (None, [])

    def _lonely_l_for(self, u: Unit, exclude: Bin | None, spare: int
                      ) -> tuple[Bin, list[Unit]] | None:
        C = self.capacity
        best, best_key = None, None
        for b in self.p.pools[L]:
            if b is exclude or b is u.bin or b.of_class(M, S) or b.count(L) != 1:
                continue
            if b.of_class(L)[0].size + u.size > C:
                continue
            evict = self._cover(b.of_class(T), b.used + u.size - C, single=False)
            if evict is None:
                continue
            if len(evict) > spare:
                self.pending[b] = None  # P4 may fail on b until a later operation has the moves
                continue
            key = (C - b.used, -len(b.units), -b.seq)
            if best_key is None or key > best_key:
                best, best_key = (b, evict), key
        return best

    def _t_home(self, u: Unit, exclude: Bin | None) -> Bin | None:
        C = self.capacity
        best, best_key = None, None
        for label in (L, M):
            for b in self.p.pools[label]:
                if b is exclude or b is u.bin or b.used + u.size > C:
                    continue
                if label == M and not self._m_takes_t(b, u):
                    continue
                key = (C - b.used, label == L, -b.seq)
                if best_key is None or key > best_key:
                    best, best_key = b, key
        if best is not None:
            return best
        k = self.p.most_recent(T)
        if k is not None and k is not exclude and k is not u.bin and k.used + u.size <= C:
            return k
        return None

    def _m_takes_t(self, b: Bin, u: Unit) -> bool:
        ts = b.of_class(T)
        if b.of_class(S) or len(ts) > 1:
            return False
        if not ts:
            return True
        # two multi-items of <= C/8 merge into one T-item
        return all(isinstance(x, Bundle) and 8 * x.size <= self.capacity for x in (ts[0], u))

    def _bundle_with_room(self, size: int) -> Bundle | None:
        C = self.capacity
        best, best_key = None, None
        for bundle in self.p.bundles.values():
            b = bundle.bin
            if b is None or 4 * (bundle.size + size) > C or b.used + size > C:
                continue
            key = (4 * b.used < 3 * C, 8 * bundle.size <= C, b.used)
            if best_key is None or key > best_key:
                best, best_key = bundle, key
        return best

    @staticmethod
    def _cover(units: list[Unit], need: int, single: bool = True) -> list[Unit] | None:
        """The fewest of `units` whose sizes sum to >= need (the smallest single one if `single`
        and one suffices, else largest first); [] if need <= 0; None if all of them fall short."""
        if need <= 0:
            return []
        if single:
            one = min((u for u in units if u.size >= need), key=lambda u: u.size, default=None)
            if one is not None:
                return [one]
        chosen, total = [], 0
        for u in sorted(units, key=lambda u: -u.size):
            chosen.append(u)
            total += u.size
            if total >= need:
                return chosen
        return None

    def _evacuate(self, b: Bin) -> bool:
        units = list(b.units)
        if len(units) > self._budget():
            return False
        for i, u in enumerate(units):
            self._put(u, b, reserve=len(units) - i - 1)
        return True
