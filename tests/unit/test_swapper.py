"""The swapper as stories on a twelve-slot pool: exact eviction order per policy, locks, running adapters and
dependencies (aLoRA suffix KV below the base node keeps its adapter), prefetch up to the watermark, and the
accounting after every step.

The world of every story (slot ids in brackets; adapters loaded best fit from the top, KV from the bottom):
```
adapters  A (300 B, 3 slots [9-11])   B (100 B, 1 slot [8])   X (an aLoRA, 200 B, 2 slots [6-7])
t=1  A request [1 2]         -> A's KV   [0 1]
t=2  base request [5 6]      -> base KV  [2 3]
t=3  X request [5 6 | 9]     -> reads [5 6], X's suffix [9] -> [4], hanging below base [5 6], depends on X
t=3.5 B request [7]          -> B's KV   [5]                                  (pool full: 6 adapter + 6 KV)
```
"""

from __future__ import annotations

import heapq
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_multilora.keys import AdapterRef, MatchKey, Namespace
from sgl_multilora.policy import create_policy
from sgl_multilora.policy.base import BasePolicy
from sgl_multilora.policy.context import AdapterRecord
from sgl_multilora.policy.usage import UsageStats
from sgl_multilora.pool import ExceedsPoolError, UnifiedPool
from sgl_multilora.residency import AdapterResidency
from sgl_multilora.slot_layout import min_run, place, slots_needed
from sgl_multilora.swapper import Swapper, _EvictionOrder
from sgl_multilora.tree import LoraRadixTree
from sgl_multilora.tree_nodes import Node, NodeKind

NS = Namespace("m")
SIZES = {"A": 300, "B": 100, "X": 200}


class Loader:
    """Copies finish when the test says so."""

    def __init__(self) -> None:
        self.started: list[tuple[str, tuple]] = []
        self.done: set[str] = set()

    def start(self, adapter_id, slots) -> None:
        self.started.append((adapter_id, slots.runs))

    def is_done(self, adapter_id) -> bool:
        return adapter_id in self.done


class AdaptersFirst(BasePolicy):
    """A test policy that would evict any adapter before any KV: only the dependency rule stops it."""

    def score(self, item, now):
        return -1.0 if isinstance(item, AdapterRecord) else item.last_access


class World:
    def __init__(self, policy: str | BasePolicy = "lru", sizes: dict[str, int] = SIZES, **swapper_kw) -> None:
        self.now = 0.0
        self.pool = UnifiedPool(12, slot_bytes=100)
        self.usage = UsageStats(sizes, 100, 1e-4, lambda num_bytes: num_bytes * 1e-6)
        self.log: list = []  # evictions in order: KV slot ids, or an adapter id
        world = self

        class Residency(AdapterResidency):
            def drop(self, adapter_id):
                world.log.append(adapter_id)
                super().drop(adapter_id)

        self.residency = Residency(self.pool, {a: self.pool.slots_for_bytes(s) for a, s in sizes.items()},
                                   self.usage)
        self.policy = create_policy(policy, context=self.usage) if isinstance(policy, str) else policy
        self.tree = LoraRadixTree(score=self.policy, clock=lambda: self.now)
        self.loader = Loader()
        self.swapper = Swapper(self.tree, self.pool, self.residency, self.policy, self.loader,
                               headroom_frac=0.0, free_kv=self._free, **swapper_kw)

    def _free(self, values) -> None:
        self.log.append(list(values))
        self.pool.release("kv_cached", values)

    def load(self, *adapter_ids: str) -> None:
        for a in adapter_ids:
            assert self.swapper.load(a)
            self.loader.done.add(a)
        assert self.swapper.poll_loads() == list(adapter_ids)
        self.check()

    def key(self, adapter, tokens, start=None, ns=NS) -> MatchKey:
        return MatchKey(ns, None if adapter is None else AdapterRef(adapter), tokens, alora_start=start)

    def serve(self, t, adapter, tokens, start=None, ns=NS) -> None:
        """A request that computes what it did not match and leaves its KV in the tree."""
        self.now = t
        self.usage.record_request(adapter, t)
        key = self.key(adapter, tokens, start, ns)
        m = self.tree.match(key)
        new = self.pool.alloc("kv_running", len(tokens) - m.prefix_len).ids()
        self.tree.insert(key, m.kv_values + new)
        self.pool.move("kv_running", "kv_cached", new)
        self.check()

    def fill(self) -> None:
        self.load("A", "B", "X")
        assert [runs for _, runs in self.loader.started] == [((9, 3),), ((8, 1),), ((6, 2),)]
        self.serve(1.0, "A", [1, 2])
        self.serve(2.0, None, [5, 6])
        self.serve(3.0, "X", [5, 6, 9], start=2)
        self.serve(3.5, "B", [7])
        assert self.kinds() == {"adapter": 6, "kv_cached": 6, "kv_running": 0, "in_flight": 0, "free": 0}

    def kinds(self) -> dict[str, int]:
        return self.pool.by_kind()

    def check(self) -> None:
        self.swapper.check_invariants()
        self.tree.check_invariants()
        assert self.swapper.invalid_kv_slots() == 0
        assert self.pool.num_of("kv_cached") == self.tree.total_len()


