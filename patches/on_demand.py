"""Adapters on demand, in the HTTP / tokenizer process: a request naming an adapter no process has loaded.

With `--multilora-adapter-source`, `resolve_lora_path` (around SGLang's `TokenizerManager._resolve_lora_path`)
resolves every name of the request that is not registered from the sources (`sgl_multilora/adapter_sources.py`),
checks it as any load is checked (the config and size rules here, off the event loop; the scheduler then reads,
validates against the model and hashes it again, `lora_transformers.load_lora_adapter`), and loads it through
SGLang's own `load_lora_adapter`, so the request waits for its adapter while every other request is served. First
requests for one adapter that arrive together share one load; a failed load is not remembered (the next request
tries again). A name no source holds, or one with path syntax, gets HTTP 400 naming it, as does an adapter larger than
the whole host budget. Host tier: with `--multilora-host-adapter-gb`, after each load (on demand or through
`/load_lora_adapter`: the load hook of `adapter_paths.py` asks `fit_host_budget`) the least recently used host copies
not in use and not pinned are unloaded until the rest fit; copies that had to stay because they were in use go once
their requests release them (`release_lora_once`). A source adapter comes back from its source on its next request,
read again: changed files are a new identity. Without sources, unknown names are refused with a message that, unlike SGLang's, does not
list every other adapter's name.

`unload_lora_adapter` (around the public `/unload_lora_adapter`): an adapter a user unloads is forgotten, so SGLang
does not quietly reload it from its old path on a later request (SGLang 0.5.23 keeps every name it ever loaded);
with sources, a later request resolves the name from them again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field

from sgl_multilora.adapter_sources import AdapterSources, choose_drops
from sgl_multilora.adapters import AdapterError, read_config, weights_file
from sgl_multilora.patches import flags, lora_remote

logger = logging.getLogger(__name__)


@dataclass
class TierStats:
    """Counters of the source and host tiers, read by `/multilora/stats`."""

    refused: int = 0
    loads: int = 0
    failed_loads: int = 0
    host_hits: int = 0
    drops: int = 0
    resolve_s: float = 0.0
    read_s: float = 0.0
    load_s: float = 0.0
    last_load: dict = field(default_factory=dict)


class OnDemand:
    """One tokenizer manager's on-demand state: its sources, the loads in flight and the source adapters' sizes."""

    def __init__(self, sources: AdapterSources, host_budget: int | None) -> None:
        self.sources = sources
        self.host_budget = host_budget
        self.stats = TierStats()
        self._inflight: dict[str, asyncio.Future] = {}
        self._sizes: dict[str, int] = {}  # name -> weight file bytes, for every adapter loaded through here
        self._from_source: set[str] = set()
        self.wanted: Counter[str] = Counter()  # names of requests between resolution and SGLang's acquire
        self.over_budget = False  # the last fit left more than the budget (what it could not drop was in use)
        self._refit: asyncio.Future | None = None

    # ---- loading ----------------------------------------------------------------------------------------------

    async def ensure(self, tm, name: str) -> None:
        """Loads `name` from the sources unless a load of it is already in flight (then waits for that one)."""
        pending = self._inflight.get(name)
        if pending is None:
            pending = asyncio.ensure_future(self._load(tm, name))
            self._inflight[name] = pending
            pending.add_done_callback(lambda _f: self._inflight.pop(name, None))
        await asyncio.shield(pending)

    async def _load(self, tm, name: str) -> None:
        from sglang.srt.managers.io_struct import LoadLoRAAdapterReqInput

        t0 = time.perf_counter()
        try:
            if lora_remote.address() is not None:  # the LoRA server's catalog: nothing to read here
                await asyncio.to_thread(lora_remote.catalog_entry, name)
                path, source, size = lora_remote.remote_path(name), lora_remote.address(), 0
                t1 = time.perf_counter()
            else:
                path, source, size, t1 = await self._check_source(name)
        except AdapterError:
            self.stats.refused += 1
            raise
        t2 = time.perf_counter()
        result = await tm.load_lora_adapter(LoadLoRAAdapterReqInput(lora_name=name, lora_path=path))
        t3 = time.perf_counter()
        if not result.success and "already loaded" not in (result.error_message or ""):
            self.stats.failed_loads += 1
            raise AdapterError(f"LoRA adapter '{name}' could not be loaded: {result.error_message}")
        stats = self.stats
        stats.loads += 1
        stats.resolve_s += t1 - t0
        stats.read_s += t2 - t1
        stats.load_s += t3 - t2
        stats.last_load = {"adapter": name, "source": source, "resolve_s": round(t1 - t0, 6),
                           "read_s": round(t2 - t1, 6), "load_s": round(t3 - t2, 6)}
        self._sizes[name] = size
        self._from_source.add(name)
        logger.info("sgl_multilora: loaded adapter %s on demand from %s (resolve %.3f s, read %.3f s, load %.3f s)",
                    name, source, t1 - t0, t2 - t1, t3 - t2)
        # the host budget was fitted by the load hook (adapter_paths.py), before this adapter counted as from a
        # source: it is kept now as it was then (the name is in flight)

    async def _check_source(self, name: str) -> tuple[str, str, int, float]:
        """(path, source, weight file bytes, when it was resolved) of `name` in the sources, after the config and size checks of any
        load (off the event loop), so a bad adapter is refused before the scheduler is asked; the weights are read
        and hashed once, by the scheduler's load. Raises AdapterError."""
        found = await asyncio.to_thread(self.sources.resolve, name)
        resolved = time.perf_counter()
        await asyncio.to_thread(read_config, found.path, name, flags.current().max_adapter_bytes)
        file = weights_file(found.path)
        size = file.stat().st_size if file is not None else 0
        if self.host_budget is not None and size > self.host_budget:
            raise AdapterError(f"LoRA adapter '{name}': {file.name} is {size / 1e9:.3f} GB, above the host "
                               f"adapter budget of {self.host_budget / 1e9:.3f} GB (--multilora-host-adapter-gb)")
        return str(found.path), found.source, size, resolved

    # ---- the host tier ----------------------------------------------------------------------------------------

    def size_of(self, tm, name: str) -> int:
        if name not in self._sizes:
            ref = tm.lora_registry.get_all_adapters().get(name)
            file = weights_file(ref.lora_path) if ref is not None and os.path.isdir(ref.lora_path) else None
            self._sizes[name] = file.stat().st_size if file is not None else 0
        return self._sizes[name]

    def host_view(self, tm) -> tuple[list[str], dict[str, int]]:
        """Registered adapters, least recently used first, and their weight files' sizes."""
        order = list(tm.lora_registry.get_all_adapters())  # SGLang's registry is kept in LRU order
        return order, {name: self.size_of(tm, name) for name in order}

    async def fit_host_budget(self, tm, keep: set[str]) -> None:
        if self.host_budget is None:
            return
        from sglang.srt.managers.io_struct import UnloadLoRAAdapterReqInput

        registry = tm.lora_registry

        def must_stay(name: str) -> bool:
            ref = registry.get_all_adapters().get(name)
            counter = registry._counters.get(ref.lora_id) if ref is not None else None
            return (ref is None or ref.pinned or name in keep or name in self._inflight or self.wanted[name] > 0
                    or (counter is not None and counter.value() > 0))

        async with tm.lora_update_lock:
            order, sizes = self.host_view(tm)
            left = sum(sizes.values())
            for name in choose_drops(order, sizes, self.host_budget, must_stay):
                result = await tm._unload_lora_adapter_locked(UnloadLoRAAdapterReqInput(lora_name=name))
                if not result.success:
                    logger.warning("sgl_multilora: could not drop adapter %s from the host tier: %s", name,
                                   result.error_message)
                    continue
                self.stats.drops += 1
                left -= sizes.get(name, 0)
                if name in self._from_source:
                    tm.lora_ref_cache.pop(name, None)  # read again from its source next time
                logger.info("sgl_multilora: dropped adapter %s's host copy (--multilora-host-adapter-gb)", name)
            self.over_budget = left > self.host_budget

    def after_release(self, tm, release: asyncio.Task | None) -> None:
        """A request released its adapter (`release`: SGLang's release task). While the last fit left the host tier
        over its budget (copies in use could not be dropped), one fit is scheduled once the release is done, so an
        idle server returns within its budget; releases while one is pending share it."""
        if not self.over_budget or (self._refit is not None and not self._refit.done()):
            return

        async def refit() -> None:
            if release is not None:
                await release
            await self.fit_host_budget(tm, keep=set())

        self._refit = asyncio.ensure_future(refit())

    def forget(self, name: str) -> None:
        self._from_source.discard(name)
        self._sizes.pop(name, None)

    def snapshot(self, tm) -> dict:
        order, sizes = self.host_view(tm)
        s = self.stats
        return {
            "sources": self.sources.describe(),
            "source": {"refused": s.refused, "loads": s.loads, "failed_loads": s.failed_loads,
                       "resolve_s": round(s.resolve_s, 6), "read_s": round(s.read_s, 6),
                       "load_s": round(s.load_s, 6), "last_load": s.last_load},
            "host": {"adapters": len(order), "resident": order, "bytes": sum(sizes.values()),
                     "budget_bytes": self.host_budget,
                     "hits": s.host_hits, "drops": s.drops, "loads_in_flight": len(self._inflight)},
        }


