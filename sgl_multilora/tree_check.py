"""Invariant checker of the LoRA-aware radix tree (`LoraRadixTree.check_invariants()`).

Lives here: one full walk that recomputes every counter and dependency from the nodes and compares
them with the `NodeStore`'s read-only view. Not here: anything that changes a node; no import of
`tree.py`.
"""

from __future__ import annotations

from sgl_multilora.keys import AdapterRef, Namespace
from sgl_multilora.tree_nodes import AloraEdge, Node, NodeKind
from sgl_multilora.tree_ops import NodeStore, child_key


def check_tree(store: NodeStore) -> None:
    """Reads `store` and its nodes, changes nothing. Raises AssertionError at the first broken rule:

    - structure: namespaces at depth 1 keyed by their `Namespace`, a base node and adapter nodes
      (keyed by identity) at depth 2, KV below; every child is stored under the key its first token
      or page gives;
    - dependencies: every resident KV node's parent chain is resident, an aLoRA suffix's adapter
      node is resident and lists it among its dependents (and lists nothing else);
    - locks: never negative, a node's count covers its children's (and an adapter's, its
      dependents');
    - lengths: node token lengths sum to `total_len`, split exactly into `evictable_len` (unlocked)
      and `protected_len` (locked); node counts and the leaf set agree with the nodes.
    """
    root = store.root
    assert root.kind is NodeKind.ROOT and root.parent is None, "root replaced or re-parented"
    totals = {"evictable_len": 0, "protected_len": 0, "num_kv_nodes": 0, "num_adapter_nodes": 0}
    leaves: set[Node] = set()
    for ns, ns_node in root.children.items():
        assert isinstance(ns, Namespace), (
            f"depth-1 key {ns!r} is not a Namespace: namespaces must be structured")
        assert (ns_node.kind is NodeKind.NAMESPACE and ns_node.parent is root
                and ns_node.edge == ns), f"namespace node {ns_node} misfiled under {ns!r}"
        base = ns_node.children.get(None)
        assert base is not None and base.kind is NodeKind.BASE, (
            f"namespace {ns!r} lost its base node")
        seen_suffixes: dict[str, set[Node]] = {}
        for edge, top in ns_node.children.items():
            assert top.parent is ns_node and top.edge == edge, (
                f"depth-2 node {top} has a stale parent or edge")
            if edge is not None:
                _check_adapter_node(top, edge)
                totals["num_adapter_nodes"] += 1
            _check_subtree(store.page_size, top, ns_node, totals, leaves, seen_suffixes)
        for identity, adapter in ns_node.children.items():
            if identity is None:
                continue
            found = seen_suffixes.get(identity, set())
            assert adapter.dependents == found, (
                f"adapter {adapter} lists dependents {adapter.dependents} "
                f"but the base subtree holds {found}")
            held = (sum(c.lock_ref for c in adapter.children.values())
                    + sum(d.lock_ref for d in found))
            assert adapter.lock_ref >= held, (
                f"adapter {adapter} lock {adapter.lock_ref} < dependents' {held}")
        stray = set(seen_suffixes) - {e for e in ns_node.children if e is not None}
        assert not stray, (
            f"aLoRA suffixes of non-resident adapters {stray} in {ns!r}: dependency broken")
    assert totals["num_adapter_nodes"] == store.num_adapter_nodes, "adapter node count out of step"
    assert totals["num_kv_nodes"] == store.num_kv_nodes, (
        f"KV node count {store.num_kv_nodes} != {totals['num_kv_nodes']} found")
    assert leaves == store.leaves(), (
        "leaf set out of step (a split, insert or evict forgot to update it)")
    assert store.evictable_len == totals["evictable_len"], (
        f"evictable_len {store.evictable_len} != {totals['evictable_len']} unlocked tokens")
    assert store.protected_len == totals["protected_len"], (
        f"protected_len {store.protected_len} != {totals['protected_len']} locked tokens")
    assert store.total_len == totals["evictable_len"] + totals["protected_len"], (
        "total_len != evictable_len + protected_len")


def _check_adapter_node(node: Node, identity: object) -> None:
    assert node.kind is NodeKind.ADAPTER, (
        f"depth-2 key {identity!r} holds {node}, not an adapter node")
    assert isinstance(node.label, AdapterRef) and node.label.identity == identity, (
        f"adapter node {node} filed under identity {identity!r}")
    assert node.dependents is not None and node.lock_ref >= 0, f"adapter node {node} is malformed"
    assert not node.key and node.value is None, f"adapter node {node} holds tokens"


def _check_subtree(page_size: int, top: Node, ns_node: Node, totals: dict[str, int],
                   leaves: set[Node], seen_suffixes: dict[str, set[Node]]) -> None:
    stack: list[tuple[Node, bool]] = [(top, False)]
    while stack:
        node, in_suffix = stack.pop()
        held = 0
        for edge, child in node.children.items():
            assert child.parent is node and child.edge == edge, (
                f"{child} has a stale parent or edge")
            assert child.kind is NodeKind.KV, f"{child} below {node} is not a KV node"
            held += child.lock_ref
            child_in_suffix = in_suffix
            if isinstance(edge, AloraEdge):
                assert top.kind is NodeKind.BASE and not in_suffix, (
                    f"aLoRA edge {edge} outside the base subtree or nested in a suffix")
                assert 0 <= edge.offset < page_size, f"aLoRA edge offset {edge.offset} >= page_size"
                assert edge.first == child_key(child.key, 0, page_size), (
                    f"{child} filed under stale {edge}")
                adapter = ns_node.children.get(edge.identity)
                assert adapter is not None and child.depends_on is adapter, (
                    f"aLoRA suffix {child} depends on {child.depends_on}, "
                    f"resident adapter is {adapter}")
                seen_suffixes.setdefault(edge.identity, set()).add(child)
                child_in_suffix = True
            else:
                assert edge == child_key(child.key, 0, page_size), (
                    f"{child} filed under stale key {edge!r}")
                assert child.depends_on is None, f"{child} has a dependency but no aLoRA edge"
            _check_kv(child, page_size, totals)
            if not child.children:
                leaves.add(child)
            stack.append((child, child_in_suffix))
        if node.kind is NodeKind.KV:
            assert node.lock_ref >= held, f"{node} lock {node.lock_ref} < its children's {held}"


def _check_kv(node: Node, page_size: int, totals: dict[str, int]) -> None:
    assert node.value is not None, f"evicted {node} is still attached"
    num_tokens = len(node.key)
    assert num_tokens > 0 and num_tokens == len(node.value), (
        f"{node} holds {num_tokens} tokens but {len(node.value)} slot ids")
    cache = node.value_cache
    if cache is not None:
        ids = cache.tolist() if hasattr(cache, "tolist") else list(cache)
        assert ids == node.value, f"{node}'s value_cache is out of step with its value"
    assert num_tokens % page_size == 0, (
        f"{node} run of {num_tokens} is not whole pages of {page_size}")
    assert node.lock_ref >= 0, f"negative lock count on {node}: unlock without lock"
    totals["num_kv_nodes"] += 1
    totals["protected_len" if node.lock_ref > 0 else "evictable_len"] += num_tokens
