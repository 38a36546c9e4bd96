"""One memory for adapter weights and KV in the live server: SGLang's token allocator over the core's
`UnifiedPool`, adapters resident in KV slots, evicted and prefetched by the core's `Swapper`.

Lives here: `UnifiedTokenAllocator` (SGLang's page-size-1 allocator, its free list being the pool's), and
`LiveMemory`, the scheduler process's one owner of adapter memory: host copies by content identity, the
`AdapterResidency`, the `UsageStats` the policy reads, the `Swapper`, and the copies into KV buffers (it is the
swapper's `Loader`). The hooks at the end translate SGLang's calls; `radix_backend.py` asks `LiveMemory` for
evictions and for the sizes it reports to SGLang's scheduler. Not here: the pool, residency, swapper and
policies themselves (`sgl_multilora/`, shared with the simulator), the slot layout (`slot_layout.py`).

Slots. The pool's slot i is SGLang's KV index i + 1 (SGLang keeps index 0 for padded tokens). KV takes the
lowest free ids, adapters best-fit from the top (`pool.py` has the drawing); an adapter's layer-l matrices sit
whole in k_buffer[l] / v_buffer[l] rows of its slots (`slot_layout.py`), and our LoRA layers read those views.

Accounting, at every step (checked with --multilora-check-invariants):
  free + adapter + kv_cached + kv_running + in_flight == pool slots == SGLang's max_total_num_tokens
  kv_cached == the tree's KV tokens;  kv_running == the KV rows requests own outside the tree.
SGLang's own leak check (available + evictable + protected + uncached == total) closes too: adapters that no
running request uses and no locked KV depends on count as evictable, the other adapter and in-flight slots as
protected.

Compaction. Free slots scattered between running requests' KV can be room enough for an adapter by count but in
runs too short for its matrices; no eviction helps while running KV sits in every window. The swapper then moves
the KV of the cheapest window out instead (`Swapper.compact`): `move_kv` copies K and V and rewrites the request
rows in use, the swapper the tree's ids; SGLang reads a request's prefix off the tree when it allocates, so
nothing else names a slot. Moves happen inside the admission pass, between steps. Under SGLang's overlap scheduler
the last batch's forward may still run on the device's forward stream while the next batch is built: the move's
copies and row rewrites are queued behind it on the device (`allow_kv_moves(after=forward_stream)`), and the last
batch's result processing, which has not run yet, names slots only through the request rows (it releases a
finished request's KV, over-allocated decode slots included, by reading its row), so it reads the new ids.

Admission. A request whose adapter is not resident is skipped for this pass (the queue goes on) while the
swapper makes room and copies it in; the room taken never exceeds what the pass's prefill budget has left, so
requests already admitted keep their memory. Adapters used by running or just-admitted requests are never
evicted (their counts are set from the scheduler's batches before and after every admission pass). Adapters the
waiting queue names and the KV its requests' prefixes match are evicted after every other candidate (`set_wanted`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from itertools import islice

import numpy as np
import torch
from sgl_multilora.patches import flags
from sgl_multilora.patches.state import process_state
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

from sgl_multilora.adapters import LoadedAdapter
from sgl_multilora.admission_gate import (
    AdmissionGate,
    check_adapter,
    check_request,
    longest_request_beside,
    max_new_beside,
)
from sgl_multilora.keys import MatchKey
from sgl_multilora.policy import create_policy
from sgl_multilora.policy.usage import UsageStats
from sgl_multilora.pool import SlotRuns, UnifiedPool
from sgl_multilora.residency import AdapterResidency
from sgl_multilora.slot_layout import min_run as shortest_run, place, slots_needed
from sgl_multilora.swapper import WANTED_KV_SCAN, Swapper
from sgl_multilora.tree import LoraRadixTree

logger = logging.getLogger(__name__)

# Before the first prefill is measured: seconds to recompute one token's KV (a 135M model on 2 CPU cores
# prefills about 1,500 tokens/s; a GPU is ~100x faster, and the estimate is replaced after one prefill).
INITIAL_RECOMPUTE_S_PER_TOKEN = 1e-3
INITIAL_COPY_BYTES_PER_S = 2e9  # host -> pool copy, replaced by the measured rate after the first load
EMA = 0.2
STALL_LOG_REQUESTS = 8  # waiting requests a stall's log line names


class UnifiedTokenAllocator(TokenToKVPoolAllocator):
    """SGLang's token allocator (page size 1) whose free list is a `UnifiedPool`: KV is handed out as kind
    `kv_running`; the tree moves what it caches to `kv_cached` and frees evicted runs from there; adapters take
    slots through the residency. `available_size()` is the pool's free count."""

    def __init__(self, size: int, dtype: torch.dtype, device: str, kvcache, need_sort: bool):
        k0 = kvcache.k_buffer[0]
        slot_bytes = 2 * len(kvcache.k_buffer) * k0[0].numel() * k0.element_size()
        self.pool = UnifiedPool(size, slot_bytes)
        self._on_cpu = torch.device(device).type == "cpu"  # indices built on the host need no copy
        super().__init__(size, dtype, device, kvcache, need_sort)

    # ---- SGLang's allocator API ---------------------------------------------------------------------------------

    def clear(self):
        """A cache flush: every KV slot comes back; resident adapters keep theirs."""
        self.free_group = None
        self.release_pages = torch.empty((0,), dtype=torch.int64, device=self.device)
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.release_all("kv_running")
            pool.release_all("kv_cached")

    @property
    def free_pages(self) -> torch.Tensor:
        """The free KV indices (SGLang's debug checks read this list)."""
        pool = getattr(self, "pool", None)
        if pool is None:  # SGLang's base __init__ runs before the pool exists
            return torch.empty((0,), dtype=torch.int64)
        return torch.from_numpy(pool.free_ids() + 1).to(self.device)

    @free_pages.setter
    def free_pages(self, value) -> None:  # SGLang's base __init__ assigns it; the pool is the free list
        pass

    def available_size(self):
        return self.pool.num_free

    def alloc(self, need_size: int):
        slots = self.pool.alloc("kv_running", need_size)
        return None if slots is None else self.to_indices(slots)

    def free(self, free_index: torch.Tensor):
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(self._copy_for_free_group(free_index))
            return
        self.pool.release("kv_running", _slot_ids(free_index))

    def merge_and_sort_free(self):
        return None

    def get_all_free_pages(self):
        return self.free_pages

    # ---- the tree's side ----------------------------------------------------------------------------------------

    def to_indices(self, slots: SlotRuns) -> torch.Tensor:
        """The KV indices (slot + 1) of `slots`, in the order handed out."""
        indices = torch.from_numpy(slots.array() + 1)
        return indices if self._on_cpu else indices.to(self.device)

    def mark_cached(self, indices) -> None:
        """KV rows a request computed that the tree now owns (KV indices: an int64 tensor or a list)."""
        if len(indices):
            self.pool.move("kv_running", "kv_cached", _slot_ids(indices))

    def free_cached(self, indices) -> None:
        """An evicted run of the tree (KV indices: an int64 tensor, the run's `value_cache`, or a list)."""
        self.pool.release("kv_cached", _slot_ids(indices))

    def free_cached_many(self, runs: list) -> None:
        """Evicted runs of the tree, each as `free_cached` takes it, given back in one release."""
        if len(runs) == 1:
            self.free_cached(runs[0])
        elif all(isinstance(r, torch.Tensor) for r in runs):
            self.free_cached(torch.cat(runs))
        else:
            self.free_cached([i for r in runs for i in (r.tolist() if isinstance(r, torch.Tensor) else r)])


