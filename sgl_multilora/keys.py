"""Cache keys of the LoRA-aware radix tree: namespaces, adapter references, the per-request key.

Lives here: the small frozen value types a request is translated into before it touches the tree.
Not here: the tree itself (`tree.py`), adapter loading and content hashing (`adapters.py`).

Every field is a separate, typed component: nothing is ever joined into one string, so no choice of
`cache_salt` / `extra_key` text can spell another namespace or an adapter (see `tree.py` for the
full argument).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Namespace:
    """Which cache a request may read: one base model, one tenant salt, one caller-chosen extra key.

    Equality and hashing are component-wise, so `Namespace("m", cache_salt="bc", extra_key="a")` and
    `Namespace("m", cache_salt="c", extra_key="ab")` are different namespaces, as are `None` and
    `""`.
    """

    base_model: str
    cache_salt: str | None = None
    extra_key: str | None = None


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """An adapter as the tree knows it: by `identity`, the content hash of its config and weights.

    `name` is a label for logs and stats only; it takes no part in equality or hashing, so two loads
    of different weights under one name are two adapters, and one set of weights under two names is
    one.
    """

    identity: str
    name: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.identity, str) or not self.identity:
            raise ValueError(f"AdapterRef needs a non-empty identity string, got {self.identity!r}")


@dataclass(frozen=True, slots=True)
class MatchKey:
    """What one request looks up or inserts.

    - `adapter is None`: a base-model request; all tokens are base KV.
    - `adapter` set, `alora_start is None`: a standard LoRA; every token's KV belongs to that
      adapter.
    - `adapter` set, `alora_start = k`: an activated LoRA that applies from position k on. Tokens
      `[0, k)` are base KV (shared with base requests); tokens `[k, ...)` belong to the adapter,
      anchored at position k.

    Running example: C = [5, 6, 7], invocation [9] at k = 3, generation [4]:
    `MatchKey(ns, X, [5, 6, 7, 9, 4], alora_start=3)` reads [5, 6, 7] from the base subtree and
    [9, 4] from X's suffix hanging below the base node that ends at position 3.

    Raises ValueError for an `alora_start` without an adapter or below zero.
    """

    namespace: Namespace
    adapter: AdapterRef | None
    token_ids: Sequence[int]
    alora_start: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, Namespace):
            raise TypeError(f"namespace must be a Namespace, got {type(self.namespace).__name__}")
        if self.adapter is not None and not isinstance(self.adapter, AdapterRef):
            raise TypeError(
                f"adapter must be an AdapterRef or None, got {type(self.adapter).__name__}")
        if self.alora_start is not None:
            if self.adapter is None:
                raise ValueError("alora_start is set but adapter is None: "
                                 "only an aLoRA has an activation start")
            if self.alora_start < 0:
                raise ValueError(f"alora_start must be >= 0, got {self.alora_start}")

    @property
    def is_alora(self) -> bool:
        return self.alora_start is not None
