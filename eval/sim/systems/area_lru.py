"""The baselines' eviction: least recently used first, within one memory area.

Lives here: `evict_adapters_lru` and `evict_kv_lru`, which the vLLM-, S-LoRA- and SGLang-like systems call from
their `make_room_*` hooks. Not here: ours, whose evictions are the core swapper's (`sgl_multilora/swapper.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
    """Frees history KV (the tree's own LRU order) until `num_slots` fit in the KV area."""
    short = num_slots - system.kv_pool.num_free
    if short > 0 and system.tree is not None:
        system.tree.evict(short, system.free_kv)
    return system.kv_pool.can_fit(num_slots)
