"""`--multilora-host-kv-gb`: the host tier of the live server, through SGLang's own host-hit protocol.

Lives here: `HostKVStore` (host slots: per-layer K and V tensors in host memory, the copies between them and
SGLang's KV buffers) and `LiveHostTier` (the scheduler process's owner of the core `HostKVTier` over that store:
spill on eviction, host hits on match, load-back on admission, stats). `radix_backend.py` calls it. Not here: the
tier's rules (`sgl_multilora/host_tier.py`, shared with the simulator), the pool and the swapper.

How a request gets its history back, in SGLang's terms (the same calls SGLang's HiCache and FlexKV caches use):
1. `match_prefix` returns the device match plus `host_hit_length`, the tokens the host tier holds beyond it, when
   the request's adapter is resident (the dependency rule: host KV returns only below a resident adapter).
2. SGLang's `PrefillAdder` budgets the request with those tokens as extend tokens, pins the device match and
   calls `init_load_back`: slots are taken from the pool (evicting, which may spill others, never this match or
   this host run), the KV is copied host -> device, the run joins the device tree as cached KV, and the request's
   prefix grows by exactly the promised tokens; or nothing is loaded (the host or the device changed since the
   match) and SGLang recomputes them.
3. Evicted leaves spill: the swapper's `on_evict_kv` writes the leaf's whole path (only what the host lacks).

Copies are synchronous on CPU. On CUDA the host pool is pinned and the copies run on a side stream, overlapped
with the forward passes (`HostKVStore` says how each direction is ordered with the kernels that read or reuse the
slots).

Why not SGLang's HiCache (`--enable-hierarchical-cache`): its `HiRadixCache` is another prefix-cache class (the
backend registry gives a server one), keyed by tokens and extra_key strings only, with no adapter nodes, aLoRA
suffixes or dependency rule; its cache controller and host pool need CUDA (on a CPU-only torch the host pool's
allocation stops the scheduler: `pool_host/common.py` registers the buffer with `torch.cuda.cudart()`). What fits is
reused: SGLang's admission protocol for host hits (`host_hit_length`, `init_load_back`, cache-owned loads) and its
sizing convention (GB = 1e9 bytes, as `--hicache-size`).
"""

from __future__ import annotations

import logging
import time

import torch

from sgl_multilora.host_tier import HostKVTier, path_key
from sgl_multilora.keys import MatchKey
from sgl_multilora.tree_nodes import Node

logger = logging.getLogger(__name__)

EMA = 0.2
PREFETCH_CANDIDATES = 16  # host leaves the idle swap-in considers per tick, highest score first


def contiguous_runs(ids) -> list[tuple[int, int, int]]:
    """(position in `ids`, first id, length) of each maximal run of consecutive ids, in order."""
    runs: list[tuple[int, int, int]] = []
    for pos, i in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == i:
            p, first, n = runs[-1]
            runs[-1] = (p, first, n + 1)
        else:
            runs.append((pos, i, 1))
    return runs


