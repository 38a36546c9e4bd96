"""MELL's packing as stories on instances of 24 KV tokens, where the classes are
L > 12, M 9..12, S 7..8, T 4..6 and tiny <= 3: exact placements, migrations and labels after every
step, with the invariants checked each time. Then batching, errors and the cost model."""

from __future__ import annotations

import pytest

from sgl_multilora.cluster import (
    Cls,
    DuplicateRequest,
    ItemTooLarge,
    MellPacker,
    Migration,
    MigrationCostModel,
    Move,
    Placement,
    UnknownRequest,
    compress_moves,
    create_packer,
    size_class,
)

C = 24


def kv(rid, src, dst, size):
    return Migration(rid, src, dst, size, "kv")


def state(p: MellPacker) -> dict[int, tuple[str, list]]:
    """instance -> (label, contents), a multi-item shown as a sorted list of its requests."""
    p.check_invariants()
    return {b.iid: (b.label.name, [u.rid if hasattr(u, "rid") else sorted(u.members) for u in b.units])
            for b in p.p.bins.values()}


def test_size_classes_at_their_exact_boundaries():
    got = {s: size_class(s, C).name for s in (3, 4, 6, 7, 8, 9, 12, 13, 24)}
    assert got == {3: "TINY", 4: "T", 6: "T", 7: "S", 8: "S", 9: "M", 12: "M", 13: "L", 24: "L"}
    assert size_class(16_384 // 8, 16_384) == Cls.TINY and size_class(2049, 16_384) == Cls.T


def test_story_l_instances_absorb_t_then_m_and_departures_refill():
    p = MellPacker(C)
    assert p.allocate("a", 13) == Placement(0)
    # a T-item goes to the L-instance that has room
    assert p.allocate("t1", 5) == Placement(0)
    # an M fits beside the L once the T-item leaves: it moves to a new T-instance
    assert p.allocate("m1", 10) == Placement(0, (kv("t1", 0, 1, 5),))
    assert state(p) == {0: ("L", ["a", "m1"]), 1: ("T", ["t1"])}
    # no lonely L fits the next M: a new M-instance, then the second M joins it
    assert p.allocate("m2", 9) == Placement(2)
    assert p.allocate("m3", 11) == Placement(2)
    assert p.allocate("m4", 12) == Placement(3)
    assert state(p)[3] == ("M", ["m4"])
    # P1: an M leaves a full M-instance, which takes the M of the most recent one (now empty)
    assert p.depart("m2") == [kv("m4", 3, 2, 12)]
    assert state(p) == {0: ("L", ["a", "m1"]), 1: ("T", ["t1"]), 2: ("M", ["m3", "m4"])}
    # the L leaves: its companion is allocated again (M-instance 2 is full: a new one)
    assert p.depart("a") == [kv("m1", 0, 4, 10)]
    assert state(p) == {1: ("T", ["t1"]), 2: ("M", ["m3", "m4"]), 4: ("M", ["m1"])}
    assert p.op_stats.max_unit_moves == 1


def test_story_tiny_requests_share_multi_items_and_grow_out_without_moving():
    p = MellPacker(C)
    assert p.allocate("x1", 2) == Placement(0)
    assert p.allocate("x2", 3) == Placement(0)  # joins x1's multi-item (5 <= C/4)
    assert p.allocate("x3", 2) == Placement(0)  # 7 > C/4: a second multi-item, same instance
    assert state(p) == {0: ("T", [["x1", "x2"], ["x3"]])}
    assert p.update("x1", 3) == []
    # x2 outgrows C/8: it becomes a T-request on the same instance; the two multi-items of
    # <= C/8 left merge into one (no migration)
    assert p.update("x2", 4) == []
    assert state(p) == {0: ("T", [["x1", "x3"], "x2"])}
    assert p.instances() == {0: 9}
    assert p.allocate("big", 20) == Placement(1)
    assert p.depart("big") == [] and state(p) == {0: ("T", [["x1", "x3"], "x2"])}


def test_story_growth_evicts_the_cheapest_and_class_changes_move_the_grown_request():
    p = MellPacker(C)
    for rid, size in (("l", 13), ("t", 5), ("t2", 4)):
        assert p.allocate(rid, size) == Placement(0)
    # the L grows past capacity: the smallest T-item that ends the overflow leaves
    assert p.update("l", 16) == [kv("t2", 0, 1, 4)]
    # t grows into S: it becomes the L's companion where it is
    assert p.update("t", 7) == []
    assert state(p) == {0: ("L", ["l", "t"]), 1: ("T", ["t2"])}
    # t grows into M and no longer fits beside the L: it moves (Depart + Allocate); the L alone
    # is below 3C/4 while a T-instance exists (P5), so it takes t2, which empties that instance
    assert p.update("t", 9) == [kv("t", 0, 2, 9), kv("t2", 1, 0, 4)]
    assert state(p) == {0: ("L", ["l", "t2"]), 2: ("M", ["t"])}


def test_story_s_and_t_instances_refill_from_the_most_recent_one():
    p = MellPacker(C)
    for i in range(4):
        p.allocate(f"s{i}", 7)
    assert state(p) == {0: ("S", ["s0", "s1", "s2"]), 1: ("S", ["s3"])}
    assert p.depart("s3") == []  # the most recent S-instance: no move
    p.allocate("s3", 7)
    assert p.depart("s0") == [kv("s3", 2, 0, 7)]  # P2
    assert state(p) == {0: ("S", ["s1", "s2", "s3"])}

    q = MellPacker(C)
    for i in range(6):
        q.allocate(f"t{i}", 6)
    assert state(q) == {0: ("T", ["t0", "t1", "t2", "t3"]), 1: ("T", ["t4", "t5"])}
    assert q.depart("t0") == []  # 18 = 3C/4 still satisfies P3
    assert q.depart("t1") == [kv("t4", 1, 0, 6)]
    assert state(q) == {0: ("T", ["t2", "t3", "t4"]), 1: ("T", ["t5"])}


def test_story_an_m_growing_into_l_keeps_its_m_instance_as_its_companion():
    p = MellPacker(C)
    p.allocate("m1", 9)
    p.allocate("m2", 10)
    assert p.update("m1", 13) == []  # 13 + 10 <= 24: an L-instance with an M companion
    assert state(p) == {0: ("L", ["m1", "m2"])}
    assert p.update("m1", 15) == [kv("m2", 0, 1, 10)]  # overflow: the other M leaves


def test_story_a_new_l_pulls_a_companion_p4_and_tops_up_from_t_instances_p5():
    p = MellPacker(C)
    for rid, size in (("m1", 9), ("m2", 10), ("t1", 5)):  # the T-item fills the M-instance
        assert p.allocate(rid, size) == Placement(0)
    # P4: the new L takes the largest M that fits it, from the most recent M-instance
    assert p.allocate("l", 14) == Placement(1, (kv("m2", 0, 1, 10),))
    assert p.allocate("t2", 6) == Placement(2)  # instance 0 already has its T-item (P1)
    # the companion leaves: m1 replaces it, and instance 0, left with a T-item only and not the
    # most recent T-instance, is emptied
    assert p.depart("m2") == [kv("m1", 0, 1, 9), kv("t1", 0, 2, 5)]
    assert state(p) == {1: ("L", ["l", "m1"]), 2: ("T", ["t2", "t1"])}

    q = MellPacker(C)
    for i in range(5):
        q.allocate(f"t{i}", 6 if i < 4 else 5)
    assert state(q) == {0: ("T", ["t0", "t1", "t2", "t3"]), 1: ("T", ["t4"])}
    # P5: an L alone is below 3C/4 while a T-instance exists: it takes from the most recent one
    assert q.allocate("l", 13) == Placement(2, (kv("t4", 1, 2, 5),))
    assert state(q) == {0: ("T", ["t0", "t1", "t2", "t3"]), 2: ("L", ["l", "t4"])}


def test_batch_places_allocations_at_their_final_instance_and_removes_unneeded_moves():
    p = MellPacker(C)
    p.allocate("a", 13)
    res = p.apply_batch(allocates={"t1": 5, "m": 10})
    # t1 was placed beside the L, then evicted by m, all inside the batch: no migration
    assert res.placements == {"t1": 1, "m": 0} and res.migrations == ()
    assert (res.num_ops, res.num_moves_before) == (2, 1)
    res = p.apply_batch(departs=["m"], updates={"a": 14}, allocates=[("n", 2)])
    assert res.num_ops == 3 and p.instance_of("m") is None and p.size_of("a") == 14
    p.check_invariants()


def test_compress_moves_collapses_chains_and_cancels_round_trips():
    moves = [Move("a", 0, 1, 5), Move("b", 2, 3, 4), Move("a", 1, 4, 5), Move("b", 3, 2, 4),
             Move("c", 5, 6, 1), Move("d", 7, 8, 2)]
    sizes = {"a": 6, "b": 4, "c": 1}
    got = compress_moves(moves, allocated={"c"}, alive=sizes.get)
    assert got == [Move("a", 0, 4, 6)]  # b went back, c is new, d is gone


def test_errors_at_the_api_edge():
    p = MellPacker(C)
    p.allocate("a", 5)
    with pytest.raises(DuplicateRequest):
        p.allocate("a", 5)
    with pytest.raises(ItemTooLarge, match="25 KV tokens exceed one instance"):
        p.allocate("b", 25)
    with pytest.raises(ItemTooLarge):
        p.update("a", 25)
    with pytest.raises(ValueError, match="sizes only grow"):
        p.update("a", 4)
    with pytest.raises(ValueError, match="kv_tokens must be >= 1"):
        p.allocate("z", 0)
    with pytest.raises(UnknownRequest):
        p.depart("nope")
    with pytest.raises(UnknownRequest):
        p.update("nope", 3)
    with pytest.raises(ValueError, match="max_moves_per_op must be >= 1"):
        MellPacker(C, max_moves_per_op=0)
    with pytest.raises(ValueError, match="supported: mell, best-fit, worst-fit, llumnix"):
        create_packer("first-fit", C)
    p.check_invariants()


def test_cost_model_fills_the_link_budget_with_kv_then_the_destination_with_recompute():
    # 8 instances per machine; 1 MB per token; PCIe 100 MB per epoch, NIC 10 MB, recompute 50 tokens
    cost = MigrationCostModel(kv_bytes_per_token=10**6, intra_bytes_per_s=1e8, inter_bytes_per_s=1e7,
                              epoch_s=1.0, recompute_tokens_per_epoch=50, prefill_tokens_per_s=100.0)
    moves = [Move("a", 0, 1, 60), Move("b", 0, 2, 50), Move("c", 0, 9, 8), Move("d", 0, 9, 5),
             Move("e", 1, 2, 70)]
    got = {m.rid: (m.kind, m.over_budget) for m in cost.plan(moves)}
    # largest first: e (70) takes PCIe of machine 0 -> a (60) and b (50) no longer fit it;
    # a fits nowhere (recompute budget of instance 1 is 50) -> over budget, faster kind;
    # b recomputes on 2; c (8) crosses machines on the NIC; d (5) no longer fits the NIC
    assert got == {"e": ("kv", False), "a": ("kv", True), "b": ("recompute", False),
                   "c": ("kv", False), "d": ("recompute", False)}
    # the caller's topology: instances 0 and 9 on one machine -> c and d ride PCIe
    same = cost.plan(moves[2:4], machine_of=lambda i: 0)
    assert [(m.kind, m.over_budget) for m in same] == [("kv", False), ("kv", False)]
