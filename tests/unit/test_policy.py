"""Eviction policies against hand-computed values of their formulas, and as the tree's score
function."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sgl_multilora.keys import AdapterRef, MatchKey, Namespace
from sgl_multilora.policy import POLICIES, create_policy
from sgl_multilora.policy.chameleon import ChameleonPolicy
from sgl_multilora.policy.context import AdapterRecord
from sgl_multilora.policy.elora import EloraPolicy, expected_adapters_per_batch
from sgl_multilora.policy.lru import LruPolicy
from sgl_multilora.policy.usage import UsageStats
from sgl_multilora.tree import LoraRadixTree
from sgl_multilora.tree_nodes import NodeKind

MiB = 2**20
NS = Namespace("m")
A = AdapterRef("A", "A")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FixedContext:
    """A context with fixed answers, independent of `UsageStats`: items carry their own numbers."""

    def __init__(self, n: int, low: float) -> None:
        self.n, self.low = n, low

    def is_adapter(self, item):
        return item.adapter

    def size_bytes(self, item):
        return item.size_bytes

    def reload_cost_s(self, item):
        return item.cost

    def visits(self, item):
        return item.visits

    def columns(self, items):
        return (np.array([i.adapter for i in items], dtype=bool),
                *(np.array([getattr(i, a) for i in items], dtype=np.float64) for a in ("size_bytes", "cost", "visits")))

    def total_visits(self):
        return 10.0

    def max_visits(self):
        return 10.0

    def max_size_bytes(self):
        return 200

    def num_resident_adapters(self):
        return self.n

    def expected_adapters_per_batch(self):
        return self.low


class Item:
    def __init__(self, adapter=False, size_bytes=32 * MiB, cost=0.032, visits=3.0, last_access=0.0):
        self.adapter, self.size_bytes, self.cost = adapter, size_bytes, cost
        self.visits, self.last_access = visits, last_access


# ---- Low_lora (Eq. 3) ----------------------------------------------------------------------------

def test_low_lora_hand_computed():
    # 1 - 0.5^2 = 0.75; 1 - 0.75^2 = 0.4375, twice
    assert expected_adapters_per_batch([0.5, 0.25, 0.25], 2) == pytest.approx(1.625)
    assert expected_adapters_per_batch([], 8) == 0.0
    with pytest.raises(ValueError, match="outside"):
        expected_adapters_per_batch([1.5], 2)


@pytest.mark.parametrize("batch,published",
                         [(8, 7.7), (32, 27.5), (64, 47.4), (128, 72.4), (256, 92.4)])
def test_low_lora_matches_perf_anchors_table(batch, published):
    # shared/reference/perf-anchors.md 6.3: expected distinct adapters, uniform popularity over
    # 100 adapters
    assert expected_adapters_per_batch([0.01] * 100, batch) == pytest.approx(published, abs=0.05)


# ---- ELORA's Eval --------------------------------------------------------------------------------

def test_elora_eval_hand_computed():
    pol = EloraPolicy(FixedContext(n=2, low=4.0))
    kv = Item(last_access=8.0)
    # min(1, 2/4) = 0.5; cost per 16 MiB block = 0.032 * 16/32 = 0.016; visit = 3/10;
    # 1 - sigmoid(2) = 0.11920292
    assert pol.evaluate(kv, now=10.0) == pytest.approx(0.5 * 0.016 * 0.3 * 0.11920292202, rel=1e-9)
    assert pol.evaluate(kv, now=10.0) == pytest.approx(2.8608701e-4, rel=1e-6)
    whole = EloraPolicy(FixedContext(n=2, low=4.0), block_bytes=None)
    assert whole.evaluate(kv, now=10.0) == pytest.approx(0.5 * 0.032 * 0.3 * 0.11920292202,
                                                         rel=1e-9)


def test_elora_lora_count_term_directions():
    kv, adapter = Item(), Item(adapter=True)
    few = EloraPolicy(FixedContext(n=2, low=4.0))  # fewer adapters resident than a batch needs
    assert few.lora_factor(kv) == 0.5 and few.lora_factor(adapter) == 1.0
    many = EloraPolicy(FixedContext(n=8, low=4.0))  # surplus adapters go first
    assert many.lora_factor(kv) == 1.0 and many.lora_factor(adapter) == 0.5
    literal = EloraPolicy(FixedContext(n=2, low=4.0), lora_mode="literal")
    assert literal.lora_factor(kv) == 0.5 and literal.lora_factor(adapter) == 0.25  # (N - 1) / Low
    idle = EloraPolicy(FixedContext(n=0, low=0.0))
    assert idle.lora_factor(kv) == 1.0 and idle.lora_factor(adapter) == 1.0


@pytest.mark.parametrize("term,factor", [("lora_count", 0.5), ("cost", 0.016), ("visit", 0.3),
                                         ("recency", 0.11920292202)])
def test_elora_ablations_drop_exactly_one_factor(term, factor):
    ctx, kv = FixedContext(n=2, low=4.0), Item(last_access=8.0)
    full = EloraPolicy(ctx).evaluate(kv, 10.0)
    dropped = EloraPolicy(ctx, drop=[term]).evaluate(kv, 10.0)
    assert dropped == pytest.approx(full / factor, rel=1e-9)
    with pytest.raises(ValueError, match="unknown ELORA terms"):
        EloraPolicy(ctx, drop=["size"])


def test_elora_log_score_orders_old_items_without_underflow():
    pol = EloraPolicy(FixedContext(n=4, low=4.0))
    old, older = Item(last_access=0.0), Item(last_access=-1000.0)
    assert pol.evaluate(old, 1000.0) == 0.0  # Eval itself underflows after ~700 s
    assert math.isfinite(pol.score(older, 1000.0))
    assert pol.score(older, 1000.0) < pol.score(old, 1000.0)
    assert pol.score(old, 1000.0) == pytest.approx(math.log(0.016 * 0.3) - 1000.0, abs=1e-9)


def test_elora_tau_scales_time():
    kv = Item(last_access=0.0)
    slow = EloraPolicy(FixedContext(n=4, low=4.0), tau_s=10.0)
    fast = EloraPolicy(FixedContext(n=4, low=4.0), tau_s=1.0)
    assert slow.evaluate(kv, 20.0) == pytest.approx(fast.evaluate(kv, 2.0), rel=1e-12)


# ---- Chameleon -----------------------------------------------------------------------------------

def test_chameleon_score_hand_computed():
    pol = ChameleonPolicy(FixedContext(n=1, low=1.0), tau_s=60.0)
    item = Item(adapter=True, size_bytes=100, visits=5.0, last_access=40.0)
    # F = 5/10, R = exp(-60/60), S = 100/200
    assert pol.terms(item, 100.0) == pytest.approx((0.5, math.exp(-1), 0.5))
    expected = 0.45 * 0.5 + 0.10 * 0.36787944117 + 0.45 * 0.5
    assert pol.score(item, 100.0) == pytest.approx(expected, rel=1e-9)
    big = Item(adapter=True, size_bytes=10_000, visits=50.0, last_access=100.0)  # clamped to 1 each
    assert pol.score(big, 100.0) == pytest.approx(1.0)


def test_chameleon_scores_kv_on_a_server_with_no_adapter_registered():
    """A base-only server: no adapter size to normalise by, so the size term is 0 (it divided by zero)."""
    u = UsageStats({}, 10, 1e-3, lambda num_bytes: num_bytes * 1e-9)
    tree = LoraRadixTree(clock=lambda: 5.0)
    tree.insert(MatchKey(Namespace("m"), None, [1, 2, 3]), [0, 1, 2])
    (leaf,) = tree.evictable_leaves()
    f, r, s = ChameleonPolicy(u).terms(leaf, 5.0)
    assert s == 0.0 and f == 1.0 and r == 1.0


def test_registry_and_errors():
    ctx = FixedContext(1, 1.0)
    assert isinstance(create_policy("lru"), LruPolicy)
    assert {"lru", "elora", "chameleon"} <= set(POLICIES)
    assert isinstance(create_policy("elora", context=ctx), EloraPolicy)
    with pytest.raises(ValueError, match="supported: chameleon, elora, lru"):
        create_policy("lfu")
    with pytest.raises(ValueError, match="tau_s"):
        ChameleonPolicy(ctx, tau_s=0)
    assert LruPolicy()(Item(last_access=3.5), 9.0) == 3.5


# ---- UsageStats as the context -------------------------------------------------------------------

def test_usage_stats_low_lora_and_window():
    u = UsageStats({"a": 100, "b": 300}, kv_bytes_per_token=10, kv_reload_s_per_token=1e-3,
                   adapter_reload_s=lambda b: b / 1000, window_s=60.0)
    for name, t in [("a", 0.0), ("a", 1.0), ("b", 2.0)]:
        u.record_request(name, t)
    u.record_batch(2.0, 2)
    u.record_batch(3.0, 4)
    # p = (2/3, 1/3), BS = mean(2, 4) = 3: (1 - (1/3)^3) + (1 - (2/3)^3) = 26/27 + 19/27
    assert u.expected_adapters_per_batch() == pytest.approx(45 / 27)
    u.record_request("b", 61.5)  # the two "a" requests leave the 60 s window
    assert u.window_probs() == [1.0]
    rec = u.records["a"]
    assert u.visits(rec) == 3 and u.total_visits() == 5 and u.max_visits() == 3
    assert u.reload_cost_s(rec) == pytest.approx(0.1) and u.size_bytes(rec) == 100
    u.set_resident("a", True)
    u.set_resident("a", True)
    assert u.num_resident_adapters() == 1


def test_elora_orders_tree_eviction_by_visits_and_cost():
    """As the tree's ScoreFn: of two equally old runs of equal length, ELORA keeps the one reused
    more; LRU keeps the one touched later."""
    clock = Clock()
    u = UsageStats({"A": 10 * MiB}, kv_bytes_per_token=MiB, kv_reload_s_per_token=1e-3,
                   adapter_reload_s=lambda b: b / 1e9)
    pol = create_policy("elora", context=u, tau_s=100.0)
    tree = LoraRadixTree(score=pol, clock=clock)
    tree.insert(MatchKey(NS, A, [1, 2, 3, 4]), [0, 1, 2, 3])
    tree.insert(MatchKey(NS, A, [9, 8, 7, 6]), [4, 5, 6, 7])
    u.record_request("A", 0.0)
    tree.match(MatchKey(NS, A, [9, 8, 7, 6]))  # same time, one more visit for [9 8 7 6]
    clock.now = 5.0
    freed = []
    tree.evict(1, freed.append)
    assert freed == [[0, 1, 2, 3]]
    tree.check_invariants()
    lru_tree = LoraRadixTree(score=create_policy("lru"), clock=clock)
    clock.now = 0.0
    lru_tree.insert(MatchKey(NS, A, [1, 2]), [0, 1])
    clock.now = 1.0
    lru_tree.insert(MatchKey(NS, A, [3, 4]), [2, 3])
    freed = []
    lru_tree.evict(1, freed.append)
    assert freed == [[0, 1]]


def test_usage_stats_terms_equal_its_four_methods_and_batch_scores_equal_single_ones():
    """`columns` (what the evictor's batch scoring reads) answers as `is_adapter`, `size_bytes`,
    `reload_cost_s` and `visits` do, for KV nodes, adapter nodes and adapter records; and over a real tree
    ELORA's batch scores are `score`'s floats."""
    clock = Clock()
    u = UsageStats({"A": 10 * MiB, "B": 3 * MiB}, kv_bytes_per_token=MiB // 4, kv_reload_s_per_token=2e-3,
                   adapter_reload_s=lambda b: b / 1e9)
    pol = create_policy("elora", context=u, tau_s=3.0)
    tree = LoraRadixTree(score=pol, clock=clock)
    tree.insert(MatchKey(NS, A, [1, 2, 3, 4]), [0, 1, 2, 3])
    tree.insert(MatchKey(NS, A, [1, 2, 7]), [0, 1, 4])
    tree.insert(MatchKey(NS, AdapterRef("B", "B"), [5, 6]), [5, 6])
    u.record_request("A", 0.0)
    u.record_request("B", 0.5)
    clock.now = 1.0
    tree.match(MatchKey(NS, A, [1, 2, 3, 4]))
    u.record_batch(1.0, 2)
    u.set_resident("A", True)
    leaves = tree.evictable_leaves()
    adapters = [n for ns in tree.root.children.values() for n in ns.children.values() if n.kind is NodeKind.ADAPTER]
    items = [*leaves, *adapters, u.records["A"], u.records["B"]]
    assert len(leaves) == 3 and len(adapters) == 2
    for batch in (leaves, adapters, items):
        columns = [c.tolist() for c in u.columns(batch)]
        assert columns == [[f(i) for i in batch] for f in (u.is_adapter, u.size_bytes, u.reload_cost_s, u.visits)]
        assert pol.score_many(batch, 4.0) == pytest.approx([pol.score(i, 4.0) for i in batch], rel=1e-12)


def test_tree_evict_leaf_and_evictable_leaves():
    clock = Clock()
    tree = LoraRadixTree(clock=clock)
    tree.insert(MatchKey(NS, A, [1, 2, 3]), [0, 1, 2])
    tree.insert(MatchKey(NS, A, [1, 2, 5]), [0, 1, 9])
    m = tree.match(MatchKey(NS, A, [1, 2, 3]))
    tree.lock(m.last_node)
    leaves = tree.evictable_leaves()
    assert [n.key for n in leaves] == [(5,)]
    with pytest.raises(ValueError, match="unlocked KV leaf"):
        tree.evict_leaf(m.last_node, print)
    freed = []
    assert tree.evict_leaf(leaves[0], freed.append) == 1 and freed == [[9]]
    with pytest.raises(ValueError):
        tree.evict_leaf(leaves[0], freed.append)  # already evicted
    tree.check_invariants()
    assert AdapterRecord("x", 5).resident is False


@pytest.mark.parametrize("drop", [(), ("lora_count",), ("cost",), ("visit",), ("recency",)])
@pytest.mark.parametrize("mode", ["intent", "literal"])
def test_elora_score_many_equals_score_item_by_item(drop, mode):
    """The evictor's batch scoring (array maths) gives `score`'s values, to the last bits of a logarithm."""
    items = [Item(), Item(adapter=True, size_bytes=64 * MiB), Item(visits=0.0), Item(cost=0.0),
             Item(last_access=-3.0), Item(adapter=True, last_access=2.0, visits=7.0)]
    for n, low in ((0, 2.0), (1, 2.0), (3, 2.0), (2, 0.0)):
        pol = EloraPolicy(FixedContext(n, low), tau_s=2.0, drop=drop, lora_mode=mode)
        assert pol.score_many(items, 5.0) == pytest.approx([pol.score(i, 5.0) for i in items], rel=1e-12)
    lru = LruPolicy()
    assert lru.score_many(items, 5.0) == [lru.score(i, 5.0) for i in items]
