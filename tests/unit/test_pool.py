"""The unified pool as a story on twelve slots: KV from the lowest ids, adapters best fit from the top, exact
ids and counts by kind after every step; "not now" returns None, "never" raises."""

from __future__ import annotations

import pytest

from sgl_multilora.pool import ExceedsPoolError, SlotRuns, UnifiedPool, runs_of, slots_for_bytes


def kinds(pool: UnifiedPool) -> dict[str, int]:
    pool.check_invariants()
    return pool.by_kind()


def test_slots_for_bytes_rounds_up_and_never_pads():
    assert slots_for_bytes(0, 100) == 0
    assert slots_for_bytes(100, 100) == 1
    assert slots_for_bytes(101, 100) == 2
    # rank 8 vs rank 64 on the same modules: 8x the slots, nothing padded to the larger rank
    per_rank = 2 * 4096 * 32 * 2  # one module's A and B rows per rank, 32 layers, 2 bytes
    assert slots_for_bytes(64 * per_rank, 131072) == 8 * slots_for_bytes(8 * per_rank, 131072) == 256
    with pytest.raises(ValueError, match="slot_bytes > 0"):
        slots_for_bytes(1, 0)


def test_story_twelve_slots_shared_by_kv_and_adapters():
    pool = UnifiedPool(12, slot_bytes=100)
    assert kinds(pool) == {"adapter": 0, "kv_cached": 0, "kv_running": 0, "in_flight": 0, "free": 12}

    # adapter A (250 B -> 3 slots) is copied in: reserved at the top, in flight until the copy ends
    a = pool.reserve(pool.slots_for_bytes(250), contiguous=True)
    assert a == SlotRuns(3, ((9, 3),)) and a.ids() == [9, 10, 11]
    pool.move("in_flight", "adapter", a)
    assert kinds(pool) == {"adapter": 3, "kv_cached": 0, "kv_running": 0, "in_flight": 0, "free": 9}

    # a request reserves 4 tokens of KV: the lowest ids
    kv = pool.alloc("kv_running", 4)
    assert kv.runs == ((0, 4),)
    # it finishes: 2 tokens go to the prefix cache, 2 were duplicates of cached KV and are freed
    pool.move("kv_running", "kv_cached", [2, 3])
    pool.release("kv_running", [0, 1])
    assert kinds(pool) == {"adapter": 3, "kv_cached": 2, "kv_running": 0, "in_flight": 0, "free": 7}
    assert pool.largest_free_run() == 5  # free: [0, 2) and [4, 9)

    # adapter B (3 slots): best fit is [4, 9), taken from its top
    b = pool.alloc("adapter", 3, contiguous=True)
    assert b.runs == ((6, 3),)
    # KV takes the lowest free ids, across runs
    kv2 = pool.alloc("kv_running", 3)
    assert kv2.ids() == [0, 1, 4]
    assert kinds(pool) == {"adapter": 6, "kv_cached": 2, "kv_running": 3, "in_flight": 0, "free": 1}

    # not now: more than is free returns None and changes nothing; never: more than the pool raises
    assert not pool.can_fit(2) and pool.alloc("kv_running", 2) is None
    with pytest.raises(ExceedsPoolError, match="13 slots .* holds 12 slots \\(1200 B\\)"):
        pool.alloc("kv_running", 13)
    assert kinds(pool)["free"] == 1

    # B leaves, then the cached KV: free runs [2, 4) and [5, 9); slot 4 is still running KV
    pool.release("adapter", b)
    pool.release("kv_cached", [3, 2])
    assert pool.largest_free_run() == 4 and kinds(pool)["free"] == 6
    pool.release("kv_running", kv2)  # and then everything below A merges into [0, 9)
    assert pool.largest_free_run() == 9 and kinds(pool)["free"] == 9


def test_fragmented_adapter_gets_the_fewest_runs():
    pool = UnifiedPool(12, slot_bytes=100)
    pool.alloc("kv_cached", 12)
    pool.release("kv_cached", [1, 2, 5, 8, 9, 10])  # free: [1, 3), [5, 6), [8, 11)
    assert pool.largest_free_run() == 3
    a = pool.alloc("adapter", 5, contiguous=True)  # no run of 5: largest first, each from its top
    assert a.runs == ((8, 3), (1, 2)) and a.num_slots == 5
    assert kinds(pool) == {"adapter": 5, "kv_cached": 6, "kv_running": 0, "in_flight": 0, "free": 1}


def test_misuse_names_the_kind():
    pool = UnifiedPool(12, slot_bytes=100)
    kv = pool.alloc("kv_cached", 2)
    with pytest.raises(AssertionError, match="2 slots of adapter given back but only 0 are held"):
        pool.release("adapter", kv)
    pool.alloc("adapter", 2)
    with pytest.raises(AssertionError, match=r"slots \[0, 2\) are not all adapter"):
        pool.release("adapter", kv)  # the counts allow it, the slots' kinds do not
    pool.release("kv_cached", kv)
    with pytest.raises(AssertionError, match="only 0 are held"):
        pool.release("kv_cached", kv)  # freed twice
    with pytest.raises(AssertionError, match="pass the ids"):
        pool.release("adapter", 2)
    with pytest.raises(ValueError, match="slot id 3 given twice"):
        runs_of([3, 4, 3])
    pool.check_invariants()


def test_counts_only_mode_for_the_simulator():
    pool = UnifiedPool(12, slot_bytes=100, track_ids=False)
    assert pool.alloc("kv_running", 5) == SlotRuns(5)
    pool.move("kv_running", "kv_cached", 3)
    pool.release("kv_running", 2)
    pool.release("kv_cached", [-1, -1])  # any sized sequence: the simulator's owner tags
    assert kinds(pool) == {"adapter": 0, "kv_cached": 1, "kv_running": 0, "in_flight": 0, "free": 11}
    assert pool.largest_free_run() == 11
    with pytest.raises(AssertionError, match="only 1 are held"):
        pool.release("kv_cached", 2)


