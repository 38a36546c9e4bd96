"""A ready-made `PolicyContext`: adapter records, request counts, batch sizes, bytes, reload costs.

Lives here: `UsageStats`, which an owner (the pool, the simulator) updates as requests arrive and
batches run, and which policies only read. Not here: any eviction.

Choices, and why:
- Visits are lifetime counts plus one (Laplace smoothing), for KV nodes (the tree's match counts
  through the node, `Node.hits`) and adapters (requests that named it) alike, normalised by the
  requests seen: one scale for both kinds, and a never-reused item still has an order (recency,
  cost) instead of a score of zero.
- Low_lora's p_i are request shares over a sliding window (`window_s`, default 60 s) and BS is the
  mean running batch size over the last `batch_window_s` (5 s, ELORA's figure); the mean, not the
  maximum, because Low_lora is an expectation.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from operator import attrgetter

import numpy as np

from sgl_multilora.policy.context import AdapterRecord
from sgl_multilora.policy.elora import expected_adapters_per_batch
from sgl_multilora.tree_nodes import Node, NodeKind

_ADAPTER = NodeKind.ADAPTER
_kind, _key, _hits = attrgetter("kind"), attrgetter("key"), attrgetter("hits")


class UsageStats:
    """Implements `PolicyContext`. Adapters are keyed by name, which must equal the tree's
    `AdapterRef.identity` for adapter nodes to find their record.

    `kv_bytes_per_token`: GPU bytes of one token's KV. `kv_reload_s_per_token`: seconds to get one
    evicted token's KV back (recompute or copy). `adapter_reload_s(size_bytes)`: seconds to copy an
    adapter in.
    """

    def __init__(self, adapters: dict[str, int], kv_bytes_per_token: int,
                 kv_reload_s_per_token: float, adapter_reload_s: Callable[[int], float],
                 window_s: float = 60.0, batch_window_s: float = 5.0) -> None:
        self.records = {name: AdapterRecord(name, size) for name, size in adapters.items()}
        self.kv_bytes_per_token = kv_bytes_per_token
        self.kv_reload_s_per_token = kv_reload_s_per_token
        self.adapter_reload_s = adapter_reload_s
        self.window_s = window_s
        self.batch_window_s = batch_window_s
        self._uses = {name: 0 for name in adapters}
        self._num_requests = 0
        self._max_uses = 0
        self._window: deque[tuple[float, str]] = deque()
        self._window_counts: dict[str, int] = {}
        self._batches: deque[tuple[float, int]] = deque()
        self._batch_sum = 0
        self._num_resident = 0
        self._max_size_bytes = max(adapters.values(), default=0)
        self._low: float | None = None  # cached Low_lora, reset by every update it depends on

    # ---- updates (the owner calls these) ---------------------------------------------------------

    def record_request(self, adapter: str | None, now: float) -> None:
        """Counts one request (adapter None: a base-model request); touches its adapter record."""
        self._num_requests += 1
        if adapter is None:
            return
        rec = self.records[adapter]
        rec.last_access = now
        self._uses[adapter] += 1
        self._max_uses = max(self._max_uses, self._uses[adapter])
        self._low = None
        self._window.append((now, adapter))
        self._window_counts[adapter] = self._window_counts.get(adapter, 0) + 1
        self._expire(now)

    def record_batch(self, now: float, batch_size: int) -> None:
        """Records the running batch size of one step."""
        self._low = None
        self._batches.append((now, batch_size))
        self._batch_sum += batch_size
        while self._batches and self._batches[0][0] < now - self.batch_window_s:
            self._batch_sum -= self._batches.popleft()[1]

    def set_resident(self, adapter: str, resident: bool) -> None:
        rec = self.records[adapter]
        if rec.resident != resident:
            self._num_resident += 1 if resident else -1
            rec.resident = resident

    def add_adapter(self, name: str, size_bytes: int) -> None:
        """Starts keeping a record for an adapter loaded after start-up (not resident, never used)."""
        assert name not in self.records, f"adapter {name!r} recorded twice"
        self.records[name] = AdapterRecord(name, size_bytes)
        self._uses[name] = 0
        self._max_size_bytes = max(self._max_size_bytes, size_bytes)

    def remove_adapter(self, name: str) -> None:
        """Forgets an unloaded adapter's record (it must not be resident)."""
        assert not self.records[name].resident, f"forgetting adapter {name!r} while it is resident"
        del self.records[name]
        del self._uses[name]
        self._window = deque(entry for entry in self._window if entry[1] != name)
        self._window_counts.pop(name, None)
        self._max_size_bytes = max((r.size_bytes for r in self.records.values()), default=0)
        self._max_uses = max(self._uses.values(), default=0)
        self._low = None

    def _expire(self, now: float) -> None:
        while self._window and self._window[0][0] < now - self.window_s:
            name = self._window.popleft()[1]
            self._window_counts[name] -= 1
            if not self._window_counts[name]:
                del self._window_counts[name]

    # ---- PolicyContext ---------------------------------------------------------------------------

    def _adapter_name(self, item: object) -> str:
        if isinstance(item, AdapterRecord):
            return item.name
        return item.label.identity

    def is_adapter(self, item: object) -> bool:
        return isinstance(item, AdapterRecord) or item.kind is NodeKind.ADAPTER

    def size_bytes(self, item: object) -> int:
        if self.is_adapter(item):
            return self.records[self._adapter_name(item)].size_bytes
        return len(item.key) * self.kv_bytes_per_token

    def reload_cost_s(self, item: object) -> float:
        if self.is_adapter(item):
            return self.adapter_reload_s(self.size_bytes(item))
        return len(item.key) * self.kv_reload_s_per_token

    def visits(self, item: object) -> float:
        if self.is_adapter(item):
            return self._uses[self._adapter_name(item)] + 1
        assert isinstance(item, Node), (
            f"visits() needs a tree Node or an AdapterRecord, got {item!r}")
        return sum(item.hits.values()) + 1

    def columns(self, items: Sequence[object]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        n = len(items)
        # (`in` over the kinds, not a set of them: enum members hash in Python)
        if not n or (set(map(type, items)) == {Node} and _ADAPTER not in map(_kind, items)):
            # KV nodes only (the evictor's usual batch: the tree's leaves, thousands of them): C-level passes
            lens = np.fromiter(map(len, map(_key, items)), np.float64, n)
            visits = np.fromiter(map(sum, map(dict.values, map(_hits, items))), np.float64, n) + 1
            return np.zeros(n, bool), lens * self.kv_bytes_per_token, lens * self.kv_reload_s_per_token, visits
        if set(map(type, items)) == {AdapterRecord}:  # adapter records only (the evictor's other batch)
            sizes = [self.records[r.name].size_bytes for r in items]
            reload_s, uses = self.adapter_reload_s, self._uses
            rows = [(size, reload_s(size), uses[r.name] + 1) for r, size in zip(items, sizes)]
            size, cost, visits = (np.array(c, dtype=np.float64) for c in zip(*rows))
            return np.ones(n, bool), size, cost, visits
        is_adapter = np.fromiter((isinstance(i, AdapterRecord) or i.kind is NodeKind.ADAPTER for i in items), bool, n)
        rows = [(self.size_bytes(i), self.reload_cost_s(i), self.visits(i)) for i in items]
        size, cost, visits = (np.array(c, dtype=np.float64) for c in zip(*rows))
        return is_adapter, size, cost, visits

    def total_visits(self) -> float:
        return self._num_requests + 1

    def max_visits(self) -> float:
        return self._max_uses + 1

    def max_size_bytes(self) -> int:
        return self._max_size_bytes

    def num_resident_adapters(self) -> int:
        return self._num_resident

    def mean_batch_size(self) -> float:
        return self._batch_sum / len(self._batches) if self._batches else 0.0

    def window_probs(self) -> list[float]:
        n = sum(self._window_counts.values())
        return [c / n for c in self._window_counts.values()] if n else []

    def expected_adapters_per_batch(self) -> float:
        if self._low is None:
            self._low = expected_adapters_per_batch(self.window_probs(), self.mean_batch_size())
        return self._low
