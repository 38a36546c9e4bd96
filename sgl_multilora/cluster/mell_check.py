"""MELL's packing invariants: the bookkeeping and the paper's Theorem 1, checked exactly.

Lives here: `composition_problem` (what an instance of each label may hold; mell_repair.py also
uses it to pick evictions) and `check_packing`. Not here: the repairs (mell_repair.py).

Bookkeeping (always, no exception):
  B1 every active instance holds at least one request (empty ones are stopped) and at most C tokens;
     its `used` is the sum of its units, its label the largest class among them, its pool the label's;
  B2 every request is on exactly one instance, once; L/M/S/T requests are units of their class;
     tiny requests (<= C/8) are members of exactly one multi-item, on the multi-item's instance;
  B3 a multi-item holds <= C/4 tokens; an instance holds at most one multi-item of <= C/8 tokens.
Theorem 1 as the paper states it, "with a constant number of exceptions": (1) an M-GPU holds two
M-requests, possibly one T-request; (2) an S-GPU holds three S-requests; (3) a T-GPU's memory usage
is >= 75%; (4) an L-GPU j holds no S/M-request only if no M/S-request on an M/S-GPU fits in j;
(5) T-GPUs exist only if every L/M-GPU has utilisation >= 75%. As checked here (T-item = a
T-request or a multi-item; usage tests in integers, 4 * used >= 3 * C), the exceptions made explicit:
the most recently activated instance of each label (4 at most) where noted, and the instances in
`pending` (repairs postponed because an operation reached its migration bound; never under the
default bound of 10 in the tests), which are also no P4 source:
  P1 an M-instance holds two M-requests, at most one T-item and nothing else (the most recent
     M-instance may hold one M-request);
  P2 an S-instance holds three S-requests and nothing else (the most recent: one to three);
  P3 a T-instance's usage is >= 3C/4 (except the most recent T-instance);
  P4 an L-instance j holds no M/S-request only if no M/S-request r on an M- or S-instance fits in j:
     size(L_j) + size(r) > C (j's T-items ignored, as Allocate evicts them); no exception;
  P5 T-instances exist only if every L-instance, and every M-instance but the most recent, has
     usage >= 3C/4;
  L composition (the paper's intended content, relaxed to what Allocate T allows): one L-request,
  at most one M/S-request, T-items as capacity allows.
"""

from __future__ import annotations

from collections.abc import Iterable

from sgl_multilora.cluster.mell_state import Bin, Bundle, Packing, Unit, members
from sgl_multilora.cluster.records import Cls, size_class


def composition_problem(units: Iterable[Unit], capacity: int) -> str | None:
    """Why these units cannot share an instance under its label (P1, P2 and the L composition,
    counts only), or None. Deficits (one M, fewer than three S) are not composition problems."""
    units = list(units)
    if not units:
        return None
    n = {c: 0 for c in Cls}
    num_underfull = 0
    for u in units:
        n[u.cls] += 1
        num_underfull += isinstance(u, Bundle) and 8 * u.size <= capacity
    label = max(u.cls for u in units)
    if num_underfull > 1:
        return f"{num_underfull} multi-items of <= C/8"
    if label == Cls.L and (n[Cls.L] > 1 or n[Cls.M] + n[Cls.S] > 1):
        return f"L-instance with {n[Cls.L]} L and {n[Cls.M] + n[Cls.S]} M/S requests"
    if label == Cls.M and (n[Cls.S] or n[Cls.T] > 1 or n[Cls.M] > 2):
        return f"M-instance with {n[Cls.M]} M, {n[Cls.S]} S, {n[Cls.T]} T-items"
    if label == Cls.S and (n[Cls.T] or n[Cls.S] > 3):
        return f"S-instance with {n[Cls.S]} S and {n[Cls.T]} T-items"
    return None


def check_packing(p: Packing, pending: Iterable[Bin] = ()) -> None:
    _check_bookkeeping(p)
    _check_theorem1(p, set(pending))


