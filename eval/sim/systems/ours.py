"""Ours: the LoRA-aware radix tree over one pool shared by adapters and KV, evicted by a policy.

Adapter nodes sit at depth two of `LoraRadixTree` with their KV below (aLoRA suffixes share the base model's
prefix KV). One heap orders unlocked KV leaves and unused adapters by the policy's score, lowest first (ELORA's
swap-out); an adapter is a candidate only when no resident KV depends on it, so the GPU-resident set stays
closed under dependency and invalid KV is 0. When used memory is below `idle_watermark` (ELORA: 70%), every
`swap_period_s` (100 ms) non-resident adapters are prefetched in descending score (ELORA's swap-in).

Host KV tier (`host_kv_bytes`, default `hostkv.HOST_KV_BYTES`; 0 turns it off, arm suffix `:no-host-kv`):
a KV leaf the heap evicts is spilled to a bounded, LRU host pool and copied back over PCIe when a request's GPU
match stops where the host's continues (`hostkv.py`, `BaseSystem.start_restore`). With the tier, cost_i of a KV
run is its PCIe copy time (ELORA: "computed using the PCIe bandwidth and size of the KV or LoRA"), without it
its recompute time. ELORA's ablations keep the tier (they change only the score or the tree). ELORA's idle
prefetch of host KV is not modelled (only adapters are prefetched).

`dependency=False` is ELORA's WOM ablation: adapters are evicted by the same score while their KV stays (that
KV is invalid until the adapter returns).

Choices the paper leaves open (seed-elora.md A8, A11): a request that needs memory evicts at once rather than
waiting for the next tick, and an eviction frees `headroom_frac` of the pool beyond the request (so one
scoring pass serves several admissions, like a swapper tick).
"""

from __future__ import annotations

import heapq

from eval.sim.hostkv import HOST_KV_BYTES, HostKVTier, gpu_path
from eval.sim.systems.base import NS, BaseSystem
from sgl_multilora.policy import create_policy
from sgl_multilora.tree_nodes import Node, NodeKind


