"""The LoRA server's slot pool as a story: loads, hits, evictions and pins with exact outcomes, on a fake clock.

Adapters are built in memory (no files): the pool only reads their sizes and units. `check_invariants` after every
step.
"""

from __future__ import annotations

import pytest
import torch

from sgl_multilora.adapters import AdapterSpec, ModelShape, ModuleDims
from sgl_multilora.lora_server.catalog import Catalog, HostAdapter, ServerModel
from sgl_multilora.lora_server.slots import NoFreeSlot, SlotEvent, SlotPool

MODEL = ServerModel(ModelShape(2, {"q_proj": ModuleDims(8, 8), "k_proj": ModuleDims(8, 4),
                                   "v_proj": ModuleDims(8, 4), "o_proj": ModuleDims(8, 8)}))


def adapter(name: str, rank: int, modules=("q_proj", "v_proj")) -> HostAdapter:
    units = {(layer, m, -1): (torch.randn(rank, 8), torch.randn(MODEL.shape.modules[m].out_features, rank))
             for layer in range(2) for m in modules}
    spec = AdapterSpec(name, f"/x/{name}", f"id-{name}", rank, float(rank), 1.0, tuple(modules), None)
    return HostAdapter(spec, units, sum(a.numel() * 4 + b.numel() * 4 for a, b in units.values()))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def make_pool(max_slots: int, policy: str = "lru", max_bytes: int | None = None, ranks=(4, 4, 4)) -> SlotPool:
    catalog = Catalog(MODEL)
    for name, rank in zip("abc", ranks):
        catalog.adapters[name] = adapter(name, rank)
    return SlotPool(catalog, max_slots, policy, max_bytes, clock=Clock())


def use(pool: SlotPool, *names: str) -> None:
    pool.acquire(list(names))
    pool.check_invariants(idle=False)
    pool.release(list(names))
    pool.check_invariants()


def test_lru_story_with_two_slots():
    pool = make_pool(2)
    use(pool, "a")
    use(pool, "b")
    assert pool.residency()["resident"] == ["a", "b"] and pool.free_slots() == 0
    use(pool, "a")  # hit: b is now the least recently used
    use(pool, "c")  # miss: evicts b, takes its slot 1
    assert pool.residency()["resident"] == ["a", "c"]
    use(pool, "b")  # evicts a (used before c)
    assert pool.residency()["resident"] == ["b", "c"]
    assert list(pool.events) == [SlotEvent("load", "a", 0), SlotEvent("load", "b", 1), SlotEvent("evict", "b", 1),
                                 SlotEvent("load", "c", 1), SlotEvent("evict", "a", 0), SlotEvent("load", "b", 0)]
    assert {k: pool.counters[k] for k in ("hits", "misses", "loads", "evictions")} == \
        {"hits": 1, "misses": 4, "loads": 4, "evictions": 2}


def test_pinned_adapters_are_never_evicted_and_a_failed_acquire_leaves_no_pin():
    pool = make_pool(2)
    tables = pool.acquire(["a", "b"])  # a call computing with a and b
    assert set(tables) == {"a", "b"} and tables["a"][(0, "qkv", -1)][0].shape == (3 * 4, 8)
    with pytest.raises(NoFreeSlot, match="'c'"):
        pool.acquire(["c"])  # a second call meanwhile: every resident adapter is pinned
    pool.check_invariants(idle=False)
    assert pool.residency()["pinned"] == {"a": 1, "b": 1}
    pool.release(["a", "b"])
    pool.check_invariants()
    with pytest.raises(NoFreeSlot):
        pool.acquire(["a", "b", "c"])  # three adapters in one call never fit two slots
    pool.check_invariants()  # the pins taken before the failure were returned
    with pytest.raises(KeyError):
        pool.acquire(["zzz"])
    pool.check_invariants()


def test_fused_tables_zero_fill_untargeted_modules():
    pool = make_pool(1)
    a = pool.catalog.adapters["a"]
    A, B = pool.acquire(["a"])["a"][(1, "qkv", -1)]
    pool.release(["a"])
    q_a, q_b = a.units[(1, "q_proj", -1)]
    v_a, v_b = a.units[(1, "v_proj", -1)]
    assert torch.equal(A, torch.cat([q_a, torch.zeros(4, 8), v_a]))
    assert torch.equal(B, torch.cat([q_b, torch.zeros(4, 4), v_b]))
    assert (0, "o", -1) not in pool._tables["a"]  # no o_proj weights: that group's delta is zeros


def test_byte_budget_limits_residency():
    """Three slots but room for 2 adapters' bytes: the third load evicts, and an adapter larger than the whole
    budget is refused."""
    size = adapter("x", 4).num_bytes
    pool = make_pool(3, max_bytes=2 * size)
    use(pool, "a")
    use(pool, "b")
    use(pool, "c")
    assert pool.residency()["resident"] == ["c", "b"] and pool.free_slots() == 1
    big = make_pool(3, max_bytes=size, ranks=(4, 8, 4))
    with pytest.raises(NoFreeSlot, match="larger than the slot budget"):
        big.acquire(["b"])
    big.check_invariants()


@pytest.mark.parametrize("policy", ["elora", "chameleon"])
def test_other_policies_evict_the_less_valued_adapter(policy):
    """a used five times, b once, both at old times; c's miss must evict b, the rarely used one, under both."""
    pool = make_pool(2, policy)
    for _ in range(5):
        use(pool, "a")
    use(pool, "b")
    use(pool, "a")
    use(pool, "c")
    assert pool.residency()["resident"] == ["a", "c"]


def test_prefetch_queue_forget_and_unknown_policy():
    pool = make_pool(2)
    assert pool.queue_prefetch(["b", "a", "b"]) == ["b", "a"]
    assert pool.residency()["loading"] == ["b", "a"]
    assert pool.prefetch_one() == "b" and pool.prefetch_one() == "a" and pool.prefetch_one() is None
    assert pool.residency()["resident"] == ["b", "a"]
    pool.check_invariants()
    pool.acquire(["a"])
    with pytest.raises(NoFreeSlot, match="in use"):
        pool.forget("a")
    pool.release(["a"])
    pool.forget("a")
    del pool.catalog.adapters["a"]
    assert pool.residency()["resident"] == ["b"]
    pool.check_invariants()
    with pytest.raises(ValueError, match="supported: chameleon, elora, lru"):
        make_pool(2, "fifo")
