"""The host tier as stories: spill order (whole paths, only what the host lacks), drops (least recently used, never
the path being written, refused when everything is pinned), return (the bytes come back into other device slots),
the dependency rule's keys (adapters, aLoRA suffixes, namespaces) and removal with an adapter. The store is the
server's own (`patches/host_kv.HostKVStore`) over small KV buffers whose every element says which slot and layer it
came from, so a copy to the wrong row is seen.
"""

from __future__ import annotations

import pytest
import torch
from sgl_multilora.patches.host_kv import HostKVStore

from sgl_multilora.host_tier import HostKVTier, path_key
from sgl_multilora.keys import AdapterRef, MatchKey, Namespace
from sgl_multilora.tree import LoraRadixTree

NS, OTHER_NS = Namespace("m"), Namespace("m", cache_salt="tenant-b")
A, B, X = AdapterRef("a" * 64, "A"), AdapterRef("b" * 64, "B"), AdapterRef("c" * 64, "X")
LAYERS, SLOTS = 3, 64


def kv_buffers():
    """Device KV: slot s of layer l holds 1000 l + s (K) and -(1000 l + s) (V), in a [SLOTS, 2 heads, 4] row."""
    k = [torch.full((SLOTS, 2, 4), 0.0) + (1000 * layer + torch.arange(SLOTS)).view(-1, 1, 1).float()
         for layer in range(LAYERS)]
    v = [-t for t in k]
    return k, v


class World:
    def __init__(self, capacity: int) -> None:
        self.k, self.v = kv_buffers()
        self.store = HostKVStore(self.k, self.v, capacity)
        self.clock = iter(range(1, 10_000)).__next__
        self.device = LoraRadixTree(clock=self.clock)
        self.host = HostKVTier(capacity, bytes_per_token=8, clock=self.clock, store=self.store)
        self.next_slot = 1

    def compute(self, key: MatchKey):
        """Puts `key`'s KV on the device (fresh slots past what the device holds); returns the last node."""
        have = self.device.match(key, touch=False)
        n = len(key.token_ids) - have.prefix_len
        values = have.kv_values + list(range(self.next_slot, self.next_slot + n))
        self.next_slot += n
        return self.device.insert(key, values).last_node

    def evict(self, node) -> list[int]:
        """What the swapper does: spill, then evict the leaf. Returns the evicted device slots."""
        self.host.spill(*path_key(node))
        freed = []
        self.device.evict_leaf(node, freed.extend)
        return freed

    def host_rows(self, key: MatchKey, start: int = 0) -> torch.Tensor:
        m = self.host.match(key, touch=False)
        return torch.stack([self.store.host_rows(m.kv_values[start:], layer)[:, 0, 0] for layer in range(LAYERS)])

    def check(self) -> None:
        self.host.check_invariants()
        self.device.check_invariants()


def test_spill_writes_the_whole_path_once_and_the_bytes_of_each_slot():
    w = World(capacity=32)
    key = MatchKey(NS, A, [1, 2, 3, 4])
    w.compute(MatchKey(NS, A, [1, 2]))
    leaf = w.compute(key)  # [3 4] below [1 2]
    device_slots = w.device.match(key, touch=False).kv_values
    w.evict(leaf)
    assert w.host.counters.spilled_tokens == 4 and w.host.used_tokens == 4  # the ancestors too: prefix-closed
    expected = torch.stack([1000 * layer + torch.tensor(device_slots, dtype=torch.float) for layer in range(LAYERS)])
    assert torch.equal(w.host_rows(key), expected)
    # The parent [1 2] is now a leaf: spilling it writes nothing new.
    parent = w.device.match(MatchKey(NS, A, [1, 2]), touch=False).last_node
    w.evict(parent)
    assert w.host.counters.spilled_tokens == 4 and w.host.counters.spills == 2
    assert w.store.num_used == 4
    w.check()


def test_restore_copies_into_other_device_slots():
    w = World(capacity=32)
    key = MatchKey(NS, None, [7, 8, 9])
    old = w.device.match(key, touch=False)
    leaf = w.compute(key)
    old_slots = w.device.match(key, touch=False).kv_values
    assert old.prefix_len == 0
    w.evict(leaf)
    for layer in range(LAYERS):  # the freed slots get overwritten by other work
        w.k[layer][old_slots] = 0.0
        w.v[layer][old_slots] = 0.0
    hit = w.host.match(key)
    assert hit.prefix_len == 3
    new_slots = [40, 41, 42]
    w.host.restore(hit.kv_values, new_slots)
    for layer in range(LAYERS):
        expected = 1000 * layer + torch.tensor(old_slots, dtype=torch.float)
        assert torch.equal(w.k[layer][new_slots, 0, 0], expected)
        assert torch.equal(w.v[layer][new_slots, 1, 3], -expected)
    assert w.host.counters.restored_tokens == 3 and w.host.used_tokens == 3  # inclusive: the host copy stays
    w.check()


