"""The room squash (sgl_multilora/sched/room.py): running decodes retracted so that the oldest fresh queued request,
whom the KV room cannot take and whom running requests ending would not serve within its TTFT SLO, gets its first
token; the batch after it admits that request alone. Exact victims, the conditions that keep it from firing, and its
bounds (never for a resumed request, a victim at most `max_squashes` times, one at a time, off by default).

TTFT SLO 2 s, share 0.5: a request qualifies once it has waited 1 s.
"""

from __future__ import annotations

import math

from sgl_multilora.sched import MultiQueueScheduler, OutputLengthPredictor, SchedConfig, SchedRequest, WrsNormalizer
from sgl_multilora.sched.room import RoomVictim, choose_room_squash, room_free_in_s

CONFIG = SchedConfig(total_tokens=100_000, requeue_s=math.inf, ttft_slo_s=2.0, max_squashes=1,
                     room_squash_share=0.5, initial_norm=WrsNormalizer(1000, 1000, 8))


def req(rid, in_len=100, arrival=0.0, adapter="a") -> SchedRequest:
    return SchedRequest(rid, adapter, in_len, rank=8, max_new_tokens=10, arrival=arrival)


def victim(rid, remaining_s, footprint, decoding=True, squashes=0, seq=0) -> RoomVictim:
    r = req(rid)
    r.num_squashes, r.seq = squashes, seq
    return RoomVictim(r, footprint, remaining_s, decoding)


def names(squash):
    return [r.rid for r in squash.victims]


def test_the_decodes_that_would_hold_their_room_longest_go_until_they_cover_the_shortfall():
    r1 = req("r1", arrival=0.0)
    running = [victim("short", 0.5, 100, seq=0), victim("mid", 2.0, 500, seq=1), victim("long", 5.0, 300, seq=2)]
    # room 400, need 1000: 600 short. Ending in order (0.5 s: 100, 2.0 s: 600) the room comes in 2 s: at 1.2 s of
    # age that is 3.2 s > the SLO. Longest remaining first: long (300), then mid (800 >= 600)
    squash = choose_room_squash(r1, 1000, 400, running, 1.2, CONFIG)
    assert names(squash) == ["long", "mid"]
    assert squash.beneficiary is r1 and squash.shortfall == 600 and squash.wait_s == 2.0
    # equal remaining times: the larger footprint first, then arrival order
    tie = [victim("small", 5.0, 200, seq=0), victim("big", 5.0, 700, seq=1), victim("big2", 5.0, 700, seq=2)]
    assert names(choose_room_squash(r1, 1000, 400, tie, 1.2, CONFIG)) == ["big"]


def test_it_does_not_fire_early_when_the_room_is_there_or_when_running_requests_end_in_time():
    r1 = req("r1", arrival=0.0)
    running = [victim("long", 5.0, 2000)]
    assert choose_room_squash(r1, 1000, 400, running, 0.9, CONFIG) is None  # waited less than half the SLO
    assert choose_room_squash(r1, 400, 400, running, 1.5, CONFIG) is None  # the room covers it
    ending = [victim("soon", 0.4, 700), victim("long", 5.0, 2000)]
    assert choose_room_squash(r1, 1000, 400, ending, 1.5, CONFIG) is None  # 1.5 + 0.4 s <= 2 s
    assert choose_room_squash(r1, 1000, 400, ending, 1.7, CONFIG) is not None  # 1.7 + 0.4 s > 2 s: now it fires


def test_only_decoding_requests_squashed_less_than_the_bound_may_go_and_they_must_cover_the_shortfall():
    r1 = req("r1")
    running = [victim("prefill", 9.0, 5000, decoding=False), victim("again", 8.0, 5000, squashes=1),
               victim("ok", 7.0, 400), victim("nothing", 6.0, 0)]
    assert choose_room_squash(r1, 1000, 400, running, 1.5, CONFIG) is None  # "ok" alone frees 400 < 600
    running.append(victim("ok2", 1.0, 300))
    assert names(choose_room_squash(r1, 1000, 400, running, 1.5, CONFIG)) == ["ok", "ok2"]
    resumed = req("resumed")
    resumed.resumed = True  # its first token is out: no squash can save its TTFT
    assert choose_room_squash(resumed, 1000, 400, running, 1.5, CONFIG) is None


