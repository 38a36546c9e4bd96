"""What every simulated system shares: adapter residency and copies, a per-adapter prefix cache, admission.

Lives here: `SimRequest`, `Admit` and `BaseSystem`. Not here: the event loop (`engine.py`) and what differs
between systems (memory areas, eviction, slots, history reuse: one file each).

A system answers the engine's four questions: `try_admit` (may this waiting request run now?), `finish`,
`tick` (copies that completed) and `sample` (memory by kind). Adapters are copied host->GPU on one FIFO PCIe
link overlapped with compute. KV that leaves the GPU is dropped (recomputed on the next use), as in SGLang's
and vLLM's GPU prefix caches, unless the system has a host KV tier (`host`, `hostkv.py`; only ours sets one):
then a request whose GPU match stops where host-resident KV continues reserves GPU memory for it, and those
tokens are copied back on the same FIFO link (`start_restore`); the request prefills only once the copy is done
(`SimRequest.ready_s`), and so does any request that reuses KV still being copied.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import Enum

from eval.requests import AdapterInfo, Request
from eval.sim.hostkv import RESTORE_ID_UNIT, HostKVTier, owner_of, restore_id_of
from eval.sim.latency import LatencyModel
from eval.sim.memory import MemoryPool
from sgl_multilora.keys import AdapterRef, MatchKey, Namespace
from sgl_multilora.policy.usage import UsageStats
from sgl_multilora.tree import LoraRadixTree
from sgl_multilora.tree_nodes import Node, NodeKind

NS = Namespace("llama-3-8b")
ALORA_INVOCATION_TOKENS = 5
"""Default length of an aLoRA invocation sequence (activation start k = prompt length - this), as the bundled
aLoRAs' (eval/workloads/alora_pipeline.py); `simulate(..., alora_invocation_tokens=)` overrides it."""


class Admit(Enum):
    OK = "ok"
    LOADING = "loading"  # its adapter is being copied in (or waits for room to be); others may go first
    NO_SLOT = "no_slot"  # no adapter slot is free (fixed-slot systems); others may go first
    NO_MEMORY = "no_memory"  # not enough KV memory: admission stops here (first come, first served)


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request inside the simulator; times in seconds from the workload's start."""

    req: Request
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    adapter_idx: int  # index in the workload's adapter list; -1 for the base model
    alora_start: int | None = None
    submit_s: float = 0.0  # arrival, or the parent's finish when that is later
    admit_s: float | None = None
    cached: int = 0
    computed: int = 0  # prompt tokens whose KV exists (cached ones included)
    generated: int = 0  # set to len(output) when it finishes (the loop tracks decoding in aggregate)
    first_token_s: float | None = None
    finish_s: float | None = None
    lock_node: Node | None = None
    reserved_bytes: int = 0
    adapter_was_resident: bool = True
    restored: int = 0  # prompt tokens copied back from the host tier (part of `cached`)
    ready_s: float = 0.0  # prefill may start (KV it reuses still being copied in until then)
    host_lock: Node | None = None  # host-tier run this request will copy back, pinned until admission