@pytest.mark.parametrize("policy,order", [
    # LRU: last access only; base [5 6] (read at t=3) ties with X (requested at t=3): KV goes first
    ("lru", [[0, 1], "A", [4], [2, 3], "X", [5], "B"]),
    # ELORA (tau 1 s): A, idle for 3 s, goes right after its KV; base [5 6] was read twice, so it outlives
    # B's fresher but once-used [7]
    ("elora", [[0, 1], "A", [4], [5], [2, 3], "X", "B"]),
    # Chameleon (0.45 F + 0.10 R + 0.45 S): size counts, so the largest adapter, A, goes last
    ("chameleon", [[4], [5], [0, 1], "B", [2, 3], "X", "A"]),
])
def test_eviction_order_per_policy(policy, order):
    w = World(policy)
    w.fill()
    w.now = 4.0
    assert w.swapper.make_room(12)
    assert w.log == order
    # an adapter only ever goes after every KV that depends on it
    assert w.log.index("A") > w.log.index([0, 1]) and w.log.index("X") > w.log.index([4])
    assert w.log.index("B") > w.log.index([5])
    assert w.kinds()["free"] == 12 and w.residency.num_resident == 0
    # at t=4, by age: B's [7] (used at 3.5) under 1 s; A's [1 2] (at 1), base [5 6] and X's [9] (read at 3) 1-10 s
    assert w.swapper.stats() == {"kv_evictions": 4, "kv_evicted_slots": 6, "adapter_evictions": 3,
                                 "adapter_evicted_slots": 6, "adapter_loads": 3, "prefetches": 0, "refused_loads": 0,
                                 "unreachable_runs": 0, "kv_prefetched_slots": 0, "kv_compactions": 0,
                                 "kv_moved_slots": 0, "kv_evicted_slots_by_age": [1, 5, 0, 0], "invalid_kv_slots": 0}
    w.check()


def test_locks_running_adapters_and_dependencies():
    w = World(AdaptersFirst())
    w.load("A", "B", "X")
    w.serve(1.0, "A", [1, 2])
    w.serve(2.0, None, [5, 6])
    w.serve(3.0, "X", [5, 6, 9], start=2)
    assert w.kinds()["free"] == 1  # slot 5
    # running: a request on B (no KV yet) and an aLoRA request holding X's suffix (which locks X and base)
    w.residency.acquire("B")
    held = w.tree.match(w.key("X", [5, 6, 9], start=2)).last_node
    w.tree.lock(held)
    w.check()

    # B is running, X and base are locked; A is kept only by its KV: the KV goes, then A
    assert w.swapper.make_room(5)
    assert w.log == [[0, 1], "A"]
    assert w.kinds() == {"adapter": 3, "kv_cached": 3, "kv_running": 0, "in_flight": 0, "free": 6}
    w.check()

    # not now: nothing left to evict; False and nothing changed
    assert not w.swapper.make_room(8)
    assert w.log == [[0, 1], "A"] and w.kinds()["free"] == 6

    # B's request ends; protected B stays, unprotected B goes (still short: False)
    w.residency.release("B")
    assert not w.swapper.make_room(8, protect="B") and w.log == [[0, 1], "A"]
    assert not w.swapper.make_room(8)
    assert w.log == [[0, 1], "A", "B"] and w.kinds()["free"] == 7
    w.check()

    # the suffix hangs below base KV but depends on X: X becomes a candidate only once [9] is gone,
    # although this policy ranks every adapter below every KV run
    w.tree.unlock(held)
    assert w.swapper.make_room(9)
    assert w.log == [[0, 1], "A", "B", [4], "X"]
    assert w.kinds() == {"adapter": 0, "kv_cached": 2, "kv_running": 0, "in_flight": 0, "free": 10}
    w.check()

    # never: more than the whole pool
    with pytest.raises(ExceedsPoolError, match="13 slots \\(1300 B\\) but the whole pool holds 12 slots"):
        w.swapper.make_room(13)


