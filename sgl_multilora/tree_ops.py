"""`NodeStore`: the one owner of the radix tree's nodes and of the bookkeeping that moves with them.

Lives here: creating, walking, splitting, locking and evicting nodes, and the state every such edit
keeps in step (id counter, leaf set, evictable / protected token lengths, node counts, eviction
counters). Not here: what a key means (namespaces, adapters, aLoRA activation), the eviction order
and hit statistics (`tree.py`), and the invariant checker (`tree_check.py`, which reads this class's
read-only view).

Why a member object, not a mixin or free functions: the leaf set and the length counters are right
only if every edit updates them, so the edits and that state live in one class and nothing else
writes either. Free functions would take the same six pieces of state on every call, and a mixin
would keep them in another class's attributes. `LoraRadixTree` holds one `NodeStore` and asks it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from sgl_multilora.keys import AdapterRef, Namespace
from sgl_multilora.tree_nodes import AloraEdge, FreeFn, HitKind, Node, NodeKind

_KV = NodeKind.KV
_ADAPTER = NodeKind.ADAPTER


def common_len(key: Sequence[int], tokens: Sequence[int], pos: int, end: int,
               page_size: int) -> int:
    """Length of the common prefix of `key` and `tokens[pos:end]`, rounded down to whole pages.

    `key` and `tokens` are tuples or `array('q')`s; slices of one type compare at C speed, so the
    first divergence is found by galloping then bisecting over slice comparisons (no per-token loop).
    Mixed types never compare equal as slices, so they fall back to comparing token by token.
    """
    n = min(len(key), end - pos)
    if type(key) is not type(tokens):
        m = 0
        while m < n and key[m] == tokens[pos + m]:
            m += 1
        return m - m % page_size
    if (key if n == len(key) else key[:n]) == tokens[pos:pos + n]:
        return n - n % page_size  # the common case: one comparison
    lo, step = 0, 1  # key[:lo] matches; the divergence lies in [lo, n)
    while True:
        hi = min(lo + step, n)
        if key[lo:hi] != tokens[pos + lo:pos + hi]:
            break
        lo, step = hi, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if key[lo:mid] == tokens[pos + lo:pos + mid]:
            lo = mid
        else:
            hi = mid
    return lo - lo % page_size


def child_key(tokens: Sequence[int], pos: int, page_size: int) -> Hashable:
    """Key of a run starting at `tokens[pos]` in its parent's children: a token or a page tuple."""
    if page_size == 1:
        return tokens[pos]
    page = tokens[pos:pos + page_size]
    return page if type(page) is tuple else tuple(page)


def take_values(vals: Sequence[int], start: int, end: int) -> tuple[list[int], object]:
    """(list, cache) of `vals[start:end]`: a list slice and no cache, or for a tensor-like (anything
    with `tolist`) the slice's list and an owned copy of the slice, kept as the node's `value_cache`."""
    piece = vals[start:end]
    if hasattr(piece, "tolist"):
        return piece.tolist(), own_slice(piece)
    return (piece if type(piece) is list else list(piece)), None


def own_slice(piece: object) -> object:
    """`piece` with storage of its own when it has `clone` (a tensor slice is a view: without the copy
    a short run would keep a whole request's row, or the evicted half of a split run, alive)."""
    clone = getattr(piece, "clone", None)
    return piece if clone is None else clone()


