"""The unified pool: token-sized slots shared by adapter weights and KV, accounted by kind.

Lives here: `UnifiedPool` (the one owner of slot ids and per-kind counts), `SlotRuns`, `slots_for_bytes`
and `ExceedsPoolError`. Not here: what to evict or prefetch (`swapper.py`), which adapter holds which slots
(`residency.py`), the KV tree (`tree.py`) or the host tier.

One slot holds what one token's K and V hold over all layers (S-LoRA / ELORA unified paging), so KV takes one
slot per token and an adapter `slots_for_bytes(weight bytes, slot bytes)` slots: in proportion to its own rank
and target modules, never padded to a maximum rank. Slot ids and their place in SGLang's per-layer KV buffers:
```
slot id  0                                                                               num_slots
         | KV: kv_cached / kv_running, sorted free list's front -> | free |  <- adapter C | B | A |
                                                                                  ^ a = first id of A, n slots
for every layer l:  k_buffer[l][s] and v_buffer[l][s] are (kv_heads x head_dim) each, for every slot s
adapter A, slots [a, a + n):  layer l's LoRA weights (A and B of every target module, rank rows)
                              fill k_buffer[l][a:a+n] ++ v_buffer[l][a:a+n]
                              (n x 2 x kv_heads x head_dim elements, one contiguous view per buffer)
```
KV is taken from the front of a sorted free list and adapters best-fit from the top, so KV stays at low ids,
adapters in few, long runs, and an adapter's weights can be viewed in place. The free list is SGLang's own
(`TokenToKVPoolAllocator`): ids freed go to a side list and are merged back, sorted, only when the front runs
short, so an allocation or a release costs array operations on its own ids, never a walk over free runs (KV
that is freed stays out of use until the next merge, then the lowest ids go first again). An adapter's run is
found from the per-slot kind array when it is allocated: contiguous only if some free run is long enough;
`largest_free_run()` says whether one is; otherwise the pool hands out the fewest runs (largest first) and a
reader must gather per run (as S-LoRA's kernels do). A run can also be made by moving KV rather than evicting it:
`cheapest_window` finds the window holding the fewest used slots and no blocked one (adapters, copies in flight),
`evacuate` moves what it holds to the lowest free ids outside it (the caller copies the KV and renames the ids).
Kinds, at every step:
free + adapter + kv_cached + kv_running + in_flight == num_slots.
`in_flight` is reserved for a host->device copy not finished (an adapter's weights, KV coming back).

Two modes (a choice of this module): `track_ids=True` hands out and takes back slot ids (the live server,
where the ids index SGLang's KV buffers; the pool keeps a kind code per slot, a numpy array, and checks each
release against it); `track_ids=False` keeps the counts only (the simulator, whose tree values are owner tags,
not slot ids): `alloc` returns `SlotRuns` without runs, and `move` / `release` take a count or any sized
sequence. In the server, SGLang's token allocator (page size 1) delegates its `alloc` / `free` to
`alloc("kv_running", n)` / `release`, so the ids SGLang writes KV into are the ones drawn above and adapters
borrow from the same free slots.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

KINDS = ("adapter", "kv_cached", "kv_running", "in_flight")
_CODE = {kind: i + 1 for i, kind in enumerate(KINDS)}  # 0: free
_FREE = 0
_NO_IDS = np.empty(0, dtype=np.int64)


def slots_for_bytes(num_bytes: int, slot_bytes: int) -> int:
    """Slots that hold `num_bytes`: ceil(num_bytes / slot_bytes). Raises ValueError for a negative size or a
    non-positive slot size."""
    if num_bytes < 0 or slot_bytes <= 0:
        raise ValueError(f"need num_bytes >= 0 and slot_bytes > 0, got {num_bytes} and {slot_bytes}")
    return -(-num_bytes // slot_bytes)


class ExceedsPoolError(ValueError):
    """A request for more slots than the whole pool holds: it can never be served ("never", not "not now")."""

    def __init__(self, what: str, num_slots: int, pool_slots: int, slot_bytes: int) -> None:
        self.what, self.num_slots, self.pool_slots = what, num_slots, pool_slots
        super().__init__(f"{what} needs {num_slots} slots ({num_slots * slot_bytes} B) but the whole pool "
                         f"holds {pool_slots} slots ({pool_slots * slot_bytes} B)")


class SlotRuns:
    """Slots handed out together, in the order taken: as `runs` of consecutive ids (start, length) and as an
    int64 id array (`array()`); whichever was not given is derived on first use. A pool without ids hands out
    `SlotRuns(n)` (no runs). Two are equal when they hold the same runs in the same order."""

    __slots__ = ("num_slots", "_runs", "_ids")

    def __init__(self, num_slots: int, runs: tuple[tuple[int, int], ...] = (), *,
                 ids: np.ndarray | None = None) -> None:
        self.num_slots = num_slots
        self._runs = None if ids is not None else tuple(runs)
        self._ids = ids

    @property
    def runs(self) -> tuple[tuple[int, int], ...]:
        if self._runs is None:
            self._runs = _runs_in_order(self._ids)
        return self._runs

    def array(self) -> np.ndarray:
        """The ids as an int64 array (shared: do not write to it)."""
        if self._ids is None:
            self._ids = _ids_of_runs(self._runs, self.num_slots)
        return self._ids

    def ids(self) -> list[int]:
        return self.array().tolist()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SlotRuns):
            return NotImplemented
        return self.num_slots == other.num_slots and self.runs == other.runs

    def __repr__(self) -> str:
        return f"SlotRuns({self.num_slots}, {self.runs})"


def _ids_of_runs(runs: Sequence[tuple[int, int]], num_slots: int) -> np.ndarray:
    if not runs:
        return _NO_IDS
    if len(runs) == 1:
        start, n = runs[0]
        return np.arange(start, start + n, dtype=np.int64)
    starts, lens = np.array(runs, dtype=np.int64).T
    # position i of run r holds starts[r] + (i - the position run r starts at)
    return np.arange(num_slots, dtype=np.int64) + np.repeat(starts - (np.cumsum(lens) - lens), lens)


def _runs_in_order(ids: np.ndarray) -> tuple[tuple[int, int], ...]:
    """Maximal stretches of consecutive ids, in array order."""
    n = len(ids)
    if not n:
        return ()
    bounds = np.flatnonzero(ids[1:] != ids[:-1] + 1) + 1
    starts = ids[np.concatenate(([0], bounds))].tolist()
    lens = np.diff(bounds, prepend=0, append=n).tolist()
    return tuple(zip(starts, lens))


def runs_of(ids: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Slot ids as sorted runs; raises ValueError naming a duplicate id."""
    if not len(ids):
        return ()
    return _runs_in_order(_checked_ids(np.asarray(ids, dtype=np.int64), sort=True))


