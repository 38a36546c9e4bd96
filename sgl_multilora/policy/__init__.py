"""Eviction scores, one per file, chosen by name: `lru`, `elora`, `chameleon`.

Lives here: the factory `create_policy`, over the registry (`registry.py`: `register`, `POLICIES`),
and the shared inputs (`context.py`, `usage.py`). Not here: anything that evicts. A policy only
scores (`score(item, now)`, higher means keep); the pool, the swapper or a simulator applies the
order. Plain Python: no sglang, no torch.
"""

from __future__ import annotations

from sgl_multilora.policy.base import BasePolicy
from sgl_multilora.policy.registry import POLICIES, register


def create_policy(name: str, **kwargs) -> BasePolicy:
    """Builds the policy registered as `name`; raises ValueError listing the supported names."""
    _load_builtin()
    cls = POLICIES.get(name)
    if cls is None:
        supported = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown eviction policy {name!r}; supported: {supported}")
    return cls(**kwargs)


def _load_builtin() -> None:
    from sgl_multilora.policy import chameleon, elora, lru  # noqa: F401  (each registers itself)


__all__ = ["POLICIES", "BasePolicy", "create_policy", "register"]
