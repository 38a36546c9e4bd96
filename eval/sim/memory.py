"""Memory budget of the simulated GPU: how many bytes the pool of KV and adapters gets.

Lives here: `pool_bytes` (HBM left for KV and adapters after the weights). Not here: the accounting, which is
the core's (`sgl_multilora.pool.UnifiedPool`: token-sized slots by kind, checked exactly at every step, one pool
per area; systems/base.py builds them), or what to evict (the systems and `sgl_multilora.swapper`).

```
area "all" (unified) or "adapter" / "kv" / "slots" (static splits), in slots of one token's KV (128 KiB):
| adapter weights | kv_cached (history) | kv_running (reserved by running requests) | in_flight | free |
```
`in_flight` holds both adapter copies and history KV being copied back from the host tier. The pool gets
`pool_bytes // kv_bytes_per_token` slots (SGLang sizes its KV pool in whole tokens the same way), and an adapter
`ceil(weight bytes / 128 KiB)` slots.

Host tier: every adapter's weights stay in pinned host memory (ELORA never drops them), so an evicted adapter
can always be copied back (`latency.LatencyModel.h2d_time`). History KV: ours (and its ablations) spill evicted
KV to a bounded host KV pool with its own exact counter (`hostkv.HostKVTier`); the baselines drop it and
recompute it (systems/__init__.py says why).
"""

from __future__ import annotations

from eval.sim.latency import LatencyModel

MEM_FRACTION_STATIC = 0.88
"""Share of HBM for weights + KV + adapters; the rest holds activations and CUDA graphs. SGLang sizes this per
GPU; 0.88 is its usual figure for an 80 GB card (an assumption, not measured here)."""


def pool_bytes(lat: LatencyModel, mem_fraction_static: float = MEM_FRACTION_STATIC) -> int:
    """Bytes left for KV and adapters: fraction x HBM - weights (~59 GB, ~450k tokens of KV, on an H100)."""
    free = int(lat.hw.hbm_total_bytes * mem_fraction_static) - lat.model.weight_bytes
    if free <= 0:
        raise ValueError(f"the weights ({lat.model.weight_bytes} B) do not fit in {mem_fraction_static} of HBM")
    return free