class HostKVStore:
    """`capacity` host slots of one token's K and V over every layer, and the copies to and from SGLang's
    `k_buffer[l]` / `v_buffer[l]`. Memory is reserved, not touched on CPU: pages are committed as slots are
    written (on CUDA the pool is pinned, so it is committed at once).

    Layout on CPU: layer-major, `host_k[layer]` is (capacity, heads, dim) like the device buffer, so each layer's
    copy is a gather / scatter of whole rows within one contiguous tensor (a slot-major pool made the CPU copies
    stride over every layer's rows: returning turns 9.3x faster than recomputing instead of 10.9x). On CUDA:
    slot-major, `host_k[slot]` is one token's K over all layers, so a run of consecutive host slots is one
    contiguous block and crosses PCIe as one DMA:

    ```
    host_k  (capacity, layers, heads, dim)      device k_buffer[l]  (size, heads, dim), one per layer
    slot 7: [l0 | l1 | ... | lL-1]  <--copy--   gather rows d of every layer -> staging (n, layers, heads, dim)
    slot 8: [l0 | l1 | ... | lL-1]
    ```

    On CUDA the copies run on a side stream (`copy_stream`), overlapped with the forward passes:
    - write (spill): the rows are gathered on the current stream into a device staging tensor (a device-speed
      read of the slots, so the evicted slots may be reused by the next kernel at once), then copied device ->
      pinned host on the side stream, one DMA per run of host slots; nothing waits on it.
    - read (load-back): host -> device staging on the side stream, then the current stream waits for that copy
      alone and scatters the rows into the KV buffers, so the forward that reads them is ordered after it.
    Host slots are only ever touched by copies on the side stream, so writes and reads of one slot are ordered
    among themselves; the CPU never reads or writes the pinned pool while a copy may be in flight."""

    def __init__(self, k_buffers, v_buffers, capacity: int) -> None:
        self.k_buffers, self.v_buffers = k_buffers, v_buffers
        self.device = k_buffers[0].device
        self.on_cuda = self.device.type == "cuda"
        k0, v0 = k_buffers[0], v_buffers[0]
        layers = len(k_buffers)
        shape = (capacity, layers) if self.on_cuda else (layers, capacity)
        self.host_k = torch.empty((*shape, *k0.shape[1:]), dtype=k0.dtype, pin_memory=self.on_cuda)
        self.host_v = torch.empty((*shape, *v0.shape[1:]), dtype=v0.dtype, pin_memory=self.on_cuda)
        self.copy_stream = torch.cuda.Stream(self.device) if self.on_cuda else None
        self.capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))  # a stack: low ids first
        self.num_copies = 0  # DMAs issued (CUDA: one per run of host slots) or copy calls (CPU); in the stats

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        ids = sorted(self._free[-n:])  # ascending: freed slots coalesce into runs (fewer DMAs)
        del self._free[-n:]
        return ids

    def free(self, host_ids: list[int]) -> None:
        self._free.extend(host_ids)

    def host_rows(self, host_ids, layer: int, v: bool = False) -> torch.Tensor:
        """The K (or V) rows of `host_ids` for one layer, whatever the layout (for inspection; not a copy path)."""
        host = self.host_v if v else self.host_k
        ids = torch.tensor(list(host_ids), dtype=torch.int64)
        return host[:, layer].index_select(0, ids) if self.on_cuda else host[layer].index_select(0, ids)

    def _device_index(self, values) -> torch.Tensor:
        """`values` as an index tensor on the device, without blocking the CPU on the current stream (a pageable
        host-to-device copy would wait for the kernels already queued, i.e. the running forward pass)."""
        index = torch.tensor(list(values), dtype=torch.int64)
        if not self.on_cuda:
            return index
        return index.pin_memory().to(self.device, non_blocking=True)

    def write(self, host_ids: list[int], device_values) -> None:
        d = self._device_index(device_values)
        h = None if self.on_cuda else torch.tensor(host_ids, dtype=torch.int64)
        for host, buffers in ((self.host_k, self.k_buffers), (self.host_v, self.v_buffers)):
            if not self.on_cuda:
                for layer, buffer in enumerate(buffers):
                    host[layer].index_copy_(0, h, buffer.index_select(0, d))
                self.num_copies += 1
                continue
            staging = torch.stack([b.index_select(0, d) for b in buffers], dim=1)  # (n, layers, ...)
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                for pos, first, n in contiguous_runs(host_ids):
                    host[first:first + n].copy_(staging[pos:pos + n], non_blocking=True)
                    self.num_copies += 1
            staging.record_stream(self.copy_stream)

    def read(self, host_ids, device_values) -> None:
        host_ids = list(host_ids)
        d = self._device_index(device_values)
        h = None if self.on_cuda else torch.tensor(host_ids, dtype=torch.int64)
        for host, buffers in ((self.host_k, self.k_buffers), (self.host_v, self.v_buffers)):
            if not self.on_cuda:
                for layer, buffer in enumerate(buffers):
                    buffer.index_copy_(0, d, host[layer].index_select(0, h))
                self.num_copies += 1
                continue
            current = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self.copy_stream):
                rows = torch.empty((len(host_ids), *host.shape[1:]), dtype=host.dtype, device=self.device)
                for pos, first, n in contiguous_runs(host_ids):
                    rows[pos:pos + n].copy_(host[first:first + n], non_blocking=True)
                    self.num_copies += 1
            current.wait_stream(self.copy_stream)
            rows.record_stream(current)
            for layer, buffer in enumerate(buffers):
                buffer.index_copy_(0, d, rows[:, layer])