def _checked_ids(ids: np.ndarray, *, sort: bool = False) -> np.ndarray:
    """`ids` (sorted when `sort`), after checking that no id appears twice; ValueError names one that does."""
    if len(ids) < 2 or (ids[1:] > ids[:-1]).all():
        return ids
    ordered = _sorted_distinct(ids)
    return ordered if sort else ids


def _sorted_distinct(ids: np.ndarray) -> np.ndarray:
    """`ids` sorted (a fresh array), after checking that no id appears twice; ValueError names one that does."""
    ordered = np.sort(ids)
    same = np.flatnonzero(ordered[1:] == ordered[:-1])
    if len(same):
        raise ValueError(f"slot id {int(ordered[same[0]])} given twice")
    return ordered


def _free_runs(kinds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the runs of free slots, ascending by start: a few passes over the kind array."""
    free = kinds == _FREE
    edges = np.flatnonzero(free[1:] != free[:-1]) + 1  # where a run of one state ends and the next begins
    bounds = np.concatenate(([0], edges, [len(kinds)]))
    first = 0 if len(kinds) and free[0] else 1  # the index in bounds of the first free run's start
    starts, ends = bounds[first:-1:2], bounds[first + 1::2]
    return starts, ends - starts


class UnifiedPool:
    """Owner of `num_slots` slots of `slot_bytes` each. Check first, then act: `can_fit` is a pure query,
    `alloc` / `reserve` return None when the slots are not free now ("not now") and raise `ExceedsPoolError`
    for more than the whole pool ("never"); `move` re-labels slots between kinds; `release` frees them.
    Misuse (moving or freeing more than a kind holds, a slot of another kind) fails an assertion that names
    the kind."""

    def __init__(self, num_slots: int, slot_bytes: int, *, track_ids: bool = True) -> None:
        if num_slots <= 0 or slot_bytes <= 0:
            raise ValueError(f"a pool needs num_slots > 0 and slot_bytes > 0, got {num_slots}, {slot_bytes}")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.track_ids = track_ids
        self._num = {kind: 0 for kind in KINDS}
        self._num_free = num_slots
        # with ids: a kind code per slot; the free ids are _free[_head:] (sorted) and the arrays in _freed
        self._kind = np.zeros(num_slots if track_ids else 0, dtype=np.uint8)
        self._free = np.arange(num_slots if track_ids else 0, dtype=np.int64)
        self._head = 0
        self._freed: list[np.ndarray] = []
        # Releases so far. Between two releases the free slots only shrink, so runs a reader could not use stay
        # unusable: a refused placement is worth retrying only after this moves.
        self.num_releases = 0

    # ---- queries ---------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_slots - self._num_free

    def num_of(self, kind: str) -> int:
        return self._num[kind]

    def by_kind(self) -> dict[str, int]:
        """Slots of each kind and "free" (a snapshot)."""
        return {**self._num, "free": self._num_free}

    def slots_for_bytes(self, num_bytes: int) -> int:
        return slots_for_bytes(num_bytes, self.slot_bytes)

    def can_fit(self, num_slots: int) -> bool:
        return 0 <= num_slots <= self._num_free

    def largest_free_run(self) -> int:
        """Longest run of consecutive free ids (the free count without ids). O(num_slots) array work."""
        if not self.track_ids:
            return self._num_free
        lens = _free_runs(self._kind)[1]
        return int(lens.max()) if len(lens) else 0

    def kind_mask(self, kinds: Iterable[str]) -> np.ndarray:
        """A fresh bool array over slot ids: True where the slot is of one of `kinds` (ids tracked only).
        One comparison per kind (`np.isin` sorts, and was most of a `Swapper.run_reachable` call)."""
        mask = np.zeros(len(self._kind), dtype=bool)
        for kind in kinds:
            mask |= self._kind == _CODE[kind]
        return mask

    def free_ids(self) -> np.ndarray:
        """Every free id, ascending (a fresh array)."""
        return np.flatnonzero(self._kind == _FREE)

    # ---- mutations -------------------------------------------------------------------------------

    def alloc(self, kind: str, num_slots: int, *, contiguous: bool = False) -> SlotRuns | None:
        """Takes `num_slots` free slots as `kind`; None (nothing changed) when fewer are free. `contiguous`
        (adapters): best fit from the top, else the fewest runs; otherwise the free list's front (KV)."""
        assert kind in _CODE, f"unknown slot kind {kind!r}; kinds: {KINDS}"
        if num_slots > self.num_slots:
            raise ExceedsPoolError(f"{num_slots} slots of {kind}", num_slots, self.num_slots, self.slot_bytes)
        if not self.can_fit(num_slots):
            return None
        self._num_free -= num_slots
        self._num[kind] += num_slots
        if not self.track_ids:
            return SlotRuns(num_slots)
        if contiguous:
            runs = self._take_top(num_slots)
            slots = SlotRuns(num_slots, runs)
            where = slice(runs[0][0], runs[0][0] + num_slots) if len(runs) == 1 else slots.array()
        else:
            where = ids = self._take_front(num_slots)  # ascending and distinct: one run when its ends say so
            slots = SlotRuns(num_slots, ids=ids)
            if num_slots and int(ids[-1]) - int(ids[0]) == num_slots - 1:
                where = slice(int(ids[0]), int(ids[-1]) + 1)
        self._kind[where] = _CODE[kind]
        if contiguous:
            self._drop_taken()
        return slots

    def reserve(self, num_slots: int, *, contiguous: bool = False) -> SlotRuns | None:
        """`alloc("in_flight", ...)`: slots for a copy not yet finished."""
        return self.alloc("in_flight", num_slots, contiguous=contiguous)

    def move(self, src: str, dst: str, slots: int | SlotRuns | Sequence[int] | np.ndarray) -> None:
        """Re-labels slots from kind `src` to `dst` (ids required when the pool tracks them)."""
        n, ids, where = self._resolve(src, slots)
        assert dst in _CODE, f"unknown slot kind {dst!r}; kinds: {KINDS}"
        self._num[src] -= n
        self._num[dst] += n
        if ids is not None and n:
            self._kind[where] = _CODE[dst]

    def release(self, kind: str, slots: int | SlotRuns | Sequence[int] | np.ndarray) -> None:
        """Frees slots of `kind` (ids required when the pool tracks them): they join the free list at its
        next merge."""
        n, ids, where = self._resolve(kind, slots, keep=True)
        self._num[kind] -= n
        self._num_free += n
        self.num_releases += n > 0
        if ids is not None and n:
            self._kind[where] = _FREE
            self._freed.append(ids)

    def release_all(self, kind: str) -> int:
        """Frees every slot of `kind` (a cache flush); returns how many. With ids: one scan of the kind codes."""
        assert kind in _CODE, f"unknown slot kind {kind!r}; kinds: {KINDS}"
        n = self._num[kind]
        if n:
            self.release(kind, np.flatnonzero(self._kind == _CODE[kind]) if self.track_ids else n)
        return n

    def cheapest_window(self, run: int, blocked: np.ndarray) -> int | None:
        """First id of the window of `run` consecutive ids with no `blocked` slot and the fewest used ones (what
        `evacuate` would move out of it; ties: the highest window, away from the KV at the front), or None when
        there is none or fewer than `run` slots are free (the used ones must have somewhere to go). Pure query,
        ids tracked only; O(num_slots) array work."""
        assert self.track_ids, "a pool without slot ids has no windows"
        if run <= 0 or run > self.num_slots or self._num_free < run:
            return None
        used = np.concatenate(([0], np.cumsum(self._kind != _FREE)))
        stuck = np.concatenate(([0], np.cumsum(blocked)))
        in_window, stuck_in = used[run:] - used[:-run], stuck[run:] - stuck[:-run]
        cost = np.where(stuck_in == 0, in_window, self.num_slots + 1)
        best = int(cost.min())
        if best > self.num_slots:
            return None
        return int(np.flatnonzero(cost == best)[-1])

    def evacuate(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Frees the window [start, start + length) by moving each used slot in it to the lowest free id outside
        it; the target takes its source's kind. Returns (sources, targets), aligned, ascending by source: the
        caller copies the contents and rewrites whatever names the old ids. Counts per kind do not change.
        Needs `length` free slots in all (`cheapest_window` checks it); ids tracked only."""
        assert self.track_ids, "a pool without slot ids has no slots to move"
        assert 0 <= start and start + length <= self.num_slots, f"window [{start}, {start + length}) off the pool"
        sources = start + np.flatnonzero(self._kind[start:start + length] != _FREE)
        if not len(sources):
            return _NO_IDS, _NO_IDS
        free = self.free_ids()
        free = free[(free < start) | (free >= start + length)]
        assert len(free) >= len(sources), f"{len(sources)} slots to move, {len(free)} free outside the window"
        targets = free[:len(sources)]
        self._kind[targets] = self._kind[sources]
        self._kind[sources] = _FREE
        self._drop_taken()
        self._freed.append(sources)
        self.num_releases += 1
        return sources, targets

    # ---- invariants ------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """free + every kind == num_slots; with ids, the kind codes and the free list agree with the counts.
        O(num_slots) with ids. Raises AssertionError naming the first broken rule."""
        assert min(self._num.values()) >= 0 and self._num_free >= 0, f"negative count: {self.by_kind()}"
        assert self._num_free + sum(self._num.values()) == self.num_slots, (
            f"free {self._num_free} + {self._num} != {self.num_slots} slots")
        if not self.track_ids:
            return
        coded = np.bincount(self._kind, minlength=len(KINDS) + 1)
        for kind, code in _CODE.items():
            assert coded[code] == self._num[kind], f"{coded[code]} slots coded {kind}, counted {self._num[kind]}"
        listed = np.sort(np.concatenate([self._free[self._head:], *self._freed]))
        assert np.array_equal(listed, self.free_ids()), (
            f"free list ({len(listed)} ids) out of step with the free slots ({self._num_free})")

    # ---- internals -------------------------------------------------------------------------------

    def _resolve(self, kind: str, slots, *, keep: bool = False) -> tuple[int, np.ndarray | None, object]:
        """(count, ids or None without ids, where to index the kind codes) of `slots`, checked against `kind`'s
        count and each slot's kind. `keep`: the ids may be kept (the free list): a caller's array is copied.
        Where: a slice when the ids are one ascending run (no gather), else the ids."""
        assert kind in _CODE, f"unknown slot kind {kind!r}; kinds: {KINDS}"
        if isinstance(slots, int):
            assert not self.track_ids, "this pool tracks slot ids: pass the ids (or the SlotRuns) back"
            n, ids = slots, None
        elif not self.track_ids:
            n, ids = (slots.num_slots if isinstance(slots, SlotRuns) else len(slots)), None
        else:
            if isinstance(slots, SlotRuns):
                ids = slots.array()
            elif type(slots) is np.ndarray and slots.dtype == np.int64 and slots.ndim == 1 and not keep:
                ids = slots
            else:
                ids = np.array(slots, dtype=np.int64).reshape(-1)  # a copy: the free list may keep it
            n = len(ids)
        assert 0 <= n <= self._num[kind], f"{n} slots of {kind} given back but only {self._num[kind]} are held"
        if ids is None or not n:
            return n, ids, None
        if n == 1 or not np.count_nonzero(ids[1:] <= ids[:-1]):  # ascending, so distinct
            lo, hi = int(ids[0]), int(ids[-1])
            where = slice(lo, hi + 1) if hi - lo == n - 1 else ids  # one run: indexed without a gather
        else:
            ordered = _sorted_distinct(ids)  # not ascending (just checked): raises on a repeated id
            lo, hi, where = int(ordered[0]), int(ordered[-1]), ids
        assert 0 <= lo and hi < self.num_slots, f"slot ids outside [0, {self.num_slots})"
        wrong = self._kind[where] != _CODE[kind]
        if np.count_nonzero(wrong):
            bad = int(ids[int(np.argmax(wrong))])  # a slice's codes are the run's, in the same order
            start, length = next((s, k) for s, k in runs_of(ids) if s <= bad < s + k)
            raise AssertionError(f"slots [{start}, {start + length}) are not all {kind}: "
                                 "freed twice or of another kind")
        return n, ids, where

    def _take_front(self, num_slots: int) -> np.ndarray:
        if len(self._free) - self._head < num_slots:  # merge what was freed since, sorted (SGLang's way)
            self._free = np.sort(np.concatenate([self._free[self._head:], *self._freed]))
            self._head, self._freed = 0, []
        ids = self._free[self._head:self._head + num_slots]
        self._head += num_slots
        return ids

    def _take_top(self, num_slots: int) -> tuple[tuple[int, int], ...]:
        starts, lens = _free_runs(self._kind)
        fits = np.flatnonzero(lens >= num_slots)
        if len(fits):  # best fit; ties: the highest run
            best = fits[lens[fits] == lens[fits].min()][-1]
            return ((int(starts[best] + lens[best]) - num_slots, num_slots),)
        runs = []
        for i in np.lexsort((-starts, -lens)).tolist():  # the largest runs first (ties: the highest)
            take = min(int(lens[i]), num_slots)
            runs.append((int(starts[i] + lens[i]) - take, take))
            num_slots -= take
            if not num_slots:
                return tuple(runs)
        raise AssertionError("free runs shorter than the free count")

    def _drop_taken(self) -> None:
        """After ids were taken from anywhere (an adapter's runs): the free list keeps only free ids (the front
        stays sorted; what was freed since is merged later)."""
        front = self._free[self._head:]
        self._free, self._head = front[self._kind[front] == _FREE], 0
        if self._freed:
            freed = np.concatenate(self._freed)
            self._freed = [freed[self._kind[freed] == _FREE]]
