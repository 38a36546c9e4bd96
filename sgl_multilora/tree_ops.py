"""Radix mechanics of `LoraRadixTree`: walking, inserting runs, splitting, lock propagation, leaf eviction.

Lives here: the private methods that edit nodes and keep the tree's size counters and leaf set in step.
Not here: the public API and its contracts (`tree.py`); nothing outside the tree calls these.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

from sgl_multilora.tree_nodes import AloraEdge, HitKind, MatchResult, Node, NodeKind

if TYPE_CHECKING:
    from sgl_multilora.tree import FreeFn

_KV = NodeKind.KV
_ADAPTER = NodeKind.ADAPTER


def common_len(key: tuple[int, ...], tokens: tuple[int, ...], pos: int, end: int, page_size: int) -> int:
    """Length of the common prefix of `key` and `tokens[pos:end]`, rounded down to whole pages."""
    n = min(len(key), end - pos)
    if (key if n == len(key) else key[:n]) == tokens[pos:pos + n]:
        m = n  # the common case, compared at C speed
    else:
        m = 0
        while key[m] == tokens[pos + m]:
            m += 1
    return m - m % page_size


class RadixOps:
    """Mixin holding the node-editing internals; `LoraRadixTree` supplies the state they keep in step:
    `page_size`, `_next_id`, `_leaves`, `_evictable_len`, `_protected_len`, `_num_kv_nodes`, counters."""

    page_size: int
    _next_id: int
    _leaves: set[Node]
    _evictable_len: int
    _protected_len: int
    _num_kv_nodes: int
    _num_matches: int
    _hits: dict[str, int]
    _hit_tokens: dict[str, int]
    _num_evicted_runs: int
    _num_evicted_tokens: int

    def _floor(self, num_tokens: int) -> int:
        return num_tokens - num_tokens % self.page_size

    def _child_key(self, tokens: tuple[int, ...], pos: int) -> Hashable:
        return tokens[pos] if self.page_size == 1 else tokens[pos:pos + self.page_size]

    def _new_node(self, kind: NodeKind, parent: Node | None = None, edge: Hashable = None,
                  label: object = None) -> Node:
        node = Node(kind, self._next_id, parent=parent, edge=edge, label=label)
        self._next_id += 1
        if parent is not None:
            parent.children[edge] = node
        return node

    def _descend(self, node: Node, tokens: tuple[int, ...], pos: int, end: int, out: list[int],
                 now: float | None, kind: HitKind, edge: tuple[str, int] | None = None,
                 ) -> tuple[Node, int, bool]:
        """Follows `tokens[pos:end]` down from `node`, appending matched slot ids to `out`.

        `edge = (identity, offset)` makes the first step follow an aLoRA suffix edge. Returns the node holding
        the last matched token (or `node`), the position reached, and whether it is the end of that node's run.
        Changes no structure; with `now` set it records the access on each node passed.
        """
        page_size = self.page_size
        while pos < end:
            ck = tokens[pos] if page_size == 1 else tokens[pos:pos + page_size]
            if edge is not None:
                ck, edge = AloraEdge(edge[0], edge[1], ck), None
            child = node.children.get(ck)
            if child is None:
                break
            run = child.key
            m = common_len(run, tokens, pos, end, page_size)
            if now is not None:
                child.last_access = now
                child.hits[kind] = child.hits.get(kind, 0) + 1
            node, pos = child, pos + m
            if m < len(run):
                out.extend(child.value[:m])
                return node, pos, False
            out.extend(child.value)
        return node, pos, True

    def _result(self, out: list[int], node: Node, regions: list[tuple[HitKind, int]],
                touch: bool) -> MatchResult:
        hit_kind = None
        for kind, num_tokens in regions:
            if num_tokens:
                hit_kind = kind
                if touch:
                    self._hits[kind] += 1
                    self._hit_tokens[kind] += num_tokens
        if touch:
            self._num_matches += 1
        return MatchResult(len(out), out, node, hit_kind)

    def _insert_run(self, node: Node, tokens: tuple[int, ...], vals: list[int], pos: int, end: int,
                    now: float, alora: tuple[Node, int] | None = None) -> tuple[Node, int]:
        """Inserts `tokens[pos:end]` below `node`; returns (node holding the last token, tokens present).

        `alora = (adapter_node, offset)` keys the first step by an `AloraEdge` and makes a new first node
        depend on the adapter node.
        """
        start = pos
        while pos < end:
            ck = self._child_key(tokens, pos)
            depends_on = None
            if alora is not None:
                depends_on, offset = alora
                ck, alora = AloraEdge(depends_on.label.identity, offset, ck), None
            child = node.children.get(ck)
            if child is None:
                node = self._add_kv(node, ck, tokens[pos:end], vals[pos:end], now, depends_on)
                return node, pos - start
            m = common_len(child.key, tokens, pos, end, self.page_size)
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = now
            node, pos = child, pos + m
        return node, pos - start

    def _add_kv(self, parent: Node, edge: Hashable, key: tuple[int, ...], value: list[int], now: float,
                depends_on: Node | None) -> Node:
        node = Node(_KV, self._next_id, key, value, parent, edge, last_access=now, depends_on=depends_on)
        self._next_id += 1
        if parent.kind is _KV and not parent.children:
            self._leaves.discard(parent)
        parent.children[edge] = node
        self._leaves.add(node)
        self._evictable_len += len(key)
        self._num_kv_nodes += 1
        if depends_on is not None:
            depends_on.dependents.add(node)
        return node

    def _split(self, child: Node, m: int) -> Node:
        """Cuts `child`'s run after `m` tokens; returns the new upper node.

        The original object keeps the tail, so a lock held on it (a request's last node) still covers the
        same tokens; the upper node copies its lock count, access time, hits and aLoRA dependency.
        """
        parent = child.parent
        upper = Node(_KV, self._next_id, child.key[:m], child.value[:m], parent, child.edge,
                     lock_ref=child.lock_ref, last_access=child.last_access,
                     depends_on=child.depends_on, hits=dict(child.hits))
        self._next_id += 1
        parent.children[child.edge] = upper
        if child.depends_on is not None:
            dependents = child.depends_on.dependents
            dependents.discard(child)
            dependents.add(upper)
            child.depends_on = None
        child.key, child.value, child.parent = child.key[m:], child.value[m:], upper
        child.edge = self._child_key(child.key, 0)
        upper.children[child.edge] = child
        self._num_kv_nodes += 1
        return upper

    def _add_lock(self, node: Node, delta: int) -> None:
        """Adds `delta` (+1 / -1) to the lock count of `node`, its KV ancestors and the adapters they need."""
        while node.kind is _KV:
            n = len(node.key)
            if delta > 0:
                if node.lock_ref == 0:
                    self._evictable_len -= n
                    self._protected_len += n
                node.lock_ref += 1
            else:
                node.lock_ref -= 1
                assert node.lock_ref >= 0, f"unlock without lock on {node}"
                if node.lock_ref == 0:
                    self._evictable_len += n
                    self._protected_len -= n
            if node.depends_on is not None:
                self._add_lock(node.depends_on, delta)
            node = node.parent
        if node.kind is _ADAPTER:
            node.lock_ref += delta
            assert node.lock_ref >= 0, f"unlock without lock on adapter {node}"

    def _evict_leaf(self, node: Node, free_fn: FreeFn) -> int:
        assert node.lock_ref == 0, f"evicting locked {node}: a lock count fell out of step"
        assert not node.children, f"evicting {node} with children: its dependents would be orphaned"
        parent, values = node.parent, node.value
        del parent.children[node.edge]
        self._leaves.discard(node)
        if parent.kind is _KV and not parent.children:
            self._leaves.add(parent)
        if node.depends_on is not None:
            node.depends_on.dependents.discard(node)
            node.depends_on = None
        num_tokens = len(values)
        self._evictable_len -= num_tokens
        self._num_kv_nodes -= 1
        self._num_evicted_runs += 1
        self._num_evicted_tokens += num_tokens
        node.value = None
        node.parent = None
        free_fn(values)
        return num_tokens

    def _evict_subtree(self, top: Node, free_fn: FreeFn) -> int:
        """Evicts `top` and everything below it, children before parents."""
        order, stack = [], [top]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        return sum(self._evict_leaf(node, free_fn) for node in reversed(order))