def _slot_ids(indices) -> np.ndarray:
    """The pool's slot ids (index - 1) of KV indices (an int64 tensor or a list), as a fresh int64 array."""
    if isinstance(indices, torch.Tensor):
        return np.subtract(indices.cpu().numpy().reshape(-1), 1, dtype=np.int64)
    return np.array(indices, dtype=np.int64) - 1


class LiveMemory:
    """The scheduler process's adapter memory over one `UnifiedTokenAllocator` (see the module docstring)."""

    def __init__(self, allocator: UnifiedTokenAllocator, tree: LoraRadixTree,
                 waiting_key: Callable[[object], MatchKey | None] | None = None, req_to_token_pool=None) -> None:
        """`waiting_key(req)`: the tree key of the prefix a queued request would reuse, None for none (the radix
        backend's `MultiLoRARadixCache.waiting_key`); without it the waiting queue's prefixes are not protected.
        `req_to_token_pool`: SGLang's request rows, rewritten when KV moves (`allow_kv_moves`); without it KV
        never moves."""
        args = flags.current()
        self.allocator = allocator
        self.pool = allocator.pool
        kv = allocator.get_kvcache()
        self.k_buffers, self.v_buffers = kv.k_buffer, kv.v_buffer
        self.half_elems = int(self.k_buffers[0][0].numel())
        self.dtype = self.k_buffers[0].dtype
        self.usage = UsageStats({}, self.pool.slot_bytes, INITIAL_RECOMPUTE_S_PER_TOKEN, self._copy_seconds)
        self.residency = AdapterResidency(self.pool, {}, self.usage)
        self.policy = create_policy(args.eviction_policy, context=self.usage)
        tree.score = self.policy
        self.swapper = Swapper(tree, self.pool, self.residency, self.policy, self,
                               idle_watermark=args.idle_watermark, swap_interval_s=flags.SWAP_INTERVAL_MS / 1000,
                               free_kv=allocator.free_cached, free_kv_many=allocator.free_cached_many,
                               value_offset=1)
        self.req_to_token_pool = req_to_token_pool
        self._after_stream = None  # see allow_kv_moves
        self.swapper.value_form = self._values_tensor
        self.copy_bytes_per_s = INITIAL_COPY_BYTES_PER_S
        self._host: dict[str, LoadedAdapter] = {}  # identity -> host copy (the registry's weights)
        self._shapes: dict[str, dict] = {}  # identity -> (layer, module, A|B) -> shape
        self._views: dict[str, LoadedAdapter] = {}  # identity -> weights as views into its slots
        self._lora_ids: dict[str, set[str]] = {}  # identity -> the engine's ids that name it
        self._pending_removal: set[str] = set()
        self._prefill_started: float | None = None
        self.gate = AdmissionGate(self.residency, self.swapper)
        self.num_lora_batch_skips = 0  # passes that skipped a request: SGLang's batch had no room for its adapter
        self.num_prefill_tokens = 0  # tokens computed by extend passes (what neither tier held)
        self.host = None  # the host tier (`host_kv.LiveHostTier`) with --multilora-host-kv-gb
        self._wanted: set[str] = set()  # adapters the waiting queue names: the swapper evicts them last
        self._kept_keys: dict[str, tuple] = {}  # rid -> (request, (output tokens, adapter spec), its waiting key)
        self._running_counts: dict[str, int] | None = None  # the last counts set_running gave the residency,
        self._running_version = -1  # and the residency's version right after
        self._running_key: tuple | None = None  # what those counts were read from (see set_running)
        self.swapper.wanted = lambda: self._wanted
        self.waiting_key = waiting_key

    # ---- adapters (load / unload) ---------------------------------------------------------------------------

    def check_fits(self, adapter: LoadedAdapter) -> None:
        """Raises `InfeasibleAdapter` (an ExceedsPoolError) naming the adapter's size and the pool's when the adapter
        leaves no room beside it for the smallest request."""
        n = slots_needed(_shapes(adapter), self.half_elems)
        check_adapter(adapter.spec.name, n, self.pool.num_slots, self.pool.slot_bytes)

    def register(self, lora_id: str, adapter: LoadedAdapter) -> None:
        """Keeps `adapter`'s host copy under its identity (absent until a request or a prefetch loads it)."""
        identity = adapter.spec.identity
        self._pending_removal.discard(identity)
        ids = self._lora_ids.setdefault(identity, set())
        ids.add(lora_id)
        if identity in self._host:
            return
        shapes = _shapes(adapter)
        n = slots_needed(shapes, self.half_elems)
        check_adapter(adapter.spec.name, n, self.pool.num_slots, self.pool.slot_bytes)
        self._host[identity], self._shapes[identity] = adapter, shapes
        self.residency.add(identity, n)
        self.usage.add_adapter(identity, n * self.pool.slot_bytes)

    def unregister(self, lora_id: str, identity: str | None) -> None:
        """The engine unloaded `lora_id`: once no id names its weights, they leave the tree, the pool and the host
        (deferred to a later step while locked KV or a running request still uses them)."""
        ids = self._lora_ids.get(identity)
        if ids is None:
            return
        ids.discard(lora_id)
        if not ids:
            self._pending_removal.add(identity)
            self._remove_pending()

    def _remove_pending(self) -> None:
        if not self._pending_removal:
            return
        for identity in list(self._pending_removal):
            nodes = self.swapper.adapter_nodes(identity)
            if self.residency.num_running(identity) or any(n.lock_ref for n in nodes):
                continue
            for node in nodes:
                self.swapper.tree.remove_adapter(node.parent.label, node.label, self.allocator.free_cached)
            if self.host is not None:
                self.host.remove_adapter(identity)
            if self.residency.is_loading(identity):
                self.residency.finish_load(identity)
            if self.residency.is_resident(identity):
                self.residency.drop(identity)
            self.residency.remove(identity)
            self.usage.remove_adapter(identity)
            for table in (self._host, self._shapes, self._views, self._lora_ids):
                table.pop(identity, None)
            self._pending_removal.discard(identity)

    # ---- the swapper's Loader ---------------------------------------------------------------------------------

    def start(self, identity: str, slots: SlotRuns) -> bool:
        """Copies the host weights into `slots` (synchronously: a CPU copy; a GPU copy stream would record an
        event for `is_done`). False when the runs are too short for some matrix."""
        placement = place(self._shapes[identity], slots.runs, self.half_elems)
        if placement is None:
            return False
        began = time.perf_counter()
        host = self._host[identity]
        views = {}
        for (layer, module), (a, b) in host.weights.items():
            va, vb = (self._view(layer, placement[(layer, module, w)]) for w in ("A", "B"))
            va.copy_(a)
            vb.copy_(b)
            views[(layer, module)] = (va, vb)
        self._views[identity] = LoadedAdapter(host.spec, views)
        seconds = time.perf_counter() - began
        if seconds > 0:
            rate = host.num_bytes() / seconds
            self.copy_bytes_per_s += EMA * (rate - self.copy_bytes_per_s)
        return True

    def is_done(self, identity: str) -> bool:
        return True

    def min_run(self, identity: str) -> int:
        """The shortest run any placement of the adapter needs (its longest matrix in one buffer): the swapper
        frees a run that long, not one as long as the whole adapter, when the free runs are refused."""
        return shortest_run(self._shapes[identity], self.half_elems)

    def _view(self, layer: int, p) -> torch.Tensor:
        buffer = (self.k_buffers if p.buffer == 0 else self.v_buffers)[layer]
        numel = p.shape[0] * p.shape[1]
        area = buffer[p.run_start + 1:].view(-1)  # rows from the run's first slot on (contiguous)
        return area[p.offset:p.offset + numel].view(p.shape)

    def _copy_seconds(self, num_bytes: int) -> float:
        return num_bytes / self.copy_bytes_per_s

    # ---- moving KV (compaction) -----------------------------------------------------------------------------

    def allow_kv_moves(self, allowed: bool, after=None) -> None:
        """Whether the swapper may move KV to free a run for an adapter (`Swapper.compact`; only with the request
        rows). `after`: the device stream of a forward that may still be running (SGLang's overlap scheduler builds
        the next batch while the last one's forward runs on its forward stream): a move's copies and row rewrites
        wait for it on the device, never on the host. On CPU the forward has returned before the next batch is
        built, so nothing waits."""
        movable = allowed and self.req_to_token_pool is not None
        self.swapper.move_kv = self.move_kv if movable else None
        self._after_stream = after

    def move_kv(self, sources: np.ndarray, targets: np.ndarray) -> None:
        """Copies the KV of slots `sources` into `targets` (every layer's K and V) and rewrites every request row
        in use that names a source (running requests, a chunked prefill, a session's row). The tree's values are
        the swapper's to rewrite; the pool already moved the kinds."""
        to_indices = self.allocator.to_indices
        src, dst = to_indices(SlotRuns(len(sources), ids=sources)), to_indices(SlotRuns(len(targets), ids=targets))
        kv = self.allocator.get_kvcache()
        if src.is_cuda:
            if self._after_stream is not None:  # the overlap scheduler's forward in flight reads both
                torch.cuda.current_stream(src.device).wait_stream(self._after_stream)
            kv.move_kv_cache(dst, src)  # SGLang's own copy: every layout and scale buffer of its pools
        else:
            for k, v in zip(self.k_buffers, self.v_buffers):
                k[dst] = k[src]
                v[dst] = v[src]
        pool = self.req_to_token_pool
        rows = sorted(set(range(1, pool.req_to_token.shape[0])) - set(pool.free_slots))
        if rows:
            lut = torch.arange(self.k_buffers[0].shape[0], dtype=torch.int64, device=src.device)
            lut[src] = dst
            rows_t = torch.tensor(rows, dtype=torch.int64, device=pool.req_to_token.device)
            table = pool.req_to_token
            table[rows_t] = lut[table[rows_t].long()].to(table.dtype)

    def _values_tensor(self, values: list[int]) -> torch.Tensor:
        """A tree node's KV indices as its `value_cache` (what the radix backend inserts: int64 on the device)."""
        return torch.tensor(values, dtype=torch.int64, device=self.k_buffers[0].device)

    # ---- serving --------------------------------------------------------------------------------------------

    def weights(self, identity: str) -> LoadedAdapter | None:
        """The adapter's weights as views of its slots, or None when it is not resident."""
        if not self.residency.is_resident(identity):
            self._views.pop(identity, None)
            return None
        return self._views.get(identity)

    def ensure_resident(self, identity: str, budget: int | None) -> bool:
        """True once the adapter is resident; otherwise makes room (at most `budget` slots of the pass's prefill
        budget may go to it) and starts the copy. False means "not now": the request waits for a later pass."""
        return self.gate.ensure_resident(identity, budget)

    def admit(self, rid: str, identity: str | None, budget: int | None, prompt_len: int = 0,
              max_new: int = 0) -> bool:
        """The admission decision for one waiting request of `prompt_len` tokens that may generate `max_new`, on a
        resident-or-not adapter (None: the base model): `AdmissionGate.admit` (the starvation and idle holds; a
        request whose resident adapter's pin does not fit the pass's budget ends the pass as SGLang's own "no
        room" does)."""
        return self.gate.admit(rid, identity, budget, prompt_len, max_new)

    def adapter_slots(self, identity: str) -> int:
        """Slots the adapter takes when resident (KeyError for one not registered)."""
        return self.residency.entry(identity).num_slots

    def check_request(self, name: str, identity: str, prompt_len: int, max_new: int) -> None:
        """Raises `InfeasibleRequest` (naming the adapter's slots, the request's tokens and the pool's slots) for a
        request that can never be admitted beside its adapter."""
        check_request(name, self.adapter_slots(identity), prompt_len, max_new, self.pool.num_slots)

    def max_new_beside(self, identity: str, prompt_len: int) -> int:
        """The most new tokens a request of `prompt_len` on the adapter can ever be admitted with (negative: its
        prompt alone does not fit)."""
        return max_new_beside(self.pool.num_slots, self.adapter_slots(identity), prompt_len)

    def capacity_line(self) -> str:
        """What the pool holds, for the start-up log: slots, bytes, the largest adapter and the longest request
        beside it."""
        pool, res = self.pool, self.residency
        line = (f"one pool for adapters and KV: {pool.num_slots} slots of {pool.slot_bytes} B "
                f"({pool.num_slots * pool.slot_bytes / 2**20:.1f} MiB), eviction policy {self.policy.name}")
        ids = list(res.ids())
        if not ids:
            return line + "; no adapter registered yet"
        largest = max(ids, key=lambda i: res.entry(i).num_slots)
        n = res.entry(largest).num_slots
        return (line + f"; the largest adapter ({self._host[largest].spec.name!r}) takes {n} slots, the longest "
                f"request beside it {longest_request_beside(pool.num_slots, n)} tokens (prompt + new)")

    def set_running(self, reqs) -> None:
        """Running-request counts per adapter from the scheduler's batches (a request with an unknown or
        non-resident adapter is not counted). Nothing to do, and nothing is read, when the requests are the same
        objects in the same order as at the last call, and neither the registry nor the residency changed since
        the counts were set (the scheduler's decode steps, where nothing finished or joined)."""
        registry, res = process_state().adapters, self.residency
        reqs = tuple(reqs)
        if self._running_key == (reqs, registry, registry.version, res.version):
            return
        identity, resident = registry.identity, res.is_resident
        counts: dict[str, int] = {}
        for r in reqs:
            if r.lora_id is not None:
                i = identity(r.lora_id)
                counts[i] = counts.get(i, 0) + 1
        for i in [i for i in counts if i is None or not resident(i)]:
            del counts[i]
        if counts != self._running_counts or res.version != self._running_version:
            res.set_running(counts)  # else the counts it holds are these: nothing changed since they were set
            self._running_counts, self._running_version = counts, res.version
        self._running_key = (reqs, registry, registry.version, res.version)

    def set_wanted(self, waiting_reqs) -> None:
        """The adapters waiting requests name, and the first WANTED_KV_SCAN requests' cached prefixes (read at each
        admission pass): the swapper evicts both after every other candidate. The prefixes are matched only when
        an eviction first needs them (`Swapper.set_waiting`), at most once per pass."""
        identity = process_state().adapters.identity
        wanted = {identity(lora_id) for lora_id in {r.lora_id for r in waiting_reqs}}  # each distinct id once
        wanted.discard(None)  # the base model, an unknown id
        self._wanted = wanted
        head = list(islice(waiting_reqs, WANTED_KV_SCAN))
        self.swapper.set_waiting(None if self.waiting_key is None else lambda: self._waiting_keys(head))

    def _waiting_keys(self, head) -> list[MatchKey]:
        """`waiting_key` of each request of `head` that has one. A request's key is kept from the last call while it
        is the same request with as many output tokens (a retraction adds some) on the same adapter spec; the keys
        kept are those of this call's requests only."""
        spec, key_of, kept = process_state().adapters.spec, self.waiting_key, self._kept_keys
        keys, now_kept = [], {}
        for req in head:
            stamp = (len(req.output_ids), None if req.lora_id is None else spec(req.lora_id))
            entry = kept.get(req.rid)
            if entry is None or entry[0] is not req or entry[1][0] != stamp[0] or entry[1][1] is not stamp[1]:
                entry = (req, stamp, key_of(req))
            now_kept[req.rid] = entry
            if entry[2] is not None:
                keys.append(entry[2])
        self._kept_keys = now_kept
        return keys

    def record_request(self, identity: str | None) -> None:
        self.usage.record_request(identity, self.swapper.tree.clock())

    def before_prefill_pass(self, reqs, waiting_rids: set[str]) -> None:
        self.gate.begin_pass(waiting_rids)
        if self.host is not None:
            self.host.prune(waiting_rids)
        self._remove_pending()
        self.set_running(reqs)
        self.swapper.tick(time.monotonic())
        self._prefill_started = time.perf_counter()

    def after_prefill_pass(self, num_admitted: int, num_running: int, waiting_reqs) -> None:
        """The pass's outcome for the gate's progress rules; logs a stall (`AdmissionGate.end_pass`) naming the
        waiting requests' adapters, sizes and what keeps each out, with the pool's state."""
        report = self.gate.end_pass(num_admitted, num_running, len(waiting_reqs))
        if report is None:
            return
        registry, res = process_state().adapters, self.residency
        lines = []
        for req in list(waiting_reqs)[:STALL_LOG_REQUESTS]:
            identity = registry.identity(req.lora_id) if req.lora_id is not None else None
            slots = res.entry(identity).num_slots if identity in res else 0
            spec = registry.spec(req.lora_id) if req.lora_id is not None else None
            name = "the base model" if req.lora_id is None else (spec.name if spec is not None else req.lora_id)
            reason = report["refusals"].get(req.rid, "not taken by SGLang's own admission (its prefill budget or "
                                                     "request caps)")
            lines.append(f"{req.rid[:12]} on {name} ({slots} adapter slots, {len(req.origin_input_ids)} prompt + "
                         f"{req.sampling_params.max_new_tokens} new tokens): {reason}")
        logger.warning("sgl_multilora: %d requests have waited %.1f s with nothing running or loading (stall %d); "
                       "pool slots %s; %s", len(waiting_reqs), report["stalled_s"], self.gate.counters.stalls,
                       self.pool.by_kind(), "; ".join(lines))

    def after_step(self, batch) -> None:
        """Batch size and measured recompute cost (prefill seconds per token) for the policy."""
        now = self.swapper.tree.clock()
        self.usage.record_batch(now, len(batch.reqs))
        if batch.forward_mode.is_extend() and self._prefill_started is not None:
            tokens = int(getattr(batch, "extend_num_tokens", 0) or 0)
            self.num_prefill_tokens += tokens
            if tokens > 0 and self.host is None:  # with the host tier a KV run's cost is its copy (host_kv.py)
                per_token = (time.perf_counter() - self._prefill_started) / tokens
                self.usage.kv_reload_s_per_token += EMA * (per_token - self.usage.kv_reload_s_per_token)
        self._prefill_started = None

    # ---- what SGLang's scheduler sees -----------------------------------------------------------------------

    def evictable_adapter_slots(self) -> int:
        """Slots of adapters the swapper can evict once their unlocked KV is gone
        (`Swapper.reclaimable_adapter_slots`)."""
        return self.swapper.reclaimable_adapter_slots()

    def room(self) -> int:
        """Slots an admission could have now: free, unlocked KV and reclaimable adapters (SGLang's
        `available_size() + evictable_size()`, what the swapper can reach)."""
        return self.swapper.reachable_slots()

    def room_without(self, identity: str | None, node, owned_slots: int) -> int:
        """`room()` as it would be if one running request were retracted: its lock on tree node `node` (None: it
        holds none) and its use of adapter `identity` released, and the `owned_slots` of KV only it holds freed.
        Computed by releasing both and taking them back before returning: nothing changes."""
        tree, res = self.swapper.tree, self.residency
        counted = identity is not None and res.is_resident(identity) and res.num_running(identity) > 0
        if node is not None:
            tree.unlock(node)
        if counted:
            res.release(identity)
        try:
            return self.room() + owned_slots
        finally:
            if counted:
                res.acquire(identity)
            if node is not None:
                tree.lock(node)

    def slots_to_start(self, identity: str | None) -> int:
        """Slots a request on adapter `identity` (None: the base model) waits for beyond its own KV: the adapter's
        and the swapper's headroom while the adapter is neither resident nor loading, else none."""
        res = self.residency
        if identity is None or identity not in res or res.is_resident(identity) or res.is_loading(identity):
            return 0
        return res.entry(identity).num_slots + self.swapper.headroom_slots

    def host_adapter_bytes(self) -> int:
        """Bytes of the adapters' host copies (one per registered adapter, never dropped)."""
        return sum(a.num_bytes() for a in self._host.values())

    def pinned_slots(self) -> int:
        """Adapter and in-flight slots SGLang cannot have back now."""
        return self.pool.num_of("adapter") + self.pool.num_of("in_flight") - self.evictable_adapter_slots()

    def evict(self, num_tokens: int) -> int:
        """SGLang asks for `num_tokens` more free slots: the swapper evicts KV leaves and adapters in ascending
        score. Returns the slots freed."""
        before = self.pool.num_free
        self.swapper.make_room(min(self.pool.num_slots, before + num_tokens))
        return self.pool.num_free - before

    # ---- observation ----------------------------------------------------------------------------------------

    def stats(self) -> dict:
        by_kind = self.pool.by_kind()
        slot_bytes = self.pool.slot_bytes
        cached = self.swapper.tree.total_len()
        return {
            "policy": self.policy.name,
            "slot_bytes": slot_bytes,
            "num_slots": self.pool.num_slots,
            "bytes": {
                "adapter_weights": by_kind["adapter"] * slot_bytes,
                "cached_kv": by_kind["kv_cached"] * slot_bytes,
                "running_kv": by_kind["kv_running"] * slot_bytes,
                "in_flight": by_kind["in_flight"] * slot_bytes,
                "free": by_kind["free"] * slot_bytes,
            },
            "slots": by_kind,
            "tree_kv_tokens": cached,
            "adapters": {"registered": len(self._host), "resident": self.residency.num_resident,
                         "loading": len(self.residency.loading_ids())},
            "adapter_sizes": {
                self._host[i].spec.name: {"num_slots": self.residency.entry(i).num_slots,
                                          "state": self.residency.entry(i).state.value, "identity": i[:16]}
                for i in self.residency.ids()},
            "swapper": self.swapper.stats(),
            "skipped_admissions": self.gate.counters.skipped_admissions,
            "starvation_holds": self.gate.counters.starvation_holds,
            "admission": self.gate.stats(),
            "lora_batch_skips": self.num_lora_batch_skips,
            "budget_stops": self.gate.counters.budget_stops,
            "copy_bytes_per_s": self.copy_bytes_per_s,
            "recompute_s_per_token": self.usage.kv_reload_s_per_token,
            "prefill_tokens": self.num_prefill_tokens,
            "host_tier": None if self.host is None else self.host.stats(),
        }

    def check_invariants(self) -> None:
        """The core's checks (pool, residency, dependency rule) and the live ones: the tree's KV is exactly the
        pool's cached KV; every resident adapter has its views."""
        self.swapper.check_invariants()
        tree_len = self.swapper.tree.total_len()
        assert self.pool.num_of("kv_cached") == tree_len, (
            f"pool holds {self.pool.num_of('kv_cached')} cached KV slots, the tree {tree_len} tokens")
        for identity in self.residency.resident_ids():
            assert identity in self._views, f"resident adapter {identity[:12]} without its weight views"