def test_room_free_in_s_is_the_end_of_the_request_that_completes_the_shortfall():
    running = [victim("a", 3.0, 100), victim("b", 1.0, 100), victim("c", 2.0, 100)]
    assert room_free_in_s(running, 0) == 0.0
    assert room_free_in_s(running, 150) == 2.0
    assert room_free_in_s(running, 300) == 3.0
    assert math.isinf(room_free_in_s(running, 301))


def scheduler(**overrides) -> MultiQueueScheduler:
    cfg = SchedConfig(**{**{f: getattr(CONFIG, f) for f in ("total_tokens", "requeue_s", "ttft_slo_s",
                                                            "max_squashes", "initial_norm")}, **overrides})
    s = MultiQueueScheduler(cfg, OutputLengthPredictor(default_out_len=10))
    s.set_plan([], [100_000])
    return s


def unread(*_):
    raise AssertionError("the memory was read before a request qualified")


def as_victims(s: MultiQueueScheduler, remaining: dict[str, float], footprint: int = 500):
    return lambda: [RoomVictim(r, footprint, remaining[r.rid]) for r in s.running.values()]


def test_the_scheduler_squashes_for_the_oldest_fresh_request_and_admits_it_alone_next():
    s = scheduler(room_squash_share=0.5)
    for i in range(3):
        s.add(req(f"old{i}", arrival=0.0))
    assert [r.rid for r in s.build_batch(0.0)] == ["old0", "old1", "old2"]
    s.add(req("new", arrival=1.0))
    s.add(req("newer", arrival=1.5))
    remaining = {"old0": 0.2, "old1": 9.0, "old2": 4.0}
    need = lambda r: 1000  # noqa: E731
    assert s.room_squash(1.9, unread, unread, unread) is None  # "new" has waited 0.9 s < 1 s: memory not read
    # room 0, need 1000: old0 ends at 0.2 s (500), old2 at 4 s (1000): too late; old1 (9 s) then old2 go
    squash = s.room_squash(2.1, lambda: 0, need, as_victims(s, remaining))
    assert [r.rid for r in squash.victims] == ["old1", "old2"] and squash.beneficiary.rid == "new"
    s.commit_room_squash(squash)
    assert s.room_reserved_for == "new" and sorted(s.running) == ["old0"]
    assert s.room_squash(2.2, lambda: 0, need, as_victims(s, remaining)) is None  # one at a time
    s.check_invariants()
    # the victims are older, yet the next batch takes "new" alone
    assert [r.rid for r in s.build_batch(2.2, budget_tokens=10_000)] == ["new"]
    assert s.room_reserved_for is None
    assert [r.rid for r in s.build_batch(2.3, budget_tokens=10_000)] == ["old1", "old2", "newer"]
    counts = s.stats().counts
    assert (counts["room_squashes"], counts["room_squashed"], counts["room_admits"]) == (1, 2, 1)
    # squashed once, each victim may not go again: with only them running, nothing covers the next shortfall
    s.add(req("late", arrival=3.0))
    s.on_finish("old0", 3.0, 10)
    s.on_finish("new", 3.0, 10)
    s.on_finish("newer", 3.0, 10)
    assert s.room_squash(5.0, lambda: 0, need, as_victims(s, {"old1": 9.0, "old2": 9.0})) is None
    s.check_invariants()


def test_a_reservation_that_cannot_be_served_takes_nothing_for_one_batch_then_ends():
    s = scheduler(room_squash_share=0.5)
    s.add(req("old", arrival=0.0))
    s.add(req("other", arrival=0.0))
    s.build_batch(0.0)
    s.add(req("big", in_len=5000, arrival=1.0))
    squash = s.room_squash(2.5, lambda: 0, lambda r: 6000, lambda: [RoomVictim(s.running["old"], 6000, 5.0)])
    s.commit_room_squash(squash)
    # its cost is over this batch's budget: the batch takes nothing (not "old", which would take the room back)
    assert s.build_batch(2.5, budget_tokens=100) == []
    assert s.room_reserved_for is None  # one batch only
    assert [r.rid for r in s.build_batch(2.6, budget_tokens=200)] == ["old"]  # 110 tokens: it fits, "big" not
    s.check_invariants()


def test_off_by_default():
    s = scheduler()
    s.add(req("old"))
    s.build_batch(0.0)
    s.add(req("new", arrival=1.0))
    assert s.room_squash(100.0, unread, unread, unread) is None
