"""The systems of the MoE-scale comparison (eval/sim/moe_compare.py): coupled serving with a static LoRA / KV split
(S-LoRA as the InfiniLoRA paper ran it, in vLLM) and InfiniLoRA's disaggregated instances around one shared LoRA
server. All run on the engine's loop (`engine.simulate_systems`) and the core's pool and residency objects.

Lives here: `CoupledSplit`, `LoraServer`, `InfiniInstance`. Not here: step costs (`moe_latency.py`), the server's
load timing (`link.ServerLoader`), the unified pool arm (`systems/ours.py`, used as it is).

- `CoupledSplit(lora_fraction)`: the pool after the weights is split once, `lora_fraction` to adapters (0.5 for
  S-LoRA, 0.4 for its Less-LoRA variant, as the paper's §6.1) and the rest to KV; no history KV (every request's KV
  is freed when it ends: the workload has no reuse); the paper's coupled scheduler (§2.2): a request is admitted if
  its adapter is resident or fits in the adapter area after dropping idle adapters (least recently requested
  first; an adapter with running requests stays), else it waits; loads go over the instance's PCIe links.
- `LoraServer`: the InfiniLoRA server's cache, M adapters (one slot each, a core `UnifiedPool` of M slots and an
  `AdapterResidency`), shared by every instance; the same rule (resident, or a slot freed by dropping an idle
  adapter, LRU); loads over its GPUs' PCIe links (`ServerLoader`: whole adapters, or layer by layer). With
  `prefetch`, the scheduler asks the server to load a request's adapter when the request arrives (its
  out-of-band signal, §5.3), not when the instance first tries to admit it.
- `InfiniInstance`: an LLM instance that holds no adapter: its whole pool is KV.
"""

from __future__ import annotations

from eval.sim.latency import LatencyModel
from eval.sim.link import ServerLoader
from eval.sim.systems.area_lru import evict_adapters_lru
from eval.sim.systems.base import BaseSystem
from eval.sim.systems.request import SimRequest
from eval.workloads.records import AdapterInfo
from sgl_multilora.pool import UnifiedPool
from sgl_multilora.residency import AdapterResidency


class CoupledSplit(BaseSystem):
    """S-LoRA-like coupled serving with a static split: `lora_fraction` of the pool for adapters."""

    adapter_area = "adapter"
    kv_area = "kv"
    history = False

    def __init__(self, adapters, lat: LatencyModel, pool_total_bytes: int, lora_fraction: float = 0.5,
                 name: str = "slora") -> None:
        if not 0 < lora_fraction < 1:
            raise ValueError(f"lora_fraction must be in (0, 1), got {lora_fraction}")
        self.lora_fraction = lora_fraction
        super().__init__(adapters, lat, pool_total_bytes)
        self.name = name

    def areas(self) -> dict[str, int]:
        adapter = int(self.num_slots * self.lora_fraction)
        return {"adapter": adapter, "kv": self.num_slots - adapter}

    @property
    def adapter_capacity(self) -> int:
        """Adapters the adapter area holds at once (all of one size)."""
        sizes = {self.residency.entry(n).num_slots for n in self.names}
        return self.adapter_pool.num_slots // max(sizes) if sizes else 0

    def make_room_kv(self, num_slots: int, protect: str | None) -> bool:
        return self.kv_pool.can_fit(num_slots)

    def make_room_adapter(self, num_slots: int, protect: str | None) -> bool:
        return evict_adapters_lru(self, num_slots, protect)


class LoraServer:
    """InfiniLoRA's LoRA server cache: `capacity` adapters (M), loads by `ServerLoader` over `gpus` GPUs."""

    def __init__(self, adapters: list[AdapterInfo] | tuple[AdapterInfo, ...], lat: LatencyModel, capacity: int,
                 gpus: int, layerwise: bool = True, prefetch: bool = True) -> None:
        if capacity < 1:
            raise ValueError(f"the LoRA server must hold at least one adapter, got capacity {capacity}")
        self.now = 0.0
        self.capacity, self.gpus, self.prefetch = capacity, gpus, prefetch
        self.sizes = {a.name: lat.model.adapter_bytes(a.rank, a.target_modules) for a in adapters}
        self.pool = UnifiedPool(capacity, 1, track_ids=False)  # one slot per adapter
        self.residency = AdapterResidency(self.pool, {n: 1 for n in self.sizes})
        self.loader = ServerLoader(lat, self.sizes, clock=lambda: self.now, gpus=gpus,
                                   num_layers=lat.model.num_layers, layerwise=layerwise)
        self.last_request: dict[str, float] = {}

    def tick(self, now: float) -> list[str]:
        self.now = max(self.now, now)
        return self.residency.complete_loads(self.loader)

    def request(self, name: str, now: float) -> None:
        self.last_request[name] = now

    def start_load(self, name: str) -> bool:
        """Starts loading `name` if a slot is free or an idle adapter can be dropped (LRU); False otherwise."""
        res = self.residency
        if not self.pool.can_fit(1):
            idle = sorted((n for n in res.resident_ids() if res.num_running(n) == 0),
                          key=lambda n: (self.last_request.get(n, -1.0), n))
            if not idle:
                return False
            res.drop(idle[0])
        self.loader.start(name, res.begin_load(name))
        return True

    def resident_bytes(self) -> int:
        return sum(self.sizes[n] for n in self.residency.resident_ids())

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        self.residency.check_invariants()
        assert self.residency.num_resident + len(self.residency.loading_ids()) <= self.capacity


class InfiniInstance(BaseSystem):
    """An LLM instance of InfiniLoRA: no adapter on its GPUs (its pool is all KV); its adapters' residency is the
    shared `LoraServer`'s."""

    adapter_area = "kv"
    kv_area = "kv"
    history = False

    def __init__(self, adapters, lat: LatencyModel, pool_total_bytes: int, server: LoraServer,
                 name: str = "infinilora") -> None:
        self.server = server
        super().__init__(adapters, lat, pool_total_bytes)
        self.residency = server.residency
        self.link = server.loader
        self.name = name

    def areas(self) -> dict[str, int]:
        return {"kv": self.num_slots}

    def adapter_slots(self) -> dict[str, int]:
        return {}  # nothing of an adapter is held here

    def make_room_kv(self, num_slots: int, protect: str | None) -> bool:
        return self.kv_pool.can_fit(num_slots)

    def make_room_adapter(self, num_slots: int, protect: str | None) -> bool:
        raise AssertionError("an InfiniLoRA instance holds no adapter")

    def start_load(self, name: str) -> bool:
        return self.server.start_load(name)

    def poll_loads(self) -> list[str]:
        return self.server.tick(self.now)

    def submit(self, sr: SimRequest) -> None:
        super().submit(sr)
        name, res = sr.req.adapter, self.residency
        if name is None:
            return
        self.server.request(name, self.now)
        if self.server.prefetch and not res.is_resident(name) and not res.is_loading(name):
            self.server.start_load(name)

    def adapter_bytes_held(self) -> int:
        """Adapter bytes on this instance's GPUs: always 0."""
        return self.kv_pool.num_of("adapter") * self.kvb

    def check_invariants(self) -> None:
        self.kv_pool.check_invariants()
        used = self.used_slots()
        assert used["adapter"] == 0 and used["in_flight"] == 0, "an InfiniLoRA instance holds adapter bytes"
        assert used["kv_running"] == self.running_reserved, "kv_running != reservations of running requests"
        self.server.check_invariants()
