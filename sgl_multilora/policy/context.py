"""What a policy may ask about an item besides its own fields: size, reload cost, visits, adapters.

Lives here: the `PolicyContext` protocol and `AdapterRecord`, an adapter's bookkeeping outside the
tree. Not here: the bookkeeping itself (`usage.py` holds a ready-made implementation) or any policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(slots=True, eq=False)
class AdapterRecord:
    """One adapter as its owner (pool, simulator) tracks it, resident or not.

    `size_bytes`: weight bytes on the GPU. `last_access`: time of the last request that used it (the
    same clock as the tree's). `resident`: whether the weights are on the GPU now.
    """

    name: str
    size_bytes: int
    last_access: float = 0.0
    resident: bool = False


class PolicyContext(Protocol):
    """Read-only inputs of the scores; every method is side-effect free.

    - `is_adapter(item)`: True for an adapter node or an `AdapterRecord`, False for a KV node.
    - `size_bytes(item)`: GPU bytes the item occupies (KV: its tokens x bytes per token).
    - `reload_cost_s(item)`: seconds to get the item back after an eviction (a PCIe copy or a
      recompute).
    - `visits(item)`: how often the item was used (KV node: matches through it; adapter: requests).
    - `total_visits()`: the normaliser of `visits` (requests seen); > 0.
    - `max_visits()`, `max_size_bytes()`: the largest `visits` and `size_bytes` among adapters
      (> 0), used to bring frequency and size to [0, 1].
    - `num_resident_adapters()`: adapters on the GPU now (ELORA's Now_LoRA before a swap).
    - `expected_adapters_per_batch()`: ELORA's Low_lora (Eq. 3), >= 0.
    - `columns(items)`: `is_adapter`, `size_bytes`, `reload_cost_s` and `visits` of many items as four
      numpy arrays (bool, then float64), the same values as the four methods (what a batch score reads).
    """

    def is_adapter(self, item: object) -> bool: ...
    def size_bytes(self, item: object) -> int: ...
    def reload_cost_s(self, item: object) -> float: ...
    def visits(self, item: object) -> float: ...
    def total_visits(self) -> float: ...
    def max_visits(self) -> float: ...
    def max_size_bytes(self) -> int: ...
    def num_resident_adapters(self) -> int: ...
    def expected_adapters_per_batch(self) -> float: ...
    def columns(self, items: Sequence[object]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]: ...
