"""Stock-SGLang-like: a fixed number of adapter slots padded to the largest rank, radix cache with LRU.

As SGLang 0.5.23 runs multi-LoRA (shared/reference/sglang-internals.md, seed-chameleon.md 8): a static
`LoRAMemoryPool` of `max_loras_per_batch` (default 8) slots, each sized for `max_lora_rank`, separate from the
KV pool; a slot is refilled (LRU among slots no running request uses) by a copy on the compute stream, so the
copy stalls the step; the radix cache keys KV by adapter (extra_key = lora id) and evicts LRU leaves, keeping
an evicted adapter's KV.
"""

from __future__ import annotations

from eval.sim.systems.base import BaseSystem


class SglangLike(BaseSystem):
    name = "sglang"
    adapter_area = "slots"
    kv_area = "kv"
    max_loras_per_batch = 8

    def areas(self) -> dict[str, int]:
        slot = max(self.sizes.values(), default=1)
        slots = min(self.max_loras_per_batch, max(1, len(self.sizes))) * slot
        return {"slots": slots, "kv": self.pool_total_bytes - slots}

    def start_load(self, name: str) -> bool:
        """A synchronous copy into a slot: the adapter is resident at once and the next step waits for it."""
        slot = max(self.sizes.values())
        if not self.pool.fits("slots", slot) and not self.make_room_adapter(slot, name):
            return False
        self.pool.alloc("slots", "adapter", slot)
        self.resident.add(name)
        self.usage.set_resident(name, True)
        self.stall_s += self.lat.h2d_time(self.weight_bytes[name])
        self.num_loads += 1
        return True

    def drop_adapter(self, name: str) -> None:
        assert self.rc[name] == 0, f"dropping adapter {name} used by {self.rc[name]} running requests"
        self.resident.discard(name)
        self.usage.set_resident(name, False)
        self.pool.free("slots", "adapter", max(self.sizes.values()))

    def make_room_kv(self, num_bytes: int, protect: str | None) -> bool:
        return self.evict_kv_lru(num_bytes)

    def make_room_adapter(self, num_bytes: int, protect: str | None) -> bool:
        return self.evict_adapters_lru(num_bytes, protect)

    def check_invariants(self) -> None:
        saved = self.sizes
        slot = max(saved.values())
        self.sizes = {n: slot for n in saved}  # every resident adapter holds one padded slot
        try:
            super().check_invariants()
        finally:
            self.sizes = saved
