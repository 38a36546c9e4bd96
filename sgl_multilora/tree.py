"""The LoRA-aware radix tree: a prefix cache of KV slot ids, keyed by namespace, adapter and tokens.

Lives here: the public API (match / insert / lock / unlock / evict, adapter nodes), what a key
means, the eviction order and hit statistics, over plain Python ints (slot ids).
Not here: the node records (`tree_nodes.py`), node edits and their bookkeeping
(`tree_ops.NodeStore`, held as a member), the invariant checker (`tree_check.py`), the memory pool
that owns the slots, other policies (`policy/`) and SGLang (`patches/`).
Layers, none importing upward: keys -> tree_nodes -> tree_ops -> tree_check -> tree.

```
root
 └─ namespace (depth 1): one per Namespace(base_model, cache_salt, extra_key)
     ├─ base (depth 2): the no-adapter node; base KV hangs below it
     │   └─ KV [5 6 7] ─┬─ KV [8 9]                  base continues (child key: token 8)
     │                  └─ KV [9 4]  aLoRA X suffix  (child key: AloraEdge(X, 0, 9); depends on X)
     ├─ adapter A (depth 2, keyed by A's content hash): A's KV hangs below it
     │   └─ KV [5 6 7 8 9]
     └─ adapter X (depth 2, an aLoRA): no KV below it; its suffixes hang in the base subtree
```

Isolation. A request's key is `MatchKey(namespace, adapter, token_ids, alora_start)` and every
component picks a separate dictionary level, so two requests share KV only if they agree on all of
them:
- depth 1 is a dict keyed by the frozen `Namespace` dataclass, compared field by field. No choice of
  `cache_salt` / `extra_key` strings can equal another namespace (`("a", "bc")` is not `("ab",
  "c")`), and an `extra_key` equal to an adapter's identity is just a namespace field: it never
  selects an adapter node. (Stock SGLang joins `extra_key + lora_id` into one string, so there such
  a base request hits the LoRA's KV.)
- depth 2 is keyed by `None` (base) or the adapter's identity, a content hash of config and weights;
  a name is never part of a key, so reloading new weights under an old name starts from an empty
  subtree.
- below depth 2 children are keyed by a token (page_size 1) or a page tuple; the only other key is
  `AloraEdge(identity, offset, first)`, which starts an aLoRA suffix and equals no token key, no
  other adapter's edge and no other activation offset. Base requests never follow an `AloraEdge`.
A standard LoRA reads only below its adapter node; an aLoRA reads base KV before its activation
start k and only its own suffix from k on, so cross-request sharing happens exactly where the KV is
provably equal.

Dependencies (ELORA's invariant): a resident KV node's parent chain is resident, and so is the
adapter node of an aLoRA suffix. Eviction takes leaves only, an adapter node goes only with
everything depending on it, and `lock` pins the whole chain including the adapter, so the invariant
holds after every call.
"""

from __future__ import annotations

import heapq
import time
from array import array
from collections.abc import Callable, Iterable, Sequence

from sgl_multilora.keys import AdapterRef, MatchKey, Namespace
from sgl_multilora.tree_check import check_tree
from sgl_multilora.tree_nodes import (
    FreeFn,
    HitKind,
    InsertResult,
    MatchResult,
    Node,
    NodeKind,
    ScoreFn,
    TreeStats,
    lru_score,
)
from sgl_multilora.tree_ops import NodeStore

__all__ = ["FreeFn", "LoraRadixTree"]

_KV = NodeKind.KV
_ADAPTER = NodeKind.ADAPTER