def test_full_host_drops_least_recently_used_leaf_never_the_path_being_written():
    w = World(capacity=6)
    first, second = MatchKey(NS, None, [1, 2, 3]), MatchKey(NS, None, [5, 6, 7])
    w.evict(w.compute(first))
    w.evict(w.compute(second))
    assert w.host.used_tokens == 6
    w.host.match(first)  # first is now the more recently used
    third = MatchKey(NS, None, [1, 2, 3, 4, 9, 9])  # shares [1 2 3] on the host: needs 3 new tokens
    w.evict(w.compute(third))
    assert w.host.match(second, touch=False).prefix_len == 0, "the least recently used leaf goes first"
    assert w.host.match(third, touch=False).prefix_len == 6, "the path being written is never dropped"
    assert w.host.counters.dropped_tokens == 3 and w.host.counters.dropped_runs == 1
    assert w.store.num_used == 6
    w.check()


def test_spill_refused_when_every_host_run_is_pinned():
    w = World(capacity=4)
    key = MatchKey(NS, None, [1, 2, 3, 4])
    w.evict(w.compute(key))
    hit = w.host.match(key)
    w.host.lock(hit.last_node)  # a restore in progress
    w.evict(w.compute(MatchKey(NS, None, [8, 9])))
    assert w.host.counters.refused_spills == 1 and w.host.used_tokens == 4
    w.host.unlock(hit.last_node)
    w.evict(w.compute(MatchKey(NS, None, [8, 9])))
    assert w.host.match(MatchKey(NS, None, [8, 9]), touch=False).prefix_len == 2
    w.check()


def test_a_path_longer_than_the_whole_host_tier_is_refused_and_nothing_leaks():
    w = World(capacity=4)
    small = MatchKey(NS, None, [1, 2])
    w.evict(w.compute(small))
    w.evict(w.compute(MatchKey(NS, None, [5, 6, 7, 8, 9, 10])))  # 6 tokens: more than the tier holds
    assert w.host.counters.refused_spills == 1
    assert w.host.used_tokens == 2 == w.store.num_used, "refused before dropping anything, nothing kept half"
    assert w.host.counters.dropped_tokens == 0
    w.check()
    w.evict(w.compute(small))  # the tier works on
    assert w.host.match(small, touch=False).prefix_len == 2
    w.check()


def test_host_keys_keep_adapters_namespaces_and_alora_suffixes_apart():
    w = World(capacity=64)
    prompt = [5, 6, 7, 9, 4]
    w.evict(w.compute(MatchKey(NS, A, prompt)))
    w.evict(w.compute(MatchKey(NS, X, prompt, alora_start=3)))  # base [5 6 7], X's suffix [9 4]
    assert w.host.match(MatchKey(NS, A, prompt), touch=False).prefix_len == 5
    assert w.host.match(MatchKey(NS, B, prompt), touch=False).prefix_len == 0, "another adapter's KV"
    assert w.host.match(MatchKey(OTHER_NS, A, prompt), touch=False).prefix_len == 0, "another tenant's KV"
    assert w.host.match(MatchKey(NS, None, prompt), touch=False).prefix_len == 3, "base reads the base prefix only"
    assert w.host.match(MatchKey(NS, X, prompt, alora_start=3), touch=False).prefix_len == 5
    assert w.host.match(MatchKey(NS, X, prompt, alora_start=2), touch=False).prefix_len == 2, "another start"
    w.check()


def test_path_key_of_an_alora_suffix_is_the_request_key():
    w = World(capacity=64)
    key = MatchKey(NS, X, [5, 6, 7, 9, 4, 1], alora_start=3)
    leaf = w.compute(key)
    got, values = path_key(leaf)
    assert (got.namespace, got.adapter, tuple(got.token_ids), got.alora_start) == (NS, X, (5, 6, 7, 9, 4, 1), 3)
    assert values == w.device.match(key, touch=False).kv_values


def test_removing_an_adapter_drops_its_host_kv_and_suffixes_only():
    w = World(capacity=64)
    prompt = [5, 6, 7, 9, 4]
    for key in (MatchKey(NS, A, prompt), MatchKey(OTHER_NS, A, [3, 3]), MatchKey(NS, X, prompt, alora_start=3),
                MatchKey(NS, None, [5, 6, 7, 8])):
        w.evict(w.compute(key))
    assert w.host.remove_adapter(A.identity) == 7  # both namespaces
    assert w.host.remove_adapter(X.identity) == 2  # the suffix [9 4]; base [5 6 7] stays
    assert w.host.match(MatchKey(NS, None, [5, 6, 7, 8]), touch=False).prefix_len == 4
    assert w.host.used_tokens == 4 == w.store.num_used
    w.check()


def test_clear_and_bad_capacity():
    w = World(capacity=8)
    w.evict(w.compute(MatchKey(NS, None, [1, 2, 3])))
    w.host.clear()
    assert w.host.used_tokens == 0 == w.store.num_used
    w.check()
    with pytest.raises(ValueError, match="positive capacity"):
        HostKVTier(0, bytes_per_token=8)
