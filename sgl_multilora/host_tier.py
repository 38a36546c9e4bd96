"""The host tier (ELORA's second tier): KV the device pool evicts is written to a bounded host pool and copied
back, instead of recomputed, when a later request's match reaches it.

Lives here: `HostKVTier` (a shadow `LoraRadixTree` of host-resident KV, its slot accounting, the spill / match /
drop / restore rules, counters and `check_invariants`), the `HostStore` protocol it copies through, and
`path_key` (the key and values of a device node's whole path). Not here: when the device evicts (the swapper's
`on_evict_kv` calls `spill`), the copies themselves (a store: `patches/host_kv.py` in the server, none in the
simulator, where values are counted, not copied) and adapter weights, whose host copies are the adapter
registry's and are never dropped.

```
device tree (resident)                 host tree (same keys)             host pool (capacity in tokens)
ns ─ base ─ [5 6 7] ─ [8 9]            ns ─ base ─ [5 6 7] ─ [8 9]         [h0 h1 h2 h3 h4 . . . ]
   └ A ─ [1 2] ─ [3 4]  <- evicted:       └ A ─ [1 2] ─ [3 4]              [h5 h6 h7 h8 . . . . ]
         spill([1 2 3 4]) writes the whole path (h5..h8), so the host tree stays prefix-closed
```

Rules (the dependency rule across tiers, seed-elora.md 2.2 / 2.4):
- Spill: only resident leaves are spilled, whole path. The host tier is inclusive: KV copied back keeps its host
  copy until dropped, so the next eviction of the same run costs no write. Tokens already on host are not
  written again.
- Drop: when a spill does not fit, the least recently used unlocked host leaves are dropped first; a spill never
  drops its own path (it is locked while room is made). A spill that would not fit even with every unlocked leaf
  dropped is refused (counted) before anything is dropped, and the device eviction goes on without it.
- Restore: the caller copies host values back only below a device-resident prefix whose adapter is resident
  (ELORA swaps in host subtree roots whose parent is resident); host KV under a non-resident adapter is legal.
- An adapter's host KV goes when the adapter is unloaded (`remove_adapter`); a flush drops everything.

Values. With a store, the host tree's values are host slot ids handed out by the store; without one (the
simulator), the tier counts tokens only and keeps the device values it was given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from itertools import chain
from typing import Protocol

from sgl_multilora.keys import MatchKey
from sgl_multilora.tree import LoraRadixTree
from sgl_multilora.tree_nodes import AloraEdge, MatchResult, Node, NodeKind


class HostStore(Protocol):
    """Host slots and the copies between them and device slots (values of the device tree)."""

    def alloc(self, n: int) -> list[int] | None:
        """`n` free host slot ids, or None."""

    def free(self, host_ids: list[int]) -> None: ...

    def write(self, host_ids: list[int], device_values: Sequence[int]) -> None:
        """Copies the KV of `device_values` (every layer) into `host_ids`."""

    def read(self, host_ids: Sequence[int], device_values: Sequence[int]) -> None:
        """Copies the KV of `host_ids` (every layer) into the device slots `device_values`."""


@dataclass(slots=True)
class HostCounters:
    spilled_tokens: int = 0  # written to the host
    spills: int = 0  # device leaves spilled (including those whose tokens were all on host already)
    refused_spills: int = 0  # spills that found no room (everything on host locked)
    dropped_tokens: int = 0  # dropped from the host to make room (LRU) or with their adapter
    dropped_runs: int = 0
    restored_tokens: int = 0  # copied back to the device
    restores: int = 0


def path_key(node: Node) -> tuple[MatchKey, list[int]]:
    """The key (namespace, adapter, tokens, aLoRA start) and values of a KV node's whole path, its KV ancestors
    included: what a request reaching `node` would have matched. The node must be attached."""
    runs, vals, suffix_at = [], [], None
    n = node
    while n.kind is NodeKind.KV:
        runs.append(n.key)
        vals.append(n.value)
        if isinstance(n.edge, AloraEdge):
            suffix_at = (len(runs), n.edge)
        n = n.parent
    ns_node = n.parent  # the BASE or ADAPTER node's parent
    namespace, ref, start = ns_node.label, None, None
    if n.kind is NodeKind.ADAPTER:
        ref = n.label
    if suffix_at is not None:  # an aLoRA suffix: base KV above the edge, the adapter's own KV below it
        count, edge = suffix_at
        ref = ns_node.children[edge.identity].label
        start = sum(len(r) for r in runs[count:]) + edge.offset
    tokens = tuple(chain.from_iterable(reversed(runs))) if len(runs) > 1 else runs[0]
    values = list(chain.from_iterable(reversed(vals)))
    return MatchKey(namespace, ref, tokens, alora_start=start), values


class HostKVTier:
    """Host-resident KV: a shadow radix tree (least recently used dropped first) over `capacity_tokens` slots."""

    def __init__(self, capacity_tokens: int, *, bytes_per_token: int, page_size: int = 1,
                 clock: Callable[[], float] | None = None, store: HostStore | None = None) -> None:
        if capacity_tokens <= 0:
            raise ValueError(f"the host KV tier needs a positive capacity, got {capacity_tokens} tokens")
        self.capacity_tokens = capacity_tokens
        self.bytes_per_token = bytes_per_token
        self.store = store
        self._tree_args = {"page_size": page_size} | ({"clock": clock} if clock is not None else {})
        self.tree = LoraRadixTree(**self._tree_args)
        self.counters = HostCounters()

    @property
    def used_tokens(self) -> int:
        return self.tree.total_len()

    @property
    def used_bytes(self) -> int:
        return self.used_tokens * self.bytes_per_token

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_tokens * self.bytes_per_token

    # ---- spill, match, restore --------------------------------------------------------------------------------

    def spill(self, key: MatchKey, device_values: Sequence[int]) -> int:
        """Writes a device path about to be evicted (`path_key`); returns the tokens newly written. Drops least
        recently used host leaves to make room, never this path; refuses (0, counted, nothing dropped) if even
        dropping every unlocked leaf would not make room."""
        c = self.counters
        c.spills += 1
        have = self.tree.match(key)  # touches the part already on host
        new = len(device_values) - have.prefix_len
        if new <= 0:
            return 0
        lock = have.last_node if have.prefix_len else None
        if lock is not None:
            self.tree.lock(lock)
        try:
            if new > self.capacity_tokens - self.tree.protected_len():  # cannot fit even after every drop
                c.refused_spills += 1
                return 0
            short = self.used_tokens + new - self.capacity_tokens
            if short > 0:
                self.tree.evict(short, self._drop)
            tail = list(device_values[have.prefix_len:])
            if self.store is None:
                host_ids = tail
            else:
                host_ids = self.store.alloc(new)
                assert host_ids is not None, "host store out of slots below the tier's capacity"
                self.store.write(host_ids, tail)
            res = self.tree.insert(key, have.kv_values + host_ids)
            assert res.prefix_len == have.prefix_len, (res.prefix_len, have.prefix_len)
        finally:
            if lock is not None:
                self.tree.unlock(lock)
        c.spilled_tokens += new
        return new

    def match(self, key: MatchKey, *, touch: bool = True) -> MatchResult:
        """The longest host-resident prefix of `key` (with `touch`, an access for the LRU order)."""
        return self.tree.match(key, touch=touch)

    def restore(self, host_values: Sequence[int], device_values: Sequence[int]) -> None:
        """Copies host KV (`match(...).kv_values[a:b]`) into device slots; the caller inserts them in the device
        tree. The host copy stays (inclusive tier)."""
        if self.store is not None:
            self.store.read(host_values, device_values)
        self.counters.restored_tokens += len(device_values)
        self.counters.restores += 1

    def lock(self, node: Node) -> None:
        """Pins a matched host run (and its path) against drops until `unlock`."""
        self.tree.lock(node)

    def unlock(self, node: Node) -> None:
        self.tree.unlock(node)

    # ---- drops ------------------------------------------------------------------------------------------------

    def remove_adapter(self, identity: str) -> int:
        """Drops the adapter's host KV in every namespace (its own subtree and its aLoRA suffixes); returns the
        tokens dropped. Nothing is dropped while a restore holds it (locked): returns None then."""
        dropped = 0
        for ns_node in list(self.tree.root.children.values()):
            node = ns_node.children.get(identity)
            if node is None:
                continue
            freed = self.tree.remove_adapter(ns_node.label, node.label, self._drop)
            if freed is None:
                return None
            dropped += freed
        return dropped

    def clear(self) -> None:
        """Drops everything (a cache flush)."""
        self.tree.evict(self.used_tokens, self._drop)
        assert self.used_tokens == 0, "host tier cleared while a restore holds part of it"
        self.tree = LoraRadixTree(**self._tree_args)

    def _drop(self, values: list[int]) -> None:
        if self.store is not None:
            self.store.free(values)
        self.counters.dropped_tokens += len(values)
        self.counters.dropped_runs += 1

    # ---- observation ------------------------------------------------------------------------------------------

    def stats(self) -> dict:
        return {"capacity_bytes": self.capacity_bytes, "used_bytes": self.used_bytes,
                "capacity_tokens": self.capacity_tokens, "used_tokens": self.used_tokens,
                **asdict(self.counters)}

    def check_invariants(self) -> None:
        """The host tree's invariants, its size within capacity, and (with a store) host slots in use equal to
        the host tree's tokens, each used once."""
        self.tree.check_invariants()
        used = self.used_tokens
        assert 0 <= used <= self.capacity_tokens, f"host KV {used} tokens over capacity {self.capacity_tokens}"
        if self.store is not None and hasattr(self.store, "num_used"):
            assert self.store.num_used == used, f"host store holds {self.store.num_used} slots, tree {used}"
