"""LoRA-aware placement across the workers behind the router: which workers serve an adapter, and which of them
a request goes to.

Lives here: `Placement`, plain Python (no HTTP, no SGLang), fed request arrivals and per-worker in-flight counts.
Not here: the HTTP layer that applies it in front of smg (gateway.py), or MELL's packing of running requests by
KV memory (mell*.py).

Replication by popularity. Each adapter's share s of recent requests (counts decayed by half every
`half_life_requests` arrivals) earns it r = clamp(ceil(s * N * replication), 1, N) workers; the base model is on
every worker. Assignments are sticky, since moving an adapter loses the KV cached under it: an adapter keeps its
workers while r holds; a new or grown adapter takes the workers carrying the least adapter share; one whose share
fell so far that even 1.25 times it would earn fewer workers leaves its most loaded (hysteresis: a share at a
boundary does not flap). Assignments are revised every `rebalance_every` arrivals, so a burst cannot thrash them.

Routing. Requests that share (namespace, adapter, prefix) share KV only on one worker. The affinity key is the
adapter (for an aLoRA adapter: none, since its requests reuse the base model's prefix KV) plus the prompt's first
`prefix_chars` characters; rendezvous hashing over the adapter's workers maps a key to the same worker for as long
as that worker holds the adapter, and moves only the keys of a worker that leaves. A load bound keeps affinity
from piling requests on one worker, as smg's cache_aware does: when the chosen worker has more than
`balance_abs` requests in flight above the least loaded of the adapter's workers and more than `balance_rel`
times its count, the least loaded one is used.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

SHRINK_SLACK = 1.25  # an adapter gives a worker up only when a 25% larger share would not need it


@dataclass
class PlacementStats:
    routed: dict[int, int] = field(default_factory=dict)
    """worker -> requests routed there."""
    affinity: int = 0
    """Requests that went to their key's rendezvous worker."""
    balanced: int = 0
    """Requests the load bound sent elsewhere."""
    moves: int = 0
    """(adapter, worker) assignments added or removed after the first."""


class Placement:
    def __init__(self, num_workers: int, *, replication: float = 1.0, half_life_requests: int = 500,
                 rebalance_every: int = 50, prefix_chars: int = 256, balance_abs: int = 4,
                 balance_rel: float = 1.5) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self.num_workers = num_workers
        self.replication, self.half_life = replication, half_life_requests
        self.rebalance_every, self.prefix_chars = rebalance_every, prefix_chars
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.counts: dict[str, float] = {}
        self.workers_of: dict[str, list[int]] = {}
        self.alora: set[str] = set()
        self.num_arrivals = 0
        self._weight = 1.0
        self.stats = PlacementStats()

    # ---- popularity and assignment ------------------------------------------------------------------------------

    def observe(self, adapter: str | None) -> None:
        """One arrival for `adapter` (None: the base model)."""
        self.num_arrivals += 1
        if adapter is not None:
            # decay without touching every count: newer arrivals weigh more, shares are ratios
            self._weight *= 2.0 ** (1.0 / self.half_life)
            if self._weight > 1e200:
                self.counts = {a: c / self._weight for a, c in self.counts.items()}
                self._weight = 1.0
            self.counts[adapter] = self.counts.get(adapter, 0.0) + self._weight
            if adapter not in self.workers_of:
                self._assign(adapter, self.wanted_replicas(adapter))
        if self.num_arrivals % self.rebalance_every == 0:
            self.rebalance()

    def wanted_replicas(self, adapter: str, slack: float = 1.0) -> int:
        """ceil(share x workers x replication), within [1, workers]; `slack` > 1 asks how many a share that much
        larger would need (shrinking uses it, so a share hovering at a boundary does not flap)."""
        total = sum(self.counts.values())
        share = self.counts.get(adapter, 0.0) / total if total else 0.0
        wanted = math.ceil(share * slack * self.num_workers * self.replication - 1e-9)
        return max(1, min(self.num_workers, wanted))

    def worker_load(self) -> list[float]:
        """Adapter share each worker carries (an adapter's share split over its workers)."""
        total = sum(self.counts.values()) or 1.0
        load = [0.0] * self.num_workers
        for adapter, workers in self.workers_of.items():
            for w in workers:
                load[w] += self.counts.get(adapter, 0.0) / total / len(workers)
        return load

    def rebalance(self) -> None:
        """Grows or shrinks each adapter's worker set to its wanted size (most popular first)."""
        for adapter in sorted(self.workers_of, key=lambda a: -self.counts.get(a, 0.0)):
            wanted, have = self.wanted_replicas(adapter), self.workers_of[adapter]
            if wanted > len(have):
                self._assign(adapter, wanted)
            keep = self.wanted_replicas(adapter, SHRINK_SLACK)
            while len(have) > keep:
                load = self.worker_load()
                have.remove(max(have, key=lambda w: (load[w], w)))
                self.stats.moves += 1

    def _assign(self, adapter: str, wanted: int) -> None:
        have = self.workers_of.setdefault(adapter, [])
        first = not have
        while len(have) < wanted:
            load = self.worker_load()
            w = min((w for w in range(self.num_workers) if w not in have), key=lambda w: (load[w], w))
            have.append(w)
            if not first:
                self.stats.moves += 1

    def set_alora(self, names: Sequence[str]) -> None:
        """Adapters whose requests reuse the base model's prefix KV (their affinity key is the base model's)."""
        self.alora = set(names)

    # ---- routing ------------------------------------------------------------------------------------------------

    def candidates(self, adapter: str | None) -> list[int]:
        if adapter is None:
            return list(range(self.num_workers))
        return list(self.workers_of.get(adapter) or range(self.num_workers))

    def route(self, adapter: str | None, prompt: str, in_flight: Sequence[int]) -> int:
        """The worker for one request: observe it, then pick among the adapter's workers by affinity and load.
        `in_flight[w]`: requests worker w is serving now (as the caller counts them)."""
        self.observe(adapter)
        workers = self.candidates(adapter)
        if adapter in self.alora:  # served where the base model's KV of this prefix is
            workers = list(range(self.num_workers))
        key = f"{'' if adapter is None or adapter in self.alora else adapter}\x00{prompt[:self.prefix_chars]}"
        chosen = max(workers, key=lambda w: _rendezvous(key, w))
        least = min(workers, key=lambda w: (in_flight[w], w))
        gap = in_flight[chosen] - in_flight[least]
        if gap > self.balance_abs and in_flight[chosen] > self.balance_rel * in_flight[least]:
            chosen = least
            self.stats.balanced += 1
        else:
            self.stats.affinity += 1
        self.stats.routed[chosen] = self.stats.routed.get(chosen, 0) + 1
        return chosen

    def view(self) -> dict:
        """Assignments, popularity and counters, for the cluster view."""
        total = sum(self.counts.values()) or 1.0
        return {
            "workers_of": {a: sorted(ws) for a, ws in sorted(self.workers_of.items())},
            "share": {a: round(c / total, 4) for a, c in sorted(self.counts.items())},
            "alora": sorted(self.alora),
            "routed": dict(sorted(self.stats.routed.items())), "affinity": self.stats.affinity,
            "balanced": self.stats.balanced, "moves": self.stats.moves,
        }

    def check_invariants(self) -> None:
        for adapter, workers in self.workers_of.items():
            assert workers and len(set(workers)) == len(workers), (adapter, workers)
            assert all(0 <= w < self.num_workers for w in workers), (adapter, workers)


def _rendezvous(key: str, worker: int) -> int:
    digest = hashlib.blake2b(f"{worker}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
