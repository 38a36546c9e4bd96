"""Records of the LoRA-aware radix tree: node kinds, nodes, the aLoRA edge key and result types.

Lives here: plain data and the callback types (`ScoreFn`, `FreeFn`), plus the default eviction
score. Not here: any logic that changes a node (only `tree_ops.NodeStore` edits nodes) and policies
other than LRU (`policy/`). Imports nothing from the rest of the package.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from enum import Enum, StrEnum


class NodeKind(Enum):
    ROOT = "root"
    NAMESPACE = "namespace"  # depth 1, one per Namespace
    BASE = "base"  # depth 2, parent of the namespace's base KV
    ADAPTER = "adapter"  # depth 2, one per AdapterRef identity, parent of that LoRA's KV
    KV = "kv"  # a run of tokens and their KV slot ids


class HitKind(StrEnum):
    """Which KV a match reused.

    - `base`: a base request on base KV.
    - `same_adapter`: a standard LoRA request on its own adapter's KV.
    - `alora_base_prefix`: an aLoRA request on base KV before its activation start.
    - `alora_suffix`: an aLoRA request on its own suffix KV from its activation start on.
    """

    BASE = "base"
    SAME_ADAPTER = "same_adapter"
    ALORA_BASE_PREFIX = "alora_base_prefix"
    ALORA_SUFFIX = "alora_suffix"


@dataclass(frozen=True, slots=True)
class AloraEdge:
    """Key, in a base KV node's `children`, of the first node of an aLoRA suffix.

    `identity` is the adapter's content hash; `offset` is the activation start minus the anchor
    position (always 0 with page_size 1; in [0, page_size) otherwise, because an anchor sits on a
    page boundary); `first` is the first token (page_size 1) or the first page tuple of the suffix.
    Plain token children are ints or tuples of ints, so they never equal an `AloraEdge`.
    """

    identity: str
    offset: int
    first: Hashable


@dataclass(slots=True, eq=False)
class Node:
    """One node of the tree. Identity-hashed (`eq=False`) so nodes can live in sets and heaps.

    KV nodes hold `key` (a run of token ids, a multiple of page_size long: a tuple, or an
    `array('q')` when the caller's tokens were one, which compares at C speed) and `value` (one KV
    slot id per token, a list). Structural nodes (ROOT, NAMESPACE, BASE, ADAPTER) hold no tokens.
    `value is None` on a KV node means it was evicted and detached; a detached node must never be
    locked again.

    `value_cache` is the same slot ids in the inserting caller's own form (the live server keeps an
    int64 tensor, so a path's indices are one `torch.cat`), or None. Only `insert` sets it (from
    values given as a tensor-like); a split slices it with `value`, an eviction drops it.

    `lock_ref` counts the locks held on this node or any node that depends on it (its subtree, and
    for an adapter node also its aLoRA suffixes). `depends_on` is set only on the first node of an
    aLoRA suffix and names the adapter node; the nodes below inherit the dependency through their
    parent chain. `dependents` (ADAPTER only) is the set of those first suffix nodes.
    """

    kind: NodeKind
    id: int
    key: tuple[int, ...] = ()
    value: list[int] | None = None
    parent: Node | None = None
    edge: Hashable = None  # this node's key in parent.children
    children: dict[Hashable, Node] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: float = 0.0
    depends_on: Node | None = None
    dependents: set[Node] | None = None
    hits: dict[HitKind, int] = field(default_factory=dict)
    label: object = None  # the Namespace (NAMESPACE) or AdapterRef (ADAPTER) this node stands for
    value_cache: object = None  # `value` in the caller's form (an int64 tensor in the server), or None

    def __repr__(self) -> str:
        if self.kind is NodeKind.KV:
            return f"Node#{self.id}(kv, len={len(self.key)}, lock={self.lock_ref})"
        return f"Node#{self.id}({self.kind.value}, {self.label!r}, lock={self.lock_ref})"

    @property
    def is_evicted(self) -> bool:
        return self.kind is NodeKind.KV and self.value is None


ScoreFn = Callable[[Node, float], float]
"""`score(node, now) -> float`: higher means keep. Pure: it must not modify the node."""

FreeFn = Callable[[object], object]
"""`free_fn(values)`: gives the slot ids of one evicted KV run back to their owner. `values` is the
node's `value_cache` when it has one (the form its inserter gave, e.g. an int64 tensor), else its
list: a caller that inserts tensor-likes frees tensor-likes."""


def lru_score(node: Node, now: float) -> float:
    """Least recently used goes first: the score is the last access time."""
    return node.last_access


@dataclass(frozen=True, slots=True)
class MatchResult:
    """Result of `LoraRadixTree.match`.

    `kv_values` are the slot ids of tokens `[0, prefix_len)`, valid only while `last_node` is locked
    (or until the next evict). `last_node` is the node holding the last matched token (possibly only
    partly matched), or the deepest structural node on the key's path when nothing matched.
    `hit_kind` is the kind of the deepest reused KV, None when `prefix_len == 0`.
    """

    prefix_len: int
    kv_values: list[int]
    last_node: Node
    hit_kind: HitKind | None


@dataclass(frozen=True, slots=True)
class InsertResult:
    """Result of `LoraRadixTree.insert`.

    The tree already held tokens `[0, prefix_len)`: it kept its own slots there, so the caller frees
    its duplicate slots `values[:prefix_len]`. The tree took ownership of `values[prefix_len:]`.
    `last_node` holds the last token of the key.
    """

    prefix_len: int
    last_node: Node


@dataclass(frozen=True, slots=True)
class TreeStats:
    """A snapshot of the tree's counters and lengths (`*_len` and `*_tokens` count tokens).

    `hits[kind]` counts matches that reused KV of that kind (an aLoRA match reusing its base prefix
    and its suffix counts once in each); `hit_tokens[kind]` counts the reused tokens of that kind.
    """

    num_matches: int
    hits: dict[str, int]
    hit_tokens: dict[str, int]
    num_namespaces: int
    num_adapter_nodes: int
    num_kv_nodes: int
    total_len: int
    evictable_len: int
    protected_len: int
    num_evicted_runs: int
    num_evicted_tokens: int
