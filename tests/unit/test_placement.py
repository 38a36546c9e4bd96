"""LoRA-aware placement (sgl_multilora/cluster/placement.py): replication by popularity, sticky assignments,
(adapter, prefix) affinity, the load bound, aLoRA requests following the base model's KV."""

from __future__ import annotations

import random

import pytest

from sgl_multilora.cluster.placement import NoWorkerError, Placement

IDLE = [0] * 4


def test_popular_adapters_get_more_workers_and_rare_ones_one():
    p = Placement(4, rebalance_every=10)
    rng = random.Random(0)
    for _ in range(2000):  # "hot" takes ~70% of requests, the rest share the remainder
        adapter = "hot" if rng.random() < 0.7 else f"cold{rng.randrange(6)}"
        p.route(adapter, f"prompt {rng.randrange(100)}", IDLE)
    p.check_invariants()
    assert len(p.workers_of["hot"]) == 3  # ceil(0.7 x 4)
    assert all(len(p.workers_of[f"cold{i}"]) == 1 for i in range(6))
    assert p.candidates(None) == [0, 1, 2, 3]
    load = p.worker_load()
    assert max(load) - min(load) < 0.3, f"adapters are not spread: {load}"


def test_assignments_are_sticky_under_a_steady_mix():
    p = Placement(3, rebalance_every=10)
    mix = ["a"] * 5 + ["b"] * 3 + ["c"] * 2
    for i in range(300):
        p.route(mix[i % len(mix)], "x", [0] * 3)
    before = {a: list(ws) for a, ws in p.workers_of.items()}
    moves = p.stats.moves
    for i in range(3000):
        p.route(mix[i % len(mix)], "x", [0] * 3)
    assert p.workers_of == before and p.stats.moves == moves


def test_a_popularity_shift_moves_replicas():
    p = Placement(4, rebalance_every=10, half_life_requests=100)
    for _ in range(500):
        p.route("a", "x", IDLE)
        p.route("b", "x", IDLE)
    assert {len(p.workers_of["a"]), len(p.workers_of["b"])} <= {2, 3}  # half the requests each
    for _ in range(1000):  # b's traffic stops: a takes every worker, b shrinks to one
        p.route("a", "x", IDLE)
    assert len(p.workers_of["a"]) == 4 and len(p.workers_of["b"]) == 1
    assert p.stats.moves >= 3


def test_same_adapter_and_prefix_meet_on_one_worker_and_distinct_prefixes_spread():
    p = Placement(4)
    p.workers_of["a"] = [0, 1, 2, 3]
    first = {i: p.route("a", f"conversation {i} " + "history " * 40, IDLE) for i in range(40)}
    for i in range(40):  # later turns: the same start, more text after the prefix window
        assert p.route("a", f"conversation {i} " + "history " * 40 + "new turn", IDLE) == first[i]
    assert set(first.values()) == {0, 1, 2, 3}
    assert p.stats.balanced == 0


def test_requests_stay_on_the_adapters_workers():
    p = Placement(4)
    p.route("a", "x", IDLE)
    workers = set(p.workers_of["a"])
    assert all(p.route("a", f"p{i}", IDLE) in workers for i in range(50))


def test_the_load_bound_moves_a_request_off_an_overloaded_worker():
    p = Placement(2, balance_abs=2, balance_rel=1.5)
    p.workers_of["a"] = [0, 1]
    prompt = "shared prefix " * 40
    home = p.route("a", prompt, [0, 0])
    loads = [0, 0]
    loads[home] = 2  # within balance_abs of the other: affinity wins
    assert p.route("a", prompt + "turn 2", loads) == home and p.stats.balanced == 0
    loads[home] = 10
    other = p.route("a", prompt + "turn 3", loads)
    assert other == 1 - home and p.stats.balanced == 1
    assert p.route("a", prompt + "turn 4", [0, 0]) == other  # the prefix's KV is there now


def test_an_overloaded_adapter_spills_to_the_least_loaded_worker():
    p = Placement(3)
    p.workers_of["a"] = [0]
    assert p.route("a", "first conversation " * 20, [5, 0, 1]) == 1  # its one worker is overloaded
    assert p.workers_of["a"] == [0, 1] and p.stats.moves == 1
    assert p.route("a", "another conversation " * 20, [0, 0, 0]) in (0, 1)  # spread over its workers now


def test_short_shared_starts_do_not_pin_conversations_to_one_worker():
    """A system prompt shared by every conversation is a short share of each first turn: first turns spread."""
    p = Placement(3)
    system = "You are a helpful assistant. " * 3
    workers = {p.route(None, system + f"user {i} asks about topic {i} " * 12, [0, 0, 0]) for i in range(30)}
    assert workers == {0, 1, 2}


def test_alora_requests_go_where_the_base_prefix_is():
    p = Placement(4)
    p.set_alora(["check"])
    p.workers_of["lora"] = [0, 1, 2, 3]
    for i in range(20):
        context = f"document {i} " * 50
        base = p.route(None, context, IDLE)
        assert p.route("check", context + "<check>", IDLE) == base


def test_down_and_excluded_workers_are_never_chosen_and_come_back():
    p = Placement(3)
    prompt = "a shared system prompt " * 20
    home = p.route("a", prompt, [0, 0, 0])
    assert p.route("a", prompt, [0, 0, 0]) == home  # affinity
    p.set_down(home)
    others = {p.route("a", prompt, [0, 0, 0]) for _ in range(5)}
    assert home not in others and len(others) == 1  # the prefix moved with the request and stays there
    moved_to = others.pop()
    arrivals = p.num_arrivals
    rest = p.route("a", prompt, [0, 0, 0], exclude=(moved_to,), arrival=False)
    assert rest not in (home, moved_to) and p.num_arrivals == arrivals  # a move is not an arrival
    with pytest.raises(NoWorkerError, match="down"):
        p.route(None, "x", [0, 0, 0], exclude=(0, 1, 2))
    p.set_down(home, False)
    assert home in {p.route(None, f"new prompt {i}", [0, 0, 0]) for i in range(30)}
    with pytest.raises(ValueError, match="no worker 7"):
        p.set_down(7)
