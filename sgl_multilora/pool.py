"""The unified pool: token-sized slots shared by adapter weights and KV, accounted by kind.

Lives here: `UnifiedPool` (the one owner of slot ids and per-kind counts), `SlotRuns`, `slots_for_bytes`
and `ExceedsPoolError`. Not here: what to evict or prefetch (`swapper.py`), which adapter holds which slots
(`residency.py`), the KV tree (`tree.py`) or the host tier.

One slot holds what one token's K and V hold over all layers (S-LoRA / ELORA unified paging), so KV takes one
slot per token and an adapter `slots_for_bytes(weight bytes, slot bytes)` slots: in proportion to its own rank
and target modules, never padded to a maximum rank. Slot ids and their place in SGLang's per-layer KV buffers:
```
slot id  0                                                                               num_slots
         | KV: kv_cached / kv_running, lowest free ids first ->  | free |  <- adapter C | B | A |
                                                                                  ^ a = first id of A, n slots
for every layer l:  k_buffer[l][s] and v_buffer[l][s] are (kv_heads x head_dim) each, for every slot s
adapter A, slots [a, a + n):  layer l's LoRA weights (A and B of every target module, rank rows)
                              fill k_buffer[l][a:a+n] ++ v_buffer[l][a:a+n]
                              (n x 2 x kv_heads x head_dim elements, one contiguous view per buffer)
```
KV is taken from the lowest free runs and adapters best-fit from the top, so adapters stay in few, long runs
and an adapter's weights can be viewed in place. A run is contiguous only if some free run is long enough:
`largest_free_run()` says whether it is; otherwise the pool hands out the fewest runs (largest first) and a
reader must gather per run (as S-LoRA's kernels do). Kinds, at every step:
free + adapter + kv_cached + kv_running + in_flight == num_slots.
`in_flight` is reserved for a host->device copy not finished (an adapter's weights, KV coming back).

Two modes (a choice of this module): `track_ids=True` hands out and takes back slot ids (the live server,
where the ids index SGLang's KV buffers; the pool keeps a kind code per slot and checks each release);
`track_ids=False` keeps the counts only (the simulator, whose tree values are owner tags, not slot ids):
`alloc` returns `SlotRuns` without runs, and `move` / `release` take a count or any sized sequence. In the
server, SGLang's token allocator (page size 1) is to delegate its `alloc` / `free` to `alloc("kv_running", n)` /
`release`, so the ids SGLang writes KV into are the ones drawn above and adapters borrow from the same free runs.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

KINDS = ("adapter", "kv_cached", "kv_running", "in_flight")
_CODE = {kind: i + 1 for i, kind in enumerate(KINDS)}  # 0: free
_FREE = 0


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


@dataclass(frozen=True, slots=True)
class SlotRuns:
    """Slots handed out together: `runs` of consecutive ids as (start, length), in the order taken.
    A pool without ids hands out `SlotRuns(n)` (no runs)."""

    num_slots: int
    runs: tuple[tuple[int, int], ...] = ()

    def ids(self) -> list[int]:
        return [s for start, n in self.runs for s in range(start, start + n)]


def runs_of(ids: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Slot ids as sorted runs; raises ValueError naming a duplicate id."""
    if not ids:
        return ()
    first, n = ids[0], len(ids)
    if isinstance(ids, range) and ids.step == 1 or list(ids) == list(range(first, first + n)):
        return ((first, n),)  # the common case: one run, checked at C speed
    ordered = sorted(ids)
    runs, start, prev = [], ordered[0], ordered[0]
    for s in ordered[1:]:
        if s == prev:
            raise ValueError(f"slot id {s} given twice")
        if s != prev + 1:
            runs.append((start, prev - start + 1))
            start = s
        prev = s
    runs.append((start, prev - start + 1))
    return tuple(runs)


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
        self._starts: list[int] = [0] if track_ids else []  # free runs, sorted by start
        self._lens: dict[int, int] = {0: num_slots} if track_ids else {}
        self._kind_of = bytearray(num_slots) if track_ids else None

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
        """Longest run of consecutive free ids (the free count without ids)."""
        return max(self._lens.values(), default=0) if self.track_ids else self._num_free

    # ---- mutations -------------------------------------------------------------------------------

    def alloc(self, kind: str, num_slots: int, *, contiguous: bool = False) -> SlotRuns | None:
        """Takes `num_slots` free slots as `kind`; None (nothing changed) when fewer are free. `contiguous`
        (adapters): best fit from the top, else the fewest runs; otherwise the lowest free ids (KV)."""
        assert kind in _CODE, f"unknown slot kind {kind!r}; kinds: {KINDS}"
        if num_slots > self.num_slots:
            raise ExceedsPoolError(f"{num_slots} slots of {kind}", num_slots, self.num_slots, self.slot_bytes)
        if not self.can_fit(num_slots):
            return None
        self._num_free -= num_slots
        self._num[kind] += num_slots
        if not self.track_ids:
            return SlotRuns(num_slots)
        runs = self._take_top(num_slots) if contiguous else self._take_low(num_slots)
        code = _CODE[kind]
        for start, n in runs:
            self._kind_of[start:start + n] = bytes((code,)) * n
        return SlotRuns(num_slots, tuple(runs))

    def reserve(self, num_slots: int, *, contiguous: bool = False) -> SlotRuns | None:
        """`alloc("in_flight", ...)`: slots for a copy not yet finished."""
        return self.alloc("in_flight", num_slots, contiguous=contiguous)

    def move(self, src: str, dst: str, slots: int | SlotRuns | Sequence[int]) -> None:
        """Re-labels slots from kind `src` to `dst` (ids required when the pool tracks them)."""
        n, runs = self._resolve(src, slots)
        assert dst in _CODE, f"unknown slot kind {dst!r}; kinds: {KINDS}"
        self._num[src] -= n
        self._num[dst] += n
        code = _CODE[dst]
        for start, length in runs:
            self._kind_of[start:start + length] = bytes((code,)) * length

    def release(self, kind: str, slots: int | SlotRuns | Sequence[int]) -> None:
        """Frees slots of `kind` (ids required when the pool tracks them); merges neighbouring free runs."""
        n, runs = self._resolve(kind, slots)
        self._num[kind] -= n
        self._num_free += n
        for start, length in runs:
            self._kind_of[start:start + length] = bytes(length)
            self._give_back(start, length)

    def release_all(self, kind: str) -> int:
        """Frees every slot of `kind` (a cache flush); returns how many. With ids: one scan of the kind codes."""
        assert kind in _CODE, f"unknown slot kind {kind!r}; kinds: {KINDS}"
        n = self._num[kind]
        if not n:
            return 0
        if not self.track_ids:
            self.release(kind, n)
            return n
        code, ids = _CODE[kind], []
        for s, c in enumerate(self._kind_of):
            if c == code:
                ids.append(s)
        self.release(kind, ids)
        return n

    # ---- invariants ------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """free + every kind == num_slots; with ids, the kind codes and free runs agree with the counts.
        O(num_slots) with ids. Raises AssertionError naming the first broken rule."""
        assert min(self._num.values()) >= 0 and self._num_free >= 0, f"negative count: {self.by_kind()}"
        assert self._num_free + sum(self._num.values()) == self.num_slots, (
            f"free {self._num_free} + {self._num} != {self.num_slots} slots")
        if not self.track_ids:
            return
        for kind, code in _CODE.items():
            assert self._kind_of.count(code) == self._num[kind], (
                f"{self._kind_of.count(code)} slots coded {kind}, counted {self._num[kind]}")
        assert self._starts == sorted(self._lens) and sum(self._lens.values()) == self._num_free, (
            "free runs out of step with the free count")
        end = -1
        for start in self._starts:
            n = self._lens[start]
            assert n > 0 and start > end, f"free run ({start}, {n}) overlaps or touches the previous one"
            assert self._kind_of[start:start + n].count(_FREE) == n, f"free run ({start}, {n}) holds used slots"
            end = start + n

    # ---- internals -------------------------------------------------------------------------------

    def _resolve(self, kind: str, slots: int | SlotRuns | Sequence[int]) -> tuple[int, tuple]:
        """(count, runs) of `slots`, checked against `kind`'s count and, with ids, each slot's kind."""
        assert kind in _CODE, f"unknown slot kind {kind!r}; kinds: {KINDS}"
        if isinstance(slots, int):
            assert not self.track_ids, "this pool tracks slot ids: pass the ids (or the SlotRuns) back"
            n, runs = slots, ()
        elif isinstance(slots, SlotRuns):
            n, runs = slots.num_slots, slots.runs
        else:
            n, runs = len(slots), (runs_of(slots) if self.track_ids else ())
        assert 0 <= n <= self._num[kind], f"{n} slots of {kind} given back but only {self._num[kind]} are held"
        code = _CODE[kind]
        for start, length in runs:
            assert self._kind_of[start:start + length].count(code) == length, (
                f"slots [{start}, {start + length}) are not all {kind}: freed twice or of another kind")
        return n, runs

    def _take_low(self, num_slots: int) -> list[tuple[int, int]]:
        runs = []
        while num_slots:
            start = self._starts[0]
            n = self._lens.pop(start)
            if n > num_slots:
                self._starts[0] = start + num_slots
                self._lens[start + num_slots] = n - num_slots
                n = num_slots
            else:
                self._starts.pop(0)
            runs.append((start, n))
            num_slots -= n
        return runs

    def _take_top(self, num_slots: int) -> list[tuple[int, int]]:
        fits = [(n, -s) for s, n in self._lens.items() if n >= num_slots]
        order = [-min(fits)[1]] if fits else sorted(self._lens, key=lambda s: (-self._lens[s], -s))
        runs = []
        for start in order:  # best fit (ties: the highest run), else the largest runs first
            n = self._lens[start]
            take = min(n, num_slots)
            if take == n:
                del self._lens[start]
                self._starts.pop(bisect_left(self._starts, start))
            else:
                self._lens[start] = n - take
            runs.append((start + n - take, take))
            num_slots -= take
            if not num_slots:
                return runs
        raise AssertionError("free runs shorter than the free count")

    def _give_back(self, start: int, n: int) -> None:
        i = bisect_left(self._starts, start)
        if i < len(self._starts) and start + n == self._starts[i]:  # merge with the next run
            n += self._lens.pop(self._starts.pop(i))
        if i and self._starts[i - 1] + self._lens[self._starts[i - 1]] == start:  # and the previous
            self._lens[self._starts[i - 1]] += n
            return
        self._starts.insert(i, start)
        self._lens[start] = n
