"""The live balancer (`sgl_multilora/cluster/balance.py`) over the core MELL packer, on instances of 24 KV tokens
and 3 workers: the packer's instances bound to distinct workers while workers last, its moves translated into
worker moves, operation batching per epoch, workers freed when instances close, down workers left out."""

from __future__ import annotations

from sgl_multilora.cluster.balance import LiveBalancer
from sgl_multilora.cluster.mell import MellPacker

C = 24
IDLE = [0, 0, 0]


def balancer() -> LiveBalancer:
    return LiveBalancer(MellPacker(C), 3, update_every=1)


def bound(b: LiveBalancer, rid) -> int:
    b.packer.check_invariants()
    return b.worker_of[b.packer.instance_of(rid)]


def test_instances_get_distinct_workers_until_none_is_left():
    b = balancer()
    workers = []
    for i in range(3):
        worker, moves = b.allocate(f"L{i}", 13, IDLE)  # an L request fills an instance of its own
        assert moves == [] and worker == bound(b, f"L{i}")
        workers.append(worker)
    assert sorted(workers) == [0, 1, 2] and b.workers_in_use == 3 and b.overcommitted == 0
    worker, _ = b.allocate("L3", 14, IDLE)  # a fourth instance: it shares the worker with the fewest packed tokens
    assert b.overcommitted == 1 and b.packer.num_instances == 4 and b.workers_in_use == 3
    assert worker in (0, 1, 2) and worker == bound(b, "L3")


def test_small_requests_share_a_worker_and_an_overflow_moves_one_away():
    b = balancer()
    a, _ = b.allocate("a", 13, IDLE)
    c, _ = b.allocate("c", 9, IDLE)  # an M request joins the L-instance as its companion (13 + 9 <= 24)
    assert a == c and b.workers_in_use == 1
    b.grew("c", 10)
    assert b.epoch(IDLE) == []  # still fits: no move
    b.grew("c", 12)  # 13 + 12 > 24: the Update evicts one of them to another instance
    moves = b.epoch(IDLE)
    assert len(moves) == 1, moves
    rid, src, dst = moves[0]
    assert src == a and dst != a and dst == bound(b, rid) and b.workers_in_use == 2
    assert b.packer.size_of("c") == 12


def test_small_growth_is_not_an_operation_and_departures_free_workers():
    b = LiveBalancer(MellPacker(C), 3, update_every=4)
    b.allocate("a", 13, IDLE)
    b.allocate("d", 13, IDLE)
    ops = b.num_ops
    b.grew("a", 15)  # +2 < 4: nothing queued
    assert b.epoch(IDLE) == [] and b.num_ops == ops and b.packer.size_of("a") == 13
    b.grew("a", 17)
    b.epoch(IDLE)
    assert b.packer.size_of("a") == 17 and b.num_ops == ops + 1
    b.ended("a")
    b.ended("d")
    b.ended("never-seen")  # not tracked (too large or unknown): ignored
    b.epoch(IDLE)
    assert b.packer.num_instances == 0 and b.workers_in_use == 0 and b.peak_workers_in_use == 2


def test_a_down_worker_holds_no_instance_and_too_large_requests_are_left_to_placement():
    b = balancer()
    w, _ = b.allocate("a", 13, IDLE)
    b.set_down(w)
    assert b.workers_in_use == 0
    b.allocate("e", 13, IDLE)  # the next operation binds every instance again, never to the down worker
    assert w not in (bound(b, "a"), bound(b, "e")) and bound(b, "a") != bound(b, "e")
    assert b.allocate("huge", C + 1, IDLE) == (None, []) and b.untracked == 1
    b.set_down(w, False)
    assert w not in b.down
