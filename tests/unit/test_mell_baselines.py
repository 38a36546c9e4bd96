"""The baselines as stories on instances of 100 KV tokens: best-fit and worst-fit placements, the
reserve an arrival must leave free, overflow without migration, and the Llumnix-like balancer's
overflow repair and load balancing."""

from __future__ import annotations

from sgl_multilora.cluster import FitPacker, LlumnixLikePacker, Migration, Placement, create_packer


def placements(p, sizes: dict[str, int]) -> dict[str, int]:
    out = {rid: p.allocate(rid, size).instance for rid, size in sizes.items()}
    p.check_invariants()
    return out


def test_best_fit_fills_the_fullest_instance_and_worst_fit_the_emptiest():
    sizes = {"a": 50, "b": 30, "c": 30, "d": 15, "e": 10}
    bf = create_packer("best-fit", 100)
    assert placements(bf, sizes) == {"a": 0, "b": 0, "c": 1, "d": 0, "e": 1}
    assert bf.instances() == {0: 95, 1: 40}
    wf = create_packer("worst-fit", 100)
    assert placements(wf, sizes) == {"a": 0, "b": 0, "c": 1, "d": 1, "e": 1}
    assert wf.instances() == {0: 80, 1: 55}


def test_reserve_keeps_room_for_growth_and_growth_can_still_overflow():
    p = FitPacker(100, fit="best", reserve_fraction=0.2)
    assert placements(p, {"a": 50, "b": 30, "c": 10}) == {"a": 0, "b": 0, "c": 1}
    assert p.update("a", 75) == [] and p.overflowing() == [0]  # never migrates
    assert p.depart("b") == [] and p.overflowing() == []
    assert p.depart("a") == [] and p.instances() == {1: 10}  # an emptied instance stops
    assert p.op_stats.max_unit_moves == 0 and p.settle_stats.num_ops == 0


def test_llumnix_like_balances_after_each_call_and_repairs_overflow():
    p = LlumnixLikePacker(100, balance_gap_fraction=0.1)
    assert p.allocate("a", 60) == Placement(0)
    assert p.allocate("b", 30) == Placement(0)
    # c opens instance 1; the gap 90 - 50 exceeds 10 tokens: b (closest to half the gap) moves
    assert p.allocate("c", 50) == Placement(1, (Migration("b", 0, 1, 30, "kv"),))
    assert p.instances() == {0: 60, 1: 80}
    # c grows: instance 1 overflows; b is the smallest request that ends it and fits instance 0
    assert p.update("c", 75) == [Migration("b", 1, 0, 30, "kv")]
    assert p.instances() == {0: 90, 1: 75} and p.overflowing() == []
    p.check_invariants()
    assert p.settle_stats.max_unit_moves == 1