class BaseSystem:
    """Shared bookkeeping. Subclasses set `name`, `areas()`, the area names and the eviction hooks.

    `history`: keep finished requests' KV in a prefix cache (a `LoraRadixTree`, one namespace level per
    adapter). `alora_sharing`: aLoRA requests read the base model's prefix KV (only the project's tree
    knows how; the baselines treat an aLoRA as a standard LoRA).
    """

    name = "base"
    adapter_area = "all"
    kv_area = "all"
    history = True
    alora_sharing = False

    def __init__(self, adapters: list[AdapterInfo] | tuple[AdapterInfo, ...], lat: LatencyModel,
                 pool_total_bytes: int) -> None:
        self.lat = lat
        self.kvb = lat.model.kv_bytes_per_token
        self.adapters = {a.name: a for a in adapters}
        self.index = {a.name: i for i, a in enumerate(adapters)}
        self.names = [a.name for a in adapters]
        self.sizes = {a.name: lat.model.adapter_bytes(a.rank, a.target_modules) for a in adapters}
        self.refs = {a.name: AdapterRef(a.name, a.name) for a in adapters}
        self.now = 0.0
        self.pool_total_bytes = pool_total_bytes
        self.pool = MemoryPool(self.areas())
        self.usage = UsageStats(self.sizes or {"-": 1}, self.kvb, lat.recompute_s_per_token(), lat.h2d_time)
        self.resident: set[str] = set()
        self.loading: dict[str, float] = {}
        self.rc: Counter[str] = Counter()
        self.link_free_s = 0.0
        self.running_reserved = 0
        self.stall_s = 0.0
        self.kv_tokens = Counter()  # adapter index (-1: base) -> cached tokens, through the slot values
        self.num_loads = 0
        self.waiting: Counter[str | None] = Counter()  # waiting requests per adapter
        self.weight_bytes = dict(self.sizes)  # bytes the kernels read (a padded slot holds more)
        self.tree = LoraRadixTree(clock=lambda: self.now) if self.history else None
        self.host: HostKVTier | None = None  # a host KV tier (ours only; see hostkv.py)
        self.restores: dict[int, tuple[float, int, Node]] = {}  # restore id -> (done, tokens, host run)
        self._next_restore = 1
        self.restoring_tokens = 0
        self.num_restores = 0

    # ---- hooks --------------------------------------------------------------------------------------

    def areas(self) -> dict[str, int]:
        return {"all": self.pool_total_bytes}

    def make_room_kv(self, num_bytes: int, protect: str | None) -> bool:
        """Frees memory in the KV area until `num_bytes` fit; False if impossible now."""
        raise NotImplementedError

    def make_room_adapter(self, num_bytes: int, protect: str | None) -> bool:
        """Frees memory in the adapter area until `num_bytes` fit; False if impossible now."""
        raise NotImplementedError

    def can_run_adapter(self, name: str | None) -> bool:
        return True

    def on_loaded(self, name: str) -> None:
        pass

    def after_finish(self, name: str | None) -> None:
        pass

    # ---- adapters -----------------------------------------------------------------------------------

    def start_load(self, name: str) -> bool:
        """Starts copying adapter `name` in; False when no room can be made now."""
        size = self.sizes[name]
        if not self.pool.fits(self.adapter_area, size) and not self.make_room_adapter(size, name):
            return False
        self.pool.alloc(self.adapter_area, "in_flight", size)
        start = max(self.now, self.link_free_s)
        self.link_free_s = self.loading[name] = start + self.lat.h2d_time(size)
        self.num_loads += 1
        return True

    def tick(self, now: float) -> None:
        """Completes the copies that finished by `now`."""
        self.now = now
        for rid, (done, n, host_node) in list(self.restores.items()):
            if done <= now:
                del self.restores[rid]
                self.pool.move(self.kv_area, "in_flight", "kv_cached", n * self.kvb)
                self.restoring_tokens -= n
                self.host.tree.unlock(host_node)
        for name, done in list(self.loading.items()):
            if done <= now:
                del self.loading[name]
                self.pool.move(self.adapter_area, "in_flight", "adapter", self.sizes[name])
                self.resident.add(name)
                self.usage.set_resident(name, True)
                self.on_loaded(name)

    def drop_adapter(self, name: str) -> None:
        """Frees a resident, unused adapter's weights (the host copy stays)."""
        assert self.rc[name] == 0, f"dropping adapter {name} used by {self.rc[name]} running requests"
        self.resident.discard(name)
        self.usage.set_resident(name, False)
        self.pool.free(self.adapter_area, "adapter", self.sizes[name])

    def next_event_s(self) -> float | None:
        nxt = min(self.loading.values(), default=None)
        if self.restores:
            done = min(d for d, _, _ in self.restores.values())
            nxt = done if nxt is None else min(nxt, done)
        return nxt

    def take_stall(self) -> float:
        stall, self.stall_s = self.stall_s, 0.0
        return stall

    # ---- requests -----------------------------------------------------------------------------------

    def submit(self, sr: SimRequest) -> None:
        name = sr.req.adapter
        self.usage.record_request(name, self.now)
        self.waiting[name] += 1
        sr.adapter_was_resident = name is None or name in self.resident

    def try_admit(self, sr: SimRequest) -> Admit:
        name = sr.req.adapter
        if name is not None and name not in self.resident:
            if name not in self.loading and not self.start_load(name):
                return Admit.LOADING
            if name not in self.resident:
                return Admit.LOADING
        if not self.can_run_adapter(name):
            return Admit.NO_SLOT
        self.match(sr)
        need = (len(sr.prompt) - sr.cached + sr.restored + len(sr.output)) * self.kvb
        if not self.pool.fits(self.kv_area, need) and not self.make_room_kv(need, name):
            self.unlock(sr)
            return Admit.NO_MEMORY
        self.pool.alloc(self.kv_area, "kv_running", need)
        if sr.restored:
            self.start_restore(sr)
            need -= sr.restored * self.kvb
        sr.reserved_bytes = need
        self.running_reserved += need
        self.waiting[name] -= 1
        if name is not None:
            self.rc[name] += 1
        return Admit.OK

    def finish(self, sr: SimRequest) -> None:
        """Moves the request's KV into the prefix cache (or frees it) and releases its adapter."""
        if self.tree is not None:
            full = sr.prompt + sr.output
            vals = self.values(sr, len(full))
            res = self.tree.insert(self.key(sr, full), vals)
            new_bytes = (len(full) - res.prefix_len) * self.kvb
            self.kv_tokens.update(vals[res.prefix_len:])
            self.pool.move(self.kv_area, "kv_running", "kv_cached", new_bytes)
            self.pool.free(self.kv_area, "kv_running", sr.reserved_bytes - new_bytes)
            self.unlock(sr)
        else:
            self.pool.free(self.kv_area, "kv_running", sr.reserved_bytes)
        self.running_reserved -= sr.reserved_bytes
        name = sr.req.adapter
        if name is not None:
            self.rc[name] -= 1
        self.after_finish(name)

    # ---- prefix cache -------------------------------------------------------------------------------

    def key(self, sr: SimRequest, tokens: tuple[int, ...]) -> MatchKey:
        name = sr.req.adapter
        ref = None if name is None else self.refs[name]
        start = sr.alora_start if self.alora_sharing else None
        return MatchKey(NS, ref, tokens, alora_start=start)

    def values(self, sr: SimRequest, n: int) -> list[int]:
        """Slot values of `n` tokens: the owning adapter's index (-1 for base KV), so a freed run tells whose
        KV it was."""
        if self.alora_sharing and sr.alora_start is not None:  # base KV before the activation start
            k = min(sr.alora_start, n)
            return [-1] * k + [sr.adapter_idx] * (n - k)
        return [sr.adapter_idx] * n

    def free_kv(self, values: list[int]) -> None:
        """Frees one evicted run (one owner per run; restored KV carries a restore id, `hostkv.py`)."""
        self.kv_tokens[owner_of(values[0])] -= len(values)
        self.pool.free(self.kv_area, "kv_cached", len(values) * self.kvb)

    def match(self, sr: SimRequest) -> None:
        """Looks up the prompt (all but its last token, which must be computed) and locks what it found. With
        a host tier, host-resident KV that continues the GPU match is pinned there and counted as cached
        (`sr.restored` of it to copy in). A match that reuses KV still being copied in waits for that copy."""
        sr.restored = 0
        if self.tree is None:
            sr.cached = 0
            return
        key = self.key(sr, sr.prompt[:-1])
        m = self.tree.match(key)
        sr.cached = m.prefix_len
        sr.lock_node = m.last_node
        self.tree.lock(m.last_node)
        sr.ready_s = 0.0
        if self.restores and m.prefix_len:
            pending = self.restores.get(restore_id_of(max(m.kv_values)))
            if pending is not None:  # FIFO link: the newest copy it reads finishes last
                sr.ready_s = pending[0]
        if self.host is not None:
            h = self.host.match(key)
            if h.prefix_len > m.prefix_len:
                sr.restored = h.prefix_len - m.prefix_len
                sr.cached = h.prefix_len
                sr.host_lock = h.last_node
                self.host.tree.lock(h.last_node)

    def start_restore(self, sr: SimRequest) -> None:
        """Copies the host-resident tokens [GPU match, sr.cached) in: they join the GPU tree at once (locked by
        the request, their bytes in flight until the copy is done) with values tagged by a restore id."""
        n, end = sr.restored, sr.cached
        start = end - n
        rid = self._next_restore
        self._next_restore += 1
        vals = self.values(sr, end)
        tag = rid * RESTORE_ID_UNIT
        tagged = [v + tag for v in vals[start:]]
        res = self.tree.insert(self.key(sr, sr.prompt[:end]), vals[:start] + tagged)
        assert res.prefix_len == start, f"restore of [{start}, {end}) found {res.prefix_len} tokens on the GPU"
        self.kv_tokens.update(vals[start:])
        self.pool.move(self.kv_area, "kv_running", "in_flight", n * self.kvb)
        self.tree.unlock(sr.lock_node)
        sr.lock_node = res.last_node
        self.tree.lock(res.last_node)
        begin = max(self.now, self.link_free_s)
        self.link_free_s = done = begin + self.lat.h2d_time(n * self.kvb)
        self.restores[rid] = (done, n, sr.host_lock)
        sr.host_lock = None
        sr.ready_s = max(sr.ready_s, done)
        self.restoring_tokens += n
        self.num_restores += 1
        self.host.num_restored_tokens += n

    def unlock(self, sr: SimRequest) -> None:
        if sr.lock_node is not None:
            self.tree.unlock(sr.lock_node)
            sr.lock_node = None
        if sr.host_lock is not None:
            self.host.tree.unlock(sr.host_lock)
            sr.host_lock = None

    def evict_adapters_lru(self, num_bytes: int, protect: str | None) -> bool:
        """Drops unused resident adapters, least recently requested first, until `num_bytes` fit in the
        adapter area."""
        if self.pool.fits(self.adapter_area, num_bytes):
            return True
        records = self.usage.records
        idle = sorted((n for n in self.resident if self.rc[n] == 0 and n != protect),
                      key=lambda n: (records[n].last_access, n))
        for name in idle:
            self.drop_adapter(name)
            if self.pool.fits(self.adapter_area, num_bytes):
                return True
        return False

    def evict_kv_lru(self, num_bytes: int) -> bool:
        """Frees history KV (the tree's own order) until `num_bytes` fit in the KV area."""
        short = num_bytes - self.pool.free_bytes(self.kv_area)
        if short > 0 and self.tree is not None:
            self.tree.evict(-(-short // self.kvb), self.free_kv)
        return self.pool.fits(self.kv_area, num_bytes)

    # ---- observation --------------------------------------------------------------------------------

    def invalid_kv_bytes(self) -> int:
        """History KV of adapters whose weights are not on the GPU (useless until the adapter returns)."""
        return sum(n for idx, n in self.kv_tokens.items()
                   if idx >= 0 and self.names[idx] not in self.resident) * self.kvb

    def sample(self) -> dict:
        out = self.pool.by_kind()
        out["invalid_kv"] = self.invalid_kv_bytes()
        out["host_kv"] = 0 if self.host is None else self.host.used_bytes
        out["num_resident_adapters"] = len(self.resident)
        return out

    def check_invariants(self) -> None:
        """Memory accounting exact by kind; every counter agrees with its owner. O(tree) with a tree."""
        self.pool.check_invariants()
        used = {k: sum(u[k] for u in self.pool.used.values()) for k in ("adapter", "in_flight",
                                                                         "kv_running", "kv_cached")}
        assert used["adapter"] == sum(self.sizes[n] for n in self.resident), "adapter bytes != resident set"
        assert used["in_flight"] == (sum(self.sizes[n] for n in self.loading)
                                     + self.restoring_tokens * self.kvb), "in-flight bytes != copies"
        assert self.restoring_tokens == sum(n for _, n, _ in self.restores.values()), "restores drifted"
        assert used["kv_running"] == self.running_reserved, "kv_running != reservations of running requests"
        assert min(self.rc.values(), default=0) >= 0, f"negative adapter reference count {self.rc}"
        assert all(self.rc[n] == 0 or n in self.resident for n in self.rc), "a running adapter is not resident"
        if self.tree is not None:
            self.tree.check_invariants()
            assert used["kv_cached"] + self.restoring_tokens * self.kvb == self.tree.total_size() * self.kvb, (
                "kv_cached + KV being copied in != tree size")
            assert sum(self.kv_tokens.values()) == self.tree.total_size(), "per-adapter KV counts drifted"
        else:
            assert used["kv_cached"] == 0, "a system without history KV holds cached KV"
        if self.host is not None:
            self.host.check_invariants()
            for _, _, host_node in self.restores.values():
                assert host_node.kind is not NodeKind.KV or host_node.lock_ref > 0, (
                    "a host run being copied in is not pinned")
        else:
            assert not self.restores and not self.restoring_tokens, "restores without a host tier"
