"""The simulated PCIe link: one FIFO host->GPU copy queue, shared by adapter loads and KV restores.

Lives here: `PcieLink`, the simulator's `sgl_multilora.residency.Loader`. Not here: what to copy and when
(the systems, the swapper) or the copy-time formula (`latency.LatencyModel.h2d_time`). Copies overlap compute
(async streams) but not each other: each starts when the previous one ends.
"""

from __future__ import annotations

from collections.abc import Callable

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
