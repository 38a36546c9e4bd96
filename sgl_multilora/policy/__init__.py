"""Eviction scores, one per file, chosen by name: `lru`, `elora`, `chameleon`.

Lives here: the registry (`register`, `create_policy`, `POLICIES`) and the shared inputs (`context.py`,
`usage.py`). Not here: anything that evicts. A policy only scores (`score(item, now)`, higher means keep);
the pool, the swapper or a simulator applies the order. Plain Python: no sglang, no torch.
"""

from __future__ import annotations

from collections.abc import Callable

from sgl_multilora.policy.base import BasePolicy

POLICIES: dict[str, type[BasePolicy]] = {}


def register(name: str) -> Callable[[type[BasePolicy]], type[BasePolicy]]:
    def wrap(cls: type[BasePolicy]) -> type[BasePolicy]:
        assert name not in POLICIES, f"policy name {name!r} registered twice"
        cls.name = name
        POLICIES[name] = cls
        return cls

    return wrap


def create_policy(name: str, **kwargs) -> BasePolicy:
    """Builds the policy registered as `name`. Raises ValueError naming the supported policies otherwise."""
    _load_builtin()
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown eviction policy {name!r}; supported: {', '.join(sorted(POLICIES))}")
    return cls(**kwargs)


def _load_builtin() -> None:
    from sgl_multilora.policy import chameleon, elora, lru  # noqa: F401  (each registers itself)


__all__ = ["BasePolicy", "POLICIES", "create_policy", "register"]
