"""What every simulated system shares: adapter residency and copies, a per-adapter prefix cache, admission.

Lives here: `SimRequest`, `Admit` and `BaseSystem`. Not here: the event loop (`engine.py`) and what differs
between systems (memory areas, eviction, slots, history reuse: one file each).

A system answers the engine's four questions: `try_admit` (may this waiting request run now?), `finish`,
`tick` (copies that completed) and `sample` (memory by kind). Adapters are copied host->GPU on one FIFO PCIe
link overlapped with compute; KV that leaves the GPU is dropped (recomputed on the next use), as in SGLang's
and vLLM's GPU prefix caches.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import Enum

from eval.requests import AdapterInfo, Request
from eval.sim.latency import LatencyModel
from eval.sim.memory import MemoryPool
from sgl_multilora.keys import AdapterRef, MatchKey, Namespace
from sgl_multilora.policy.usage import UsageStats
from sgl_multilora.tree import LoraRadixTree
from sgl_multilora.tree_nodes import Node

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
        return min(self.loading.values(), default=None)

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
        need = (len(sr.prompt) - sr.cached + len(sr.output)) * self.kvb
        if not self.pool.fits(self.kv_area, need) and not self.make_room_kv(need, name):
            self.unlock(sr)
            return Admit.NO_MEMORY
        self.pool.alloc(self.kv_area, "kv_running", need)
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
        if self.alora_sharing and sr.alora_start is not None and sr.alora_start < n:
            return [-1] * sr.alora_start + [sr.adapter_idx] * (n - sr.alora_start)
        return [sr.adapter_idx] * n

    def free_kv(self, values: list[int]) -> None:
        self.kv_tokens[values[0]] -= len(values)
        self.pool.free(self.kv_area, "kv_cached", len(values) * self.kvb)

    def match(self, sr: SimRequest) -> None:
        """Looks up the prompt (all but its last token, which must be computed) and locks what it found."""
        if self.tree is None:
            sr.cached = 0
            return
        m = self.tree.match(self.key(sr, sr.prompt[:-1]))
        sr.cached = m.prefix_len
        sr.lock_node = m.last_node
        self.tree.lock(m.last_node)

    def unlock(self, sr: SimRequest) -> None:
        if sr.lock_node is not None:
            self.tree.unlock(sr.lock_node)
            sr.lock_node = None

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
        out["num_resident_adapters"] = len(self.resident)
        return out

    def check_invariants(self) -> None:
        """Memory accounting exact by kind; every counter agrees with its owner. O(tree) with a tree."""
        self.pool.check_invariants()
        used = {k: sum(u[k] for u in self.pool.used.values()) for k in ("adapter", "in_flight",
                                                                         "kv_running", "kv_cached")}
        assert used["adapter"] == sum(self.sizes[n] for n in self.resident), "adapter bytes != resident set"
        assert used["in_flight"] == sum(self.sizes[n] for n in self.loading), "in-flight bytes != copies"
        assert used["kv_running"] == self.running_reserved, "kv_running != reservations of running requests"
        assert min(self.rc.values(), default=0) >= 0, f"negative adapter reference count {self.rc}"
        assert all(self.rc[n] == 0 or n in self.resident for n in self.rc), "a running adapter is not resident"
        if self.tree is not None:
            self.tree.check_invariants()
            assert used["kv_cached"] == self.tree.total_size() * self.kvb, "kv_cached bytes != tree size"
            assert sum(self.kv_tokens.values()) == self.tree.total_size(), "per-adapter KV counts drifted"
        else:
            assert used["kv_cached"] == 0, "a system without history KV holds cached KV"