def test_adapter_larger_than_the_pool_raises_naming_both_sizes():
    with pytest.raises(ExceedsPoolError, match="adapter 'H' needs 13 slots \\(1300 B\\) but the whole pool "
                                               "holds 12 slots \\(1200 B\\)") as err:
        World(sizes={**SIZES, "H": 1250})
    assert (err.value.num_slots, err.value.pool_slots) == (13, 12)


def test_adapter_kv_in_two_namespaces_keeps_it_until_both_go():
    w = World("lru")
    w.load("A")
    tenant = Namespace("m", cache_salt="t")
    w.serve(1.0, "A", [1, 2])
    w.serve(2.0, "A", [1, 2], ns=tenant)  # same tokens, another tenant: its own KV [2 3]
    assert w.swapper.make_room(6)  # 5 free: A's KV in the first namespace goes, A stays for the tenant's
    assert w.log == [[0, 1]] and w.residency.is_resident("A")
    assert w.swapper.make_room(12)
    assert w.log == [[0, 1], [2, 3], "A"]
    assert w.tree.adapter_node(NS, AdapterRef("A")) is None and w.tree.adapter_node(tenant, AdapterRef("A")) is None
    w.check()


def test_on_demand_load_makes_room():
    w = World("lru")
    w.load("B")
    w.serve(1.0, None, list(range(1, 11)))  # base KV [0-9]: 11 of 12 slots used
    w.now = 2.0
    assert w.swapper.load("A")  # 3 slots: B (requested never, last access 0) goes first, then the KV
    assert w.log == ["B", list(range(10))] and w.residency.is_loading("A")
    assert w.loader.started[-1] == ("A", ((9, 3),))
    assert w.kinds() == {"adapter": 0, "kv_cached": 0, "kv_running": 0, "in_flight": 3, "free": 9}
    c = w.swapper.counters
    assert (c.adapter_loads, c.prefetches, c.adapter_evictions, c.kv_evictions) == (2, 0, 1, 1)
    assert w.swapper.load("A")  # already loading: nothing to do
    w.check()


def test_prefetch_stops_at_the_watermark():
    sizes = {"A": 300, "B": 100, "C": 400, "X": 200}
    w = World("lru", sizes=sizes)  # idle_watermark 0.7 of 12 slots: 8.4
    for t, a in ((1.0, "B"), (1.5, "X"), (2.0, "A"), (3.0, "C")):
        w.usage.record_request(a, t)  # LRU: C, A, X, B from most to least recent
    assert w.swapper.tick(4.0) == []
    # C (4 slots) and A (3) start: 7 slots; X (2) would cross 8.4 and stops the pass, though B (1) would fit
    assert w.loader.started == [("C", ((8, 4),)), ("A", ((5, 3),))]
    assert w.kinds() == {"adapter": 0, "kv_cached": 0, "kv_running": 0, "in_flight": 7, "free": 5}
    assert w.swapper.counters.prefetches == 2 and w.swapper.counters.adapter_loads == 0
    w.check()
    w.loader.done |= {"C", "A"}
    assert w.swapper.tick(4.05) == ["C", "A"]  # loads complete at every tick; the next pass is at 4.1
    assert w.kinds()["adapter"] == 7 and len(w.loader.started) == 2
    w.check()
    w.serve(4.08, None, [1])  # 8 slots used, below 8.4: X (2) still would cross
    assert w.swapper.tick(4.1) == [] and len(w.loader.started) == 2
    w.serve(4.15, None, [2])  # 9 slots used: above the watermark, no pass at all
    assert w.swapper.tick(4.2) == [] and len(w.loader.started) == 2
    assert w.swapper.make_room(5)  # busy: A (last requested at t=2) is the least recent item
    assert w.log == ["A"]
    w.check()


def test_adapters_waiting_requests_name_are_evicted_last():
    """LRU would take A right after its KV (see the LRU order above); with a request for A waiting, A goes after
    every other candidate, its KV still before it (the dependency rule)."""
    w = World("lru")
    w.fill()
    w.now = 4.0
    w.swapper.wanted = lambda: {"A"}
    assert w.swapper.make_room(12)
    assert w.log == [[0, 1], [4], [2, 3], "X", [5], "B", "A"]
    w.check()


