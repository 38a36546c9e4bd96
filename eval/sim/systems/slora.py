"""S-LoRA-like: one pool for adapters and running KV, no history KV, adapters loaded on demand.

As ELORA describes its S-LoRA baseline (seed-elora.md 5.4) and Chameleon reads S-LoRA (seed-chameleon.md: an
adapter is discarded when no running request uses it): every prompt is computed in full, and an adapter's
weights leave when its last running request finishes, unless a waiting request wants it (S-LoRA prefetches
adapters for queued requests). KV needs win over idle adapters, which go least recently requested first.
"""

from __future__ import annotations

from eval.sim.systems.area_lru import evict_adapters_lru
from eval.sim.systems.base import BaseSystem


class SLoraLike(BaseSystem):
    name = "slora"
    history = False

    def make_room_kv(self, num_slots: int, protect: str | None) -> bool:
        return evict_adapters_lru(self, num_slots, protect)

    def make_room_adapter(self, num_slots: int, protect: str | None) -> bool:
        return evict_adapters_lru(self, num_slots, protect)

    def after_finish(self, name: str | None) -> None:
        res = self.residency
        if name is not None and not res.num_running(name) and not self.waiting[name] and res.is_resident(name):
            self.drop_adapter(name)
