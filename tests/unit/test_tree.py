"""The LoRA-aware radix tree, told as stories: insert, hit, lock, evict with exact slot ids and
order, then the isolation guarantees one by one (base / LoRA / aLoRA / namespaces / identity)."""

from __future__ import annotations

import pytest

from sgl_multilora.keys import AdapterRef, MatchKey, Namespace
from sgl_multilora.tree import LoraRadixTree
from sgl_multilora.tree_nodes import HitKind

NS = Namespace("smollm2")
A = AdapterRef("sha256:aaaa", "A")
B = AdapterRef("sha256:bbbb", "B")
X = AdapterRef("sha256:xxxx", "X")  # an aLoRA
Y = AdapterRef("sha256:yyyy", "Y")  # another aLoRA
C = [5, 6, 7]  # a shared context; the aLoRA invocation token is 9, so k = 3


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def base(tokens, ns=NS):
    return MatchKey(ns, None, tokens)


def lora(adapter, tokens, ns=NS):
    return MatchKey(ns, adapter, tokens)


def alora(adapter, tokens, k, ns=NS):
    return MatchKey(ns, adapter, tokens, alora_start=k)


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def tree(clock):
    return LoraRadixTree(clock=clock)


def test_story_insert_hit_lock_evict(tree, clock):
    freed = []
    clock.now = 1
    assert tree.insert(base([1, 2, 3, 4]), [100, 101, 102, 103]).prefix_len == 0
    clock.now = 2
    r = tree.insert(base([1, 2, 3, 5, 6]), [200, 201, 202, 203, 204])
    assert r.prefix_len == 3  # the caller frees its duplicates 200, 201, 202
    assert (tree.total_len(), tree.stats().num_kv_nodes) == (6, 3)  # [1 2 3] -> [4], [5 6]
    tree.check_invariants()

    clock.now = 3
    m = tree.match(base([1, 2, 3, 5, 6, 7]))
    assert (m.prefix_len, m.kv_values, m.hit_kind) == (5, [100, 101, 102, 203, 204], HitKind.BASE)
    assert m.last_node is r.last_node
    tree.lock(m.last_node)
    assert (tree.protected_len(), tree.evictable_len()) == (5, 1)
    tree.check_invariants()

    clock.now = 4
    assert tree.evict(10, freed.append) == 1  # only [4] is unlocked
    assert freed == [[103]] and tree.evictable_len() == 0
    tree.unlock(m.last_node)
    assert (tree.protected_len(), tree.evictable_len()) == (0, 5)
    tree.check_invariants()

    clock.now = 5
    assert tree.insert(base([1, 2, 3, 4, 8]), [300, 301, 302, 303, 304]).prefix_len == 3
    clock.now = 6
    assert tree.match(base([1, 2, 3, 5])).prefix_len == 4  # touches [1 2 3] and [5 6] at t=6
    freed.clear()
    assert tree.evict(1, freed.append) == 2  # least recent leaf: [4 8] (t=5)
    assert tree.evict(1, freed.append) == 2  # then [5 6] (t=6)
    assert tree.evict(3, freed.append) == 3  # [1 2 3] became a leaf
    assert freed == [[303, 304], [203, 204], [100, 101, 102]]
    assert tree.total_len() == 0 and tree.evict(1, freed.append) == 0
    assert tree.stats().num_evicted_runs == 4
    tree.check_invariants()


def test_match_never_changes_structure_and_touch_false_records_nothing(tree, clock):
    clock.now = 1
    node = tree.insert(base([1, 2, 3, 4]), [10, 11, 12, 13]).last_node
    clock.now = 2
    m = tree.match(base([1, 2, 9]), touch=False)
    assert (m.prefix_len, m.kv_values, m.last_node) == (2, [10, 11], node)  # ends inside the run
    assert tree.stats().num_kv_nodes == 1 and node.last_access == 1
    assert tree.stats().num_matches == 0
    tree.match(base([1, 2, 9]))
    assert tree.stats().num_kv_nodes == 1 and node.last_access == 2


def test_split_keeps_a_held_lock_on_the_tail(tree):
    held = tree.insert(base([1, 2, 3, 4]), [10, 11, 12, 13]).last_node
    tree.lock(held)
    assert tree.insert(base([1, 2, 8]), [20, 21, 22]).prefix_len == 2  # splits the locked run
    assert (tree.protected_len(), tree.evictable_len()) == (4, 1)
    tree.check_invariants()
    tree.unlock(held)
    assert (tree.protected_len(), tree.evictable_len()) == (0, 5)
    tree.check_invariants()
    with pytest.raises(AssertionError, match="unlock without lock"):
        tree.unlock(held)


