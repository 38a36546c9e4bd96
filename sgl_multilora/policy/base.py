"""The interface every eviction policy implements.

Lives here: `BasePolicy`. Not here: concrete scores (one file each) and the inputs they read
(`context.py`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar


class BasePolicy:
    """A pure score: `score(item, now) -> float`, higher means keep.

    `item` is a tree `Node` (KV or adapter) or an `AdapterRecord` (an adapter the tree does not
    hold, e.g. one on the host tier being considered for a prefetch). A policy never modifies the
    item or its context. Instances are callable, so one can be passed as the tree's `ScoreFn`.
    """

    name: ClassVar[str] = "base"

    def score(self, item: object, now: float) -> float:
        raise NotImplementedError

    def score_many(self, items: Iterable[object], now: float) -> list[float]:
        """`[score(item, now) for item in items]` (an override may compute it over arrays): an evictor ranking every candidate
        calls this, and a policy may compute once what the items share (pure, like `score`)."""
        score = self.score
        return [score(item, now) for item in items]

    def __call__(self, item: object, now: float) -> float:
        return self.score(item, now)