def test_random_operations_never_hand_out_a_held_slot():
    """Against a plain model (a dict slot -> kind): a long random mix of KV allocations, adapter runs, moves and
    releases (lists, arrays and `SlotRuns`) never hands out a slot that is held, adapters get the run best fit
    chooses whenever one is long enough, and the pool's own invariants hold after every step."""
    import random

    import numpy as np

    rng = random.Random(7)
    pool, held = UnifiedPool(257, slot_bytes=10), {}
    groups: list[tuple[str, list[int]]] = []
    for _ in range(3000):
        op = rng.random()
        free = pool.num_slots - len(held)
        if op < 0.45 and groups:  # release or move a group, or part of one
            kind, ids = groups.pop(rng.randrange(len(groups)))
            cut = rng.randrange(len(ids) + 1)
            part, rest = ids[:cut], ids[cut:]
            if rest:
                groups.append((kind, rest))
            form = rng.choice((list, np.array, lambda x: x[::-1]))
            if kind == "kv_running" and rng.random() < 0.5:
                pool.move("kv_running", "kv_cached", form(part))
                if part:
                    groups.append(("kv_cached", part))
                held.update(dict.fromkeys(part, "kv_cached"))
            else:
                pool.release(kind, form(part))
                for s in part:
                    del held[s]
        elif op < 0.8:  # KV
            n = rng.randrange(1, 20)
            got = pool.alloc("kv_running", n)
            assert (got is None) == (n > free)
            if got is not None:
                ids = got.ids()
                assert len(set(ids)) == n and not set(ids) & held.keys()
                held.update(dict.fromkeys(ids, "kv_running"))
                groups.append(("kv_running", ids))
        else:  # an adapter's run
            n = rng.randrange(1, 30)
            runs = [(s, k) for s, k in _free_runs_of(pool.num_slots, held)]
            fits = [(k, -s) for s, k in runs if k >= n]
            got = pool.alloc("adapter", n, contiguous=True)
            assert (got is None) == (n > free)
            if got is None:
                continue
            if fits:
                k, s = min(fits)
                assert got.runs == ((-s + k - n, n),), "best fit, from the top of the highest such run"
            ids = got.ids()
            assert len(set(ids)) == n and not set(ids) & held.keys()
            held.update(dict.fromkeys(ids, "adapter"))
            groups.append(("adapter", ids))
        pool.check_invariants()
        counts = {k: sum(1 for v in held.values() if v == k) for k in ("adapter", "kv_cached", "kv_running")}
        assert {k: pool.num_of(k) for k in counts} == counts and pool.num_free == pool.num_slots - len(held)
        if groups and rng.random() < 0.01:  # a double free is caught and changes nothing
            kind, ids = groups[0]
            other = "kv_cached" if kind != "kv_cached" else "adapter"
            with pytest.raises(AssertionError, match=f"not all {other}|only"):
                pool.release(other, ids)
            pool.check_invariants()


def _free_runs_of(num_slots: int, held: dict) -> list[tuple[int, int]]:
    runs, start = [], None
    for s in range(num_slots + 1):
        if s < num_slots and s not in held:
            start = s if start is None else start
        elif start is not None:
            runs.append((start, s - start))
            start = None
    return runs


def test_evacuating_the_cheapest_window_moves_its_kv_to_the_lowest_free_ids_outside_it():
    """KV at [0 1], [4] and [6-10], an adapter at [11], [2 3] and [5] free. A free run of 3 costs the fewest moves
    in [1-3], [2-4] or [3-5] (one used slot each); ties go to the highest window, away from the KV at the front.
    No window may hold the adapter, and a run longer than the free count has nowhere to send what it holds."""
    pool = UnifiedPool(12, slot_bytes=100)
    assert pool.alloc("adapter", 1, contiguous=True).runs == ((11, 1),)
    kv = pool.alloc("kv_running", 11).ids()
    pool.move("kv_running", "kv_cached", kv[:2])
    pool.release("kv_running", [2, 3, 5])
    blocked = pool.kind_mask(("adapter", "in_flight"))
    assert pool.cheapest_window(3, blocked) == 3
    assert pool.cheapest_window(2, blocked) == 2  # [2 3] is free already: nothing to move
    assert pool.cheapest_window(4, blocked) is None  # 3 free slots cannot take a window of 4
    assert pool.cheapest_window(3, pool.kind_mask(("adapter", "kv_running"))) == 1  # only [1-3] holds none
    assert pool.cheapest_window(3, pool.kind_mask(("adapter", "kv_running", "kv_cached"))) is None
    sources, targets = pool.evacuate(3, 3)
    assert sources.tolist() == [4] and targets.tolist() == [2]
    assert pool.largest_free_run() == 3 and pool.free_ids().tolist() == [3, 4, 5]
    assert kinds(pool) == {"adapter": 1, "kv_cached": 2, "kv_running": 6, "in_flight": 0, "free": 3}
    assert pool.alloc("kv_running", 3).ids() == [3, 4, 5]  # the free list took the window back
    pool.release("kv_running", [6, 7, 8, 9, 10, 3, 4, 5])
    sources, targets = pool.evacuate(0, 2)  # cached KV keeps its kind where it lands
    assert sources.tolist() == [0, 1] and targets.tolist() == [3, 4]
    assert pool.kind_mask(("kv_cached",)).nonzero()[0].tolist() == [3, 4]
    kinds(pool)
