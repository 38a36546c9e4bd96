"""LoRA-aware placement across the workers behind the router: which workers serve an adapter, and which of them
a request goes to.

Lives here: `Placement`, plain Python (no HTTP, no SGLang), fed request arrivals and per-worker in-flight counts.
Not here: the HTTP layer that applies it in front of smg (sgl_multilora/gateway/app.py), or MELL's packing of
running requests by KV memory (mell*.py).

Replication by popularity. Each adapter's share s of recent requests (counts decayed by half every
`half_life_requests` arrivals) earns it r = clamp(ceil(s * N * replication), 1, N) workers; the base model is on
every worker. Assignments are sticky, since moving an adapter loses the KV cached under it: an adapter keeps its
workers while r holds; a new or grown adapter takes the workers carrying the least adapter share; one whose share
fell so far that even 1.25 times it would earn fewer workers leaves its most loaded (hysteresis: a share at a
boundary does not flap). Assignments are revised every `rebalance_every` arrivals, so a burst cannot thrash them.

Routing: smg's cache_aware, keyed by namespace. Requests that share (namespace, adapter, prefix) share KV only on
one worker. The placement remembers, per block of `block_chars` prompt characters, which worker was last sent that
prefix in that namespace (the adapter; for an aLoRA adapter the base model's, since its requests reuse the base
model's prefix KV), in a bounded LRU map. A request goes to the worker holding its longest such prefix when that
prefix is at least `cache_threshold` of the prompt and the worker is not overloaded (more than `balance_abs` requests
in flight above the least loaded worker and more than `balance_rel` times its count); otherwise to the least loaded
of its adapter's workers, or, when even that one is overloaded, to the least loaded worker, which then counts as
holding the adapter too (the request spills rather than queues). A worker marked down (`set_down`) is skipped by
every rule until it is marked up again.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

SHRINK_SLACK = 1.25  # an adapter gives a worker up only when a 25% larger share would not need it


class NoWorkerError(RuntimeError):
    """Every worker is down or excluded."""


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
                 rebalance_every: int = 50, block_chars: int = 128, max_prefix_chars: int = 65536,
                 cache_threshold: float = 0.3, balance_abs: int = 2, balance_rel: float = 1.5,
                 max_prefixes: int = 200_000) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self.num_workers = num_workers
        self.replication, self.half_life = replication, half_life_requests
        self.rebalance_every = rebalance_every
        self.block_chars, self.max_prefix_chars = block_chars, max_prefix_chars
        self.cache_threshold, self.max_prefixes = cache_threshold, max_prefixes
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self._homes: OrderedDict[bytes, int] = OrderedDict()  # prefix block key -> the worker last sent it
        self.counts: dict[str, float] = {}
        self.workers_of: dict[str, list[int]] = {}
        self.alora: set[str] = set()
        self.down: set[int] = set()  # workers that failed: nothing is routed to them until they are back
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

    def set_down(self, worker: int, down: bool = True) -> None:
        """Takes a failed worker out of routing (or puts it back)."""
        if not 0 <= worker < self.num_workers:
            raise ValueError(f"no worker {worker}: the cluster has {self.num_workers}")
        (self.down.add if down else self.down.discard)(worker)

    def route(self, adapter: str | None, prompt: str, in_flight: Sequence[int], *,
              exclude: Collection[int] = (), arrival: bool = True) -> int:
        """The worker for one request: observe it, find the worker holding the longest cached prefix of it in its
        namespace, and go there unless the match is short or that worker is overloaded; otherwise the least
        loaded of the adapter's workers, or (when those are all overloaded) the least loaded worker, which then
        holds the adapter too. `in_flight[w]`: requests worker w is serving now (as the caller counts them).
        Workers that are down or in `exclude` are never chosen (`NoWorkerError` when none is left);
        `arrival=False` (a request moving on) leaves the popularity counts alone."""
        up = [w for w in range(self.num_workers) if w not in self.down and w not in exclude]
        if not up:
            raise NoWorkerError(f"no worker can take the request: down {sorted(self.down)}, "
                                f"excluded {sorted(exclude)} of {self.num_workers}")
        if arrival:
            self.observe(adapter)
        namespace = "" if adapter is None or adapter in self.alora else adapter
        blocks = self._block_keys(namespace, prompt)
        least = min(up, key=lambda w: (in_flight[w], w))
        home, matched = None, 0
        for i in range(len(blocks) - 1, -1, -1):  # the longest prefix some worker was sent
            home = self._homes.get(blocks[i])
            if home is not None:
                matched = (i + 1) * self.block_chars
                break
        if home is not None and home not in up:
            home, matched = None, 0
        share = min(1.0, matched / max(1, len(prompt)))
        if home is not None and share >= self.cache_threshold and not self._overloaded(home, least, in_flight):
            chosen = home
            self.stats.affinity += 1
        else:
            workers = [w for w in (self.candidates(adapter) if namespace else up) if w in up] or up
            tie = blocks[-1] if blocks else prompt.encode()  # spreads new prompts over equally loaded workers
            ranked = sorted(workers, key=lambda w: (in_flight[w], -_rendezvous(tie, w)))
            chosen = ranked[0]
            if self._overloaded(chosen, least, in_flight):
                chosen = least  # spill: the adapter is loaded there on demand
                if adapter is not None and chosen not in self.workers_of.setdefault(adapter, []):
                    self.workers_of[adapter].append(chosen)
                    self.stats.moves += 1
            if home is not None and share >= self.cache_threshold:
                self.stats.balanced += 1
        for key in blocks:  # this worker now holds the prompt's prefixes
            self._homes[key] = chosen
            self._homes.move_to_end(key)
        while len(self._homes) > self.max_prefixes:
            self._homes.popitem(last=False)
        self.stats.routed[chosen] = self.stats.routed.get(chosen, 0) + 1
        return chosen

    def _overloaded(self, w: int, least: int, in_flight: Sequence[int]) -> bool:
        return (in_flight[w] - in_flight[least] > self.balance_abs
                and in_flight[w] > self.balance_rel * in_flight[least])

    def _block_keys(self, namespace: str, prompt: str) -> list[bytes]:
        """One key per whole block of `block_chars` characters: the hash of the namespace and the prompt up to the
        block's end (so a key names a whole prefix, as a radix path does)."""
        h = hashlib.blake2b(namespace.encode() + b"\x00", digest_size=16)
        keys = []
        for end in range(self.block_chars, min(len(prompt), self.max_prefix_chars) + 1, self.block_chars):
            h.update(prompt[end - self.block_chars:end].encode())
            keys.append(h.copy().digest())
        return keys

    def view(self) -> dict:
        """Assignments, popularity and counters, for the cluster view."""
        total = sum(self.counts.values()) or 1.0
        return {
            "workers_of": {a: sorted(ws) for a, ws in sorted(self.workers_of.items())},
            "share": {a: round(c / total, 4) for a, c in sorted(self.counts.items())},
            "alora": sorted(self.alora),
            "routed": dict(sorted(self.stats.routed.items())), "affinity": self.stats.affinity,
            "balanced": self.stats.balanced, "moves": self.stats.moves, "prefixes": len(self._homes),
        }

    def check_invariants(self) -> None:
        for adapter, workers in self.workers_of.items():
            assert workers and len(set(workers)) == len(workers), (adapter, workers)
            assert all(0 <= w < self.num_workers for w in workers), (adapter, workers)


def _rendezvous(key: bytes, worker: int) -> int:
    digest = hashlib.blake2b(worker.to_bytes(4, "big") + key, digest_size=8).digest()
    return int.from_bytes(digest, "big")
