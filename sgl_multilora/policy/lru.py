"""LRU: the least recently used item goes first. Needs no context."""

from __future__ import annotations

from sgl_multilora.policy.base import BasePolicy
from sgl_multilora.policy.registry import register


@register("lru")
class LruPolicy(BasePolicy):
    """score = last access time (seconds on the owner's clock); `context` is accepted, unused."""

    def __init__(self, context: object = None) -> None:
        self.context = context

    def score(self, item: object, now: float) -> float:
        return item.last_access