def test_policy_scores_order_eviction(clock):
    # keep frequently hit runs: score = number of hits, so LRU order is overridden
    tree = LoraRadixTree(clock=clock, score=lambda node, now: sum(node.hits.values()))
    tree.insert(base([1, 2]), [10, 11])
    tree.insert(base([3, 4]), [30, 31])
    for t in (1, 2):
        clock.now = t
        tree.match(base([3, 4]))
    clock.now = 3
    tree.match(base([1, 2]))  # most recent, but only one hit
    freed = []
    tree.evict(1, freed.append)
    assert freed == [[10, 11]]


def test_lock_of_an_alora_suffix_pins_base_prefix_and_adapter(tree):
    tree.insert(base(C + [8]), [10, 11, 12, 13])
    suffix = tree.insert(alora(X, C + [9, 4], k=3), [20, 21, 22, 23, 24]).last_node
    adapter_node = tree.adapter_node(NS, X)
    tree.lock(suffix)
    assert adapter_node.lock_ref == 1
    assert (tree.protected_len(), tree.evictable_len()) == (5, 1)  # [5 6 7] + [9 4] locked, [8] not
    freed = []
    assert tree.evict(100, freed.append) == 1 and freed == [[13]]
    tree.unlock(suffix)
    assert adapter_node.lock_ref == 0
    # the anchor [5 6 7] holds a suffix: the suffix must go first (dependency order)
    assert tree.evict(100, freed.append) == 5 and freed[1:] == [[23, 24], [10, 11, 12]]
    tree.check_invariants()


def test_remove_adapter_refuses_while_locked_then_evicts_its_dependents_first(tree):
    tree.insert(base(C + [8]), [10, 11, 12, 13])
    suffix = tree.insert(alora(X, C + [9, 4], k=3), [20, 21, 22, 23, 24]).last_node
    tree.insert(lora(X, [1, 2]), [30, 31])  # X used as a standard LoRA too: KV below its node
    freed = []
    tree.lock(suffix)
    assert tree.remove_adapter(NS, X, freed.append) is None and freed == []
    assert tree.adapter_node(NS, X) is not None
    tree.unlock(suffix)
    assert tree.remove_adapter(NS, X, freed.append) == 4
    assert sorted(freed) == [[23, 24], [30, 31]]
    assert tree.adapter_node(NS, X) is None and tree.total_len() == 4  # base KV stays
    assert tree.match(alora(X, C + [9, 4], k=3)).prefix_len == 3  # base prefix only
    tree.check_invariants()
    with pytest.raises(KeyError):
        tree.remove_adapter(NS, X, freed.append)
    held = tree.insert(lora(A, [1, 2]), [40, 41]).last_node
    tree.lock(held)
    assert tree.remove_adapter(NS, A, freed.append) is None  # locked through its KV
    tree.unlock(held)


def test_stats_count_hits_by_kind(tree):
    tree.insert(base(C), [10, 11, 12])
    tree.insert(lora(A, [1, 2]), [20, 21])
    tree.insert(alora(X, C + [9, 4], k=3), [10, 11, 12, 30, 31])
    tree.match(base(C))
    tree.match(lora(A, [1, 2, 3]))
    tree.match(alora(Y, C + [9], k=3))
    tree.match(alora(X, C + [9, 4], k=3))
    s = tree.stats()
    assert s.hits == {"base": 1, "same_adapter": 1, "alora_base_prefix": 2, "alora_suffix": 1}
    assert s.hit_tokens == {"base": 3, "same_adapter": 2, "alora_base_prefix": 6, "alora_suffix": 2}
    assert (s.num_matches, s.num_namespaces, s.num_adapter_nodes, s.total_len) == (4, 1, 2, 7)


# ---- isolation -----------------------------------------------------------------------------------


def test_base_lora_and_other_lora_with_same_tokens_never_share(tree):
    tokens = [1, 2, 3, 4]
    tree.insert(base(tokens), [10, 11, 12, 13])
    assert tree.match(lora(A, tokens)).prefix_len == 0
    assert tree.insert(lora(A, tokens), [20, 21, 22, 23]).prefix_len == 0
    assert tree.match(lora(B, tokens)).prefix_len == 0
    assert tree.insert(lora(B, tokens), [30, 31, 32, 33]).prefix_len == 0
    assert tree.match(base(tokens)).kv_values == [10, 11, 12, 13]
    assert tree.match(lora(A, tokens)).kv_values == [20, 21, 22, 23]
    assert tree.match(lora(B, tokens)).kv_values == [30, 31, 32, 33]
    assert tree.match(lora(A, tokens)).hit_kind is HitKind.SAME_ADAPTER
    tree.check_invariants()


