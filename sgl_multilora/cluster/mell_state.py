"""MELL's packing state: instances (bins), requests, multi-items of tiny requests, label pools.

Lives here: `Packing`, the only owner of who sits where. It places, removes, moves and resizes units,
keeps every bin's `used`, label and pool, forms multi-items, logs each move and marks changed bins
dirty. Not here: which unit goes where (mell.py decides) or the invariant checks (mell_check.py).

Units: a request of class L, M, S or T is a unit by itself; tiny requests (<= C/8) sit in
multi-items (`Bundle`), each one unit of class T. A bundle lives on one bin, holds <= C/4 tokens,
and each bin holds at most one bundle of <= C/8 tokens ("underfull"): bundles on the same bin merge
and split without any move, since they are only a grouping of requests that already share the bin.

    bin 3 (label L, used 0.86 C):  [L 0.55] [bundle 0.18: r7 r9 r12] [T 0.13]
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import ClassVar

from sgl_multilora.cluster.records import Cls, size_class


@dataclass(slots=True, eq=False)
class PackedRequest:
    rid: Hashable
    size: int
    cls: Cls
    bin: Bin | None = None
    """Set for L/M/S/T requests (units); None for tiny ones, which live in `bundle`."""
    bundle: Bundle | None = None


@dataclass(slots=True, eq=False)
class Bundle:
    bid: int
    size: int = 0
    members: dict[Hashable, PackedRequest] = field(default_factory=dict)
    bin: Bin | None = None
    cls: ClassVar[Cls] = Cls.T


Unit = PackedRequest | Bundle


@dataclass(slots=True, eq=False)
class Bin:
    iid: int
    seq: int
    """Activation order: the most recently activated bin of a label has the highest seq in it."""
    used: int = 0
    units: dict[Unit, None] = field(default_factory=dict)
    label: Cls | None = None
    alive: bool = True

    def count(self, cls: Cls) -> int:
        return sum(1 for u in self.units if u.cls == cls)

    def of_class(self, *classes: Cls) -> list[Unit]:
        return [u for u in self.units if u.cls in classes]

    def underfull(self, capacity: int) -> Bundle | None:
        for u in self.units:
            if isinstance(u, Bundle) and 8 * u.size <= capacity:
                return u
        return None

    def __repr__(self) -> str:
        return f"Bin({self.iid}, {self.label.name if self.label else '-'}, used={self.used})"


MoveLog = Callable[[Hashable, int, int, int], None]


def members(u: Unit) -> Iterable[PackedRequest]:
    return u.members.values() if isinstance(u, Bundle) else (u,)


class Packing:
    def __init__(self, capacity: int, on_move: MoveLog, on_unit_move: Callable[[], None]) -> None:
        self.C = capacity
        self.bins: dict[int, Bin] = {}
        self.requests: dict[Hashable, PackedRequest] = {}
        self.bundles: dict[int, Bundle] = {}
        self.pools: dict[Cls, dict[Bin, None]] = {c: {} for c in (Cls.T, Cls.S, Cls.M, Cls.L)}
        self.dirty: dict[Bin, None] = {}
        self.op_labels: dict[Bin, Cls | None] = {}
        """Label of each bin relabelled during the current operation, as it was when the operation
        started (the caller clears it at each operation's start)."""
        self._recent: dict[Cls, Bin | None] = {}
        self._on_move = on_move
        self._on_unit_move = on_unit_move
        self._next_iid = 0
        self._next_bid = 0

    # ---- queries (modify nothing) ----------------------------------------------------------------

    def bin_of(self, r: PackedRequest) -> Bin:
        b = r.bundle.bin if r.bundle is not None else r.bin
        assert b is not None, f"request {r.rid} is not placed"
        return b

    def most_recent(self, label: Cls, exclude: Iterable[Bin] = ()) -> Bin | None:
        skip = set(exclude)
        if not skip and label in self._recent:
            return self._recent[label]
        best = None
        for b in self.pools[label]:
            if b not in skip and (best is None or b.seq > best.seq):
                best = b
        if not skip:
            self._recent[label] = best
        return best

    def is_most_recent(self, b: Bin) -> bool:
        return b.label is not None and self.most_recent(b.label) is b

    # ---- bins ------------------------------------------------------------------------------------

    def new_bin(self) -> Bin:
        b = Bin(self._next_iid, self._next_iid)
        self._next_iid += 1
        self.bins[b.iid] = b
        return b

    def _terminate(self, b: Bin) -> None:
        assert not b.units and b.used == 0, f"terminating non-empty {b}"
        if b.label is not None:
            del self.pools[b.label][b]
            self._recent.pop(b.label, None)
        b.label = None
        b.alive = False
        del self.bins[b.iid]
        self.dirty.pop(b, None)

    def _relabel(self, b: Bin) -> None:
        new = max((u.cls for u in b.units), default=None)
        old = b.label
        if new != old:
            self.op_labels.setdefault(b, old)
            if old is not None:
                del self.pools[old][b]
                self._recent.pop(old, None)
            if new is not None:
                self.pools[new][b] = None
                self._recent.pop(new, None)
            b.label = new
        if new is None:
            self._terminate(b)
        else:
            self.dirty[b] = None

    def mark(self, b: Bin) -> None:
        if b.alive:
            self.dirty[b] = None

    # ---- units -----------------------------------------------------------------------------------

    def add(self, u: Unit, b: Bin) -> None:
        """Places unit `u` (not placed) on live bin `b`; an underfull bundle joins b's underfull one.
        Does not check capacity: callers check first."""
        assert b.alive and u.bin is None, f"add {u} to {b}"
        if isinstance(u, Bundle) and 8 * u.size <= self.C and (host := b.underfull(self.C)):
            b.used += u.size
            self._absorb(host, u)
        else:
            b.units[u] = None
            u.bin = b
            b.used += u.size
        self._relabel(b)

    def remove(self, u: Unit) -> Bin:
        """Takes `u` off its bin; an emptied bin is terminated. Returns the (maybe dead) bin."""
        b = u.bin
        assert b is not None and u in b.units, f"remove {u}: not placed"
        del b.units[u]
        b.used -= u.size
        u.bin = None
        self._relabel(b)
        return b

    def move(self, u: Unit, dst: Bin) -> None:
        src = u.bin
        assert src is not None and src is not dst, f"move {u} onto its own bin"
        for r in members(u):
            self._on_move(r.rid, src.iid, dst.iid, r.size)
        self._on_unit_move()
        self.remove(u)
        self.add(u, dst)

    # ---- requests and bundles ----------------------------------------------------------------------

    def new_bundle(self) -> Bundle:
        bundle = Bundle(self._next_bid)
        self._next_bid += 1
        self.bundles[bundle.bid] = bundle
        return bundle

    def join(self, r: PackedRequest, bundle: Bundle) -> None:
        bundle.members[r.rid] = r
        bundle.size += r.size
        r.bundle = bundle
        if bundle.bin is not None:
            bundle.bin.used += r.size
            self.mark(bundle.bin)

    def leave(self, r: PackedRequest) -> Bin:
        """Takes tiny request `r` out of its bundle and its bin (a departure). Returns the bin."""
        bundle = r.bundle
        assert bundle is not None and bundle.bin is not None
        b = bundle.bin
        del bundle.members[r.rid]
        bundle.size -= r.size
        b.used -= r.size
        r.bundle = None
        if not bundle.members:
            del b.units[bundle]
            bundle.bin = None
            del self.bundles[bundle.bid]
        self._merge_underfull(b)
        self._relabel(b)
        return b

    def grow(self, r: PackedRequest, new_size: int) -> Bin:
        """Resizes placed request `r` in place. A tiny request that outgrows C/8 leaves its bundle
        and becomes a unit on the same bin; a bundle that outgrows C/4 splits (no move)."""
        b = self.bin_of(r)
        delta = new_size - r.size
        new_cls = size_class(new_size, self.C)
        bundle = r.bundle
        b.used += delta
        if bundle is not None:
            bundle.size += delta
            r.size = new_size
            if new_cls != Cls.TINY:
                del bundle.members[r.rid]
                bundle.size -= new_size
                r.bundle = None
                if not bundle.members:
                    del b.units[bundle]
                    bundle.bin = None
                    del self.bundles[bundle.bid]
                b.units[r] = None
                r.bin = b
            elif 4 * bundle.size > self.C:
                self._split(bundle)
            self._merge_underfull(b)
        r.size = new_size
        r.cls = new_cls
        self._relabel(b)
        return b

    def _absorb(self, host: Bundle, other: Bundle) -> None:
        """Moves `other`'s members into `host` (same bin, or `other` unplaced); `other` disappears."""
        for rid, r in other.members.items():
            host.members[rid] = r
            r.bundle = host
        host.size += other.size
        if other.bin is not None:
            del other.bin.units[other]
            other.bin = None
        other.members = {}
        other.size = 0
        del self.bundles[other.bid]

    def _merge_underfull(self, b: Bin) -> None:
        small = [u for u in b.units if isinstance(u, Bundle) and 8 * u.size <= self.C]
        for other in small[1:]:
            self._absorb(small[0], other)

    def _split(self, bundle: Bundle) -> None:
        """First-fit decreasing of the members into bundles of at most C/4, on the same bin."""
        b = bundle.bin
        assert b is not None
        ordered = sorted(bundle.members.values(), key=lambda r: -r.size)
        pieces: list[list[PackedRequest]] = []
        loads: list[int] = []
        for r in ordered:
            for i, load in enumerate(loads):
                if 4 * (load + r.size) <= self.C:
                    pieces[i].append(r)
                    loads[i] += r.size
                    break
            else:
                pieces.append([r])
                loads.append(r.size)
        bundle.members = {r.rid: r for r in pieces[0]}
        bundle.size = loads[0]
        for piece, load in zip(pieces[1:], loads[1:]):
            extra = self.new_bundle()
            extra.members = {r.rid: r for r in piece}
            extra.size = load
            for r in piece:
                r.bundle = extra
            b.units[extra] = None
            extra.bin = b
