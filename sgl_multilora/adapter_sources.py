"""Adapters on demand: where a name no process has loaded is looked up, and which host copies make room.

Lives here: adapter names (`check_name`), resolvers (a name -> a local adapter directory, or None when the source does
not hold it), the chain of sources a server was given (`AdapterSources`, built from `--multilora-adapter-source`
values by `parse_source`), and the host tier's choice of what to drop (`choose_drops`). Plain Python: the tokenizer
hook that loads through SGLang's own `/load_lora_adapter` path lives in `patches/on_demand.py`.

Sources, in the order given; the first that holds a name wins:
- `DIR`: a directory of adapter directories, `DIR/<name>/adapter_config.json` (as `--multilora-adapter-dir`, but
  nothing is read at start-up).
- `hf-cache:DIR`: a local Hugging Face hub cache (`DIR/models--<org>--<name>/snapshots/<revision>/`), read offline;
  the name is the repository id `<org>/<name>`, the revision the one `refs/main` names (else the newest snapshot).
- `<scheme>:<argument>`: a resolver a package registers under the entry-point group `sgl_multilora.adapter_resolvers`
  (as vLLM's LoRA resolver plugins): the entry point loads a factory called with the argument, returning an object
  with `resolve(name) -> path | None` (an object store's resolver downloads into a local directory and returns it).

Names. A name is one or two components of `[A-Za-z0-9][A-Za-z0-9._-]*` (at most 128 characters each) joined by one
`/`: no `..`, no leading dot, no absolute path, so no name reaches outside a source's directory; a directory resolver
also checks, after resolving symlinks, that the adapter lies inside its directory.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Protocol

from sgl_multilora.adapters import CONFIG_FILE, AdapterError, resolve_under_root

ENTRY_POINT_GROUP = "sgl_multilora.adapter_resolvers"
_COMPONENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_name(name: object) -> str:
    """`name` if it is an adapter name a source may be asked for (module docstring); AdapterError otherwise."""
    if not isinstance(name, str) or not name:
        raise AdapterError(f"LoRA adapter name {name!r} is not a non-empty string")
    parts = name.split("/")
    if len(parts) > 2 or not all(_COMPONENT.fullmatch(p) and ".." not in p for p in parts):
        raise AdapterError(f"LoRA adapter name {name[:200]!r} is not a valid adapter name (one or two components of "
                           "letters, digits, '.', '_' and '-', joined by '/'; no '..')")
    return name


class AdapterResolver(Protocol):
    """Finds an adapter by name. `resolve` returns the local directory holding `adapter_config.json` and the
    weights, or None when this source does not hold `name`; it may block (reads, downloads): callers run it off the
    event loop. Raising AdapterError refuses the name outright (no later source is asked)."""

    def resolve(self, name: str) -> str | os.PathLike | None: ...


@dataclass(frozen=True)
class DirectoryResolver:
    """`root/<name>/` for a one-component name."""

    root: str

    def resolve(self, name: str) -> Path | None:
        if "/" in name:
            return None
        path = resolve_under_root(name, self.root, name)
        return path if (path / CONFIG_FILE).is_file() else None

    def __str__(self) -> str:
        return self.root


@dataclass(frozen=True)
class HubCacheResolver:
    """A Hugging Face hub cache (`huggingface_hub`'s layout), offline: `<org>/<name>` is found in
    `root/models--<org>--<name>/snapshots/<revision>/`, the revision read from `refs/main` when it is there, else
    the most recently modified snapshot."""

    root: str

    def resolve(self, name: str) -> Path | None:
        repo = Path(self.root) / ("models--" + name.replace("/", "--"))
        snapshots = repo / "snapshots"
        if not snapshots.is_dir():
            return None
        ref = repo / "refs" / "main"
        revision = ref.read_text().strip() if ref.is_file() else None
        if revision is not None and _COMPONENT.fullmatch(revision) and (snapshots / revision).is_dir():
            candidates = [snapshots / revision]
        else:
            candidates = sorted((p for p in snapshots.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime,
                                reverse=True)
        for snapshot in candidates:
            # snapshot files are symlinks into blobs/: the adapter must resolve inside this repository's folder
            path = resolve_under_root(snapshot, repo, name)
            if (path / CONFIG_FILE).is_file():
                resolve_under_root(path / CONFIG_FILE, repo, name)
                return path
        return None

    def __str__(self) -> str:
        return f"hf-cache:{self.root}"


BUILTIN: dict[str, Callable[[str], AdapterResolver]] = {"hf-cache": HubCacheResolver}


def _plugin_factories() -> dict[str, Callable[[str], AdapterResolver]]:
    return {ep.name: ep.load for ep in entry_points(group=ENTRY_POINT_GROUP)}


def parse_source(value: str) -> tuple[str, str]:
    """(`scheme`, argument) of one `--multilora-adapter-source` value: 'dir' for a plain directory. Raises ValueError
    naming what is wrong: a directory that does not exist, a scheme no resolver is registered under."""
    scheme, sep, arg = value.partition(":")
    if sep and re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme) and not os.path.isdir(value):
        known = {**BUILTIN, **_plugin_factories()}
        if scheme not in known:
            raise ValueError(f"{value!r}: no adapter resolver is registered for {scheme!r} (known: "
                             f"{', '.join(sorted(known))}; a plain directory needs no scheme)")
        if scheme in BUILTIN and not os.path.isdir(arg):
            raise ValueError(f"{value!r}: {arg!r} is not a directory")
        return scheme, os.path.realpath(arg) if scheme in BUILTIN else arg
    if not os.path.isdir(value):
        raise ValueError(f"{value!r} is not a directory")
    return "dir", os.path.realpath(value)


def make_resolver(scheme: str, arg: str) -> AdapterResolver:
    if scheme == "dir":
        return DirectoryResolver(arg)
    if scheme in BUILTIN:
        return BUILTIN[scheme](arg)
    factory = _plugin_factories()[scheme]()  # the entry point's object: a factory of resolvers
    return factory(arg)


@dataclass(frozen=True)
class Resolved:
    name: str
    path: Path
    source: str


class AdapterSources:
    """The sources a server resolves unknown adapter names from, asked in order."""

    def __init__(self, values: Iterable[tuple[str, str]], root: str | None = None) -> None:
        self._resolvers = [(f"{scheme}:{arg}" if scheme != "dir" else arg, make_resolver(scheme, arg))
                           for scheme, arg in values]
        self._root = root

    def __bool__(self) -> bool:
        return bool(self._resolvers)

    def describe(self) -> list[str]:
        return [label for label, _ in self._resolvers]

    def resolve(self, name: str) -> Resolved:
        """The first source's directory for `name`. Raises AdapterError when the name is invalid, when no source holds
        it (the message names the adapter, not the sources' paths), or when the adapter lies outside
        `--multilora-adapter-root`."""
        check_name(name)
        for label, resolver in self._resolvers:
            found = resolver.resolve(name)
            if found is None:
                continue
            path = Path(found)
            if self._root is not None:
                path = resolve_under_root(path, self._root, name)
            return Resolved(name, path, label)
        raise AdapterError(f"LoRA adapter '{name}' is not loaded and no adapter source holds it")


def choose_drops(lru_order: Iterable[str], sizes: Mapping[str, int], budget: int,
                 keep: Callable[[str], bool]) -> list[str]:
    """The host copies to drop so that the rest fit `budget` bytes: least recently used first, passing over those
    `keep` says must stay (pinned, in use, being requested). Stops as soon as the rest fit; may return fewer than
    needed when everything left must stay (the caller serves over budget until some are released)."""
    order = list(lru_order)
    total = sum(sizes.get(name, 0) for name in order)
    drops = []
    for name in order:
        if total <= budget:
            break
        if keep(name):
            continue
        drops.append(name)
        total -= sizes.get(name, 0)
    return drops
