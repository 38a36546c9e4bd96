"""Ours: the LoRA-aware radix tree over one pool shared by adapters and KV, evicted by a policy.

Runs the core's memory system as the server does: `sgl_multilora.pool.UnifiedPool` (one area), the adapter
states of `sgl_multilora.residency` and `sgl_multilora.swapper.Swapper`, which evicts KV leaves and adapters
in ascending score when a request needs room (ELORA's swap-out, dependency kept, so invalid KV is 0) and
prefetches adapters below `idle_watermark` every `swap_period_s` (ELORA's swap-in); the simulator's parts are
the PCIe link (`link.py`, the swapper's loader) and the host KV tier. Adapter nodes sit at depth two of
`LoraRadixTree` with their KV below (aLoRA suffixes share the base model's prefix KV); here an adapter's node
is created when its weights arrive, so adapter nodes and resident adapters are the same set.

Host KV tier (`host_kv_bytes`, default `hostkv.HOST_KV_BYTES`; 0 turns it off, arm suffix `:no-host-kv`):
a KV leaf the heap evicts is spilled to a bounded, LRU host pool and copied back over PCIe when a request's GPU
match stops where the host's continues (`hostkv.py`, `BaseSystem.start_restore`). With the tier, cost_i of a KV
run is its PCIe copy time (ELORA: "computed using the PCIe bandwidth and size of the KV or LoRA"), without it
its recompute time. ELORA's ablations keep the tier (they change only the score or the tree). ELORA's idle
prefetch of host KV is not modelled (only adapters are prefetched).

`dependency=False` is ELORA's WOM ablation: adapters are evicted by the same score while their KV stays (that
KV is invalid until the adapter returns). The swapper's module docstring lists the choices the paper leaves
open (evict at once on demand, 1% headroom, rescoring after an adapter eviction, tie-breaking).
"""

from __future__ import annotations

from eval.sim.hostkv import HOST_KV_BYTES
from eval.sim.systems.base import BaseSystem
from eval.sim.systems.request import NS, SimRequest
from sgl_multilora.policy import create_policy
from sgl_multilora.host_tier import HostKVTier, path_key
from sgl_multilora.swapper import WANTED_KV_SCAN, Swapper
from sgl_multilora.tree_nodes import Node


class Ours(BaseSystem):
    alora_sharing = True

    def __init__(self, adapters, lat, pool_total_bytes: int, policy: str = "elora",
                 policy_kwargs: dict | None = None, dependency: bool = True, prefetch: bool = True,
                 headroom_frac: float = 0.01, idle_watermark: float = 0.7,
                 swap_period_s: float = 0.1, host_kv_bytes: int | None = None) -> None:
        super().__init__(adapters, lat, pool_total_bytes)
        host_kv_bytes = HOST_KV_BYTES if host_kv_bytes is None else host_kv_bytes
        if host_kv_bytes:
            self.host = HostKVTier(host_kv_bytes // self.kvb, bytes_per_token=self.kvb, clock=lambda: self.now)
            self.usage.kv_reload_s_per_token = self.kvb / lat.hw.pcie_bytes_per_s
        self.policy = create_policy(policy, context=self.usage, **(policy_kwargs or {}))
        self.tree.score = self.policy
        self.dependency = dependency
        self.swapper = Swapper(self.tree, self.kv_pool, self.residency, self.policy, self.link,
                               dependency=dependency, prefetch=prefetch, headroom_frac=headroom_frac,
                               idle_watermark=idle_watermark, swap_interval_s=swap_period_s,
                               free_kv=self.free_kv, on_evict_kv=self._spill if self.host else None)
        self.swapper.wanted = lambda: {name for name, n in self.waiting.items() if n and name is not None}
        self.name = (f"ours:{policy}" + ("" if dependency else ":no-tree")
                     + ("" if self.host is not None else ":no-host-kv"))

    @property
    def num_prefetches(self) -> int:
        return self.swapper.counters.prefetches

    def on_loaded(self, name: str) -> None:
        if self.dependency:
            self.tree.ensure_adapter(NS, self.refs[name])

    def _spill(self, node: Node) -> None:
        """A KV leaf the swapper evicts goes to the host tier (its whole path, so the host stays prefix-closed)."""
        self.host.spill(*path_key(node))

    # ---- the swapper decides ----------------------------------------------------------------------

    def set_waiting(self, waiting: list[SimRequest]) -> None:
        """As the live server: adapters waiting requests name and the KV the first WANTED_KV_SCAN of them would
        reuse are evicted last (the prefixes matched at the first eviction of the pass)."""
        head = waiting[:WANTED_KV_SCAN]
        self.swapper.set_waiting(lambda: (self.key(sr, sr.prompt[:-1]) for sr in head))

    def admission_room(self) -> int:
        """Also the idle adapters' slots, as the live server's `evictable_size` counts them: one pool."""
        return super().admission_room() + self.swapper.reclaimable_adapter_slots()

    def start_load(self, name: str) -> bool:
        return self.swapper.load(name)

    def make_room_kv(self, num_slots: int, protect: str | None) -> bool:
        return num_slots <= self.kv_pool.num_slots and self.swapper.make_room(num_slots, protect)

    def make_room_adapter(self, num_slots: int, protect: str | None) -> bool:
        return self.make_room_kv(num_slots, protect)

    def poll_loads(self) -> list[str]:
        return self.swapper.poll_loads()

    def tick(self, now: float) -> None:
        super().tick(now)  # host KV copies and adapter loads that finished
        self.swapper.tick(now)  # idle prefetch

    def check_invariants(self) -> None:
        super().check_invariants()
        self.swapper.check_invariants()
        if not self.dependency:
            return
        ns_node = self.tree.namespace_node(NS)
        in_tree = set() if ns_node is None else {e for e in ns_node.children if e is not None}
        resident = set(self.residency.resident_ids())
        assert in_tree == resident, f"adapter nodes {sorted(in_tree ^ resident)} disagree with the resident set"
        assert self.invalid_kv_bytes() == 0, "resident KV of a non-resident adapter: dependency broken"
