"""ELORA's host KV tier, simulated: history KV the GPU evicts goes to a bounded host pool and can come back
over PCIe instead of being recomputed.

Lives here: `HostKVTier` (a sim-side shadow tree of host-resident KV, its byte counter and its exact check)
and the slot-value encoding of KV restored from it. Not here: when the GPU evicts (the systems) or the copy
timing (`systems/base.py`, on the same FIFO PCIe link as adapter copies, `LatencyModel.h2d_time`).

Model (seed-elora.md 2.2, 2.4, 3.1, 3.5):
- The host tier is a `LoraRadixTree` keyed exactly like the GPU tree (namespace, adapter, tokens, aLoRA start),
  so the dependency rule holds across tiers: host KV of adapter A is found only by a request that names A
  (and aLoRA suffixes only by their own aLoRA), and it comes back only below a GPU-resident prefix whose
  adapter is resident (ELORA swaps in only host subtree roots whose parent is in GPU).
- Spill: when the GPU evicts a history-KV leaf, the leaf's whole token path (its GPU-resident ancestors too)
  is inserted, so the host tree stays prefix-closed and a later match on it is a plain prefix match. The tier
  is *inclusive*: KV copied back to the GPU keeps its host copy until host LRU drops it (ELORA moves a block
  between tiers; an inclusive host spends host memory on copies the GPU also holds and saves a write-back
  on the next eviction). The GPU->host copy is not timed: PCIe is full duplex and ELORA's swapper writes out
  ahead of need; the GPU memory counts as free at once (optimistic for the tier).
- Bounded: `capacity_bytes`; when a spill overflows it, host leaves go least recently used first (ELORA: "cold
  KV blocks are evicted" when GPU and host are both full, rule unspecified). A host run being copied back is
  locked and never dropped.
- Default size `HOST_KV_BYTES`: half of the 256 GB of host DRAM of ELORA's machine (Table II), the rest left to
  the OS, the serving process and the pinned host copies of the adapters (100 x 336 MB = 34 GB at most here).
  An assumption: the paper does not give the host pool's size, and the machine has 8 GPUs (32 GB each if all
  served at once; `compare.py` runs that as `ours:elora:host-kv=32`).

Invalid KV stays a GPU measure (ELORA's "invalid KV" is GPU memory held by KV whose LoRA is not on the GPU):
host KV of a non-resident adapter costs no GPU memory, and it cannot come back before its adapter does.
"""

from __future__ import annotations

from itertools import chain

from sgl_multilora.keys import AdapterRef, MatchKey, Namespace
from sgl_multilora.tree import LoraRadixTree
from sgl_multilora.tree_nodes import AloraEdge, Node, NodeKind

HOST_KV_BYTES = 128 * 10**9
"""Default host KV pool: 128 GB, half of ELORA's 256 GB host DRAM (an assumption, see the module docstring)."""

RESTORE_ID_UNIT = 1 << 20
"""Slot values of restored KV: owner index + restore id x this (owner index -1 for base KV, < 2**20 - 1
adapters). Computed KV has restore id 0, so its values are the owner indices as before. A match returns the
values it read, and restores finish in FIFO order, so the largest restore id among them says which copy a
request that reuses restored KV must wait for."""


def owner_of(value: int) -> int:
    """The adapter index (-1: base) a slot value belongs to."""
    return (value + 1) % RESTORE_ID_UNIT - 1


def restore_id_of(value: int) -> int:
    return (value + 1) // RESTORE_ID_UNIT


def gpu_path(node: Node, refs: dict[str, AdapterRef], namespace: Namespace) -> tuple[MatchKey, list[int]]:
    """The key (from the namespace) and slot values of a GPU KV node's whole path, its ancestors included."""
    runs, vals, suffix_at = [], [], None
    n = node
    while n.kind is NodeKind.KV:
        runs.append(n.key)
        vals.append(n.value)
        if isinstance(n.edge, AloraEdge):
            suffix_at = (len(runs), n.edge)
        n = n.parent
    ref, start = None, None
    if n.kind is NodeKind.ADAPTER:
        ref = n.label
    if suffix_at is not None:  # an aLoRA suffix: base KV above the edge, the adapter's own KV below it
        count, edge = suffix_at
        ref = refs[edge.identity]
        start = sum(len(r) for r in runs[count:]) + edge.offset
    tokens = tuple(chain.from_iterable(reversed(runs))) if len(runs) > 1 else runs[0]
    values = list(chain.from_iterable(reversed(vals)))
    return MatchKey(namespace, ref, tokens, alora_start=start), values


class HostKVTier:
    """Host-resident history KV: a shadow radix tree in tokens, LRU-evicted, with an exact byte counter."""

    def __init__(self, capacity_bytes: int, kv_bytes_per_token: int, clock) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"the host KV tier needs a positive capacity, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.kvb = kv_bytes_per_token
        self.tree = LoraRadixTree(clock=clock)  # LRU order (lru_score)
        self.used_bytes = 0
        self.num_spilled_tokens = 0  # tokens newly written to the host
        self.num_dropped_tokens = 0  # tokens the host dropped (LRU) to make room
        self.num_restored_tokens = 0

    def _drop(self, values: list[int]) -> None:
        self.used_bytes -= len(values) * self.kvb
        self.num_dropped_tokens += len(values)

    def spill(self, key: MatchKey, values: list[int]) -> None:
        """Writes an evicted GPU path; drops least recently used host leaves while over capacity."""
        res = self.tree.insert(key, values)
        new = len(values) - res.prefix_len
        self.used_bytes += new * self.kvb
        self.num_spilled_tokens += new
        over = self.used_bytes - self.capacity_bytes
        if over > 0:
            self.tree.evict(-(-over // self.kvb), self._drop)
        assert self.used_bytes <= self.capacity_bytes, "host tier over capacity with only locked runs left"

    def match(self, key: MatchKey):
        """Longest host-resident prefix of `key` (touches it: host LRU)."""
        return self.tree.match(key)

    def check_invariants(self) -> None:
        """Exact: the byte counter is the shadow tree's size, within capacity."""
        self.tree.check_invariants()
        assert self.used_bytes == self.tree.total_len() * self.kvb, (
            f"host KV bytes {self.used_bytes} != {self.tree.total_len()} tokens in the host tree")
        assert 0 <= self.used_bytes <= self.capacity_bytes, f"host KV {self.used_bytes} B over capacity"
