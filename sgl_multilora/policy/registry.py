"""The table of eviction policies by name: `POLICIES` and the `register` decorator.

Lives here: the registry alone, so each policy file imports it without importing the package's
factory. Not here: `create_policy` (`policy/__init__.py`, which loads the built-in policies) and any
score.
"""

from __future__ import annotations

from collections.abc import Callable

from sgl_multilora.policy.base import BasePolicy

POLICIES: dict[str, type[BasePolicy]] = {}
"""Policy classes by registered name; filled as each policy module is imported."""


def register(name: str) -> Callable[[type[BasePolicy]], type[BasePolicy]]:
    """Class decorator: files the class under `name`, sets its `name`; asserts the name is new."""

    def wrap(cls: type[BasePolicy]) -> type[BasePolicy]:
        assert name not in POLICIES, f"policy name {name!r} registered twice"
        cls.name = name
        POLICIES[name] = cls
        return cls

    return wrap