def test_kv_waiting_requests_would_reuse_is_evicted_last():
    """A base request [5 6 8] waits: base [5 6] (its cached prefix) goes after every other candidate, even X, which
    LRU takes before it. An aLoRA X request [5 6 9 7] waits: base [5 6] and X's suffix [9] go last, so X (which the
    suffix depends on) waits for them; A and B, not wanted, go as LRU orders them."""
    w = World("lru")
    w.fill()
    w.now = 4.0
    w.swapper.set_waiting(lambda: [w.key(None, [5, 6, 8])])
    assert w.swapper.make_room(12)
    assert w.log == [[0, 1], "A", [4], "X", [5], "B", [2, 3]]
    w.check()

    w = World("lru")
    w.fill()
    w.now = 4.0
    assert len(w.tree.prefix_node_ids([w.key("X", [5, 6, 9, 7], start=2)])) == 2
    w.swapper.set_waiting(lambda: [w.key("X", [5, 6, 9, 7], start=2)])
    assert w.swapper.make_room(12)
    assert w.log == [[0, 1], "A", [5], "B", [4], "X", [2, 3]]
    assert w.kinds()["free"] == 12  # wanted KV only goes last: it never keeps room from a request
    w.check()


def test_prefix_node_ids_is_a_pure_query_over_the_matched_path():
    w = World("lru")
    w.fill()
    before = {n.id: n.last_access for n in w.tree.evictable_leaves()}, w.tree.stats()
    path = w.tree.prefix_node_ids([w.key("X", [5, 6, 9], start=2)])  # base [5 6] and X's suffix [9]
    # a match ending inside a run keeps the whole run ([5] of base [5 6]); no match, another namespace or an
    # adapter with no KV add nothing; a second key on the same path adds nothing either
    assert w.tree.prefix_node_ids([w.key(None, [5])]) < path
    assert w.tree.prefix_node_ids([w.key(None, [8]), w.key(None, [5], ns=Namespace("other")),
                                   w.key("B", [1, 2])]) == set()
    assert w.tree.prefix_node_ids([w.key("X", [5, 6, 9], start=2), w.key(None, [5, 6])]) == path
    assert ({n.id: n.last_access for n in w.tree.evictable_leaves()}, w.tree.stats()) == before  # nothing recorded
    w.check()


def test_host_kv_swap_in_gets_what_the_adapters_left_below_the_watermark():
    w = World("lru", sizes={"A": 300, "B": 100})  # idle_watermark 0.7 of 12 slots: 8.4
    asked = []

    def kv_prefetch(room: int) -> int:  # as the host tier does: copy back a 3-token run if it fits, never evict
        asked.append(room)
        if room < 3:
            return 0
        key = w.key(None, [len(asked), 0, 0])
        ids = w.pool.alloc("kv_cached", 3).ids()
        w.tree.insert(key, ids)
        return 3

    w.swapper.kv_prefetch = kv_prefetch
    w.usage.record_request("A", 1.0)
    w.usage.record_request("B", 1.5)
    w.swapper.tick(2.0)  # B (1 slot) and A (3) start: 4 used, 4 left below 8
    assert asked == [4] and w.kinds()["kv_cached"] == 3 and w.kinds()["in_flight"] == 4
    w.loader.done |= {"A", "B"}
    w.swapper.tick(2.2)  # 7 used: room for 1, too short for a run
    assert asked == [4, 1] and w.swapper.counters.kv_prefetched_slots == 3
    w.serve(2.3, None, [9])
    w.swapper.tick(2.4)  # 8 used: nothing left below the watermark, not asked
    assert asked == [4, 1]
    w.check()


def test_no_prefetch_and_bad_settings():
    w = World("lru", prefetch=False)
    w.usage.record_request("A", 1.0)
    assert w.swapper.tick(2.0) == [] and w.loader.started == []
    with pytest.raises(ValueError, match="idle_watermark"):
        World("lru", idle_watermark=1.5)


def test_without_the_dependency_rule_kv_is_left_invalid():
    """ELORA's WOM ablation: the adapter goes by its score while its KV stays, useless until it returns."""
    w = World(AdaptersFirst(), dependency=False)
    w.load("A")
    w.serve(1.0, "A", [1, 2])
    assert w.swapper.make_room(10)  # 7 free: A (3 slots) goes first, its KV [0 1] stays
    assert w.log == ["A"] and w.swapper.stats()["invalid_kv_slots"] == 2
    assert w.kinds() == {"adapter": 0, "kv_cached": 2, "kv_running": 0, "in_flight": 0, "free": 10}
    w.swapper.check_invariants()  # the accounting still holds; only the dependency rule is off


