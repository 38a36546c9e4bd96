"""The baselines' eviction: least recently used first, within one memory area.

Lives here: `evict_adapters_lru` and `evict_kv_lru`, which the vLLM-, S-LoRA- and SGLang-like systems call from
their `make_room_*` hooks. Not here: ours, whose evictions are the core swapper's (`sgl_multilora/swapper.py`).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from sgl_multilora.host_tier import path_key
from sgl_multilora.tree_nodes import NodeKind

if TYPE_CHECKING:
    from eval.sim.systems.base import BaseSystem


def evict_adapters_lru(system: BaseSystem, num_slots: int, protect: str | None) -> bool:
    """Drops unused resident adapters, least recently requested first (ties by name), never `protect`, until
    `num_slots` fit in the adapter area; False if they still do not."""
    pool, res = system.adapter_pool, system.residency
    if pool.can_fit(num_slots):
        return True
    records = system.usage.records
    idle = sorted((n for n in res.resident_ids() if res.num_running(n) == 0 and n != protect),
                  key=lambda n: (records[n].last_access, n))
    for name in idle:
        system.drop_adapter(name)
        if pool.can_fit(num_slots):
            return True
    return False


def evict_kv_lru(system: BaseSystem, num_slots: int) -> bool:
    """Frees history KV (the tree's own LRU order) until `num_slots` fit in the KV area. With a host tier
    (SGLang's HiCache) every evicted leaf is spilled to it first."""
    short = num_slots - system.kv_pool.num_free
    tree = system.tree
    if short <= 0 or tree is None:
        return system.kv_pool.can_fit(num_slots)
    if system.host is None:
        tree.evict(short, system.free_kv)
        return system.kv_pool.can_fit(num_slots)
    now, freed = tree.clock(), 0
    heap = [(tree.score(n, now), n.id, n) for n in tree.evictable_leaves()]
    heapq.heapify(heap)
    while freed < short and heap:
        node = heapq.heappop(heap)[2]
        if node.is_evicted or node.children or node.lock_ref:
            continue
        parent = node.parent
        system.host.spill(*path_key(node))
        freed += tree.evict_leaf(node, system.free_kv)
        if parent.kind is NodeKind.KV and not parent.children and parent.lock_ref == 0:
            heapq.heappush(heap, (tree.score(parent, now), parent.id, parent))
    return system.kv_pool.can_fit(num_slots)