def test_alora_reuses_exactly_k_tokens_of_base_kv(tree):
    tree.insert(base(C + [8]), [10, 11, 12, 13])
    m = tree.match(alora(X, C + [9], k=3))
    assert (m.prefix_len, m.kv_values, m.hit_kind) == (3, [10, 11, 12], HitKind.ALORA_BASE_PREFIX)
    assert tree.insert(alora(X, C + [9, 4], k=3), [20, 21, 22, 23, 24]).prefix_len == 3
    m = tree.match(alora(X, C + [9, 4, 1], k=3))
    assert (m.prefix_len, m.kv_values) == (5, [10, 11, 12, 23, 24])
    assert m.hit_kind is HitKind.ALORA_SUFFIX
    # the base model never reads the suffix, a standard use of X never reads it, nor does a later
    # activation
    assert tree.match(base(C + [9, 4])).kv_values == [10, 11, 12]
    assert tree.match(lora(X, C + [9, 4])).prefix_len == 0
    assert tree.match(alora(X, C + [9, 4], k=4)).prefix_len == 3
    tree.check_invariants()


def test_base_reuses_the_prefix_an_alora_computed(tree):
    tree.insert(alora(X, C + [9], k=3), [20, 21, 22, 23])
    assert tree.match(base(C + [8])).kv_values == [20, 21, 22]
    # a prompt that ends before its activation start is all base KV
    assert tree.insert(alora(X, [5, 6], k=3), [30, 31]).prefix_len == 2
    assert tree.match(alora(X, [5, 6], k=3)).hit_kind is HitKind.ALORA_BASE_PREFIX


def test_two_aloras_share_the_base_prefix_but_not_their_suffixes(tree):
    tree.insert(alora(X, C + [9, 4], k=3), [10, 11, 12, 13, 14])
    assert tree.insert(alora(Y, C + [9, 4], k=3), [20, 21, 22, 23, 24]).prefix_len == 3
    assert tree.match(alora(X, C + [9, 4], k=3)).kv_values == [10, 11, 12, 13, 14]
    assert tree.match(alora(Y, C + [9, 4], k=3)).kv_values == [10, 11, 12, 23, 24]
    assert tree.total_len() == 7
    tree.check_invariants()


@pytest.mark.parametrize(
    "ns1, ns2",
    [
        (Namespace("m", cache_salt="bc", extra_key="a"),
         Namespace("m", cache_salt="c", extra_key="ab")),
        (Namespace("m", cache_salt=None), Namespace("m", cache_salt="")),
        (Namespace("m", extra_key="s"), Namespace("m", cache_salt="s")),
        (Namespace("m1", extra_key="x"), Namespace("m", extra_key="1x")),
    ],
)
def test_namespaces_built_from_crafted_strings_never_collide(tree, ns1, ns2):
    tree.insert(base([1, 2, 3], ns=ns1), [10, 11, 12])
    assert tree.match(base([1, 2, 3], ns=ns2)).prefix_len == 0
    tree.insert(lora(A, [1, 2, 3], ns=ns1), [20, 21, 22])
    assert tree.match(lora(A, [1, 2, 3], ns=ns2)).prefix_len == 0
    tree.check_invariants()


def test_extra_key_equal_to_an_adapter_identity_does_not_reach_its_kv(tree):
    # SGLang issue #24638: stock SGLang joins extra_key + lora_id, so a base request whose extra_key
    # is the LoRA's id lands in the LoRA's subtree. Here the extra_key is only a namespace field.
    tree.insert(lora(A, [1, 2, 3]), [20, 21, 22])
    forged = Namespace(NS.base_model, extra_key=A.identity)
    assert tree.match(base([1, 2, 3], ns=forged)).prefix_len == 0
    tree.insert(lora(B, [1, 2, 3], ns=Namespace("m", extra_key="x")), [30, 31, 32])
    joined = Namespace("m", extra_key="x" + B.identity)
    assert tree.match(base([1, 2, 3], ns=joined)).prefix_len == 0
    with pytest.raises(TypeError):
        MatchKey("smollm2", None, [1])  # a string is never a namespace


def test_same_adapter_name_with_new_weights_never_shares(tree):
    old, new = AdapterRef("sha256:0001", "A"), AdapterRef("sha256:0002", "A")
    tree.insert(lora(old, [1, 2, 3]), [10, 11, 12])
    assert tree.match(lora(new, [1, 2, 3])).prefix_len == 0
    tree.insert(alora(old, C + [9], k=3), [20, 21, 22, 23])
    assert tree.match(alora(new, C + [9], k=3)).prefix_len == 3  # the base prefix only
    # the name is a label: the same weights under another name are the same adapter
    assert tree.match(lora(AdapterRef("sha256:0001", "renamed"), [1, 2, 3])).prefix_len == 3


# ---- pages and the checker -----------------------------------------------------------------------