def _check_bookkeeping(p: Packing) -> None:
    C = p.C
    seen: set = set()
    for iid, b in p.bins.items():
        assert b.alive and b.iid == iid, f"{b} filed under {iid} or marked dead"
        assert b.units, f"{b} is active but empty (empty instances are stopped)"
        assert b.used == sum(u.size for u in b.units), f"{b}: used is not the sum of its units"
        assert b.used <= C, f"{b} exceeds the capacity {C}"
        label = max(u.cls for u in b.units)
        assert b.label == label and b in p.pools[label], f"{b}: label/pool stale, should be {label}"
        assert sum(isinstance(u, Bundle) and 8 * u.size <= C for u in b.units) <= 1, \
            f"{b} holds several multi-items of <= C/8 (they should have merged)"
        for u in b.units:
            assert u.bin is b, f"{u} on {b} points at {u.bin}"
            if isinstance(u, Bundle):
                assert u.members and p.bundles.get(u.bid) is u, f"bundle {u.bid} empty or unfiled"
                assert u.size == sum(r.size for r in u.members.values()), f"bundle {u.bid} size"
                assert 4 * u.size <= C, f"bundle {u.bid} holds {u.size} > C/4 (should have split)"
                for r in u.members.values():
                    assert r.bundle is u and r.bin is None and 8 * r.size <= C and r.cls == Cls.TINY, \
                        f"member {r.rid} of bundle {u.bid} is not a tiny request of it"
            else:
                assert u.bundle is None and u.cls == size_class(u.size, C) != Cls.TINY, \
                    f"request {u.rid}: class {u.cls} does not match size {u.size}"
            for r in members(u):
                assert r.rid not in seen, f"request {r.rid} placed twice"
                assert p.requests.get(r.rid) is r, f"request {r.rid} placed but not registered"
                seen.add(r.rid)
    assert seen == set(p.requests), f"registered but not placed: {set(p.requests) - seen}"
    for label, pool in p.pools.items():
        for b in pool:
            assert b.alive and b.label == label, f"{b} in the {label.name} pool"
        assert p.most_recent(label) is max(pool, key=lambda b: b.seq, default=None), \
            f"cached most recent {label.name}-instance is stale"
    for bundle in p.bundles.values():
        assert bundle.bin is not None and bundle.bin.alive, f"bundle {bundle.bid} not placed"


def _check_theorem1(p: Packing, pending: set[Bin]) -> None:
    C = p.C
    t_exists = bool(p.pools[Cls.T])
    smallest_ms = min((u.size for label in (Cls.M, Cls.S) for b in p.pools[label] if b not in pending
                       for u in b.units if u.cls in (Cls.M, Cls.S)), default=None)
    for b in p.bins.values():
        if b in pending:
            continue
        latest = p.is_most_recent(b)
        problem = composition_problem(b.units, C)
        assert problem is None, f"{b}: {problem}"
        full = 4 * b.used >= 3 * C
        if b.label == Cls.M:
            num_m = b.count(Cls.M)
            assert num_m == 2 or (latest and num_m == 1), f"P1: {b} holds {num_m} M-requests"
            assert full or latest or not t_exists, f"P5: {b} below 3C/4 while T-instances exist"
        elif b.label == Cls.S:
            num_s = b.count(Cls.S)
            assert num_s == 3 or latest, f"P2: {b} holds {num_s} S-requests"
        elif b.label == Cls.T:
            assert full or latest, f"P3: T-instance {b} below 3C/4"
        else:
            large = b.of_class(Cls.L)[0]
            if not b.of_class(Cls.M, Cls.S) and smallest_ms is not None:
                assert large.size + smallest_ms > C, \
                    f"P4: {b} has no M/S companion but an M/S-request of {smallest_ms} fits"
            assert full or not t_exists, f"P5: {b} below 3C/4 while T-instances exist"
