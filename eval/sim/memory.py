"""Memory accounting of the simulated GPU: byte counters by area and kind, checked exactly.

Lives here: `pool_bytes` (HBM left for KV and adapters after the weights) and `MemoryPool`. Not here: what to
evict (the systems decide and call `free`).

```
area "all" (unified) or "adapter" / "kv" / "slots" (static splits):
| adapter weights | kv_cached (history) | kv_running (reserved by running requests) | in_flight | free |
```
`in_flight` is memory reserved for a host->GPU copy not yet finished. Per area, at every step:
free + adapter + kv_cached + kv_running + in_flight == capacity (integers, so the check is exact).

`in_flight` holds both adapter copies and history KV being copied back from the host tier.

Host tier: every adapter's weights stay in pinned host memory (ELORA never drops them), so an evicted adapter
can always be copied back (`latency.LatencyModel.h2d_time`). History KV: ours (and its ablations) spill evicted
KV to a bounded host KV pool with its own exact counter (`hostkv.HostKVTier`); the baselines drop it and
recompute it (systems/__init__.py says why).
"""

from __future__ import annotations

from eval.sim.latency import LatencyModel

KINDS = ("adapter", "kv_cached", "kv_running", "in_flight")

MEM_FRACTION_STATIC = 0.88
"""Share of HBM for weights + KV + adapters; the rest holds activations and CUDA graphs. SGLang sizes this per
GPU; 0.88 is its usual figure for an 80 GB card (an assumption, not measured here)."""


def pool_bytes(lat: LatencyModel, mem_fraction_static: float = MEM_FRACTION_STATIC) -> int:
    """Bytes left for KV and adapters: fraction x HBM - weights (~59 GB, ~450k tokens of KV, on an H100)."""
    free = int(lat.hw.hbm_total_bytes * mem_fraction_static) - lat.model.weight_bytes
    if free <= 0:
        raise ValueError(f"the weights ({lat.model.weight_bytes} B) do not fit in {mem_fraction_static} of HBM")
    return free


class MemoryPool:
    """Owner of the byte counters. `areas`: name -> capacity in bytes.

    Check first, then act: `fits(area, n)` is a pure query; `alloc` asserts the room exists (an owner that
    allocates without checking has a bug); `move` re-labels bytes between kinds within an area.
    """

    def __init__(self, areas: dict[str, int]) -> None:
        if not areas or min(areas.values()) <= 0:
            raise ValueError(f"every memory area needs a positive capacity, got {areas}")
        self.capacity = dict(areas)
        self.used = {a: {k: 0 for k in KINDS} for a in areas}
        self._free = dict(areas)

    def free_bytes(self, area: str) -> int:
        return self._free[area]

    def used_bytes(self, area: str) -> int:
        return self.capacity[area] - self._free[area]

    def fits(self, area: str, num_bytes: int) -> bool:
        return num_bytes <= self._free[area]

    def alloc(self, area: str, kind: str, num_bytes: int) -> None:
        assert num_bytes >= 0, f"negative allocation {num_bytes} of {kind}"
        assert num_bytes <= self._free[area], (
            f"alloc of {num_bytes} B {kind} in {area} with {self._free[area]} B free: call fits() first")
        self._free[area] -= num_bytes
        self.used[area][kind] += num_bytes

    def free(self, area: str, kind: str, num_bytes: int) -> None:
        assert 0 <= num_bytes <= self.used[area][kind], (
            f"freeing {num_bytes} B of {kind} in {area} but only {self.used[area][kind]} B are held")
        self.used[area][kind] -= num_bytes
        self._free[area] += num_bytes

    def move(self, area: str, src: str, dst: str, num_bytes: int) -> None:
        assert 0 <= num_bytes <= self.used[area][src], (
            f"moving {num_bytes} B from {src} to {dst} in {area} but {src} holds {self.used[area][src]} B")
        self.used[area][src] -= num_bytes
        self.used[area][dst] += num_bytes

    def by_kind(self) -> dict[str, int]:
        """Bytes of each kind summed over areas, plus "free"."""
        out = {k: sum(u[k] for u in self.used.values()) for k in KINDS}
        out["free"] = sum(self._free.values())
        return out

    def check_invariants(self) -> None:
        for area, cap in self.capacity.items():
            used = self.used[area]
            assert min(used.values()) >= 0 and self._free[area] >= 0, f"negative counter in {area}: {used}"
            assert self._free[area] + sum(used.values()) == cap, (
                f"area {area}: free {self._free[area]} + {used} != capacity {cap}")