class LiveHostTier:
    """The host tier of one scheduler process (see the module docstring)."""

    def __init__(self, memory, capacity_bytes: float) -> None:
        self.memory = memory  # the unified pool's LiveMemory
        slot_bytes = memory.pool.slot_bytes
        capacity = int(capacity_bytes // slot_bytes)
        if capacity <= 0:
            raise ValueError(f"--multilora-host-kv-gb {capacity_bytes / 1e9:g} holds no token of KV "
                             f"({slot_bytes} B per token)")
        tree = memory.swapper.tree
        self.store = HostKVStore(memory.k_buffers, memory.v_buffers, capacity)
        self.tier = HostKVTier(capacity, bytes_per_token=slot_bytes, page_size=tree.page_size, store=self.store)
        self.copy_s_per_token: float | None = None
        self.promised: dict[str, tuple[MatchKey, int, int]] = {}  # rid -> (key, device len, host hit length)
        self.num_load_backs = 0
        self.num_declined = 0  # promised host hits not loaded (recomputed instead)
        self.num_declined_tokens = 0
        memory.swapper.on_evict_kv = self.spill
        memory.swapper.kv_prefetch = self.prefetch
        logger.info("sgl_multilora: host KV tier of %d tokens (%.2f GB)", capacity, capacity * slot_bytes / 1e9)

    # ---- spill --------------------------------------------------------------------------------------------------

    def spill(self, node: Node) -> None:
        """The swapper is about to evict this KV leaf: its path goes to the host (what the host lacks)."""
        self.tier.spill(*path_key(node))

    # ---- match and load-back ------------------------------------------------------------------------------------

    def host_hit(self, rid: str, key: MatchKey, device_len: int) -> int:
        """Tokens of `key` the host holds beyond the device match (0 if none, or if the key's adapter is not
        resident); remembered for `load_back`."""
        self.promised.pop(rid, None)
        if key.adapter is not None and not self.memory.residency.is_resident(key.adapter.identity):
            return 0
        found = self.tier.match(key, touch=False).prefix_len
        if found <= device_len:
            return 0
        self.promised[rid] = (key, device_len, found - device_len)
        return found - device_len

    def load_back(self, rid: str, device_node: Node, host_hit_length: int) -> tuple[int, Node]:
        """SGLang's `init_load_back`: copies exactly the promised tokens back and inserts them as cached KV, or
        nothing. Returns (tokens loaded, the request's new last node)."""
        promised = self.promised.pop(rid, None)
        if promised is None or promised[2] != host_hit_length:
            return self._decline(host_hit_length, device_node)
        key, device_len, n = promised
        end = device_len + n
        key = MatchKey(key.namespace, key.adapter, key.token_ids[:end], key.alora_start)
        tree = self.memory.swapper.tree
        if device_node.is_evicted:
            return self._decline(n, device_node)
        device = tree.match(key, touch=False)
        host = self.tier.match(key)
        if device.prefix_len != device_len or host.prefix_len < end:
            return self._decline(n, device_node)
        if key.adapter is not None and not self.memory.residency.is_resident(key.adapter.identity):
            return self._decline(n, device_node)
        self.tier.lock(host.last_node)  # making room may spill and drop: never this run
        tree.lock(device.last_node)
        try:
            began = time.perf_counter()
            allocator = self.memory.allocator
            slots = allocator.alloc(n)
            if slots is None:
                self.memory.evict(n)
                slots = allocator.alloc(n)
            if slots is None:
                return self._decline(n, device_node)
            new = slots.tolist()
            self.tier.restore(host.kv_values[device_len:end], new)
            result = tree.insert(key, device.kv_values + new)
            assert result.prefix_len == device_len, (result.prefix_len, device_len)
            allocator.mark_cached(new)
            per_token = (time.perf_counter() - began) / n
        finally:
            tree.unlock(device.last_node)
            self.tier.unlock(host.last_node)
        self.copy_s_per_token = per_token if self.copy_s_per_token is None else (
            self.copy_s_per_token + EMA * (per_token - self.copy_s_per_token))
        self.memory.usage.kv_reload_s_per_token = self.copy_s_per_token  # ELORA: a KV run's cost is its copy
        self.num_load_backs += 1
        return n, result.last_node

    def prefetch(self, room: int) -> int:
        """The idle swapper's swap-in of host KV: the highest-scored host leaves whose adapter is resident get the
        part of their path the device lacks copied back as cached KV, into at most `room` free slots (never
        evicting). Returns the slots used."""
        tree = self.memory.swapper.tree
        score, now = self.memory.policy.score, tree.clock()
        allocator, residency = self.memory.allocator, self.memory.residency
        leaves = sorted(self.tier.tree.evictable_leaves(), key=lambda n: (-score(n, now), n.id))
        used = 0
        for leaf in leaves[:PREFETCH_CANDIDATES]:
            key, host_values = path_key(leaf)
            if key.adapter is not None and not residency.is_resident(key.adapter.identity):
                continue  # host KV of an absent adapter stays on the host (the dependency rule)
            device = tree.match(key, touch=False)
            n = len(host_values) - device.prefix_len
            if n <= 0 or n > room - used:
                continue
            slots = allocator.alloc(n)
            if slots is None:
                break
            new = slots.tolist()
            self.tier.restore(host_values[device.prefix_len:], new)
            result = tree.insert(key, device.kv_values + new)
            assert result.prefix_len == device.prefix_len, (result.prefix_len, device.prefix_len)
            allocator.mark_cached(new)
            used += n
        return used

    def _decline(self, n: int, node: Node) -> tuple[int, Node]:
        self.num_declined += 1
        self.num_declined_tokens += n
        return 0, node

    # ---- adapters, flush, observation ---------------------------------------------------------------------------

    def remove_adapter(self, identity: str) -> None:
        self.tier.remove_adapter(identity)

    def clear(self) -> None:
        self.tier.clear()
        self.promised.clear()

    def prune(self, waiting_rids: set[str]) -> None:
        """Forgets promises to requests no longer waiting (admitted without a load-back, or aborted)."""
        for rid in [r for r in self.promised if r not in waiting_rids]:
            del self.promised[rid]

    def stats(self) -> dict:
        return {**self.tier.stats(), "load_backs": self.num_load_backs, "declined_load_backs": self.num_declined,
                "declined_tokens": self.num_declined_tokens, "copy_s_per_token": self.copy_s_per_token,
                "copies": self.store.num_copies,
                "adapter_host_copies_bytes": self.memory.host_adapter_bytes()}

    def check_invariants(self) -> None:
        self.tier.check_invariants()