class OneRunLoader(Loader):
    """A loader whose copies need one run (as weight matrices placed whole do): it refuses several runs."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: list[tuple] = []

    def start(self, adapter_id, slots):
        if len(slots.runs) > 1:
            self.refused.append(slots.runs)
            return False
        return super().start(adapter_id, slots)


def fragmented_world() -> World:
    """B at [11], base KV at [0 1], [4] and [6-10] (tokens [1 2], [5], [7-11]); [2 3] and [5] free: room for A
    (3 slots) by count, but in no one run. The loader takes one run only."""
    w = World("lru")
    w.loader = OneRunLoader()
    w.swapper.loader = w.loader
    w.load("B")  # B: [11]
    w.serve(1.0, None, [1, 2])  # [0 1]
    w.serve(2.0, None, [3, 4])  # [2 3]
    w.serve(3.0, None, [5])  # [4]
    w.serve(4.0, None, [6])  # [5]
    w.serve(5.0, None, [7, 8, 9, 10, 11])  # [6-10]
    assert w.pool.num_free == 0
    w.now = 6.0
    w.tree.evict_leaf(w.tree.match(w.key(None, [3, 4])).last_node, w._free)  # frees [2 3]
    w.tree.evict_leaf(w.tree.match(w.key(None, [6])).last_node, w._free)  # frees [5]
    w.log.clear()
    return w


def test_a_refused_load_frees_one_run_long_enough_and_retries():
    """Fragmented free slots: [2 3] and [5] free (3 slots) is room enough for A (3 slots) by count, but not in
    one run. The loader refuses the runs; the swapper gives them back (nothing leaks), evicts on in ascending
    score until a run of 3 is free, and the retried load gets it."""
    w = fragmented_world()
    assert w.pool.num_free == 3 and w.pool.largest_free_run() == 2
    assert w.swapper.load("A")
    assert w.loader.refused == [((2, 2), (5, 1))]
    assert w.swapper.counters.refused_loads == 1 and w.swapper.counters.adapter_loads == 2  # B, then A
    # LRU: B (never requested) frees [11], still no run of 3; then the oldest KV [0 1] makes [0-3] free
    assert w.log == ["B", [0, 1]]
    assert [r for a, r in w.loader.started if a == "A"] == [((1, 3),)]  # best fit from the top of [0-3]
    w.loader.done.add("A")
    w.swapper.poll_loads()
    w.check()


def test_a_refused_load_evicts_nothing_when_locks_leave_no_run_long_enough():
    """The pool of the story above, but running requests lock the KV at [0 1], [4] and [6-10]: every window of
    3 slots holds a locked one, so no eviction can give A (3 slots) one run. The refused load is "not now" with
    the cache intact (B at [11] would otherwise be evicted in vain, as every pass retried); once the lock on [4]
    goes, [2-5] can be made one run and the retried load evicts in score order until it is."""
    w = fragmented_world()
    locked = {tuple(t): w.tree.match(w.key(None, t)).last_node for t in ([1, 2], [5], [7, 8, 9, 10, 11])}
    for node in locked.values():
        w.tree.lock(node)
    assert w.pool.num_free == 3 and w.swapper.reachable_slots() == 4  # by count A fits, even without evicting
    assert not w.swapper.run_reachable(3) and w.swapper.run_reachable(2)
    assert not w.swapper.load("A")
    assert w.loader.refused == [((2, 2), (5, 1))] and w.log == [] and w.residency.is_resident("B")
    assert w.swapper.counters.unreachable_runs == 1
    w.check()
    w.tree.unlock(locked[(5,)])  # [4] evictable: [2-5] can be one free run
    assert w.swapper.run_reachable(3) and w.swapper.run_reachable(4) and not w.swapper.run_reachable(5)
    # then eviction is in the policy's order again (LRU: B, never requested, first), until the run is free
    assert w.swapper.load("A") and w.log == ["B", [4]]
    assert [r for a, r in w.loader.started if a == "A"] == [((3, 3),)]
    w.loader.done.add("A")
    w.swapper.poll_loads()
    w.check()


def test_with_kv_moves_a_refused_load_moves_the_kv_of_the_cheapest_window_and_evicts_nothing():
    """The locked pool of the story above, where no eviction can give A one run of 3: with an owner that can move
    KV, the swapper moves it out of the window holding the least of it ([3-5]: the locked [4], ties to the
    highest) into the lowest free slot outside ([2]), rewrites the tree's ids, and A takes [3-5]. Nothing is
    evicted, the locks hold, and every request still finds its KV (at its new id)."""
    w = fragmented_world()
    for t in ([1, 2], [5], [7, 8, 9, 10, 11]):
        w.tree.lock(w.tree.match(w.key(None, t)).last_node)
    moves = []
    w.swapper.move_kv = lambda sources, targets: moves.append((sources.tolist(), targets.tolist()))
    assert w.swapper.load("A")
    assert moves == [([4], [2])] and w.log == [] and w.residency.is_resident("B")
    assert [r for a, r in w.loader.started if a == "A"] == [((3, 3),)]
    assert w.tree.match(w.key(None, [5])).kv_values == [2] and w.tree.match(w.key(None, [5])).last_node.lock_ref
    assert w.tree.match(w.key(None, [1, 2])).kv_values == [0, 1]
    c = w.swapper.counters
    assert (c.kv_compactions, c.kv_moved_slots, c.kv_evictions, c.unreachable_runs) == (1, 1, 0, 0)
    w.loader.done.add("A")
    w.swapper.poll_loads()
    w.check()
    w.tree.check_invariants()


def test_locked_kv_is_found_at_its_slot_when_tree_values_are_offset():
    """The server's tree holds SGLang's KV indices (slot + 1): `run_reachable` reads a locked node's slots through
    `value_offset`, so the KV in the last slot is found there (not one past the pool) and the windows are exact."""
    pool = UnifiedPool(4, slot_bytes=100)
    usage = UsageStats({}, 100, 1e-4, lambda num_bytes: 0.0)
    tree = LoraRadixTree()
    swapper = Swapper(tree, pool, AdapterResidency(pool, {}, usage), create_policy("lru", context=usage),
                      Loader(), value_offset=1)
    for tokens in ([10, 11], [20, 21]):
        ids = pool.alloc("kv_running", 2).ids()
        tree.insert(MatchKey(NS, None, tokens), [i + 1 for i in ids])
        pool.move("kv_running", "kv_cached", ids)
    tree.lock(tree.match(MatchKey(NS, None, [20, 21])).last_node)  # slots [2 3], KV indices 3 and 4
    assert swapper.run_reachable(2) and not swapper.run_reachable(3)


class PlacingLoader(Loader):
    """The server's rule for A: its matrices placed whole in the runs given (`slot_layout.place`, two elements a
    buffer row), refused when one does not fit. A's longest matrix needs 2 slots of one run, the whole of A 3."""

    HALF_ELEMS = 2
    SHAPES = {(0, "m", "A"): (2, 2), (0, "m", "B"): (1, 2), (0, "n", "A"): (1, 2), (0, "n", "B"): (2, 1),
              (0, "o", "A"): (1, 2)}

    def __init__(self, *, one_run: bool = False) -> None:
        super().__init__()
        self.refused: list[tuple] = []
        self.one_run = one_run  # refuse several runs even where `place` would take them (the fallback's story)

    def min_run(self, adapter_id):
        return min_run(self.SHAPES, self.HALF_ELEMS) if adapter_id == "A" else 1

    def start(self, adapter_id, slots):
        if adapter_id == "A" and (place(self.SHAPES, slots.runs, self.HALF_ELEMS) is None
                                  or self.one_run and len(slots.runs) > 1):
            self.refused.append(slots.runs)
            return False
        return super().start(adapter_id, slots)


