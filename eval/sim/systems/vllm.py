"""vLLM-like: a static split, 20% of the pool for adapters and 80% for KV, each area with its own LRU.

As ELORA describes its vLLM baseline (seed-elora.md 5.4): Punica kernels, prefix caching keyed by adapter,
LoRA ratio 0.2, LRU in each area. The areas never lend memory to each other, and an adapter evicted from its
area leaves its history KV behind (ELORA's "invalid KV"). Block size 32 is not modelled (page size 1). Each
area is its own core `UnifiedPool` of token-sized slots.
"""

from __future__ import annotations

from eval.sim.systems.area_lru import evict_adapters_lru, evict_kv_lru
from eval.sim.systems.base import BaseSystem


class VllmLike(BaseSystem):
    name = "vllm"
    adapter_area = "adapter"
    kv_area = "kv"
    lora_fraction = 0.2

    def areas(self) -> dict[str, int]:
        adapter = int(self.num_slots * self.lora_fraction)
        return {"adapter": adapter, "kv": self.num_slots - adapter}

    def make_room_kv(self, num_slots: int, protect: str | None) -> bool:
        return evict_kv_lru(self, num_slots)

    def make_room_adapter(self, num_slots: int, protect: str | None) -> bool:
        return evict_adapters_lru(self, num_slots, protect)
