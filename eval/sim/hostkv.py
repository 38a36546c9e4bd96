"""ELORA's host KV tier in the simulator: history KV the GPU evicts goes to a bounded host pool and can come back
over PCIe instead of being recomputed.

Lives here: the simulator's default host pool size and the slot-value encoding of KV restored from it. Not here:
the tier itself (`sgl_multilora.host_tier.HostKVTier`, the object the server runs too, here in its count-only
mode), when the GPU evicts (the systems) or the copy timing (`systems/base.py`, on the same FIFO PCIe link as
adapter copies, `LatencyModel.h2d_time`).

Model (seed-elora.md 2.2, 2.4, 3.1, 3.5):
- The host tier is a `LoraRadixTree` keyed exactly like the GPU tree (namespace, adapter, tokens, aLoRA start),
  so the dependency rule holds across tiers: host KV of adapter A is found only by a request that names A
  (and aLoRA suffixes only by their own aLoRA), and it comes back only below a GPU-resident prefix whose
  adapter is resident (ELORA swaps in only host subtree roots whose parent is in GPU).
- Spill: when the GPU evicts a history-KV leaf, the leaf's whole token path (its GPU-resident ancestors too)
  is inserted, so the host tree stays prefix-closed and a later match on it is a plain prefix match. The tier
  is *inclusive*: KV copied back to the GPU keeps its host copy until host LRU drops it (ELORA moves a block
  between tiers; an inclusive host spends host memory on copies the GPU also holds and saves a write-back
  on the next eviction). The GPU->host copy is not timed: PCIe is full duplex and ELORA's swapper writes out
  ahead of need; the GPU memory counts as free at once (optimistic for the tier).
- Bounded: `capacity_bytes` (whole tokens); when a spill would overflow it, host leaves go least recently used first (ELORA: "cold
  KV blocks are evicted" when GPU and host are both full, rule unspecified). A host run being copied back is
  locked and never dropped.
- Default size `HOST_KV_BYTES`: half of the 256 GB of host DRAM of ELORA's machine (Table II), the rest left to
  the OS, the serving process and the pinned host copies of the adapters (100 x 336 MB = 34 GB at most here).
  An assumption: the paper does not give the host pool's size, and the machine has 8 GPUs (32 GB each if all
  served at once; `compare.py` runs that as `ours:elora:host-kv=32`).

Invalid KV stays a GPU measure (ELORA's "invalid KV" is GPU memory held by KV whose LoRA is not on the GPU):
host KV of a non-resident adapter costs no GPU memory, and it cannot come back before its adapter does.
"""

from __future__ import annotations

HOST_KV_BYTES = 128 * 10**9
"""Default host KV pool: 128 GB, half of ELORA's 256 GB host DRAM (an assumption, see the module docstring)."""

RESTORE_ID_UNIT = 1 << 20
"""Slot values of restored KV: owner index + restore id x this (owner index -1 for base KV, < 2**20 - 1
adapters). Computed KV has restore id 0, so its values are the owner indices as before. A match returns the
values it read, and restores finish in FIFO order, so the largest restore id among them says which copy a
request that reuses restored KV must wait for."""


def owner_of(value: int) -> int:
    """The adapter index (-1: base) a slot value belongs to."""
    return (value + 1) % RESTORE_ID_UNIT - 1


def restore_id_of(value: int) -> int:
    return (value + 1) // RESTORE_ID_UNIT
