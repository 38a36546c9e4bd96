"""Chameleon's adapter-cache score: 0.45 F + 0.10 R + 0.45 S.

Lives here: `ChameleonPolicy`. Not here: Chameleon's eviction tiers (running adapters are never
evicted, adapters wanted by queued requests last): the owner applies those before asking the score.

Choices the paper leaves open (shared/reference/seed-chameleon.md, section 3.3), and why:
- Each term is brought to [0, 1] so the weights mean something: F = visits / max visits among
  adapters, S = size / the largest adapter's size (both clamped to 1, so a KV node larger than any
  adapter gets S = 1), R = exp(-age / tau_s), which grows with freshness (the paper evicts the
  lowest score, so R must).
- The frequency window is the context's (`usage.py` counts adapter requests over a sliding window).
- `tau_s` defaults to 60 s: the score must tell apart adapters idle for seconds and for minutes.
"""

from __future__ import annotations

import math

from sgl_multilora.policy.base import BasePolicy
from sgl_multilora.policy.context import PolicyContext
from sgl_multilora.policy.registry import register

WEIGHTS = (0.45, 0.10, 0.45)
"""(F, R, S): static weights, set by Chameleon's offline profiling on the Splitwise trace."""


@register("chameleon")
class ChameleonPolicy(BasePolicy):
    """score = wF * F + wR * R + wS * S; higher means keep. Raises ValueError for tau_s <= 0 or
    negative weights."""

    def __init__(self, context: PolicyContext, tau_s: float = 60.0,
                 weights: tuple[float, float, float] = WEIGHTS) -> None:
        if tau_s <= 0:
            raise ValueError(f"tau_s must be > 0, got {tau_s}")
        if len(weights) != 3 or min(weights) < 0:
            raise ValueError(f"weights must be three non-negative numbers (F, R, S), got {weights}")
        self.context = context
        self.tau_s = tau_s
        self.weights = tuple(weights)

    def terms(self, item: object, now: float) -> tuple[float, float, float]:
        """(F, R, S), each in [0, 1]."""
        ctx = self.context
        f = min(1.0, ctx.visits(item) / ctx.max_visits())
        r = math.exp(-max(0.0, now - item.last_access) / self.tau_s)
        largest = ctx.max_size_bytes()  # 0 while no adapter is registered (a base-only server): no size term
        s = min(1.0, ctx.size_bytes(item) / largest) if largest > 0 else 0.0
        return f, r, s

    def score(self, item: object, now: float) -> float:
        f, r, s = self.terms(item, now)
        wf, wr, ws = self.weights
        return wf * f + wr * r + ws * s
