"""`AdapterRegistry`: the one owner of what a process knows about its adapters, keyed by the engine's adapter id.

Lives here: id -> `AdapterSpec` (content identity, rank, aLoRA invocation tokens) and, where our LoRA layers
compute, the `LoadedAdapter` weights; the aLoRA invocation tokens of an adapter directory for request validation.
Not here: reading and validating adapter files (`adapters.py`), where weights sit at serving time (the pool).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from types import MappingProxyType

from sgl_multilora.adapters import AdapterError, AdapterSpec, LoadedAdapter, read_config


class AdapterRegistry:
    """Every adapter one process has loaded. Only this class edits its maps; everyone else asks it.

    An id is registered by `add` once its weights were validated and the engine accepted it, and forgotten by
    `remove` when the engine unloads it. Specs are immutable; a reloaded adapter gets a new spec (and, if its
    weights changed, a new identity). `version` changes whenever an id's spec may have (every `add` and `remove`),
    so a reader can keep what it derived from `spec` / `identity` until it moves.
    """

    def __init__(self) -> None:
        self.version = 0
        self._specs: dict[str, AdapterSpec] = {}
        self._loaded: dict[str, LoadedAdapter] = {}
        self._loaded_view = MappingProxyType(self._loaded)
        self._invocations: dict[tuple[str, float], tuple[int, ...] | None] = {}

    # ---- queries (no side effects) -----------------------------------------------------------------------------

    def spec(self, adapter_id: str) -> AdapterSpec | None:
        return self._specs.get(adapter_id)

    def identity(self, adapter_id: str) -> str | None:
        spec = self._specs.get(adapter_id)
        return spec.identity if spec is not None else None

    def find(self, *, name: str | None = None, identity: str | None = None) -> tuple[str, AdapterSpec] | None:
        """(id, spec) of a registered adapter with this name, or with this content identity; None if none."""
        for adapter_id, spec in self._specs.items():
            if (name is not None and spec.name == name) or (identity is not None and spec.identity == identity):
                return adapter_id, spec
        return None

    def loaded(self, adapter_id: str) -> LoadedAdapter | None:
        """The weights our LoRA layers compute with, or None where the engine's layers hold them."""
        return self._loaded.get(adapter_id)

    def loaded_items(self) -> Iterator[tuple[str, LoadedAdapter]]:
        return iter(self._loaded.items())

    def loaded_view(self) -> Mapping[str, LoadedAdapter]:
        """A read-only, live view of id -> weights (it follows later `stage` / `remove` calls)."""
        return self._loaded_view

    def __contains__(self, adapter_id: str) -> bool:
        return adapter_id in self._specs

    def __len__(self) -> int:
        return len(self._specs)

    # ---- mutations ---------------------------------------------------------------------------------------------

    def stage(self, adapter_id: str, loaded: LoadedAdapter) -> None:
        """Holds validated weights for `adapter_id` before the engine has accepted it (`add` or `remove` follow)."""
        self._loaded[adapter_id] = loaded

    def add(self, adapter_id: str, spec: AdapterSpec) -> None:
        self._specs[adapter_id] = spec
        self.version += 1

    def remove(self, adapter_id: str) -> None:
        """Forgets `adapter_id` (its spec and weights); a no-op for an unknown id."""
        self._specs.pop(adapter_id, None)
        self.version += 1
        self._loaded.pop(adapter_id, None)

    # ---- request validation (HTTP process) ---------------------------------------------------------------------

    def invocation_tokens(self, adapter_path: str) -> tuple[int, ...] | None:
        """The `alora_invocation_tokens` of the adapter at `adapter_path`, or None for a standard LoRA or an
        unreadable config (cached per config file version: a rewritten config is read again)."""
        config_path = os.path.join(adapter_path, "adapter_config.json")
        try:
            key = (config_path, os.path.getmtime(config_path))
        except OSError:
            return None
        if key not in self._invocations:
            try:
                tokens = read_config(adapter_path).get("alora_invocation_tokens")
            except AdapterError:
                tokens = None
            self._invocations[key] = tuple(tokens) if tokens else None
        return self._invocations[key]