def test_page_size_two_matches_whole_pages_and_keys_the_activation_offset(clock):
    tree = LoraRadixTree(page_size=2, clock=clock)
    tree.insert(base([1, 2, 3, 4]), [10, 11, 12, 13])
    assert tree.match(base([1, 2, 3, 5])).kv_values == [10, 11]
    assert tree.match(base([1, 2, 3])).prefix_len == 2
    with pytest.raises(ValueError, match="page_size"):
        tree.insert(base([1, 2, 3]), [1, 2, 3])
    # k = 3 anchors at position 2 with offset 1; k = 2 anchors there too but with offset 0
    assert tree.insert(alora(X, [1, 2, 3, 9], k=3), [20, 21, 22, 23]).prefix_len == 2
    m = tree.match(alora(X, [1, 2, 3, 9, 7], k=3))
    assert (m.prefix_len, m.kv_values, m.hit_kind) == (4, [10, 11, 22, 23], HitKind.ALORA_SUFFIX)
    assert tree.match(alora(X, [1, 2, 3, 9], k=2)).prefix_len == 2
    assert tree.match(base([1, 2, 3, 9])).prefix_len == 2
    tree.check_invariants()


def test_check_invariants_names_the_cause(tree):
    tree.insert(base(C + [8]), [10, 11, 12, 13])
    node = tree.insert(alora(X, C + [9], k=3), [20, 21, 22, 23]).last_node
    tree.check_invariants()
    tree._store._evictable_len += 1  # corrupt the counter behind the checker
    with pytest.raises(AssertionError, match="evictable_len"):
        tree.check_invariants()
    tree._store._evictable_len -= 1
    ns_node = tree.namespace_node(NS)
    adapter_node = ns_node.children.pop(X.identity)  # an adapter vanishing under its suffix
    with pytest.raises(AssertionError, match="depends on"):
        tree.check_invariants()
    ns_node.children[X.identity] = adapter_node
    node.lock_ref = -1
    with pytest.raises(AssertionError, match="negative lock count"):
        tree.check_invariants()


def test_array_tokens_and_tensor_values_keep_value_cache_in_step(clock):
    """SGLang's form: `array('q')` tokens and int64 tensor values. New nodes keep their slice of the
    tensor (`value_cache`), a split slices it with the list, eviction frees it; matches, lengths and
    the invariants are as with tuples and lists."""
    from array import array

    import torch

    tree = LoraRadixTree(clock=clock)
    tree.insert(lora(A, array("q", [1, 2, 3, 4, 5])), torch.tensor([10, 11, 12, 13, 14]))
    res = tree.insert(lora(A, array("q", [1, 2, 3, 8, 9])), torch.tensor([20, 21, 22, 23, 24]))
    assert res.prefix_len == 3  # split after [1 2 3]; the caller frees 20 21 22
    tree.check_invariants()  # checks every value_cache against its list
    assert tree.match(lora(A, array("q", [1, 2, 3, 4, 5]))).kv_values == [10, 11, 12, 13, 14]
    assert tree.match(lora(A, (1, 2, 3, 8))).kv_values == [10, 11, 12, 23]  # a tuple key still matches
    upper = res.last_node.parent
    assert upper.value == [10, 11, 12] and upper.value_cache.tolist() == [10, 11, 12]
    freed = []
    assert tree.evict(4, freed.append) == 4
    assert sorted(t.tolist() for t in freed) == [[13, 14], [23, 24]]
    assert all(isinstance(t, torch.Tensor) for t in freed)
    tree.check_invariants()


def test_remap_values_rewrites_moved_slot_ids_and_nothing_else(tree):
    """KV compaction: the slot ids the owner moved read their new ids in every node holding them (the inserter's
    `value_cache` rebuilt by `form`); keys, matches, locks and lengths stay as they were."""
    tree.insert(base([5, 6, 7]), [10, 11, 12])
    tree.insert(base([5, 6, 8]), [10, 11, 13])  # splits [5 6 | 7]
    tree.insert(lora(A, [1, 2]), [20, 21])
    node = tree.match(lora(A, [1, 2])).last_node
    tree.lock(node)
    before = (tree.evictable_len(), tree.protected_len(), tree.stats().num_kv_nodes)
    changed = tree.remap_values({11: 3, 13: 4, 21: 5, 99: 6}, form=tuple)
    assert changed == 3  # [10 11], [13] and A's [20 21]; [12] holds no moved id
    assert tree.match(base([5, 6, 7])).kv_values == [10, 3, 12]
    assert tree.match(base([5, 6, 8])).kv_values == [10, 3, 4]
    assert tree.match(lora(A, [1, 2])).kv_values == [20, 5] and node.lock_ref == 1
    assert (tree.evictable_len(), tree.protected_len(), tree.stats().num_kv_nodes) == before
    tree.check_invariants()
