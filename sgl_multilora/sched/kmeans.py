"""1-D k-means over recent WRS values, the choice of K by an elbow rule, and the queue cut-offs.

Lives here: `kmeans_1d` and `choose_clustering` (pure functions, deterministic). Not here: the
window they run on or the routing of requests (plan.py, queues.py).

Choices the paper leaves open (reference/seed-chameleon.md, sections 4.5 and 8.3), and why:
- K rule. "The K with minimal WCSS" always picks K_max, since WCSS never grows with K. We pick the
  smallest K whose next queue would remove less than `min_gain` (default 6%) of the window's
  total variance: (WCSS(K) - WCSS(K+1)) / WCSS(1) < min_gain. A queue costs quota fragmentation
  (the paper's "too many queues"), so it must buy a real share of the spread. Measured against
  WCSS(1), not WCSS(K): against WCSS(K) every continuous spread keeps "gaining" a fixed fraction
  and the rule degenerates to K_max again. Where 6% sits: k well-separated groups of equal size
  give k (with four, the fourth queue still removes 10%); a uniform spread gives 3 (the fourth
  would remove 4.9%); a normal spread gives 4 (7.3%). The silhouette score was not used: it is
  undefined for K = 1 and quadratic in the window.
- Determinism: no random restarts. Three fixed starts per K (the best K-1 solution with its
  costliest cluster split at its mean, evenly spaced over the range, quantiles of the distinct
  values) each run Lloyd's iterations to convergence, and the lowest WCSS wins. The split start
  makes WCSS(K) <= WCSS(K-1) hold exactly, which the rule relies on.
- Cut-offs are the midpoints of consecutive sorted centroids; a value equal to a cut-off belongs
  to the upper cluster (the paper's B_(i-1) <= WRS < B_i).
- Cost: values are sorted once and every Lloyd step is O(K log n) with prefix sums.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise

MAX_ITER = 100


@dataclass(frozen=True)
class Clustering:
    k: int
    centroids: tuple[float, ...]
    """Sorted ascending, strictly."""
    cutoffs: tuple[float, ...]
    """k - 1 midpoints of consecutive centroids."""
    wcss_by_k: tuple[float, ...]
    """WCSS for K = 1, 2, ... (index K - 1), non-increasing."""


class _Prefix:
    """Sorted values with prefix sums, so a contiguous segment's mean and cost are O(1)."""

    def __init__(self, sorted_values: Sequence[float]) -> None:
        self.xs = sorted_values
        self.s = list(accumulate(sorted_values, initial=0.0))
        self.q = list(accumulate((x * x for x in sorted_values), initial=0.0))
        self.distinct = sorted(set(sorted_values))

    def mean(self, a: int, b: int) -> float:
        return (self.s[b] - self.s[a]) / (b - a)

    def cost(self, a: int, b: int) -> float:
        s = self.s[b] - self.s[a]
        return max(0.0, self.q[b] - self.q[a] - s * s / (b - a))

    def bounds(self, centroids: Sequence[float]) -> list[int] | None:
        """Segment starts for sorted centroids (plus n at the end); None if a segment is empty."""
        idx = [0]
        for lo, hi in pairwise(centroids):
            mid = (lo + hi) / 2  # rounds onto lo for adjacent floats (0 and 5e-324): then split just above lo
            idx.append(bisect.bisect_left(self.xs, mid) if lo < mid else bisect.bisect_right(self.xs, lo))
        idx.append(len(self.xs))
        if any(a >= b for a, b in pairwise(idx)):
            return None
        return idx


def _lloyd(p: _Prefix, start: Sequence[float]) -> tuple[list[float], float] | None:
    """Lloyd's iterations from sorted `start`; None if the start leaves a cluster empty. Stops
    before a step that would empty a cluster, keeping the last valid assignment."""
    idx = p.bounds(start)
    if idx is None:
        return None
    for _ in range(MAX_ITER):
        centroids = [p.mean(a, b) for a, b in pairwise(idx)]
        nxt = p.bounds(centroids)
        if nxt is None or nxt == idx:
            break
        idx = nxt
    centroids = [p.mean(a, b) for a, b in pairwise(idx)]
    return centroids, sum(p.cost(a, b) for a, b in pairwise(idx))


def _split_start(p: _Prefix, prev: Sequence[float]) -> list[float] | None:
    idx = p.bounds(prev)
    if idx is None:
        return None
    worst = max(range(len(prev)), key=lambda i: p.cost(idx[i], idx[i + 1]))
    a, b = idx[worst], idx[worst + 1]
    m = bisect.bisect_left(p.xs, p.mean(a, b), a, b)
    if m in (a, b):  # all of the segment on one side of its mean: it holds one distinct value
        return None
    return sorted([*prev[:worst], p.mean(a, m), p.mean(m, b), *prev[worst + 1:]])


def kmeans_1d(sorted_values: Sequence[float], k: int,
              prev: Sequence[float] | None = None) -> tuple[list[float], float]:
    """(sorted centroids, WCSS) for `k` clusters of ascending `sorted_values`. `prev`: the best
    K-1 centroids, used as one start. Raises ValueError if there are fewer than `k` distinct
    values (a k-cluster split does not exist)."""
    return _kmeans(_Prefix(sorted_values), k, prev)


def _kmeans(p: _Prefix, k: int, prev: Sequence[float] | None) -> tuple[list[float], float]:
    distinct = p.distinct
    if k < 1 or len(distinct) < k:
        raise ValueError(f"k={k} needs at least k distinct values, got {len(distinct)}")
    lo, hi = distinct[0], distinct[-1]
    starts = [
        _split_start(p, prev) if prev is not None else None,
        [lo + (i + 0.5) * (hi - lo) / k for i in range(k)],
        [distinct[int((i + 0.5) * len(distinct) / k)] for i in range(k)],
    ]
    best: tuple[list[float], float] | None = None
    for start in starts:
        result = _lloyd(p, start) if start is not None else None
        if result is not None and (best is None or result[1] < best[1]):
            best = result
    assert best is not None, "quantiles of distinct values always give non-empty clusters"
    return best


def choose_clustering(values: Sequence[float], max_k: int = 4,
                      min_gain: float = 0.06) -> Clustering:
    """K, centroids and cut-offs for `values` (any order). Raises ValueError if `values` is
    empty or the settings are out of range."""
    if not values:
        raise ValueError("choose_clustering needs at least one value")
    if max_k < 1 or not 0 <= min_gain <= 1:
        raise ValueError(f"need max_k >= 1 and 0 <= min_gain <= 1, got {max_k}, {min_gain}")
    p = _Prefix(sorted(values))
    max_k = min(max_k, len(p.distinct))
    solutions: list[list[float]] = []
    wcss: list[float] = []
    for k in range(1, max_k + 1):
        centroids, cost = _kmeans(p, k, solutions[-1] if solutions else None)
        solutions.append(centroids)
        wcss.append(min(cost, wcss[-1]) if wcss else cost)
    k = max_k
    if wcss[0] <= 0:
        k = 1
    else:
        for i in range(max_k - 1):
            if (wcss[i] - wcss[i + 1]) / wcss[0] < min_gain:
                k = i + 1
                break
    centroids = tuple(solutions[k - 1])
    cutoffs = tuple((a + b) / 2 for a, b in pairwise(centroids))
    return Clustering(k, centroids, cutoffs, tuple(wcss))
