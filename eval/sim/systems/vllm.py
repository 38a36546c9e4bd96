"""vLLM-like: a static split, 20% of the pool for adapters and 80% for KV, each area with its own LRU.

As ELORA describes its vLLM baseline (seed-elora.md 5.4): Punica kernels, prefix caching keyed by adapter,
LoRA ratio 0.2, LRU in each area. The areas never lend memory to each other, and an adapter evicted from its
area leaves its history KV behind (ELORA's "invalid KV"). Block size 32 is not modelled (page size 1).
"""

from __future__ import annotations

from eval.sim.systems.base import BaseSystem


class VllmLike(BaseSystem):
    name = "vllm"
    adapter_area = "adapter"
    kv_area = "kv"
    lora_fraction = 0.2

    def areas(self) -> dict[str, int]:
        adapter = int(self.pool_total_bytes * self.lora_fraction)
        return {"adapter": adapter, "kv": self.pool_total_bytes - adapter}

    def make_room_kv(self, num_bytes: int, protect: str | None) -> bool:
        return self.evict_kv_lru(num_bytes)

    def make_room_adapter(self, num_bytes: int, protect: str | None) -> bool:
        return self.evict_adapters_lru(num_bytes, protect)