def state(tm) -> OnDemand | None:
    """The tokenizer manager's on-demand state, made on first use; None without `--multilora-adapter-source` and
    without `--multilora-host-adapter-gb`."""
    od = getattr(tm, "_multilora_on_demand", None)
    if od is None:
        args = flags.current()
        if not args.adapter_source and not args.host_adapter_gb and not args.lora_server:
            return None
        od = OnDemand(AdapterSources(args.adapter_source, args.adapter_root),
                      int(args.host_adapter_gb * 1e9) if args.host_adapter_gb else None)
        tm._multilora_on_demand = od
    return od


def release_lora_once(result, self, req_state, *args, **kwargs):
    """AFTER `TokenizerManager._release_lora_once(state)`: the host tier's budget is applied again once a request's
    adapter is released, if the last fit had to leave copies in use over it."""
    od = state(self)
    if od is not None and od.host_budget is not None:
        od.after_release(self, result)
    return result


def _names(obj) -> set[str]:
    paths = [obj.lora_path] if isinstance(obj.lora_path, str) else list(obj.lora_path or ())
    return {p for p in paths if p}


async def resolve_lora_path(original, self, obj, *args, **kwargs):
    """AROUND hook on `TokenizerManager._resolve_lora_path(obj)` (module docstring)."""
    names = _names(obj)
    od = state(self) if names else None
    if od is not None:
        od.wanted.update(names)  # the host tier keeps them until SGLang's acquire counts them as in use
    try:
        if names:
            # SGLang's name -> ref map, read without its lock (no await until the names are checked): a request
            # whose adapters are all registered pays no second lock round here; the original call below takes it
            registry = self.lora_registry._registry
            missing = [name for name in names if name not in registry]
            if od is not None:
                od.stats.host_hits += len(names) - len(missing)
            for name in sorted(missing):
                if name in self.lora_ref_cache and (od is None or name not in od._from_source):
                    continue  # SGLang reloads what was loaded by path and dropped (--max-loaded-loras, the host tier)
                if od is None or not (od.sources or lora_remote.address()):
                    raise AdapterError(f"LoRA adapter '{name}' is not loaded (load it with /load_lora_adapter, or "
                                       "start the server with --multilora-adapter-source)")
                await od.ensure(self, name)
        return await original(self, obj, *args, **kwargs)
    finally:
        if od is not None:
            od.wanted.subtract(names)
            for name in names:
                if od.wanted[name] <= 0:
                    del od.wanted[name]


async def unload_lora_adapter(original, self, obj, *args, **kwargs):
    """AROUND hook on `TokenizerManager.unload_lora_adapter(obj)`: the name is forgotten once unloaded."""
    result = await original(self, obj, *args, **kwargs)
    if result.success and obj.lora_name:
        self.lora_ref_cache.pop(obj.lora_name, None)
        od = getattr(self, "_multilora_on_demand", None)
        if od is not None:
            od.forget(obj.lora_name)
    return result