def scattered_world(loader: Loader) -> World:
    """B at [11]; base KV at [0], [2 3], [5 6] and [8-10] (used at t=1, 3, 5, 7); [1], [4] and [7] free: room
    for A (3 slots) by count, in runs of one slot only."""
    w = World("lru")
    w.loader = w.swapper.loader = loader
    w.load("B")
    for t, tokens in enumerate(([1], [2], [3, 4], [5], [6, 7], [8], [9, 10, 11]), start=1):
        w.serve(float(t), None, tokens)
    assert w.pool.num_free == 0
    for tokens in ([2], [5], [8]):
        w.tree.evict_leaf(w.tree.match(w.key(None, tokens)).last_node, w._free)  # frees [1], [4], [7]
    w.log.clear()
    w.now = 8.0
    return w


def test_a_refused_load_frees_only_the_run_its_longest_matrix_needs():
    """A (3 slots) fits in a run of 2 plus a slot elsewhere: its longest matrix is 2 slots of one run. The three
    free single slots are refused; the swapper frees a run of 2 (LRU: B, then [0], which joins the free [1]), not
    one of 3 (that would also evict [2 3]), and the load takes [0 1] and one slot more."""
    loader = PlacingLoader()
    assert slots_needed(loader.SHAPES, loader.HALF_ELEMS) == 3 and loader.min_run("A") == 2
    w = scattered_world(loader)
    assert w.pool.num_free == 3 and w.pool.largest_free_run() == 1
    assert w.swapper.load("A")
    assert loader.refused == [((7, 1), (4, 1), (1, 1))]  # from the top
    assert w.log == ["B", [0]]
    (runs,) = [r for a, r in loader.started if a == "A"]
    assert runs[0] == (0, 2) and len(runs) == 2 and sum(n for _, n in runs) == 3, runs
    assert w.tree.match(w.key(None, [3, 4])).prefix_len == 2  # the KV a run of 3 would have cost is kept
    loader.done.add("A")
    w.swapper.poll_loads()
    w.check()