class Ours(BaseSystem):
    alora_sharing = True

    def __init__(self, adapters, lat, pool_total_bytes: int, policy: str = "elora",
                 policy_kwargs: dict | None = None, dependency: bool = True, prefetch: bool = True,
                 headroom_frac: float = 0.01, idle_watermark: float = 0.7,
                 swap_period_s: float = 0.1, host_kv_bytes: int | None = None) -> None:
        super().__init__(adapters, lat, pool_total_bytes)
        host_kv_bytes = HOST_KV_BYTES if host_kv_bytes is None else host_kv_bytes
        if host_kv_bytes:
            self.host = HostKVTier(host_kv_bytes, self.kvb, clock=lambda: self.now)
            self.usage.kv_reload_s_per_token = self.kvb / lat.hw.pcie_bytes_per_s
        self.by_identity = {r.identity: r for r in self.refs.values()}
        self.policy = create_policy(policy, context=self.usage, **(policy_kwargs or {}))
        self.tree.score = self.policy
        self.dependency = dependency
        self.prefetch = prefetch
        self.headroom = int(headroom_frac * pool_total_bytes)
        self.idle_watermark = idle_watermark
        self.swap_period_s = swap_period_s
        self._next_swap_s = 0.0
        self.num_prefetches = 0
        self.name = (f"ours:{policy}" + ("" if dependency else ":no-tree")
                     + ("" if self.host is not None else ":no-host-kv"))

    # ---- adapters are tree nodes ----------------------------------------------------------------------

    def on_loaded(self, name: str) -> None:
        if self.dependency:
            self.tree.ensure_adapter(NS, self.refs[name])

    def _adapter_evictable(self, name: str, protect: str | None) -> bool:
        if name not in self.resident or self.rc[name] or name == protect:
            return False
        if not self.dependency:
            return True
        node = self.tree.adapter_node(NS, self.refs[name])
        return node is None or (not node.children and not node.dependents and node.lock_ref == 0)

    def _evict_adapter(self, name: str) -> None:
        self.drop_adapter(name)
        if self.dependency and self.tree.adapter_node(NS, self.refs[name]) is not None:
            freed = self.tree.remove_adapter(NS, self.refs[name], self.free_kv)
            assert freed == 0, f"adapter {name} removed with {freed} tokens of KV depending on it"

    # ---- one heap for KV leaves and adapters ----------------------------------------------------------

    def make_room_kv(self, num_bytes: int, protect: str | None) -> bool:
        return self.evict(num_bytes, protect)

    def make_room_adapter(self, num_bytes: int, protect: str | None) -> bool:
        return self.evict(num_bytes, protect)

    def _heap(self, protect: str | None) -> list:
        """Candidates as (score, kind, key, item): ties go to KV before adapters, then by node id or adapter
        name, so the order never depends on set iteration (deterministic across processes)."""
        now, score = self.now, self.policy.score
        heap = [(score(n, now), 0, n.id, n) for n in self.tree.evictable_leaves()]
        records = self.usage.records
        heap += [(score(records[a], now), 1, a, a) for a in self.resident if self._adapter_evictable(a, protect)]
        heapq.heapify(heap)
        return heap

    def evict(self, num_bytes: int, protect: str | None) -> bool:
        """Evicts lowest-scored candidates until `num_bytes` (+ headroom) are free; True if `num_bytes` fit.
        Never evicts locked KV, an adapter a running request uses, or `protect`."""
        area, pool = self.kv_area, self.pool
        target = num_bytes + self.headroom
        heap = self._heap(protect)
        while heap and pool.free_bytes(area) < target:
            item = heapq.heappop(heap)[3]
            if isinstance(item, str):
                if not self._adapter_evictable(item, protect):
                    continue
                self._evict_adapter(item)
                heap = self._heap(protect)  # the adapter count changed: ELORA rescores (A10)
                continue
            if item.is_evicted or item.children or item.lock_ref:
                continue
            parent, dep = item.parent, item.depends_on
            if self.host is not None:
                self.host.spill(*gpu_path(item, self.by_identity, NS))
            self.tree.evict_leaf(item, self.free_kv)
            if parent.kind is NodeKind.KV and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (self.policy.score(parent, self.now), 0, parent.id, parent))
            for adapter in (parent, dep):
                if isinstance(adapter, Node) and adapter.kind is NodeKind.ADAPTER:
                    name = adapter.label.identity
                    if self._adapter_evictable(name, protect):
                        rec = self.usage.records[name]
                        heapq.heappush(heap, (self.policy.score(rec, self.now), 1, name, name))
        return pool.fits(area, num_bytes)

    # ---- prefetch when idle ---------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        super().tick(now)
        if not self.prefetch or now < self._next_swap_s:
            return
        self._next_swap_s = now + self.swap_period_s
        cap = self.pool.capacity[self.adapter_area]
        limit = self.idle_watermark * cap
        if self.pool.used_bytes(self.adapter_area) >= limit:
            return
        records = self.usage.records
        cold = [n for n in self.names if n not in self.resident and n not in self.loading]
        cold.sort(key=lambda n: (-self.policy.score(records[n], now), n))
        for name in cold:
            if self.pool.used_bytes(self.adapter_area) + self.sizes[name] > limit:
                break
            self.start_load(name)
            self.num_prefetches += 1

    def check_invariants(self) -> None:
        super().check_invariants()
        if not self.dependency:
            return
        ns_node = self.tree.namespace_node(NS)
        in_tree = set() if ns_node is None else {e for e in ns_node.children if e is not None}
        assert in_tree == self.resident, (
            f"adapter nodes {sorted(in_tree ^ self.resident)} disagree with the resident set")
        assert self.invalid_kv_bytes() == 0, "resident KV of a non-resident adapter: dependency broken"
