"""Stock-SGLang-like: a fixed number of adapter slots padded to the largest rank, radix cache with LRU.

As SGLang 0.5.23 runs multi-LoRA (shared/reference/sglang-internals.md, seed-chameleon.md 8): a static
`LoRAMemoryPool` of `max_loras_per_batch` (default 8) slots, each sized for `max_lora_rank`, separate from the
KV pool; a slot is refilled (LRU among slots no running request uses) by a copy on the compute stream, so the
copy stalls the step; the radix cache keys KV by adapter (extra_key = lora id) and evicts LRU leaves, keeping
an evicted adapter's KV. Both areas are core `UnifiedPool`s of token-sized slots; each adapter's padded size is
its slot count, so the pool's adapter count is exact.

`sglang:hicache` adds SGLang's hierarchical cache (`--enable-hierarchical-cache`): the same host KV tier as ours
(`sgl_multilora.host_tier`, inclusive, LRU drops, copies back over the same PCIe link), with the same host budget;
what differs from ours is everything else (fixed adapter slots, LRU, keys by adapter with no aLoRA sharing).
"""

from __future__ import annotations

from eval.sim.systems.area_lru import evict_adapters_lru, evict_kv_lru
from eval.sim.systems.base import BaseSystem
from sgl_multilora.host_tier import HostKVTier


class SglangLike(BaseSystem):
    name = "sglang"
    adapter_area = "slots"
    kv_area = "kv"
    max_loras_per_batch = 8

    def __init__(self, adapters, lat, pool_total_bytes: int, host_kv_bytes: int = 0) -> None:
        super().__init__(adapters, lat, pool_total_bytes)
        if host_kv_bytes:
            self.host = HostKVTier(host_kv_bytes // self.kvb, bytes_per_token=self.kvb, clock=lambda: self.now)
            self.name = "sglang:hicache"

    def adapter_slots(self) -> dict[str, int]:
        """Every adapter takes one LoRA slot padded to the largest adapter (SGLang's max_lora_rank)."""
        padded = max(super().adapter_slots().values(), default=1)
        return {n: padded for n in self.sizes}

    def areas(self) -> dict[str, int]:
        slots = min(self.max_loras_per_batch, max(1, len(self.sizes))) * max(self.adapter_slots().values(),
                                                                              default=1)
        return {"slots": slots, "kv": self.num_slots - slots}

    def start_load(self, name: str) -> bool:
        """A synchronous copy into a slot: the adapter is resident at once and the next step waits for it."""
        n = self.residency.entry(name).num_slots
        if not self.adapter_pool.can_fit(n) and not self.make_room_adapter(n, name):
            return False
        self.residency.begin_load(name)
        self.residency.finish_load(name)
        self.stall_s += self.lat.h2d_time(self.weight_bytes[name])
        return True

    def make_room_kv(self, num_slots: int, protect: str | None) -> bool:
        return evict_kv_lru(self, num_slots)

    def make_room_adapter(self, num_slots: int, protect: str | None) -> bool:
        return evict_adapters_lru(self, num_slots, protect)