def test_when_the_short_run_is_refused_too_the_load_frees_a_run_of_the_whole_adapter():
    """The same pool and a loader that takes one run only, though it names a shorter useful run: the run of 2 is
    made and refused, then the swapper evicts on ([2 3]) until a run of 3 is free, and the load gets it."""
    loader = PlacingLoader(one_run=True)
    w = scattered_world(loader)
    assert w.swapper.load("A")
    assert len(loader.refused) == 2 and loader.refused[1][0] == (0, 2)
    assert w.log == ["B", [0], [2, 3]] and w.swapper.counters.refused_loads == 2
    assert [r for a, r in loader.started if a == "A"] == [((2, 3),)]
    loader.done.add("A")
    w.swapper.poll_loads()
    w.check()


def test_a_refused_prefetch_is_not_retried_until_a_slot_is_released():
    """Idle, the highest-scored absent adapter (A, 3 slots) gets only fragmented runs, which the loader refuses.
    Every later tick would be refused the same way until some slot is released: the swapper waits for a release
    instead of trying (and counting a refusal) every swap interval."""
    w = World("lru", idle_watermark=1.0)
    w.loader = OneRunLoader()
    w.swapper.loader = w.loader
    w.serve(1.0, None, [1, 2])  # [0 1]
    w.serve(2.0, None, [3])  # [2]
    w.serve(3.0, None, [4, 5, 6, 7, 8, 9, 10])  # [3-9]
    w.tree.evict_leaf(w.tree.match(w.key(None, [3])).last_node, w._free)  # frees [2]; [10 11] free
    w.usage.record_request("A", 4.0)  # A scores above B and X
    assert w.pool.num_free == 3 and w.pool.largest_free_run() == 2
    assert w.swapper.tick(5.0) == [] and w.loader.refused == [((10, 2), (2, 1))]
    for t in (5.1, 5.2, 5.3):  # nothing released: not tried again
        w.swapper.tick(t)
    assert len(w.loader.refused) == 1 and w.swapper.counters.refused_loads == 1 and not w.loader.started
    w.check()
    w.tree.evict_leaf(w.tree.match(w.key(None, [1, 2])).last_node, w._free)  # frees [0 1]: [0-2] is a run of 3
    w.swapper.tick(5.4)
    assert w.loader.started[0] == ("A", ((0, 3),)) and w.swapper.counters.prefetches >= 1
    w.check()


def test_make_room_for_a_run_never_evicts_protected_and_says_not_now():
    w = World("lru")
    w.load("A", "B", "X")  # [9-11], [8], [6-7]
    w.serve(1.0, None, [1, 2, 3, 4, 5, 6])  # [0-5]: the pool is full
    m = w.tree.match(w.key(None, [1, 2, 3, 4, 5, 6]))
    w.tree.lock(m.last_node)  # a running request holds the base KV
    w.residency.acquire("A"), w.residency.acquire("B"), w.residency.acquire("X")
    assert not w.swapper.make_room(1, run=1)
    assert w.log == [] and w.pool.num_free == 0
    w.residency.release("X")
    assert w.swapper.make_room(2, run=2) and w.log == ["X"]
    w.check()