class LoraRadixTree:
    """The prefix cache. Its nodes and their bookkeeping belong to a private `NodeStore`; the tree
    decides which node a key reaches, what to evict first and what to count as a hit.

    Lengths (`*_len`) count tokens; values are KV slot ids, one per token.

    `page_size`: match lengths are multiples of it and inserted keys must be. `score(node, now)`
    orders eviction (lowest first, ties by creation order); it may be replaced between calls.
    `clock()` gives `now` for access times and scores.
    """

    def __init__(self, page_size: int = 1, score: ScoreFn = lru_score,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.score = score
        self.clock = clock
        self._store = NodeStore(page_size)
        self._num_matches = 0
        self._hits: dict[str, int] = {k.value: 0 for k in HitKind}
        self._hit_tokens: dict[str, int] = {k.value: 0 for k in HitKind}

    @property
    def page_size(self) -> int:
        return self._store.page_size

    @property
    def root(self) -> Node:
        """The root node (read-only: nodes are edited only through the tree's methods)."""
        return self._store.root

    # ---- structural nodes ------------------------------------------------------------------------

    def namespace_node(self, namespace: Namespace) -> Node | None:
        """The namespace node, or None. Does not modify the tree."""
        return self.root.children.get(namespace)

    def adapter_node(self, namespace: Namespace, adapter: AdapterRef) -> Node | None:
        """The resident adapter node, or None. Does not modify the tree."""
        ns_node = self.root.children.get(namespace)
        return None if ns_node is None else ns_node.children.get(adapter.identity)

    def ensure_namespace(self, namespace: Namespace) -> Node:
        """Returns the namespace node, creating it and its base node if absent. Raises TypeError for
        a key that is not a `Namespace`."""
        if not isinstance(namespace, Namespace):
            raise TypeError(f"namespace must be a Namespace, got {type(namespace).__name__}")
        ns_node = self.root.children.get(namespace)
        if ns_node is None:
            ns_node = self._store.add_namespace(namespace)
        return ns_node

    def ensure_adapter(self, namespace: Namespace, adapter: AdapterRef) -> Node:
        """Returns the adapter node (depth 2), creating it (and the namespace) if absent. Raises
        TypeError for an adapter that is not an `AdapterRef`."""
        if not isinstance(adapter, AdapterRef):
            raise TypeError(f"adapter must be an AdapterRef, got {type(adapter).__name__}")
        ns_node = self.ensure_namespace(namespace)
        node = ns_node.children.get(adapter.identity)
        if node is None:
            node = self._store.add_adapter(ns_node, adapter, self.clock())
        return node

    def remove_adapter(self, namespace: Namespace, adapter: AdapterRef,
                       free_fn: FreeFn) -> int | None:
        """Removes an adapter node and all KV that depends on it; returns the tokens freed.

        Dependents go first: the adapter's own KV subtree and every aLoRA suffix keyed by it are
        evicted (each run through `free_fn`), then the node itself. Returns None, changing nothing,
        while the adapter is locked (a running request uses it or its KV); since every lock on a
        dependent also locks the adapter, an unlocked adapter has no locked dependent. Raises
        KeyError if the adapter is not resident.
        """
        node = self.adapter_node(namespace, adapter)
        if node is None:
            raise KeyError(f"adapter {adapter!r} is not resident in {namespace!r}")
        if node.lock_ref > 0:
            return None
        return self._store.remove_adapter(node, free_fn)

    # ---- match and insert ------------------------------------------------------------------------

    def match(self, key: MatchKey, *, touch: bool = True) -> MatchResult:
        """Longest cached prefix of `key` (a multiple of page_size) and its KV slot ids.

        Never changes the tree's structure. With `touch` (the default) it records the access:
        last-access times on the matched path and the adapter node, hit counters. With `touch=False`
        it is a pure query. With the tree drawn in the module docstring, an aLoRA X request on
        [5 6 7 9 4 1] with k = 3 gets 5 tokens: [5 6 7] of base KV and [9 4] of X's suffix. When no
        suffix token matched, `last_node` lies in the base subtree and locking it does not pin X:
        lock `adapter_node(...)` too if the request needs it.
        """
        return self._match(key, touch, [])

    def _match(self, key: MatchKey, touch: bool, out: list[int]) -> MatchResult:
        """`match`, the matched slot ids appended to `out` (`_NO_VALUES` keeps none: a walk for the last node)."""
        store = self._store
        tokens = _as_tokens(key.token_ids)
        ns_node = store.root.children.get(key.namespace)
        if ns_node is None:
            return MatchResult(0, out, store.root, None)
        now = self.clock() if touch else None
        adapter = key.adapter
        end = self._floor(len(tokens))
        if adapter is not None and key.alora_start is None:
            start = ns_node.children.get(adapter.identity)
            if start is None:
                return MatchResult(0, [], ns_node, None)
            if now is not None:
                store.touch(start, now)
            node, pos, _ = store.descend(start, tokens, 0, end, out, now, HitKind.SAME_ADAPTER)
            return self._result(out, node, [(HitKind.SAME_ADAPTER, pos)], touch)
        base = ns_node.children[None]
        if adapter is None:
            node, pos, _ = store.descend(base, tokens, 0, end, out, now, HitKind.BASE)
            return self._result(out, node, [(HitKind.BASE, pos)], touch)
        adapter_node = ns_node.children.get(adapter.identity)
        if now is not None and adapter_node is not None:
            store.touch(adapter_node, now)
        k = key.alora_start
        base_end = end if len(tokens) <= k else self._floor(k)
        node, pos, boundary = store.descend(base, tokens, 0, base_end, out, now,
                                            HitKind.ALORA_BASE_PREFIX)
        regions = [(HitKind.ALORA_BASE_PREFIX, pos)]
        if len(tokens) > k and pos == base_end and boundary and adapter_node is not None:
            edge = (adapter.identity, k - base_end)
            suffix_node, end_pos, _ = store.descend(node, tokens, pos, end, out, now,
                                                    HitKind.ALORA_SUFFIX, edge)
            if end_pos > pos:
                regions.append((HitKind.ALORA_SUFFIX, end_pos - pos))
                node = suffix_node
        return self._result(out, node, regions, touch)

    def insert(self, key: MatchKey, values: Sequence[int]) -> InsertResult:
        """Caches `values` (one KV slot id per token of `key.token_ids`) under `key`.

        Must hold: `len(values) == len(key.token_ids)`, a multiple of page_size (ValueError
        otherwise). Creates the namespace and adapter nodes it needs: the caller just computed this
        KV with the adapter, so it is loaded. Splits nodes where the key diverges. See
        `InsertResult` for who frees which slots. `values` may be a tensor-like (with `tolist`,
        e.g. int64): then only the slices the tree takes are converted, and each new node keeps its
        slice as `value_cache` (freed in that form: see `FreeFn`). The tree never writes `values`.
        """
        store = self._store
        tokens = _as_tokens(key.token_ids)
        vals = values if hasattr(values, "tolist") or type(values) in (list, tuple) else list(values)
        n = len(tokens)
        if len(vals) != n:
            raise ValueError(f"insert needs one value per token: {n} tokens, {len(vals)} values")
        if n % self.page_size:
            raise ValueError(f"insert length {n} is not a multiple of page_size {self.page_size}")
        now = self.clock()
        ns_node = self.ensure_namespace(key.namespace)
        adapter = key.adapter
        if adapter is not None and key.alora_start is None:
            start = self.ensure_adapter(key.namespace, adapter)
            store.touch(start, now)
            node, present = store.insert_run(start, tokens, vals, 0, n, now)
            return InsertResult(present, node)
        base = ns_node.children[None]
        k = key.alora_start
        if adapter is None or n <= k:
            node, present = store.insert_run(base, tokens, vals, 0, n, now)
            return InsertResult(present, node)
        adapter_node = self.ensure_adapter(key.namespace, adapter)
        store.touch(adapter_node, now)
        anchor_pos = self._floor(k)
        anchor, present = store.insert_run(base, tokens, vals, 0, anchor_pos, now)
        node, suffix_present = store.insert_run(anchor, tokens, vals, anchor_pos, n, now,
                                                (adapter_node, k - anchor_pos))
        return InsertResult(present + suffix_present, node)

    # ---- locks and eviction ----------------------------------------------------------------------

    def lock(self, node: Node) -> None:
        """Pins `node`, its KV ancestors and the adapter nodes they belong to or depend on (aLoRA).

        Locked KV is never evicted and a locked adapter is never removed. A no-op on ROOT, NAMESPACE
        and BASE. Every `lock` must be paired with one `unlock` of the same node. Asserts `node` is
        still attached.
        """
        assert not node.is_evicted, (
            f"lock on evicted {node}: a match result used after an evict without a lock")
        assert node.kind is not _ADAPTER or node.parent is not None, (
            f"lock on removed adapter {node}")
        self._store.add_lock(node, 1)

    def unlock(self, node: Node) -> None:
        """Undoes one `lock(node)`. Asserts it was locked."""
        assert node.kind not in (_KV, _ADAPTER) or node.lock_ref > 0, (
            f"unlock without lock on {node}")
        self._store.add_lock(node, -1)

    def evict(self, num_tokens: int, free_fn: FreeFn) -> int:
        """Evicts unlocked leaves, lowest `score` first, until `num_tokens` tokens are freed.

        Stops early when no unlocked leaf is left. Calls `free_fn(values)` once per evicted run (see
        `FreeFn` for the form of `values`); a parent left childless and unlocked becomes a candidate
        in the same call. Returns the tokens evicted (may exceed `num_tokens` by part of the last
        run).
        """
        if num_tokens <= 0:
            return 0
        now = self.clock()
        score = self.score
        heap = [(score(n, now), n.id, n) for n in self._store.evictable_leaves()]
        heapq.heapify(heap)
        num_evicted = 0
        while num_evicted < num_tokens and heap:
            node = heapq.heappop(heap)[2]
            parent = node.parent
            num_evicted += self._store.evict_leaf(node, free_fn)
            if parent.kind is _KV and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (score(parent, now), parent.id, parent))
        return num_evicted

    def evictable_leaves(self) -> list[Node]:
        """The unlocked KV leaves, i.e. the candidates `evict` considers (a snapshot, valid until
        the next insert, lock or evict). Does not modify the tree. For an external evictor that
        orders KV leaves and adapter nodes together (the unified pool)."""
        return self._store.evictable_leaves()

    def evict_leaf(self, node: Node, free_fn: FreeFn) -> int:
        """Evicts one unlocked KV leaf the caller chose; returns its tokens (slots go to `free_fn`).

        Raises ValueError unless `node` is an attached, unlocked KV leaf of this tree."""
        if not self._store.is_evictable_leaf(node):
            raise ValueError(f"evict_leaf needs an unlocked KV leaf of this tree, got {node}")
        return self._store.evict_leaf(node, free_fn)

    def remap_values(self, mapping: dict[int, int], form: Callable[[list[int]], object] | None = None) -> int:
        """After the owner of the slots moved some (KV compaction): every cached slot id `old` in `mapping` reads
        `mapping[old]` from now on; `form` rebuilds a node's `value_cache` in its inserter's form (the server's
        int64 tensor), without one the cache is dropped. Returns the nodes changed; nothing else changes."""
        return self._store.remap_values(mapping, form)

    def prefix_node_ids(self, keys: Iterable[MatchKey]) -> set[int]:
        """Ids of the KV nodes holding any of the cached prefixes of `keys`: each key's match (with
        `touch=False`, so a pure query) ends at a node, and that node and its KV ancestors hold the
        prefix. For an evictor that frees what waiting requests will reuse last. O(matched nodes)."""
        return set(self.prefix_nodes(keys))

    def prefix_nodes(self, keys: Iterable[MatchKey]) -> dict[int, Node]:
        """`prefix_node_ids` with the nodes themselves (id -> node), each once however many keys share it."""
        nodes: dict[int, Node] = {}
        for key in keys:
            node = self._match(key, False, _NO_VALUES).last_node  # the path's last node; its slot ids are not needed
            while node.kind is _KV and node.id not in nodes:
                nodes[node.id] = node
                node = node.parent
        return nodes

    # ---- lengths, stats, invariants --------------------------------------------------------------

    def evictable_len(self) -> int:
        """Tokens cached in unlocked KV nodes (what `evict` could free now)."""
        return self._store.evictable_len

    def protected_len(self) -> int:
        """Tokens cached in locked KV nodes."""
        return self._store.protected_len

    def total_len(self) -> int:
        """Tokens cached: `evictable_len() + protected_len()`."""
        return self._store.total_len

    def stats(self) -> TreeStats:
        """A snapshot of the counters; does not modify the tree."""
        store = self._store
        return TreeStats(
            num_matches=self._num_matches, hits=dict(self._hits), hit_tokens=dict(self._hit_tokens),
            num_namespaces=len(store.root.children), num_adapter_nodes=store.num_adapter_nodes,
            num_kv_nodes=store.num_kv_nodes, total_len=store.total_len,
            evictable_len=store.evictable_len, protected_len=store.protected_len,
            num_evicted_runs=store.num_evicted_runs, num_evicted_tokens=store.num_evicted_tokens,
        )

    def check_invariants(self) -> None:
        """Walks every node (O(nodes)); raises AssertionError naming the first broken invariant."""
        check_tree(self._store)

    # ---- internals -------------------------------------------------------------------------------

    def _floor(self, num_tokens: int) -> int:
        return num_tokens - num_tokens % self._store.page_size

    def _result(self, out: list[int], node: Node, regions: list[tuple[HitKind, int]],
                touch: bool) -> MatchResult:
        """Builds the result; with `touch`, counts the match and the hit tokens of each region."""
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


class _NoValues:
    """An `out` for `_match` that keeps nothing (its length stays 0)."""

    __slots__ = ()

    def extend(self, values) -> None:
        return None

    def __len__(self) -> int:
        return 0


_NO_VALUES = _NoValues()


def _as_tokens(token_ids: Sequence[int]) -> Sequence[int]:
    """The key's tokens as the tree stores them: a tuple or an `array('q')` (SGLang's own token type,
    kept as is: slices of it compare at C speed, and converting would cost more than the walk)."""
    kind = type(token_ids)
    if kind is tuple or kind is array and token_ids.typecode == "q":
        return token_ids
    if hasattr(token_ids, "tolist"):
        return tuple(token_ids.tolist())
    return tuple(token_ids)
