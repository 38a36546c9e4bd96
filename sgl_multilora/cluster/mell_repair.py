"""MELL's repairs: what restores capacity and Theorem 1 on one instance after an operation changed it.

Lives here: `RepairRules`, a mixin of `MellPacker`: overflow (always fixed), composition (P1, P2, the
L composition) and deficits (P1-P5). Each fix returns None (nothing to fix), True (moved something;
look again) or False (the operation's migration bound leaves no room: postpone). Not here: the loop
over dirty instances and the operations (mell.py), destinations (mell_place.py).
"""

from __future__ import annotations

from sgl_multilora.cluster.mell_check import composition_problem
from sgl_multilora.cluster.mell_place import AllocateRules
from sgl_multilora.cluster.mell_state import Bin, Bundle, Unit
from sgl_multilora.cluster.records import Cls

L, M, S, T = Cls.L, Cls.M, Cls.S, Cls.T


class RepairRules(AllocateRules):
    _culprit: Unit | None
    """The unit that grew in the current Update, if any."""

    def _culprit_on(self, b: Bin) -> Unit | None:
        c = self._culprit
        return c if c is not None and c.bin is b else None

    # ---- capacity ----------------------------------------------------------------------------------

    def _fix_overflow(self, b: Bin) -> None:
        """Evicts the fewest units (within the bound) that leave `b` within capacity with a valid
        composition and its label; else the grown unit alone, which always fits elsewhere."""
        over = b.used - self.capacity
        culprit = self._culprit_on(b)
        best = None
        for option in self._overflow_options(b, over, culprit):
            if len(option) <= self._budget() and self._leaves_valid(b, option) and (
                    best is None or len(option) < len(best)):
                best = option
        if best is None:
            assert culprit is not None and culprit.size >= over and self._budget() >= 1, \
                f"{b} over capacity by {over} with no grown unit to move (a repair overfilled it)"
            best = [culprit]
        for i, u in enumerate(best):
            self._put(u, b, reserve=len(best) - i - 1)

    def _overflow_options(self, b: Bin, over: int, culprit: Unit | None) -> list[list[Unit]]:
        ts = b.of_class(T)
        options = []
        if (cover := self._cover(ts, over)) is not None:
            options.append(cover)
        if culprit is not None and culprit.size >= over:
            options.append([culprit])
        if b.label == L:
            for c in b.of_class(M, S):
                if c is not culprit and (cover := self._cover(ts, over - c.size)) is not None:
                    options.append(cover + [c])
        if culprit is not None:
            options.append([u for u in b.units if u is not culprit])
        return options

    def _leaves_valid(self, b: Bin, option: list[Unit]) -> bool:
        rest = [u for u in b.units if u not in option]
        if not rest:
            return True
        if b.used - sum(u.size for u in option) > self.capacity:
            return False
        if composition_problem(rest, self.capacity) is not None:
            return False
        label = max(u.cls for u in rest)
        return label in (b.label, self.p.op_labels.get(b, b.label))

    # ---- composition -----------------------------------------------------------------------------

    def _fix_composition(self, b: Bin) -> bool | None:
        if composition_problem(b.units, self.capacity) is None:
            return None
        if self._budget() < 1:
            return False
        culprit = self._culprit_on(b)
        rest = [u for u in b.units if u is not culprit]
        if culprit is not None and culprit.cls == b.label and rest and \
                composition_problem(rest, self.capacity) is None:
            victim = culprit  # a class change broke the instance: Depart + Allocate the grown one
        else:
            allowed_out = {L: (M, S), M: (S,) if b.of_class(S) else (T,), S: (T,)}.get(b.label, ())
            offenders = b.of_class(*allowed_out)
            assert offenders, f"{b}: {composition_problem(b.units, self.capacity)}, nothing to evict"
            victim = culprit if culprit in offenders else min(offenders, key=lambda u: u.size)
        self._put(victim, b)
        return True

    # ---- deficits --------------------------------------------------------------------------------

    def _fix_deficit(self, b: Bin) -> bool | None:
        C = self.capacity
        latest = self.p.is_most_recent(b)
        needy = 4 * b.used < 3 * C
        t_exist = bool(self.p.pools[T])
        if b.label == M:
            if b.count(M) == 1 and not latest:
                return self._refill_m(b)
            if needy and t_exist and not latest:
                return self._top_up_m(b)
        elif b.label == S:
            if b.count(S) < 3 and not latest:
                return self._pull_one(b, self.p.most_recent(S, exclude=[b]), (S,))
        elif b.label == T:
            if needy and not latest:
                return self._pull_one(b, self.p.most_recent(T, exclude=[b]), (T,))
        elif b.label == L:
            if not b.of_class(M, S) and (done := self._pull_companion(b)) is not None:
                return done
            if needy and t_exist:
                return self._pull_one(b, self.p.most_recent(T), (T,))
        return None

    def _pull_one(self, b: Bin, k: Bin | None, classes: tuple[Cls, ...]) -> bool:
        """P2, P3, P5 on an L-instance: the largest unit of `classes` on `k` moves to b."""
        assert k is not None and k is not b, f"{b}: no source instance to refill from"
        x = max(k.of_class(*classes), key=lambda u: u.size)
        assert b.used + x.size <= self.capacity, f"refill of {b} from {k} does not fit"
        if self._budget() < 1:
            return False
        self.p.move(x, b)
        return True

    def _refill_m(self, b: Bin) -> bool:
        """P1: an M from the most recent M-instance; b's T-item leaves if both M no longer fit."""
        k = self.p.most_recent(M, exclude=[b])
        assert k is not None, f"{b} holds one M but no other M-instance exists"
        ms = sorted(k.of_class(M), key=lambda u: -u.size)
        fitting = [m for m in ms if b.used + m.size <= self.capacity]
        m, evict = (fitting[0], []) if fitting else (ms[0], b.of_class(T))
        if self._budget() < 1 + len(evict):
            return False
        for i, t in enumerate(evict):
            self._put(t, b, reserve=len(evict) - i)
        self.p.move(m, b)
        return True

    def _pull_companion(self, b: Bin) -> bool | None:
        """P4: the M/S-request from an M/S-instance that fits with b's L (the most recent
        instances' first, then the largest); b's T-items leave as needed."""
        C = self.capacity
        room = C - b.of_class(L)[0].size
        recents = (self.p.most_recent(M), self.p.most_recent(S))
        best, best_key = None, None
        for label in (M, S):
            for k in self.p.pools[label]:
                for r in k.of_class(M, S):
                    key = (k in recents, r.size, -k.seq)
                    if r.size <= room and (best_key is None or key > best_key):
                        best, best_key = r, key
        if best is None:
            return None
        evict = self._cover(b.of_class(T), b.used + best.size - C, single=False)
        assert evict is not None, f"{best} fits {b}'s L but not after evicting its T-items"
        if self._budget() < 1 + len(evict):
            return False
        for i, t in enumerate(evict):
            self._put(t, b, reserve=len(evict) - i)
        self.p.move(best, b)
        return True

    def _top_up_m(self, b: Bin) -> bool:
        """P5 on an M-instance: one T-item that lifts it to 3C/4, from the most recent T-instance
        (else the one before it); an underfull multi-item already there leaves unless they merge."""
        C = self.capacity
        ts = b.of_class(T)
        t = ts[0] if ts else None
        base = b.used - (t.size if t is not None else 0)
        k0 = self.p.most_recent(T)
        k1 = self.p.most_recent(T, exclude=[k0]) if k0 is not None else None
        for k in (k0, k1):
            if k is None:
                continue
            for x in sorted(k.units, key=lambda u: -u.size):
                merge = t is not None and _underfull(t, C) and _underfull(x, C)
                total = b.used + x.size if merge else base + x.size
                if total > C or 4 * total < 3 * C:
                    continue
                evict = [] if merge or t is None else [t]
                if self._budget() < 1 + len(evict):
                    return False
                for e in evict:
                    self._put(e, b, reserve=1)
                self.p.move(x, b)
                return True
        return False


def _underfull(u: Unit, capacity: int) -> bool:
    return isinstance(u, Bundle) and 8 * u.size <= capacity