def test_reclaimable_adapter_slots_are_exactly_what_evicting_everything_frees():
    """The room a scheduler may plan with (free + evictable KV + reclaimable adapters, SGLang's evictable_size) is
    what `make_room` then really frees: a running adapter, and one held by locked KV below it or by a locked
    aLoRA suffix depending on it, are not counted."""
    def world() -> World:
        w = World(AdaptersFirst())
        w.load("A", "B", "X")
        w.serve(1.0, "A", [1, 2])
        w.serve(2.0, None, [5, 6])
        w.serve(3.0, "X", [5, 6, 9], start=2)
        return w

    slots = {a: world().residency.entry(a).num_slots for a in SIZES}
    cases = {
        "idle": (lambda w: None, {"A", "B", "X"}),
        "B running": (lambda w: w.residency.acquire("B"), {"A", "X"}),
        "A's KV locked": (lambda w: w.tree.lock(w.tree.match(w.key("A", [1, 2])).last_node), {"B", "X"}),
        "X's suffix locked": (lambda w: w.tree.lock(w.tree.match(w.key("X", [5, 6, 9], start=2)).last_node),
                              {"A", "B"}),
    }
    for name, (setup, expect) in cases.items():
        w = world()
        setup(w)
        counted = w.swapper.reclaimable_adapter_slots()
        assert counted == sum(slots[a] for a in expect), name
        before = w.kinds()["adapter"]
        w.swapper.make_room(w.pool.num_slots - 1)
        assert before - w.kinds()["adapter"] == counted, name
        assert {a for a in SIZES if not w.residency.is_resident(a)} == expect, name
        w.check()


def test_a_load_no_eviction_can_satisfy_evicts_nothing():
    """A request whose adapter cannot fit even after evicting every candidate (running adapters and locked KV
    hold the rest) is told "not now" with the cache intact: evicting first would empty every other adapter's
    and request's cache on each admission pass while it waits, and bring it no closer."""
    w = World("lru")
    w.load("B", "X")
    w.serve(1.0, None, [5, 6])  # cached base KV, unlocked
    w.serve(2.0, "B", [7, 8])
    w.residency.acquire("X")  # a running request on X
    w.tree.lock(w.tree.match(w.key("B", [7, 8])).last_node)  # and one whose prefix below B is locked
    running = w.pool.alloc("kv_running", w.pool.num_free).ids()  # running KV takes the rest
    reachable = w.swapper.reachable_slots()
    assert reachable == 2 < w.residency.entry("A").num_slots  # only the base KV could go
    before, counters = w.kinds(), dict(w.swapper.stats())
    assert not w.swapper.load("A")
    assert w.kinds() == before and w.swapper.stats() == counters and w.log == []
    assert w.tree.total_len() == 4 and w.residency.is_resident("B") and w.residency.is_resident("X")
    w.check()
    w.pool.release("kv_running", running[:1])  # one more slot of room: now A fits after evicting what can go
    assert w.swapper.reachable_slots() == w.residency.entry("A").num_slots
    base_kv = w.tree.match(w.key(None, [5, 6])).kv_values
    assert w.swapper.load("A") and w.log == [base_kv]  # the base KV went; B and X, still held, stayed


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.sampled_from([-math.inf, -2.0, -1.0, 0.0, 0.5])), max_size=40),
       st.lists(st.tuples(st.integers(0, 1), st.sampled_from([-math.inf, -1.0, 0.0, 0.5]), st.integers(0, 1)),
                max_size=12),
       st.lists(st.integers(0, 3), max_size=40))
def test_eviction_order_is_the_heap_order_of_every_candidate(leaves, side, pushes_after):
    """`_EvictionOrder` (leaves sorted as arrays, merged with a heap of what is pushed later) pops exactly what one
    heap of every candidate's (tier, score, kind, id) tuple pops, with candidates pushed between pops and scores tied
    (node ids are shuffled against creation order, adapter ids are strings)."""
    nodes = [Node(NodeKind.KV, id=(7919 * i) % 1009) for i in range(len(leaves))]
    wanted_kv = {n.id for n, (tier, _) in zip(nodes, leaves) if tier}
    initial = [(int(a in ("a1",)), s, 1, a, a) for a, s in (("a0", 0.0), ("a1", -1.0), ("a2", 0.5))]
    extra = []  # what an eviction exposes later: a parent (kind 0, a fresh id) or an adapter (kind 1)
    for j, (tier, s, kind) in enumerate(side):
        item = Node(NodeKind.KV, id=2000 + j) if kind == 0 else f"b{j}"
        extra.append((tier, s, kind, item.id if kind == 0 else item, item))
    order = _EvictionOrder(nodes, [s for _, s in leaves], wanted_kv, list(initial))
    ref = [(int(n.id in wanted_kv), s, 0, n.id, n) for n, (_, s) in zip(nodes, leaves)] + list(initial)
    heapq.heapify(ref)
    got, want, k = [], [], 0
    for after in pushes_after + [0] * (len(nodes) + len(extra) + 3):
        for _ in range(after):
            if k < len(extra):
                order.push(extra[k])
                heapq.heappush(ref, extra[k])
                k += 1
        got.append(order.pop())
        want.append(heapq.heappop(ref)[4] if ref else None)
    assert got == want
