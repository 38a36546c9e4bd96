"""ELORA's cache swapper over the dependency tree and the unified pool: busy, evict the lowest-scored KV leaves
and adapters; idle, prefetch the highest-scored adapters.

Lives here: `Swapper` and its counters. Not here: the scores (`policy/`: a policy scores, the swapper applies
the order), the slots (`pool.py`), adapter states (`residency.py`), node edits (`tree.py`), the copies (the
caller's `residency.Loader`) and the host KV tier.

Busy (`make_room`): one order (`_EvictionOrder`) holds the unlocked KV leaves and the resident adapters that no
running request uses and no resident KV depends on, lowest score first (ELORA's swap-out of GPU leaves). Popping a
KV leaf may make its parent a leaf, or its adapter (its parent, or the adapter an aLoRA suffix depends on) free of
dependents: those join the order. So the resident set stays closed under dependency at every instant: no
resident KV of a non-resident adapter (invalid KV == 0), no locked node and no used adapter ever evicted.
A load the loader refuses for scattered free slots (a weight matrix must sit whole in one run) gets a run: by
moving KV out of the window that holds the least of it when the owner can move KV (`compact`, a copy: running
requests keep their KV, the cache loses nothing), else by evicting in the same order until one is free.
Idle (`tick`): every `swap_interval_s`, while used slots are below `idle_watermark` of the pool, absent
adapters start loading in descending score, stopping before one would cross the watermark (or at one the loader
refused, not retried until the pool frees some slot: between releases the free runs only shrink), then the host
tier (when there is one: `kv_prefetch`) copies back host KV, highest score first, into what is left below the
watermark (ELORA's swap-in of adapters and KV).

Choices the paper leaves open (shared/reference/seed-elora.md), and why:
- A11: a request that needs slots evicts at once (`make_room`) rather than waiting for the next tick: the
  tick period (100 ms) is long against a step, and waiting adds queueing the paper counts against TTFT.
- A8: "full" means the request's slots do not fit; an eviction then frees `headroom_frac` of the pool beyond
  them (default 1%), so one scoring pass serves several admissions, as one swapper tick would. Usage for the
  idle watermark counts every kind (running KV and in-flight copies included).
- A10: after each adapter eviction the order is rebuilt, since Low_lora's N changed and ELORA rescores; after
  a KV eviction only the newly eligible items are scored.
- Adapters that waiting requests name (`wanted`, from the scheduler's queue) are evicted after every other
  candidate, whatever their score (Chameleon's cache-aware admission: a pool input, not a second cache). So is
  the KV that waiting requests' prefixes match (`set_waiting`, matched by `LoraRadixTree.prefix_nodes`): a
  follow-up turn queued behind a burst would otherwise lose its history to the requests admitted before it and
  recompute it, more work exactly when the server is short of it; the KV of a conversation not yet back is
  needed later than a queued request's (Belady's order, where the queue is the only foresight there is).
- Ties: equal scores go KV first, then by node id (creation order) or adapter id, so the order never depends
  on set iteration or hash seeds (the simulator is deterministic across processes).
- `dependency=False` is ELORA's WOM ablation: adapters go by the same score while their KV stays (invalid).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Container, Iterable
from bisect import bisect_right
from dataclasses import asdict, dataclass, field
from operator import attrgetter

import numpy as np

from sgl_multilora.policy.base import BasePolicy
from sgl_multilora.pool import ExceedsPoolError, UnifiedPool
from sgl_multilora.residency import AdapterResidency, AdapterState, Loader
from sgl_multilora.keys import MatchKey
from sgl_multilora.tree import LoraRadixTree
from sgl_multilora.tree_nodes import FreeFn, Node, NodeKind

_KV = NodeKind.KV
_node_id = attrgetter("id")
_ADAPTER = NodeKind.ADAPTER
# Waiting requests, from the queue's head, whose keys an owner passes to `set_waiting`: bounds the matching (one tree
# walk per request) an eviction does under a queue of thousands.
WANTED_KV_SCAN = 256


EVICTION_AGE_BOUNDS_S = (1.0, 10.0, 60.0)
"""Buckets of `SwapperCounters.kv_evicted_slots_by_age`: evicted KV last used under 1 s, 1-10 s, 10-60 s and 60 s or
more before its eviction. Slots evicted within a second of their last use mean that every evictable leaf was that
fresh: the pool is smaller than what comes back (eviction order can no longer help; more memory or less load can)."""


@dataclass(slots=True)
class SwapperCounters:
    """Lifetime counts. Evictions by kind (KV runs and their slots; adapters and theirs); adapter loads
    started on demand (`adapter_loads`) and by the idle swap-in (`prefetches`)."""

    kv_evictions: int = 0
    kv_evicted_slots: int = 0
    adapter_evictions: int = 0
    adapter_evicted_slots: int = 0
    adapter_loads: int = 0
    prefetches: int = 0
    refused_loads: int = 0  # loads the loader refused (slots it cannot use, e.g. runs too short)
    unreachable_runs: int = 0  # runs no eviction could free (locked slots in every window): nothing evicted
    kv_prefetched_slots: int = 0  # host KV copied back by the idle swap-in
    kv_compactions: int = 0  # runs freed for an adapter by moving KV out of a window (`compact`)
    kv_moved_slots: int = 0  # KV slots those moves copied
    kv_evicted_slots_by_age: list[int] = field(default_factory=lambda: [0] * (len(EVICTION_AGE_BOUNDS_S) + 1))
    """`kv_evicted_slots` by the time since the evicted KV was last used (`EVICTION_AGE_BOUNDS_S`)."""


class Swapper:
    """Applies a policy's order to the tree's KV leaves and the resident adapters of one pool.

    `residency.usage` must be set: adapters are scored by their `AdapterRecord`. `free_kv(values)` gives an
    evicted KV run's slots back (default: `pool.release("kv_cached", values)`); `free_kv_many(runs)`, when set,
    gives back the runs one `make_room` without a `run` evicted, in one call after its last eviction (`runs`:
    what `free_kv` would have got, in eviction order; for an owner whose per-call cost dominates: the pool ends
    holding the same free slots as with `free_kv` per run); `on_evict_kv(node)` runs just
    before a KV leaf is evicted (a host tier copies it out); `kv_prefetch(slots)` copies host KV back into at
    most `slots` free slots, never evicting, and returns the slots it used. The clock is the tree's. The tree's
    values are slot ids plus `value_offset` (SGLang's KV index is slot + 1). `move_kv(sources, targets)`, set by
    an owner while KV may move (between steps, its copies ordered after any forward still reading the slots),
    copies KV between slot ids and rewrites what outside the tree names them; `value_form` rebuilds a node's
    `value_cache` after a move (see `compact`).
    """

    def __init__(self, tree: LoraRadixTree, pool: UnifiedPool, residency: AdapterResidency,
                 policy: BasePolicy, loader: Loader, *, dependency: bool = True, prefetch: bool = True,
                 headroom_frac: float = 0.01, idle_watermark: float = 0.7, swap_interval_s: float = 0.1,
                 free_kv: FreeFn | None = None, on_evict_kv: Callable[[Node], object] | None = None,
                 value_offset: int = 0, free_kv_many: Callable[[list], object] | None = None) -> None:
        if residency.usage is None:
            raise ValueError("the swapper scores adapters by their usage records: give the residency a usage")
        if not 0.0 <= idle_watermark <= 1.0 or headroom_frac < 0 or swap_interval_s <= 0:
            raise ValueError(f"need 0 <= idle_watermark <= 1, headroom_frac >= 0, swap_interval_s > 0; got "
                             f"{idle_watermark}, {headroom_frac}, {swap_interval_s}")
        self.tree, self.pool, self.residency, self.policy, self.loader = tree, pool, residency, policy, loader
        self.records = residency.usage.records
        self.dependency = dependency
        self.prefetch = prefetch
        self.headroom_slots = int(headroom_frac * pool.num_slots)
        self.idle_watermark = idle_watermark
        self.swap_interval_s = swap_interval_s
        self.free_kv = free_kv if free_kv is not None else self._release_kv
        self.free_kv_many = free_kv_many
        self.on_evict_kv = on_evict_kv
        self.value_offset = value_offset
        self.move_kv: Callable[[np.ndarray, np.ndarray], object] | None = None
        self.value_form: Callable[[list[int]], object] | None = None
        self.kv_prefetch: Callable[[int], int] | None = None
        self.wanted: Callable[[], Container[str]] | None = None  # adapters waiting requests name: evicted last
        self._waiting_keys: Callable[[], Iterable[MatchKey]] | None = None  # see set_waiting
        self._wanted_kv: dict[int, Node] | None = None  # id -> KV node those keys match, once asked for
        self.counters = SwapperCounters()
        self._next_swap_s = 0.0
        self._refused_prefetch: tuple[str, int] | None = None  # (adapter, pool.num_releases after its refusal)

    def set_waiting(self, keys: Callable[[], Iterable[MatchKey]] | None) -> None:
        """The waiting queue's tree keys (at most WANTED_KV_SCAN of them), given anew before each admission pass:
        the KV their prefixes match is evicted after every other candidate. `keys` is called, and its prefixes
        matched, only when an eviction first needs them, at most once per call of `set_waiting`."""
        self._waiting_keys, self._wanted_kv = keys, None

    def _wanted_kv_nodes(self) -> dict[int, Node]:
        if self._wanted_kv is None:
            keys = self._waiting_keys
            self._wanted_kv = {} if keys is None else self.tree.prefix_nodes(keys())
        return self._wanted_kv

    # ---- busy: evict -----------------------------------------------------------------------------

    def make_room(self, num_slots: int, protect: str | None = None, *, run: int = 0) -> bool:
        """Evicts in ascending score until `num_slots` (+ headroom) are free and, with `run`, some run of
        `run` consecutive slots is free; True once both hold.

        Never evicts locked KV, an adapter a running request uses or that resident KV depends on, or the
        adapter `protect`. False ("not now") when the candidates run out first. Raises ExceedsPoolError for
        more slots than the whole pool."""
        pool = self.pool
        if num_slots > pool.num_slots or run > pool.num_slots:
            n = max(num_slots, run)
            raise ExceedsPoolError(f"{n} slots", n, pool.num_slots, pool.slot_bytes)
        if pool.can_fit(num_slots) and (not run or pool.largest_free_run() >= run):
            return True
        if run and not self.run_reachable(run, protect):
            self.counters.unreachable_runs += 1
            return False  # evicting would free no run that long: keep the cache for everyone else
        target = num_slots + self.headroom_slots
        now, score = self.tree.clock(), self.policy.score
        wanted = self.wanted() if self.wanted is not None else ()
        wanted_kv = self._wanted_kv_nodes()  # id -> node: `in` asks by id
        order = self._order(protect, now, wanted, wanted_kv)
        # Without `run` the evicted runs may go back in one `free_kv_many` call at the end: until then `held`
        # counts their slots as free (nothing in the loop reads which slots are free, only how many).
        batch = [] if self.free_kv_many is not None and not run else None
        free_kv = self.free_kv if batch is None else batch.append
        held = 0
        try:
            while pool.num_free + held < target or (run and pool.largest_free_run() < run):
                item = order.pop()
                if item is None:
                    break
                if isinstance(item, str):
                    if self._adapter_evictable(item, protect):
                        self._evict_adapter(item)
                        order = self._order(protect, now, wanted, wanted_kv)  # N changed: ELORA rescores (A10)
                    continue
                if item.is_evicted or item.children or item.lock_ref:
                    continue
                parent, dep = item.parent, item.depends_on
                if self.on_evict_kv is not None:
                    self.on_evict_kv(item)
                c = self.counters
                age_bucket = bisect_right(EVICTION_AGE_BOUNDS_S, now - item.last_access)
                slots = self.tree.evict_leaf(item, free_kv)
                if batch is not None:
                    held += slots
                c.kv_evicted_slots += slots
                c.kv_evicted_slots_by_age[age_bucket] += slots
                c.kv_evictions += 1
                if parent.kind is _KV and not parent.children and parent.lock_ref == 0:
                    order.push((int(parent.id in wanted_kv), score(parent, now), 0, parent.id, parent))
                for adapter in (parent, dep):
                    if adapter is not None and adapter.kind is _ADAPTER:
                        name = adapter.label.identity
                        if self._adapter_evictable(name, protect):
                            order.push((int(name in wanted), score(self.records[name], now), 1, name, name))
        finally:
            if batch:
                self.free_kv_many(batch)
        return pool.can_fit(num_slots) and (not run or pool.largest_free_run() >= run)

    def run_reachable(self, run: int, protect: str | None = None) -> bool:
        """Whether evicting every candidate could leave `run` consecutive slots free: False when every
        window of that length holds a slot no eviction frees (running KV, a copy in flight, KV a lock holds,
        an adapter that is not reclaimable, or `protect`). Without slot ids (the simulator) only the count is
        known: True. Pure query; walks the locked part of the tree only."""
        pool = self.pool
        if not pool.track_ids or run <= 1:
            return True
        fixed = pool.kind_mask(("kv_running", "in_flight"))
        # a lock pins KV ancestors and adapter nodes, never a namespace or base node: the walk starts below those
        stack = [kv for ns in self.tree.root.children.values() for top in ns.children.values()
                 for kv in top.children.values() if kv.lock_ref]
        while stack:
            node = stack.pop()
            if node.kind is _KV and node.value:
                fixed[np.asarray(node.value, dtype=np.int64) - self.value_offset] = True
            stack.extend(child for child in node.children.values() if child.lock_ref)
        res, namespaces = self.residency, self._lock_scopes()
        for adapter_id in res.resident_ids():
            if adapter_id == protect or not self._reclaimable(adapter_id, namespaces):
                fixed[res.entry(adapter_id).slots.array()] = True
        edges = np.flatnonzero(np.concatenate(([True], fixed, [True])))
        return int(np.diff(edges).max()) - 1 >= run

    def compact(self, run: int) -> bool:
        """Frees `run` consecutive slots by moving KV, running or cached, locked or not, out of the window that
        holds the least of it (`UnifiedPool.cheapest_window`) into the lowest free slots outside it: the owner
        copies the KV and rewrites the request rows (`move_kv`), the tree's ids are rewritten here. Adapter
        weights and copies in flight stay put (a window holds none), so no view of an adapter changes. True once
        such a run is free; False, nothing moved, without `move_kv` or slot ids, when every window holds an
        adapter or a copy in flight, or when fewer than `run` slots are free."""
        pool = self.pool
        if pool.track_ids and pool.largest_free_run() >= run:
            return True
        if self.move_kv is None or not pool.track_ids:
            return False
        start = pool.cheapest_window(run, pool.kind_mask(("adapter", "in_flight")))
        if start is None:
            return False
        sources, targets = pool.evacuate(start, run)
        if len(sources):
            self.move_kv(sources, targets)
            off = self.value_offset
            self.tree.remap_values(dict(zip((sources + off).tolist(), (targets + off).tolist())), self.value_form)
            self.counters.kv_moved_slots += len(sources)
        self.counters.kv_compactions += 1
        return True

    def reachable_slots(self) -> int:
        """Free slots `make_room` could reach by evicting every candidate: free, unlocked KV and reclaimable
        adapters (with the dependency rule an adapter goes after its KV, which is unlocked when it is
        reclaimable). Pure query."""
        return self.pool.num_free + self.tree.evictable_len() + self.reclaimable_adapter_slots()

    def reclaimable_adapter_slots(self) -> int:
        """Slots of the adapters `make_room` could free once their unlocked KV is gone: resident, used by no
        running request and (with the dependency rule) no lock on their node in any namespace. With the tree's
        `evictable_len()` and the free slots, the room the next batch can have (SGLang's `evictable_size`).
        Pure query."""
        res, namespaces = self.residency, self._lock_scopes()
        total = 0
        for adapter_id in res.resident_ids():  # `_reclaimable` of each, written out: once per admission pass
            e = res.entry(adapter_id)
            if e.num_running:
                continue
            for children in namespaces:
                n = children.get(adapter_id)
                if n is not None and n.lock_ref:
                    break
            else:
                total += e.num_slots
        return total

    def adapter_reclaimable(self, adapter_id: str) -> bool:
        """Whether the adapter's slots count in `reclaimable_adapter_slots` now. Pure query."""
        return self._reclaimable(adapter_id, self._lock_scopes())

    def _lock_scopes(self) -> list[dict]:
        """Each namespace's adapter nodes by id, where a lock can pin an adapter (none without the dependency rule)."""
        return [ns.children for ns in self.tree.root.children.values()] if self.dependency else []

    def _reclaimable(self, adapter_id: str, namespaces: list[dict]) -> bool:
        res = self.residency
        if not res.is_resident(adapter_id) or res.num_running(adapter_id):
            return False
        return not any((n := children.get(adapter_id)) is not None and n.lock_ref for children in namespaces)

    def adapter_evictable(self, adapter_id: str, protect: str | None = None) -> bool:
        """Resident, used by no running request, not `protect`, and (with the dependency rule) no KV in any
        namespace hangs below or depends on it and no lock holds it. Pure query."""
        return self._adapter_evictable(adapter_id, protect)

    # ---- loads and idle prefetch -----------------------------------------------------------------

    def load(self, adapter_id: str) -> bool:
        """On demand: makes room (never evicting this adapter), reserves its slots and starts the copy. True
        once it is loading or resident; False ("not now") when no room can be made, and then nothing is evicted
        (a request whose adapter cannot fit must not empty everyone's cache, pass after pass). Raises
        ExceedsPoolError (naming both sizes) for an adapter larger than the pool, KeyError for an unknown one."""
        e = self.residency.entry(adapter_id)
        if e.state is not AdapterState.ABSENT:
            return True
        if e.num_slots > self.pool.num_slots:
            raise ExceedsPoolError(f"adapter {adapter_id!r}", e.num_slots, self.pool.num_slots,
                                   self.pool.slot_bytes)
        if not self.pool.can_fit(e.num_slots):
            if self.reachable_slots() < e.num_slots:
                return False  # evicting every candidate would not do: evict none (the cache stays for others)
            if not self.make_room(e.num_slots, protect=adapter_id):
                return False
        if not self._start(adapter_id):
            # The loader cannot use the free runs (too short for a weight matrix). Free a run as long as its
            # longest matrix needs (when the loader says) and try again; if the runs still do not take it, one
            # run that holds the whole adapter (which always does). A run is freed by moving KV out of a window
            # when KV may move (`compact`: a copy, nothing lost), else by evicting on in ascending score. A run
            # that cannot be made short cannot be made long either: then "not now".
            short = self._min_run(adapter_id, e.num_slots)
            runs = (short, e.num_slots) if self.pool.largest_free_run() < short < e.num_slots else (e.num_slots,)
            for run in runs:
                if not (self.compact(run) or self.make_room(e.num_slots, protect=adapter_id, run=run)):
                    return False
                if self._start(adapter_id):
                    break
            else:
                return False
        self.counters.adapter_loads += 1
        return True

    def _min_run(self, adapter_id: str, num_slots: int) -> int:
        """The loader's shortest useful run for the adapter (`Loader.min_run`), else the whole adapter."""
        min_run = getattr(self.loader, "min_run", None)
        return num_slots if min_run is None else max(1, min(num_slots, int(min_run(adapter_id))))

    def poll_loads(self) -> list[str]:
        """Finishes the loads the loader reports done; returns their ids (in the order they started)."""
        return self.residency.complete_loads(self.loader)

    def tick(self, now: float) -> list[str]:
        """Finishes done loads (returned, as `poll_loads`); then, once per `swap_interval_s`, while used
        slots are below `idle_watermark` of the pool, starts loading absent adapters, highest score first
        (ties by id), stopping before one would cross the watermark or at one the loader refuses (which is not
        tried again until the pool releases a slot), and gives what is left below it to `kv_prefetch`. Never
        evicts."""
        done = self.poll_loads()
        if not self.prefetch or now < self._next_swap_s:
            return done
        self._next_swap_s = now + self.swap_interval_s
        limit = self.idle_watermark * self.pool.num_slots
        if self.pool.num_used >= limit:
            return done
        res, score = self.residency, self.policy.score
        cold = [a for a in res.ids() if res.entry(a).state is AdapterState.ABSENT]
        cold.sort(key=lambda a: (-score(self.records[a], now), a))
        for adapter_id in cold:
            if self.pool.num_used + res.entry(adapter_id).num_slots > limit:
                break
            if self._refused_prefetch == (adapter_id, self.pool.num_releases):
                break  # refused, and nothing was freed since: the same runs would be refused again
            if not self._start(adapter_id):
                self._refused_prefetch = (adapter_id, self.pool.num_releases)
                break
            self.counters.prefetches += 1
        room = int(limit) - self.pool.num_used
        if self.kv_prefetch is not None and room > 0:
            self.counters.kv_prefetched_slots += self.kv_prefetch(room)
        return done

    # ---- observation -----------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """The counters and the invalid KV slots now (a snapshot)."""
        return {**asdict(self.counters), "invalid_kv_slots": self.invalid_kv_slots()}

    def invalid_kv_slots(self) -> int:
        """KV slots below (or depending on) adapter nodes whose adapter is not resident: always 0 with the
        dependency rule. Walks those subtrees only."""
        total = 0
        for ns_node in self.tree.root.children.values():
            for identity, top in ns_node.children.items():
                if identity is None or self.residency.is_resident(identity):
                    continue
                stack = [*top.children.values(), *top.dependents]
                while stack:
                    node = stack.pop()
                    total += len(node.key)
                    stack.extend(node.children.values())
        return total

    def check_invariants(self) -> None:
        """The pool's and the residency's checks, plus the dependency rule: every adapter node in the tree
        is resident (so invalid KV is 0). The tree's own check is its owner's to call (O(tree))."""
        self.pool.check_invariants()
        self.residency.check_invariants()
        if not self.dependency:
            return
        for ns_node in self.tree.root.children.values():
            for identity, node in ns_node.children.items():
                assert identity is None or self.residency.is_resident(identity), (
                    f"adapter node {node} in the tree while its weights are not resident: dependency broken")

    # ---- internals -------------------------------------------------------------------------------

    def _order(self, protect: str | None, now: float, wanted: Container[str],
               wanted_kv: Container[int]) -> _EvictionOrder:
        """Every candidate now, in eviction order (see `_EvictionOrder`): the unlocked KV leaves and the evictable
        adapters, each keyed (tier, score, kind, id)."""
        leaves = self.tree.evictable_leaves()
        adapters = self._evictable_adapters(protect)
        scores = self.policy.score_many([self.records[a] for a in adapters], now)
        side = [(int(a in wanted), s, 1, a, a) for s, a in zip(scores, adapters)]
        return _EvictionOrder(leaves, self.policy.score_many(leaves, now), wanted_kv, side)

    def adapter_nodes(self, adapter_id: str) -> list[Node]:
        """The adapter's node in every namespace that has one (a snapshot). Pure query."""
        return [ns.children[adapter_id] for ns in self.tree.root.children.values() if adapter_id in ns.children]

    def _evictable_adapters(self, protect: str | None) -> list[str]:
        """The resident adapters `_adapter_evictable` admits, in residency order (its checks written out once for all)."""
        res = self.residency
        namespaces = list(self.tree.root.children.values()) if self.dependency else ()
        out = []
        for adapter_id in res.resident_ids():
            if adapter_id == protect or res.entry(adapter_id).num_running:
                continue
            for ns in namespaces:  # the adapter's node in every namespace: a bare leaf
                n = ns.children.get(adapter_id)
                if n is not None and (n.children or n.dependents or n.lock_ref):
                    break
            else:
                out.append(adapter_id)
        return out

    def _adapter_evictable(self, adapter_id: str, protect: str | None) -> bool:
        if adapter_id == protect or not self.residency.is_resident(adapter_id):
            return False
        if self.residency.num_running(adapter_id):
            return False
        if not self.dependency:
            return True
        for ns in self.tree.root.children.values():  # the adapter's node in every namespace: a bare leaf
            n = ns.children.get(adapter_id)
            if n is not None and (n.children or n.dependents or n.lock_ref):
                return False
        return True

    def _evict_adapter(self, adapter_id: str) -> None:
        num_slots = self.residency.entry(adapter_id).num_slots
        self.residency.drop(adapter_id)
        if self.dependency:
            for node in self.adapter_nodes(adapter_id):
                freed = self.tree.remove_adapter(node.parent.label, node.label, self.free_kv)
                assert freed == 0, f"adapter {adapter_id!r} removed with {freed} tokens of KV depending on it"
        self.counters.adapter_evictions += 1
        self.counters.adapter_evicted_slots += num_slots

    def _start(self, adapter_id: str) -> bool:
        """Reserves the slots and starts the copy; False (slots given back) if the loader refuses them."""
        slots = self.residency.begin_load(adapter_id)
        assert slots is not None, f"no room to load adapter {adapter_id!r}: check can_fit first"
        if self.loader.start(adapter_id, slots) is False:
            self.residency.abort_load(adapter_id)
            self.counters.refused_loads += 1
            return False
        return True

    def _release_kv(self, values: list[int]) -> None:
        self.pool.release("kv_cached", values)


class _EvictionOrder:
    """Candidates in ascending (tier, score, kind, id), popped one at a time: the KV leaves scored at once and sorted
    as arrays, merged with a small heap of what is pushed later (adapters, and leaves an eviction exposes).

    Tier 1 holds what waiting requests want (evicted after everything else); kind 0 is KV, 1 an adapter (KV first on
    equal scores); ids break the remaining ties. The order is the one a heap of every candidate's tuple gives, without
    a tuple per leaf: an evicting step of a large tree ranks thousands of leaves to evict a few dozen, and building and
    collecting a tuple for each was about half of the ranking's time (eval/bench/pool_cost.py at ~9k nodes)."""

    __slots__ = ("_leaves", "_tiers", "_scores", "_ids", "_order", "_next", "_side")

    def __init__(self, leaves: list[Node], scores: Iterable[float], wanted_kv: Container[int],
                 side: list[tuple]) -> None:
        n = len(leaves)
        ids = np.fromiter(map(_node_id, leaves), np.int64, n)
        score_arr = np.fromiter(scores, np.float64, n)
        tiers = (np.fromiter((i in wanted_kv for i in ids.tolist()), np.int8, n) if wanted_kv
                 else np.zeros(n, np.int8))
        order = np.lexsort((ids, score_arr, tiers))  # the last key is the primary one
        self._leaves = leaves
        self._tiers, self._scores, self._ids = tiers.tolist(), score_arr.tolist(), ids.tolist()
        self._order = order.tolist()
        self._next = 0
        heapq.heapify(side)
        self._side = side

    def push(self, entry: tuple) -> None:
        """A candidate that became evictable: (tier, score, kind, id, item)."""
        heapq.heappush(self._side, entry)

    def pop(self) -> Node | str | None:
        """The next candidate (a KV node or an adapter id; it may have stopped being evictable since), or None when
        none is left."""
        side = self._side
        if self._next < len(self._order):
            i = self._order[self._next]
            if not side or (self._tiers[i], self._scores[i], 0, self._ids[i]) < side[0][:4]:
                self._next += 1
                return self._leaves[i]
        return heapq.heappop(side)[4] if side else None
