"""The simulated PCIe link: one FIFO host->GPU copy queue, shared by adapter loads and KV restores.

Lives here: `PcieLink`, the simulator's `sgl_multilora.residency.Loader`; `NetLink` (instance <-> LoRA server
network, the InfiniLoRA comparison) and `ServerLoader` (a LoRA server's loads, layer by layer or whole). Not here: what to copy and when
(the systems, the swapper) or the copy-time formula (`latency.LatencyModel.h2d_time`). Copies overlap compute
(async streams) but not each other: each starts when the previous one ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from eval.sim.latency import LatencyModel
from sgl_multilora.pool import SlotRuns


class PcieLink:
    """`adapter_bytes`: weight bytes copied per adapter. `clock()`: the simulated now."""

    def __init__(self, lat: LatencyModel, adapter_bytes: dict[str, int], clock: Callable[[], float]) -> None:
        self.lat = lat
        self.adapter_bytes = adapter_bytes
        self.clock = clock
        self.free_s = 0.0  # when the last queued copy ends
        self._done_s: dict[str, float] = {}  # adapter -> end of its latest copy

    def copy(self, num_bytes: int) -> float:
        """Queues one copy of `num_bytes`; returns when it ends."""
        start = max(self.clock(), self.free_s)
        self.free_s = start + self.lat.h2d_time(num_bytes)
        return self.free_s

    def start(self, adapter_id: str, slots: SlotRuns) -> None:
        self._done_s[adapter_id] = self.copy(self.adapter_bytes[adapter_id])

    def is_done(self, adapter_id: str) -> bool:
        return self._done_s[adapter_id] <= self.clock()

    def done_s(self, adapter_id: str) -> float:
        """End of the adapter's latest copy (KeyError if it was never started)."""
        return self._done_s[adapter_id]


@dataclass(frozen=True)
class NetLink:
    """A network link between an LLM instance and a LoRA server: bytes per second per NIC (one NIC per GPU) and a
    fixed latency per message. The InfiniLoRA paper's bandwidths (seed-infinilora.md 5.1): one 400 Gb/s InfiniBand
    NIC per GPU (50 GB/s) and NVLink 900 GB/s per GPU (both directions: 450 GB/s each way)."""

    name: str
    bytes_per_s: float
    latency_s: float


IB_400G = NetLink("InfiniBand 400 Gb/s, one NIC per GPU", 50e9, 5e-6)
"""50 GB/s per GPU; 5 us per one-sided write (IBGDA): the latency is an assumption, not from the paper."""
NVLINK = NetLink("NVLink 900 GB/s per GPU (450 GB/s each way)", 450e9, 2e-6)
"""The paper's collocated variant (§A.1.3) and the instances' own expert all-to-all; 2 us per message assumed."""
LINKS = {"ib": IB_400G, "nvlink": NVLINK}


class ServerLoader(PcieLink):
    """The LoRA server's host->GPU loads: every one of its `gpus` GPUs copies its shard of an adapter over its own
    PCIe link at once (one FIFO of `gpus` x PCIe bandwidth). With `layerwise`, a request may use the adapter once its
    first layer has landed (the rest arrives behind the compute, layer by layer: InfiniLoRA §5.3), while the copy
    still occupies the link until the whole adapter is in; without it, only once all of it is in."""

    def __init__(self, lat: LatencyModel, adapter_bytes: dict[str, int], clock: Callable[[], float], gpus: int,
                 num_layers: int, layerwise: bool) -> None:
        super().__init__(lat, adapter_bytes, clock)
        self.gpus, self.num_layers, self.layerwise = gpus, num_layers, layerwise

    def copy_time(self, num_bytes: int) -> float:
        return self.lat.hw.pcie_latency_s + num_bytes / (self.gpus * self.lat.hw.pcie_bytes_per_s)

    def start(self, adapter_id: str, slots: SlotRuns) -> None:
        size = self.adapter_bytes[adapter_id]
        start = max(self.clock(), self.free_s)
        self.free_s = start + self.copy_time(size)
        self._done_s[adapter_id] = (start + self.copy_time(size // self.num_layers) if self.layerwise
                                    else self.free_s)
