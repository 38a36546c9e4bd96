"""Random insert / match / lock / unlock / evict / remove_adapter runs against a brute-force model.

The model stores one cell per cached token, keyed by everything that determines that token's KV:
- base KV (base requests, and aLoRA tokens before the activation page): ("base", ns, page_prefix);
- standard LoRA KV: ("lora", ns, identity, page_prefix);
- aLoRA suffix KV: ("alora", ns, identity, k, page_prefix),
where page_prefix = (tokens up to the end of the page holding token i, i): the tree caches whole
pages. Slot ids are unique, so every slot the tree frees names exactly one cell. A match must return
exactly the leading cells of its key that the model holds, which pins isolation: a request never
gets KV cached under another namespace, adapter or activation start.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sgl_multilora.keys import AdapterRef, MatchKey, Namespace
from sgl_multilora.tree import LoraRadixTree

# namespace strings that would collide if joined (and an extra_key equal to an adapter identity)
NAMESPACES = [
    Namespace("m", cache_salt="bc", extra_key="a"),
    Namespace("m", cache_salt="c", extra_key="ab"),
]
A, B, X = AdapterRef("a"), AdapterRef("ab"), AdapterRef("bc")  # X: an aLoRA (and sometimes not)
ADAPTER_CHOICES = [None, A, B, X, "X as aLoRA"]


def cell_keys(key: MatchKey, page_size: int) -> list[tuple]:
    tokens = tuple(key.token_ids)
    n, k = len(tokens), key.alora_start
    anchor = None if k is None or n <= k else k - k % page_size
    cells = []
    for i in range(n):
        prefix = (tokens[: i + 1 - i % page_size + page_size - 1], i)  # the page holding token i
        if key.adapter is None or (k is not None and (anchor is None or i < anchor)):
            cells.append(("base", key.namespace, prefix))
        elif k is None:
            cells.append(("lora", key.namespace, key.adapter.identity, prefix))
        else:
            cells.append(("alora", key.namespace, key.adapter.identity, k, prefix))
    return cells


def draw_key(data, page_size: int, previous: list[MatchKey]) -> MatchKey:
    """Over 2 namespaces x {base, A, B, X as a LoRA, X as an aLoRA}, tokens in {0, 1, 2}. Mostly a
    variation of an earlier key (trimmed and extended, sometimes with another namespace, adapter or
    activation start), so hits and near-collisions are common."""
    draw = data.draw
    if previous and draw(st.integers(0, 3)) > 0:
        prev = draw(st.sampled_from(previous))
        tokens = list(prev.token_ids)[: max(0, len(prev.token_ids) - draw(st.integers(0, 3)))]
        tokens = _whole_pages(tokens + draw(st.lists(st.integers(0, 2), max_size=3)), page_size)
        ns = prev.namespace if draw(st.integers(0, 3)) else draw(st.sampled_from(NAMESPACES))
        if draw(st.integers(0, 3)):
            return MatchKey(ns, prev.adapter, tokens, prev.alora_start)
    else:
        ns = draw(st.sampled_from(NAMESPACES))
        tokens = _whole_pages(draw(st.lists(st.integers(0, 2), max_size=8)), page_size)
    choice = draw(st.sampled_from(ADAPTER_CHOICES))
    if choice == "X as aLoRA":
        return MatchKey(ns, X, tokens, alora_start=draw(st.integers(0, len(tokens) + 1)))
    return MatchKey(ns, choice, tokens)


def _whole_pages(tokens: list[int], page_size: int) -> list[int]:
    return tokens[: len(tokens) - len(tokens) % page_size]


class TreeMachine(RuleBasedStateMachine):
    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        ticks = itertools.count()
        self.tree = LoraRadixTree(page_size=self.page_size, clock=lambda: next(ticks))
        self.cells: dict[tuple, int] = {}
        self.cell_of_slot: dict[int, tuple] = {}
        self.next_slot = 0
        self.held = []  # locked nodes, one entry per lock
        self.inserted: list[MatchKey] = []

    def free(self, slots: list[int]) -> None:
        for slot in slots:
            assert slot in self.cell_of_slot, f"tree freed slot {slot} it never owned"
            del self.cells[self.cell_of_slot.pop(slot)]

    def expected(self, key: MatchKey) -> list[int]:
        n = len(key.token_ids)
        found = []
        for cell in cell_keys(key, self.page_size)[: n - n % self.page_size]:
            if cell not in self.cells:
                break
            found.append(self.cells[cell])
        return found[: len(found) - len(found) % self.page_size]

    def insert_key(self, key: MatchKey, lock: bool) -> None:
        present = self.expected(key)
        assert self.tree.match(key, touch=False).kv_values == present  # check, then act
        values = list(range(self.next_slot, self.next_slot + len(key.token_ids)))
        self.next_slot += len(values)
        result = self.tree.insert(key, values)
        self.inserted.append(key)
        assert result.prefix_len == len(present)
        new_cells = cell_keys(key, self.page_size)[result.prefix_len:]
        for cell, slot in zip(new_cells, values[result.prefix_len:]):
            assert cell not in self.cells, f"cell {cell} cached twice"
            self.cells[cell] = slot
            self.cell_of_slot[slot] = cell
        if lock:
            self.tree.lock(result.last_node)
            self.held.append(result.last_node)

    def match_key(self, key: MatchKey, lock: bool, touch: bool) -> None:
        result = self.tree.match(key, touch=touch)
        expected = self.expected(key)
        assert result.kv_values == expected, f"{key} got {result.kv_values}, cached {expected}"
        assert result.prefix_len == len(expected)
        assert (result.hit_kind is None) == (result.prefix_len == 0)
        if lock:
            self.tree.lock(result.last_node)
            self.held.append(result.last_node)

    @rule(data=st.data(), lock=st.booleans())
    def insert(self, data, lock: bool) -> None:
        self.insert_key(draw_key(data, self.page_size, self.inserted), lock)

    @rule(data=st.data(), lock=st.booleans(), touch=st.booleans())
    def match(self, data, lock: bool, touch: bool) -> None:
        self.match_key(draw_key(data, self.page_size, self.inserted), lock, touch)

    @precondition(lambda self: self.inserted)
    @rule(data=st.data(), lock=st.booleans(),
          extra=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def alora_turn(self, data, lock: bool, extra: list[int]) -> None:
        """A pipeline turn: X checks an earlier conversation (k = its length), then it repeats."""
        prev = data.draw(st.sampled_from(self.inserted))
        tokens = _whole_pages(list(prev.token_ids) + extra, self.page_size)
        key = MatchKey(prev.namespace, X, tokens, alora_start=len(prev.token_ids))
        self.insert_key(key, lock)
        again = MatchKey(key.namespace, X, tokens + extra, key.alora_start)
        self.match_key(again, lock=False, touch=True)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def unlock(self, data) -> None:
        node = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.tree.unlock(node)

    @rule(num_tokens=st.integers(0, 8))
    def evict(self, num_tokens: int) -> None:
        freed: list[list[int]] = []
        evictable = self.tree.evictable_len()
        num_evicted = self.tree.evict(num_tokens, freed.append)
        for run in freed:
            self.free(run)
        assert num_evicted == sum(map(len, freed))
        assert num_evicted >= min(num_tokens, evictable), (
            "evict stopped while unlocked leaves remained")
        assert all(not node.is_evicted for node in self.held), "a locked node was evicted"

    @rule(ns=st.sampled_from(NAMESPACES), adapter=st.sampled_from([A, B, X]))
    def remove_adapter(self, ns: Namespace, adapter: AdapterRef) -> None:
        node = self.tree.adapter_node(ns, adapter)
        freed: list[list[int]] = []
        if node is None:
            with pytest.raises(KeyError):
                self.tree.remove_adapter(ns, adapter, freed.append)
            return
        locked = node.lock_ref > 0
        before = dict(self.cells)
        result = self.tree.remove_adapter(ns, adapter, freed.append)
        for run in freed:
            self.free(run)
        if locked:
            assert result is None and self.cells == before
            return
        assert result == sum(map(len, freed))
        left = [c for c in self.cells if c[0] != "base" and c[1] == ns and c[2] == adapter.identity]
        assert not left, f"removing {adapter} left its KV cached: {left[:3]}"

    @invariant()
    def consistent(self) -> None:
        self.tree.check_invariants()
        assert self.tree.total_len() == len(self.cells)


class PagedTreeMachine(TreeMachine):
    page_size = 2


SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
TestTree = TreeMachine.TestCase
TestTree.settings = SETTINGS
TestPagedTree = PagedTreeMachine.TestCase
TestPagedTree.settings = SETTINGS