class NodeStore:
    """Owns every node of one tree, from the root down; only its methods change a node.

    Lengths count tokens; a KV node's value holds one slot id per token. Callers may read the nodes
    it returns (live objects) but never write them, or the leaf set and the lengths would drift.
    """

    def __init__(self, page_size: int) -> None:
        self._page_size = page_size
        self._next_id = 0
        self._root = self._new_node(NodeKind.ROOT)
        self._leaves: set[Node] = set()  # KV nodes without children, locked or not
        self._evictable_len = 0
        self._protected_len = 0
        self._num_kv_nodes = 0
        self._num_adapter_nodes = 0
        self._num_evicted_runs = 0
        self._num_evicted_tokens = 0

    # ---- read-only view --------------------------------------------------------------------------

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def root(self) -> Node:
        return self._root

    @property
    def evictable_len(self) -> int:
        """Tokens in unlocked KV nodes."""
        return self._evictable_len

    @property
    def protected_len(self) -> int:
        """Tokens in locked KV nodes."""
        return self._protected_len

    @property
    def total_len(self) -> int:
        return self._evictable_len + self._protected_len

    @property
    def num_kv_nodes(self) -> int:
        return self._num_kv_nodes

    @property
    def num_adapter_nodes(self) -> int:
        return self._num_adapter_nodes

    @property
    def num_evicted_runs(self) -> int:
        return self._num_evicted_runs

    @property
    def num_evicted_tokens(self) -> int:
        return self._num_evicted_tokens

    def leaves(self) -> frozenset[Node]:
        """Every KV node without children, locked or not (a snapshot, O(leaves))."""
        return frozenset(self._leaves)

    def evictable_leaves(self) -> list[Node]:
        """The unlocked KV leaves (a snapshot, in no particular order)."""
        return [n for n in self._leaves if n.lock_ref == 0]

    def is_evictable_leaf(self, node: Node) -> bool:
        """True for an attached, unlocked KV leaf of this store."""
        return node in self._leaves and node.lock_ref == 0

    # ---- structural nodes ------------------------------------------------------------------------

    def add_namespace(self, namespace: Namespace) -> Node:
        """Creates the namespace node (depth 1) and its base node. The namespace must be absent."""
        assert namespace not in self._root.children, f"namespace {namespace!r} added twice"
        ns_node = self._new_node(NodeKind.NAMESPACE, self._root, namespace, namespace)
        self._new_node(NodeKind.BASE, ns_node, None, namespace)
        return ns_node

    def add_adapter(self, ns_node: Node, adapter: AdapterRef, now: float) -> Node:
        """Creates the (absent) adapter node below `ns_node`, at depth 2, last accessed at `now`."""
        assert adapter.identity not in ns_node.children, f"adapter {adapter!r} added twice"
        node = self._new_node(_ADAPTER, ns_node, adapter.identity, adapter)
        node.dependents = set()
        node.last_access = now
        self._num_adapter_nodes += 1
        return node

    def remove_adapter(self, node: Node, free_fn: FreeFn) -> int:
        """Evicts the adapter's own KV subtree and its aLoRA suffixes (slots to `free_fn`), then
        detaches the node; returns the tokens freed. The caller has checked `node.lock_ref == 0`."""
        assert node.kind is _ADAPTER and node.lock_ref == 0, (
            f"removing locked or non-adapter {node}")
        freed = 0
        for top in [*node.children.values(), *node.dependents]:
            freed += self._evict_subtree(top, free_fn)
        del node.parent.children[node.edge]
        node.parent = None
        self._num_adapter_nodes -= 1
        return freed

    def touch(self, node: Node, now: float) -> None:
        """Records an access to `node` at `now` (its last-access time only)."""
        node.last_access = now

    # ---- walks -----------------------------------------------------------------------------------

    def descend(self, node: Node, tokens: Sequence[int], pos: int, end: int, out: list[int],
                now: float | None, kind: HitKind, edge: tuple[str, int] | None = None,
                ) -> tuple[Node, int, bool]:
        """Follows `tokens[pos:end]` down from `node`, appending matched slot ids to `out`.

        `edge = (identity, offset)` makes the first step follow an aLoRA suffix edge. Returns the
        node holding the last matched token (or `node`), the position reached, and whether it is the
        end of that node's run. Changes no structure; with `now` set it records the access (time,
        `hits[kind]`) on each node passed.
        """
        page_size = self._page_size
        while pos < end:
            ck = tokens[pos] if page_size == 1 else child_key(tokens, pos, page_size)
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

    def insert_run(self, node: Node, tokens: Sequence[int], vals: Sequence[int], pos: int, end: int,
                   now: float, alora: tuple[Node, int] | None = None) -> tuple[Node, int]:
        """Inserts `tokens[pos:end]` below `node`; returns (last node, tokens already present).

        Takes ownership of `vals[pos + present:end]` (`take_values`: a tensor-like is converted only
        there and kept as the new node's `value_cache`); splits a run where the key diverges inside it.
        `alora = (adapter_node, offset)` keys the first step by an `AloraEdge` and makes a new first
        node depend on the adapter node.
        """
        start = pos
        while pos < end:
            ck = child_key(tokens, pos, self._page_size)
            depends_on = None
            if alora is not None:
                depends_on, offset = alora
                ck, alora = AloraEdge(depends_on.label.identity, offset, ck), None
            child = node.children.get(ck)
            if child is None:
                value, cache = take_values(vals, pos, end)
                node = self._add_kv(node, ck, tokens[pos:end], value, now, depends_on)
                node.value_cache = cache
                return node, pos - start
            m = common_len(child.key, tokens, pos, end, self._page_size)
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = now
            node, pos = child, pos + m
        return node, pos - start

    # ---- locks and eviction ----------------------------------------------------------------------

    def add_lock(self, node: Node, delta: int) -> None:
        """Adds `delta` (+1 / -1) to the lock count of `node`, its KV ancestors and the adapters
        they need, moving tokens between evictable and protected. Asserts no count goes negative."""
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
                self.add_lock(node.depends_on, delta)
            node = node.parent
        if node.kind is _ADAPTER:
            node.lock_ref += delta
            assert node.lock_ref >= 0, f"unlock without lock on adapter {node}"

    def evict_leaf(self, node: Node, free_fn: FreeFn) -> int:
        """Detaches an unlocked KV leaf, gives its slots to `free_fn` and returns its tokens.

        `free_fn` gets the node's `value_cache` when it has one, else its list (see `FreeFn`). The
        node keeps `value None` and must not be used again; a parent left childless becomes a leaf."""
        assert node.lock_ref == 0, f"evicting locked {node}: a lock count fell out of step"
        assert not node.children, f"evicting {node} with children: its dependents would be orphaned"
        parent, values, cache = node.parent, node.value, node.value_cache
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
        node.value = node.value_cache = None
        node.parent = None
        free_fn(values if cache is None else cache)
        return num_tokens

    def remap_values(self, mapping: dict[int, int], form: Callable[[list[int]], object] | None) -> int:
        """Rewrites slot ids through `mapping` (old -> new; ids it does not name stay) in every KV node: a node
        whose ids change gets a new list and, if it kept a `value_cache`, `form(new list)` (None without a form).
        Returns the nodes changed. Keys, lengths, locks and the leaf set do not change. O(cached tokens)."""
        changed, moved = 0, mapping.keys()
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.kind is not _KV or moved.isdisjoint(node.value):
                continue
            node.value = [mapping.get(v, v) for v in node.value]
            if node.value_cache is not None:
                node.value_cache = None if form is None else form(node.value)
            changed += 1
        return changed

    # ---- private edits ---------------------------------------------------------------------------

    def _new_node(self, kind: NodeKind, parent: Node | None = None, edge: Hashable = None,
                  label: object = None) -> Node:
        node = Node(kind, self._next_id, parent=parent, edge=edge, label=label)
        self._next_id += 1
        if parent is not None:
            parent.children[edge] = node
        return node

    def _add_kv(self, parent: Node, edge: Hashable, key: Sequence[int], value: list[int],
                now: float, depends_on: Node | None) -> Node:
        node = Node(_KV, self._next_id, key, value, parent, edge, last_access=now,
                    depends_on=depends_on)
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

        The original object keeps the tail, so a lock held on it (a request's last node) still
        covers the same tokens; the upper node copies its lock count, access time, hits and aLoRA
        dependency.
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
        cache = child.value_cache
        if cache is not None:
            upper.value_cache, child.value_cache = own_slice(cache[:m]), own_slice(cache[m:])
        child.key, child.value, child.parent = child.key[m:], child.value[m:], upper
        child.edge = child_key(child.key, 0, self._page_size)
        upper.children[child.edge] = child
        self._num_kv_nodes += 1
        return upper

    def _evict_subtree(self, top: Node, free_fn: FreeFn) -> int:
        """Evicts `top` and everything below it, children before parents."""
        order, stack = [], [top]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        return sum(self.evict_leaf(node, free_fn) for node in reversed(order))
