"""What every simulated system shares: adapter residency and copies, a per-adapter prefix cache, admission.

Lives here: `BaseSystem`. Not here: the request records (`request.py`), the event loop (`engine.py`) and what
differs between systems (memory areas, eviction, slots, history reuse: one file each).

Memory is the core's: each area is a `sgl_multilora.pool.UnifiedPool` of token-sized slots (one token's KV;
an adapter takes `slots_for_bytes` of its weights) in counts-only mode, since the tree's values here are owner
tags, not slot ids; `sgl_multilora.residency.AdapterResidency` owns which adapters hold slots. A unified system
has one area ("all"); a static split gets one pool per area. `pool_total_bytes` is rounded down to whole slots.

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

from eval.sim.hostkv import RESTORE_ID_UNIT, owner_of, restore_id_of
from sgl_multilora.host_tier import HostKVTier
from eval.sim.latency import LatencyModel
from eval.sim.link import PcieLink
from eval.sim.lora_cost import groups_of
from eval.sim.systems.request import NS, Admit, SimRequest
from eval.workloads.records import AdapterInfo
from sgl_multilora.keys import AdapterRef, MatchKey
from sgl_multilora.policy.usage import UsageStats
from sgl_multilora.pool import KINDS, UnifiedPool, slots_for_bytes
from sgl_multilora.residency import AdapterResidency
from sgl_multilora.tree import LoraRadixTree
from sgl_multilora.tree_nodes import Node, NodeKind


class BaseSystem:
    """Shared bookkeeping. Subclasses set `name`, `areas()`, the area names and the eviction hooks. Memory is
    counted in slots (`kvb` bytes each); sizes in bytes are the adapters' weights (copies, kernels, scores).

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
        self.num_slots = pool_total_bytes // self.kvb
        self.pools = {area: UnifiedPool(n, self.kvb, track_ids=False) for area, n in self.areas().items()}
        self.kv_pool, self.adapter_pool = self.pools[self.kv_area], self.pools[self.adapter_area]
        self.usage = UsageStats(self.sizes or {"-": 1}, self.kvb, lat.recompute_s_per_token(), lat.h2d_time)
        self.residency = AdapterResidency(self.adapter_pool, self.adapter_slots(), self.usage)
        self.link = PcieLink(lat, self.sizes, clock=lambda: self.now)
        self.running_reserved = 0  # KV slots reserved by running requests
        self.stall_s = 0.0
        self.kv_tokens = Counter()  # adapter index (-1: base) -> cached tokens, through the slot values
        self.waiting: Counter[str | None] = Counter()  # waiting requests per adapter
        self.weight_bytes = dict(self.sizes)  # bytes the kernels read (a padded slot holds more)
        self.lora_specs = {a.name: (a.rank, groups_of(a.target_modules)) for a in adapters}  # for step costs
        self.tree = LoraRadixTree(clock=lambda: self.now) if self.history else None
        self.host: HostKVTier | None = None  # a host KV tier (ours only; see hostkv.py)
        self.restores: dict[int, tuple[float, int, Node]] = {}  # restore id -> (done, tokens, host run)
        self._next_restore = 1
        self.restoring_tokens = 0
        self.num_restores = 0

    # ---- hooks --------------------------------------------------------------------------------------

    def areas(self) -> dict[str, int]:
        """Area name -> slots."""
        return {"all": self.num_slots}

    def adapter_slots(self) -> dict[str, int]:
        """Slots each adapter's weights take: its own size, no padding."""
        return {n: slots_for_bytes(size, self.kvb) for n, size in self.sizes.items()}

    def make_room_kv(self, num_slots: int, protect: str | None) -> bool:
        """Frees slots in the KV area until `num_slots` fit; False if impossible now."""
        raise NotImplementedError

    def make_room_adapter(self, num_slots: int, protect: str | None) -> bool:
        """Frees slots in the adapter area until `num_slots` fit; False if impossible now."""
        raise NotImplementedError

    def admission_room(self) -> int:
        """Slots the next batch can have: free plus unlocked cached KV (SGLang's available + evictable size)."""
        return self.kv_pool.num_free + (self.tree.evictable_len() if self.tree is not None else 0)

    def can_run_adapter(self, name: str | None) -> bool:
        return True

    def on_loaded(self, name: str) -> None:
        pass

    def after_finish(self, name: str | None) -> None:
        pass

    # ---- adapters -----------------------------------------------------------------------------------

    @property
    def num_loads(self) -> int:
        """Adapter loads started (on demand and prefetched)."""
        return self.residency.num_loads

    def start_load(self, name: str) -> bool:
        """Starts copying adapter `name` in; False when no room can be made now."""
        n = self.residency.entry(name).num_slots
        if not self.adapter_pool.can_fit(n) and not self.make_room_adapter(n, name):
            return False
        self.link.start(name, self.residency.begin_load(name))
        return True

    def poll_loads(self) -> list[str]:
        """Completes the adapter copies that finished; returns the adapters."""
        return self.residency.complete_loads(self.link)

    def tick(self, now: float) -> None:
        """Completes the copies that finished by `now`."""
        self.now = now
        for rid, (done, n, host_node) in list(self.restores.items()):
            if done <= now:
                del self.restores[rid]
                self.kv_pool.move("in_flight", "kv_cached", n)
                self.restoring_tokens -= n
                self.host.tree.unlock(host_node)
        for name in self.poll_loads():
            self.on_loaded(name)

    def drop_adapter(self, name: str) -> None:
        """Frees a resident, unused adapter's weights (the host copy stays)."""
        self.residency.drop(name)

    def next_event_s(self) -> float | None:
        nxt = min((self.link.done_s(a) for a in self.residency.loading_ids()), default=None)
        if self.restores:
            done = min(d for d, _, _ in self.restores.values())
            nxt = done if nxt is None else min(nxt, done)
        return nxt

    def take_stall(self) -> float:
        stall, self.stall_s = self.stall_s, 0.0
        return stall

    # ---- requests -----------------------------------------------------------------------------------

    def set_waiting(self, waiting: list[SimRequest]) -> None:
        """The waiting queue, in admission order, before each admission pass (a system with a swapper evicts what
        it wants last, as the live server's `LiveMemory.set_wanted`)."""

    def submit(self, sr: SimRequest) -> None:
        name = sr.req.adapter
        self.usage.record_request(name, self.now)
        self.waiting[name] += 1
        sr.adapter_was_resident = name is None or self.residency.is_resident(name)

    def try_admit(self, sr: SimRequest) -> Admit:
        name, res = sr.req.adapter, self.residency
        if name is not None and not res.is_resident(name):
            if not res.is_loading(name) and not self.start_load(name):
                return Admit.LOADING
            if not res.is_resident(name):
                return Admit.LOADING
        if not self.can_run_adapter(name):
            return Admit.NO_SLOT
        self.match(sr)
        need = len(sr.prompt) - sr.cached + sr.restored + len(sr.output)
        if not self.kv_pool.can_fit(need) and not self.make_room_kv(need, name):
            self.unlock(sr)
            return Admit.NO_MEMORY
        reserved = self.kv_pool.alloc("kv_running", need)
        assert reserved is not None, "make_room_kv said yes without room"
        if sr.restored:
            self.start_restore(sr)
            need -= sr.restored
        sr.reserved_slots = need
        self.running_reserved += need
        self.waiting[name] -= 1
        if name is not None:
            res.acquire(name)
        return Admit.OK

    def finish(self, sr: SimRequest) -> None:
        """Moves the request's KV into the prefix cache (or frees it) and releases its adapter."""
        self._release(sr, sr.prompt + sr.output)

    def retract(self, sr: SimRequest, generated: int) -> None:
        """A running request goes back to waiting after `generated` output tokens (a slot squash): its KV so far
        goes into the prefix cache as a finished request's would (so resuming recomputes little), its adapter is
        released, and it waits again (`prompt` then holds what it streamed; engine.py resumes it)."""
        self._release(sr, sr.prompt + sr.output[:generated])
        self.waiting[sr.req.adapter] += 1

    def _release(self, sr: SimRequest, full: tuple[int, ...]) -> None:
        if self.tree is not None:
            vals = self.values(sr, len(full))
            res = self.tree.insert(self.key(sr, full), vals)
            new = len(full) - res.prefix_len
            self.kv_tokens.update(vals[res.prefix_len:])
            self.kv_pool.move("kv_running", "kv_cached", new)
            self.kv_pool.release("kv_running", sr.reserved_slots - new)
            self.unlock(sr)
        else:
            self.kv_pool.release("kv_running", sr.reserved_slots)
        self.running_reserved -= sr.reserved_slots
        name = sr.req.adapter
        if name is not None:
            self.residency.release(name)
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
        self.kv_pool.release("kv_cached", len(values))

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
        self.kv_pool.move("kv_running", "in_flight", n)
        self.tree.unlock(sr.lock_node)
        sr.lock_node = res.last_node
        self.tree.lock(res.last_node)
        done = self.link.copy(n * self.kvb)
        self.restores[rid] = (done, n, sr.host_lock)
        sr.host_lock = None
        sr.ready_s = max(sr.ready_s, done)
        self.restoring_tokens += n
        self.num_restores += 1
        self.host.restore(tagged, tagged)  # counted only: the simulator's copy is the link's

    def unlock(self, sr: SimRequest) -> None:
        if sr.lock_node is not None:
            self.tree.unlock(sr.lock_node)
            sr.lock_node = None
        if sr.host_lock is not None:
            self.host.tree.unlock(sr.host_lock)
            sr.host_lock = None

    # ---- observation --------------------------------------------------------------------------------

    def invalid_kv_bytes(self) -> int:
        """History KV of adapters whose weights are not on the GPU (useless until the adapter returns)."""
        return sum(n for idx, n in self.kv_tokens.items()
                   if idx >= 0 and not self.residency.is_resident(self.names[idx])) * self.kvb

    def used_slots(self) -> dict[str, int]:
        """Slots of each kind, summed over the areas."""
        return {k: sum(p.num_of(k) for p in self.pools.values()) for k in KINDS}

    def sample(self) -> dict:
        """Memory by kind in bytes (slots x bytes per slot), "free" included, and the counters."""
        out = {k: n * self.kvb for k, n in self.used_slots().items()}
        out["free"] = sum(p.num_free for p in self.pools.values()) * self.kvb
        out["invalid_kv"] = self.invalid_kv_bytes()
        out["host_kv"] = 0 if self.host is None else self.host.used_bytes
        out["num_resident_adapters"] = self.residency.num_resident
        return out

    def check_invariants(self) -> None:
        """Memory accounting exact by kind; every counter agrees with its owner. O(tree) with a tree."""
        for pool in self.pools.values():
            pool.check_invariants()
        self.residency.check_invariants()  # also: running adapters are resident
        used = self.used_slots()
        assert used["adapter"] == self.residency.resident_slots(), "adapter slots != resident set"
        assert used["in_flight"] == self.residency.loading_slots() + self.restoring_tokens, (
            "in-flight slots != copies")
        assert self.restoring_tokens == sum(n for _, n, _ in self.restores.values()), "restores drifted"
        assert used["kv_running"] == self.running_reserved, "kv_running != reservations of running requests"
        if self.tree is not None:
            self.tree.check_invariants()
            assert used["kv_cached"] + self.restoring_tokens == self.tree.total_len(), (
                "kv_cached + KV being copied in != tree size")
            assert sum(self.kv_tokens.values()) == self.tree.total_len(), "per-adapter KV counts drifted"
        else:
            assert used["kv_cached"] == 0, "a system without history KV holds cached KV"
        if self.host is not None:
            self.host.check_invariants()
            for _, _, host_node in self.restores.values():
                assert host_node.kind is not NodeKind.KV or host_node.lock_ref > 0, (
                    "a host run being copied in is not pinned")
        else:
            assert not self.restores and not self.restoring_tokens, "restores without a host tier"
