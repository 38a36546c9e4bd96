"""Which adapters' weights hold slots of the unified pool, in which slots, and how many running requests
use each.

Lives here: `AdapterResidency` (the one owner of every adapter's state: absent, loading, resident), its
records and the `Loader` protocol a caller implements to copy weights in. Not here: choosing what to load or
evict (`swapper.py`), the slots themselves (`pool.py`), the copies (the caller's loader).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from sgl_multilora.pool import ExceedsPoolError, SlotRuns, UnifiedPool

if TYPE_CHECKING:
    from sgl_multilora.policy.usage import UsageStats


class Loader(Protocol):
    """Copies an adapter's weights from the host into its slots; supplied by the caller (the simulator's
    PCIe link, the server's copy stream). `start` begins the copy and returns at once, or returns False to
    refuse slots it cannot use (runs too short for a weight matrix to sit whole in one); `is_done` is a pure
    query that becomes True once the weights can be read. A loader that refuses may also define
    `min_run(adapter_id) -> int`, the shortest run any placement of that adapter needs: the swapper then frees a
    run that long before one as long as the whole adapter."""

    def start(self, adapter_id: str, slots: SlotRuns) -> bool | None: ...
    def is_done(self, adapter_id: str) -> bool: ...


class AdapterState(Enum):
    ABSENT = "absent"  # weights only on the host
    LOADING = "loading"  # slots reserved (in_flight), copy under way
    RESIDENT = "resident"  # slots of kind "adapter", weights readable


@dataclass(slots=True, eq=False)
class AdapterEntry:
    """One adapter. `slots` are its slot runs while loading or resident (None when absent); `num_running`
    counts the running requests that use it (a used adapter is never dropped)."""

    adapter_id: str
    num_slots: int
    state: AdapterState = AdapterState.ABSENT
    slots: SlotRuns | None = None
    num_running: int = 0


class AdapterResidency:
    """Adapters by id (the tree's `AdapterRef.identity`, which `UsageStats` records are keyed by too).

    `num_slots`: each adapter's size in slots (`pool.slots_for_bytes` of its weight bytes, or more for a
    system that pads). `usage`: told when an adapter becomes resident or leaves (ELORA's N in Low_lora).
    Raises `ExceedsPoolError` for an adapter larger than the whole pool.
    """

    def __init__(self, pool: UnifiedPool, num_slots: dict[str, int], usage: UsageStats | None = None) -> None:
        self.pool = pool
        self.usage = usage
        self._entries: dict[str, AdapterEntry] = {}
        self._resident: dict[str, None] = {}  # ordered sets: iteration never depends on hashing
        self._loading: dict[str, None] = {}
        self._running: set[str] = set()  # adapters with num_running > 0
        self.num_loads = 0  # loads started (on demand and prefetched)
        # Bumped by every change of an adapter's state or running count: equal values mean nothing changed between.
        self.version = 0
        for adapter_id, n in num_slots.items():
            self.add(adapter_id, n)

    def add(self, adapter_id: str, num_slots: int) -> None:
        """Registers an adapter (absent). Raises ExceedsPoolError when it can never fit, ValueError if known."""
        if adapter_id in self._entries:
            raise ValueError(f"adapter {adapter_id!r} registered twice")
        if num_slots > self.pool.num_slots:
            raise ExceedsPoolError(f"adapter {adapter_id!r}", num_slots, self.pool.num_slots,
                                   self.pool.slot_bytes)
        self._entries[adapter_id] = AdapterEntry(adapter_id, num_slots)
        self.version += 1

    def remove(self, adapter_id: str) -> None:
        """Forgets an absent adapter (unloaded by its user). Asserts it is absent and unused."""
        e = self._entries[adapter_id]
        assert e.state is AdapterState.ABSENT and e.num_running == 0, (
            f"removing adapter {adapter_id!r} that is {e.state.value} with {e.num_running} running requests")
        del self._entries[adapter_id]
        self.version += 1

    # ---- queries ---------------------------------------------------------------------------------

    def entry(self, adapter_id: str) -> AdapterEntry:
        """The live record (read it, never write it). Raises KeyError for an unknown adapter."""
        return self._entries[adapter_id]

    def __contains__(self, adapter_id: object) -> bool:
        """Whether `adapter_id` is registered."""
        return adapter_id in self._entries

    def ids(self) -> list[str]:
        """Every registered adapter, in registration order."""
        return list(self._entries)

    def is_resident(self, adapter_id: str) -> bool:
        return adapter_id in self._resident

    def is_loading(self, adapter_id: str) -> bool:
        return adapter_id in self._loading

    def resident_ids(self) -> list[str]:
        """Resident adapters in the order they arrived (a snapshot)."""
        return list(self._resident)

    def loading_ids(self) -> list[str]:
        return list(self._loading)

    @property
    def num_resident(self) -> int:
        return len(self._resident)

    def num_running(self, adapter_id: str) -> int:
        return self._entries[adapter_id].num_running

    def resident_slots(self) -> int:
        return sum(self._entries[a].num_slots for a in self._resident)

    def loading_slots(self) -> int:
        return sum(self._entries[a].num_slots for a in self._loading)

    # ---- transitions -----------------------------------------------------------------------------

    def begin_load(self, adapter_id: str) -> SlotRuns | None:
        """Reserves the adapter's slots (in_flight, one run if a free run is long enough) and marks it
        loading; None, changing nothing, when the slots are not free now. Asserts it is absent."""
        e = self._entries[adapter_id]
        assert e.state is AdapterState.ABSENT, f"load of adapter {adapter_id!r} that is {e.state.value}"
        slots = self.pool.reserve(e.num_slots, contiguous=True)
        if slots is None:
            return None
        e.state, e.slots = AdapterState.LOADING, slots
        self._loading[adapter_id] = None
        self.version += 1
        self.num_loads += 1
        return slots

    def finish_load(self, adapter_id: str) -> None:
        """The copy is done: its slots become "adapter" and it is resident."""
        e = self._entries[adapter_id]
        assert e.state is AdapterState.LOADING, f"finishing adapter {adapter_id!r} that is {e.state.value}"
        self.pool.move("in_flight", "adapter", e.slots)
        e.state = AdapterState.RESIDENT
        del self._loading[adapter_id]
        self._resident[adapter_id] = None
        self.version += 1
        if self.usage is not None:
            self.usage.set_resident(adapter_id, True)

    def abort_load(self, adapter_id: str) -> None:
        """A copy that cannot go on (its slots cannot hold the weights): frees the reserved slots; absent."""
        e = self._entries[adapter_id]
        assert e.state is AdapterState.LOADING, f"aborting adapter {adapter_id!r} that is {e.state.value}"
        self.pool.release("in_flight", e.slots)
        e.state, e.slots = AdapterState.ABSENT, None
        del self._loading[adapter_id]
        self.version += 1

    def complete_loads(self, loader: Loader) -> list[str]:
        """Finishes every load `loader` reports done, in the order they started; returns their ids."""
        if not self._loading:
            return []
        done = [a for a in self._loading if loader.is_done(a)]
        for adapter_id in done:
            self.finish_load(adapter_id)
        return done

    def drop(self, adapter_id: str) -> None:
        """Frees a resident adapter's slots (its host copy stays). Asserts no running request uses it."""
        e = self._entries[adapter_id]
        assert e.state is AdapterState.RESIDENT, f"dropping adapter {adapter_id!r} that is {e.state.value}"
        assert e.num_running == 0, f"dropping adapter {adapter_id!r} used by {e.num_running} running requests"
        self.pool.release("adapter", e.slots)
        e.state, e.slots = AdapterState.ABSENT, None
        del self._resident[adapter_id]
        self.version += 1
        if self.usage is not None:
            self.usage.set_resident(adapter_id, False)

    def acquire(self, adapter_id: str) -> None:
        """A running request starts using the adapter (it must be resident)."""
        e = self._entries[adapter_id]
        assert e.state is AdapterState.RESIDENT, f"request admitted on adapter {adapter_id!r}, {e.state.value}"
        e.num_running += 1
        self._running.add(adapter_id)
        self.version += 1

    def release(self, adapter_id: str) -> None:
        e = self._entries[adapter_id]
        assert e.num_running > 0, f"release of adapter {adapter_id!r} that no running request holds"
        e.num_running -= 1
        self.version += 1
        if not e.num_running:
            self._running.discard(adapter_id)

    def set_running(self, counts: dict[str, int]) -> None:
        """Sets every adapter's running-request count at once (absent ids: 0), for an owner that reads them
        off its scheduler's batches instead of counting admissions and finishes. Asserts that only resident
        adapters run. O(adapters running before and now), not O(adapters)."""
        entries = self._entries
        for adapter_id in self._running.difference(counts):
            entries[adapter_id].num_running = 0
        running = set()
        for adapter_id, n in counts.items():
            e = entries[adapter_id]
            assert n == 0 or e.state is AdapterState.RESIDENT, (
                f"{n} running requests on adapter {adapter_id!r}, which is {e.state.value}")
            e.num_running = n
            if n:
                running.add(adapter_id)
        self._running = running
        self.version += 1

    # ---- invariants ------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """States, the ordered sets and the pool's "adapter" count agree (this table is the only owner of
        that kind); in-flight slots cover the loads; only resident adapters run. O(adapters)."""
        for a, e in self._entries.items():
            assert (e.state is AdapterState.RESIDENT) == (a in self._resident), f"adapter {a!r} set out of step"
            assert (e.state is AdapterState.LOADING) == (a in self._loading), f"adapter {a!r} load out of step"
            assert (e.slots is None) == (e.state is AdapterState.ABSENT), f"adapter {a!r} slots out of step"
            assert e.slots is None or e.slots.num_slots == e.num_slots, f"adapter {a!r} holds the wrong size"
            assert e.num_running >= 0 and (e.num_running == 0 or a in self._resident), (
                f"adapter {a!r} runs {e.num_running} requests while {e.state.value}")
            assert (e.num_running > 0) == (a in self._running), f"adapter {a!r} running set out of step"
        assert self.pool.num_of("adapter") == self.resident_slots(), (
            f"pool holds {self.pool.num_of('adapter')} adapter slots, resident adapters "
            f"{self.resident_slots()}")
        assert self.pool.num_of("in_flight") >= self.loading_slots(), "in-flight slots below the loads"
