"""The LoRA server's device slots: which adapters are resident where compute can read them, and who goes on a miss.

Lives here: `SlotPool` (the slots, pins, loads, evictions, their counters) and `SlotEvent`. Not here: the host
copies (`catalog.py`), the score (`sgl_multilora.policy`, by name), the maths (`compute.py`).

    slots    | s0: a (pins 1) | s1: b | s2: -  | s3: - |      free + resident == total
    tables   a: {(layer, group, expert): (A_fused, B_fused)} on the device, built at load

A resident adapter's tables are fused per (layer, group, expert): A (num_modules * r, in) with the group's modules
stacked by rows, B (out_total, r) stacked by rows, zeros for a module the adapter does not target (one GEMM pair per
group, the layout `triton_kernels.LoRAWeights.from_list` reads). A miss copies host -> slot; when no slot is free,
the unpinned resident adapter with the lowest policy score is evicted. Pins are held only while a call computes
(`acquire` ... `release` in a `finally`), so a client that vanishes mid-call leaves no pin behind.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sgl_multilora.lora_server.catalog import Catalog, HostAdapter, ServerModel
from sgl_multilora.lora_server.protocol import GROUP_OF, GROUPS
from sgl_multilora.policy import create_policy
from sgl_multilora.policy.usage import UsageStats

Tables = dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]]  # (layer, group, expert) -> (A, B)


@dataclass(frozen=True, slots=True)
class SlotEvent:
    """One load or eviction, in order (tests read them as a story)."""

    kind: str  # "load" | "evict"
    adapter: str
    slot: int


class NoFreeSlot(RuntimeError):
    """Not now: every slot holds a pinned adapter (or the byte budget is spent by pinned ones)."""


def fuse_tables(adapter: HostAdapter, model: ServerModel, device: torch.device | str) -> Tables:
    """An adapter's per-(layer, group, expert) fused A / B on `device` (see the module docstring). Pure."""
    by_key: dict[tuple[int, str, int], dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (layer, module, expert), ab in adapter.units.items():
        by_key.setdefault((layer, GROUP_OF[module], expert), {})[module] = ab
    rank = adapter.spec.rank
    tables: Tables = {}
    for (layer, group, expert), present in by_key.items():
        a_parts, b_parts = [], []
        for module in GROUPS[group]:
            if module in present:
                a, b = present[module]
            else:  # not targeted: a zero block keeps the group's column layout
                dims = model.module_dims(module)
                a, b = torch.zeros(rank, dims.in_features), torch.zeros(dims.out_features, rank)
            a_parts.append(a), b_parts.append(b)
        tables[(layer, group, expert)] = (torch.cat(a_parts).to(device), torch.cat(b_parts).to(device))
    return tables


class SlotPool:
    """`max_slots` device slots (and, when `max_bytes` is set, at most that many resident weight bytes, counted as
    `HostAdapter.num_bytes`) over the adapters of `catalog`, evicting by the policy named `policy`.

    Owned by one thread (the server's compute thread). Queries (`is_resident`, `free_slots`, `residency`) never
    mutate. `acquire` loads and pins, `release` unpins, `prefetch_one` loads a queued prefetch, `forget` drops an
    unloaded adapter. `clock` gives the policy's time (seconds); tests pass a fake one.
    """

    def __init__(self, catalog: Catalog, max_slots: int, policy: str = "lru", max_bytes: int | None = None,
                 device: torch.device | str = "cpu", clock: Callable[[], float] = time.monotonic,
                 copy_bytes_per_s: float = 25e9) -> None:
        if max_slots < 1:
            raise ValueError(f"the LoRA server needs at least one slot, got --max-slots {max_slots}")
        self.catalog, self.max_slots, self.max_bytes = catalog, max_slots, max_bytes
        self.device, self.clock = torch.device(device), clock
        self.stats = UsageStats({n: a.num_bytes for n, a in catalog.adapters.items()}, kv_bytes_per_token=0,
                                kv_reload_s_per_token=0.0, adapter_reload_s=lambda b: b / copy_bytes_per_s)
        self.policy = create_policy(policy, context=self.stats)
        self._slots: list[str | None] = [None] * max_slots
        self._slot_of: dict[str, int] = {}
        self._tables: dict[str, Tables] = {}
        self._pins: dict[str, int] = {}
        self.loading: deque[str] = deque()
        self.in_use: set[str] = set()  # adapters workers declared in use (the server keeps it current)
        self.events: deque[SlotEvent] = deque(maxlen=4096)
        self.counters = {"hits": 0, "misses": 0, "loads": 0, "evictions": 0, "load_s": 0.0}

    # ---- queries ---------------------------------------------------------------------------------

    def is_resident(self, name: str) -> bool:
        return name in self._slot_of

    def free_slots(self) -> int:
        return self.max_slots - len(self._slot_of)

    def resident_bytes(self) -> int:
        return sum(self.catalog.adapters[n].num_bytes for n in self._slot_of)

    def residency(self) -> dict:
        """Resident adapters in slot order, free slots, queued prefetches and pins (JSON-ready)."""
        return {"resident": [n for n in self._slots if n is not None], "free_slots": self.free_slots(),
                "loading": list(self.loading), "pinned": {n: p for n, p in self._pins.items() if p},
                "resident_bytes": self.resident_bytes(), "max_bytes": self.max_bytes}

    # ---- mutations -------------------------------------------------------------------------------

    def register(self, name: str) -> None:
        """Starts tracking an adapter the catalog loaded after start-up."""
        if name not in self.stats.records:
            self.stats.add_adapter(name, self.catalog.adapters[name].num_bytes)

    def forget(self, name: str) -> None:
        """Evicts (if resident) and stops tracking `name`; the catalog unloads it next. Raises NoFreeSlot when the
        adapter is pinned (a call computes with it now)."""
        if self._pins.get(name):
            raise NoFreeSlot(f"adapter {name!r} is in use by a running call")
        if name in self._slot_of:
            self._evict(name)
        if name in self.loading:
            self.loading.remove(name)
        if name in self.stats.records:
            self.stats.remove_adapter(name)

    def acquire(self, names: Sequence[str]) -> dict[str, Tables]:
        """Makes every adapter in `names` resident (loading misses, evicting unpinned others) and pins each once.
        Returns their tables, valid until `release(names)`. Raises NoFreeSlot (no pin left behind) when they do
        not all fit beside the pinned ones, KeyError for a name the catalog does not hold."""
        now = self.clock()
        wanted = list(dict.fromkeys(names))
        for name in wanted:
            self.catalog.adapters[name]  # KeyError before anything changes
        for name in wanted:
            self.stats.record_request(name, now)
        pinned: list[str] = []
        try:
            for name in wanted:  # hits first, so that no miss of this call evicts an adapter it also uses
                if name in self._slot_of:
                    self.counters["hits"] += 1
                    self._pin(name), pinned.append(name)
            for name in wanted:
                if name not in self._slot_of:
                    self.counters["misses"] += 1
                    self._load(name, now)
                    self._pin(name), pinned.append(name)
        except NoFreeSlot:
            self.release(pinned)
            raise
        return {name: self._tables[name] for name in wanted}

    def release(self, names: Sequence[str]) -> None:
        """Unpins each adapter once (the names `acquire` was given, duplicates collapsed as there)."""
        for name in dict.fromkeys(names):
            assert self._pins.get(name, 0) > 0, f"release of {name!r} without acquire"
            self._pins[name] -= 1

    def queue_prefetch(self, names: Sequence[str]) -> list[str]:
        """Queues loads of the named adapters not resident nor queued; returns those queued. Raises KeyError for a
        name the catalog does not hold (nothing queued then)."""
        for name in names:
            self.catalog.adapters[name]
        queued = [n for n in dict.fromkeys(names) if n not in self._slot_of and n not in self.loading]
        self.loading.extend(queued)
        return queued

    def prefetch_one(self) -> str | None:
        """Loads the oldest queued prefetch (evicting an unpinned adapter if needed); returns its name, or None when
        nothing is queued. A prefetch that cannot fit now is dropped (the next call's miss loads it)."""
        while self.loading:
            name = self.loading.popleft()
            if name in self._slot_of or name not in self.catalog.adapters:
                continue
            try:
                self._load(name, self.clock())
            except NoFreeSlot:
                return None
            return name
        return None

    def _pin(self, name: str) -> None:
        self._pins[name] = self._pins.get(name, 0) + 1

    def _fits(self, name: str) -> bool:
        if not self.free_slots():
            return False
        return self.max_bytes is None or self.resident_bytes() + self.catalog.adapters[name].num_bytes <= self.max_bytes

    def _load(self, name: str, now: float) -> None:
        adapter = self.catalog.adapters[name]
        if self.max_bytes is not None and adapter.num_bytes > self.max_bytes:
            raise NoFreeSlot(f"adapter {name!r} ({adapter.num_bytes} bytes) is larger than the slot budget "
                             f"({self.max_bytes} bytes, --slot-gb)")
        while not self._fits(name):
            victim = self._victim(now)
            if victim is None:
                raise NoFreeSlot(f"no slot for adapter {name!r}: all {len(self._slot_of)} resident adapters are "
                                 f"in use by this call or a running one")
            self._evict(victim)
        start = time.perf_counter()
        slot = self._slots.index(None)
        self._tables[name] = fuse_tables(adapter, self.catalog.model, self.device)
        self._slots[slot], self._slot_of[name] = name, slot
        self.stats.set_resident(name, True)
        if name in self.loading:
            self.loading.remove(name)
        self.counters["loads"] += 1
        self.counters["load_s"] += time.perf_counter() - start
        self.events.append(SlotEvent("load", name, slot))

    def _victim(self, now: float) -> str | None:
        """The unpinned resident adapter with the lowest score (ties: the lowest slot), one no worker declared in
        use (`in_use`) if there is one; None when all are pinned."""
        candidates = [n for n in self._slots if n is not None and not self._pins.get(n)]
        candidates = [n for n in candidates if n not in self.in_use] or candidates
        if not candidates:
            return None
        records = [self.stats.records[n] for n in candidates]
        scores = self.policy.score_many(records, now)
        return candidates[min(range(len(candidates)), key=scores.__getitem__)]

    def _evict(self, name: str) -> None:
        assert not self._pins.get(name), f"evicting pinned adapter {name!r}: a caller skipped acquire's pin check"
        slot = self._slot_of.pop(name)
        self._slots[slot] = None
        del self._tables[name]
        self._pins.pop(name, None)
        self.stats.set_resident(name, False)
        self.counters["evictions"] += 1
        self.events.append(SlotEvent("evict", name, slot))

    def check_invariants(self, idle: bool = True) -> None:
        """Asserts the bookkeeping: free + resident == total, slot table and index agree, every resident adapter is
        in the catalog and has tables, the byte budget holds, and (when `idle`) no pin is held."""
        resident = [n for n in self._slots if n is not None]
        assert self.free_slots() + len(resident) == self.max_slots, "slot count drifted"
        assert len(set(resident)) == len(resident), f"an adapter holds two slots: {resident}"
        assert {n: i for i, n in enumerate(self._slots) if n is not None} == self._slot_of, "slot index out of sync"
        assert set(self._tables) == set(self._slot_of), "tables of a non-resident adapter kept (or missing)"
        assert all(n in self.catalog.adapters for n in resident), "a resident adapter is not in the catalog"
        assert all(self.stats.records[n].resident for n in resident), "policy records disagree on residency"
        assert self.stats.num_resident_adapters() == len(resident), "policy's resident count drifted"
        assert self.max_bytes is None or self.resident_bytes() <= self.max_bytes, "byte budget exceeded"
        assert all(p >= 0 for p in self._pins.values()), f"negative pin count: {self._pins}"
        if idle:
            assert not any(self._pins.values()), f"pins held while idle: {self._pins} (a call skipped release)"