def _shapes(adapter: LoadedAdapter) -> dict:
    out = {}
    for (layer, module), (a, b) in adapter.weights.items():
        out[(layer, module, "A")] = (int(a.shape[0]), int(a.shape[1]))
        out[(layer, module, "B")] = (int(b.shape[0]), int(b.shape[1]))
    return out


def memory() -> LiveMemory | None:
    """This process's live memory, when the unified pool is on."""
    return process_state().memory


# ---- hooks (see hook_table.py) --------------------------------------------------------------------------------


def build_allocator(original, self, *args, **kwargs):
    """The unified pool (on with the tree unless `--multilora-stock-baseline memory`): SGLang's page-size-1
    allocator becomes a `UnifiedTokenAllocator` over the same KV buffers (other allocators: unchanged, with a
    warning)."""
    allocator = original(self, *args, **kwargs)
    if not flags.unified_memory_requested():
        return allocator
    kv = allocator.get_kvcache() if hasattr(allocator, "get_kvcache") else None
    if type(allocator) is not TokenToKVPoolAllocator or not hasattr(kv, "k_buffer") or not hasattr(kv, "v_buffer"):
        logger.warning("sgl_multilora: the unified adapter/KV pool needs page size 1 and a K/V buffer pool (got "
                       "%s); adapters keep separate memory", type(allocator).__name__)
        return allocator
    return UnifiedTokenAllocator(allocator.size, allocator.dtype, allocator.device, kv, allocator.need_sort)
