"""Batch building on hand-made queues, with exact admitted sets: the paper's Fig. 10 (a) and (b),
then the quota held while requests run, removal while queued, non-resident skip with prefetch,
oversized requests, the batch budget, refresh and stats.

Sizes: a request of size n has n/2 prompt and n/2 output tokens, so it costs n tokens and its WRS
is n / 2000 (rank 8 of max 8, lengths over 1000): small 100 -> 0.05, medium 400 -> 0.2, large 1000
-> 0.5; the cut-offs (0.1, 0.3) put them in queues 0, 1 and 2.
"""

from __future__ import annotations

import math

import pytest

from sgl_multilora.sched import (
    MultiQueueScheduler,
    OutputLengthPredictor,
    SchedConfig,
    SchedRequest,
    WrsNormalizer,
)

NORM = WrsNormalizer(max_in_len=1000, max_out_len=1000, max_rank=8)
CUTS = [0.1, 0.3]


def make(quotas, cutoffs=CUTS, **kw) -> MultiQueueScheduler:
    cfg = SchedConfig(total_tokens=sum(quotas), requeue_s=math.inf, initial_norm=NORM, **kw)
    s = MultiQueueScheduler(cfg, OutputLengthPredictor(default_out_len=10**6))
    s.set_plan(cutoffs, quotas)
    return s


def req(rid, size, adapter="a", adapter_tokens=0, arrival=0.0) -> SchedRequest:
    return SchedRequest(rid, adapter, in_len=size // 2, rank=8, adapter_tokens=adapter_tokens,
                        max_new_tokens=size - size // 2, arrival=arrival)


def add_all(s, *requests):
    for r in requests:
        s.add(r)
    s.check_invariants()


def rids(batch):
    return [r.rid for r in batch]


def test_fig10a_every_queue_within_its_quota_no_spare():
    s = make([300, 800, 1000])
    add_all(s, *(req(f"s{i}", 100) for i in range(1, 6)),
            *(req(f"m{i}", 400) for i in range(1, 4)), req("l1", 1000), req("l2", 1000))
    assert [s.queues.len_of(q) for q in range(3)] == [5, 3, 2]
    batch = s.build_batch(now=0.0)
    # phase 1, small queue first: 3 x 100 of 300, 2 x 400 of 800, 1 x 1000 of 1000; no queue
    # drained, so phase 2 has nothing to hand out
    assert rids(batch) == ["s1", "s2", "s3", "m1", "m2", "l1"]
    assert [s.queues.len_of(q) for q in range(3)] == [2, 1, 1]
    assert s.ledger.held == [300, 800, 1000]
    assert s.build_batch(now=1.0) == []  # nothing until something finishes
    # each queue stopped at its head, for its quota: what the live server's hold log prints
    assert {q: (st.reason, st.rid, st.cost, st.limit) for q, st in s.last_stops.items()} == {
        0: ("quota", "s4", 100, 0), 1: ("quota", "m3", 400, 0), 2: ("quota", "l2", 1000, 0)}
    assert s.counts["stops_quota"] == 3 + 3  # both batches
    s.check_invariants()

    # the quota is held while requests run, and comes back on finish
    s.on_finish("m1", now=2.0, out_len=200)
    assert rids(s.build_batch(now=2.0)) == ["m3"]
    s.on_finish("s2", now=3.0)
    assert rids(s.build_batch(now=3.0)) == ["s4"]
    s.check_invariants()


def test_fig10b_drained_medium_queue_lends_to_small_not_to_large():
    s = make([300, 800, 1000])
    add_all(s, *(req(f"s{i}", 100) for i in range(1, 6)), req("m1", 400),
            req("l1", 1000), req("l2", 1000))
    batch = s.build_batch(now=0.0)
    # phase 1: s1-s3, m1 (medium drains with 400 spare), l1. Phase 2, small first: s4 and s5 take
    # 200 of the spare; l2 needs 1000 > 200 left and stays queued.
    assert rids(batch) == ["s1", "s2", "s3", "m1", "l1", "s4", "s5"]
    assert rids(s.queues.scan(2)) == ["l2"]
    by_rid = {r.rid: r for r in batch}
    assert by_rid["s4"].charges == [(1, 100)]  # borrowed tokens are charged to the lender
    assert s.ledger.held == [300, 600, 1000]
    s.check_invariants()

    s.on_finish("s4", now=1.0)  # ... and go back to it
    assert s.ledger.held == [300, 500, 1000]
    s.check_invariants()


def test_phase2_adds_the_queues_own_remainder_to_the_spare_pool():
    s = make([300, 800, 1000])
    add_all(s, req("s1", 180), req("s2", 180), req("m1", 400), req("l1", 1000))
    # s2 does not fit the 120 left of its own quota, but 120 + 400 spare from medium does
    assert rids(s.build_batch(now=0.0)) == ["s1", "m1", "l1", "s2"]
    assert s.running["s2"].charges == [(0, 120), (1, 60)]
    s.check_invariants()


def test_removal_while_queued_and_wanted_adapters():
    s = make([300, 800, 1000])
    add_all(s, req("s1", 100, "x"), req("s2", 100, "y"), req("s3", 100, "x"), req("b", 100, None))
    assert s.wanted_adapters() == {"x": 2, "y": 1}  # base-model requests want no adapter
    assert s.remove("s2").rid == "s2"
    assert s.remove("s2") is None  # not queued (any more): not now, not an error
    assert s.wanted_adapters() == {"x": 2}
    s.check_invariants()
    assert rids(s.build_batch(now=0.0)) == ["s1", "s3", "b"]
    assert s.remove("s1") is None  # running: the caller finishes it instead
    assert s.wanted_adapters() == {}
    with pytest.raises(KeyError, match="not running"):
        s.on_finish("s2", now=1.0)
    with pytest.raises(ValueError, match="already queued or running"):
        s.add(req("s1", 100))


def test_non_resident_adapter_is_skipped_and_prefetched_without_blocking():
    s = make([300, 800, 1000])
    add_all(s, req("s1", 100, "x"), req("s2", 100, "a"), req("s3", 100, "x"), req("s4", 100, "a"))
    resident = {"a"}
    prefetched = []

    def prefetch(adapter):
        prefetched.append(adapter)
        return True  # a load is under way

    batch = s.build_batch(0.0, is_resident=resident.__contains__, request_prefetch=prefetch)
    assert rids(batch) == ["s2", "s4"]  # the paper would stop at s1 and admit nothing
    assert prefetched == ["x"]  # once per adapter and batch
    assert rids(s.queues.scan(0)) == ["s1", "s3"]  # they keep their places

    resident.add("x")  # the load finished
    batch = s.build_batch(1.0, is_resident=resident.__contains__, request_prefetch=prefetch)
    # s1 takes the small queue's last 100 tokens; s3 borrows from the drained queues
    assert rids(batch) == ["s1", "s3"]
    assert s.running["s3"].charges == [(1, 100)]
    s.check_invariants()


def test_lookahead_bounds_how_many_loading_requests_are_passed():
    s = make([300, 800, 1000], lookahead=1)
    add_all(s, req("s1", 100, "x"), req("s2", 100, "y"), req("s3", 100, "a"))
    batch = s.build_batch(0.0, is_resident={"a"}.__contains__, request_prefetch=lambda a: True)
    assert batch == []  # s1 passed, s2 is one too many: the scan stops before s3
    assert s.last_stops[0].reason == "lookahead" and s.last_stops[0].rid == "s2"
    assert s.last_passes == {"slot": 0, "not_resident": 4}  # s1 and s2, in phase 1 and phase 2


def test_oversized_request_runs_alone_when_its_queue_is_idle():
    s = make([300, 300, 1000])
    add_all(s, req("m1", 400), req("m2", 400), req("l1", 1000))  # m: above the medium quota
    # m1 runs alone; m2 does not fit the small queue's 300 spare (the large queue lends none)
    assert rids(s.build_batch(now=0.0)) == ["m1", "l1"]
    assert s.ledger.available(1) == -100  # it holds more than the quota while it runs
    assert s.build_batch(now=1.0) == []
    s.on_finish("m1", now=2.0)
    assert rids(s.build_batch(now=2.0)) == ["m2"]
    assert s.running["m2"].charges == [(1, 400)]
    s.check_invariants()


def test_budget_caps_the_batch_and_a_skipped_head_gets_promoted():
    s = make([300, 800, 1000], max_budget_skips=2)
    add_all(s, *(req(f"s{i}", 100) for i in range(1, 21)), req("l1", 1000))
    for first in (1, 11):
        batch = s.build_batch(float(first), budget_tokens=1000)
        # phase 1: three small (300 of the budget); l1 fits its quota but not the 700 left;
        # phase 2: seven more small on the medium queue's spare, up to the budget
        assert rids(batch) == [f"s{i}" for i in range(first, first + 10)]
        # the small queue stopped at the budget in phase 2 (its phase-1 quota stop superseded) in
        # the first batch and drained in the second; the large queue stopped at the budget again
        # in phase 2 (none left by then); the medium queue was empty
        small = {0: ("budget", "s11", 0)} if first == 1 else {}
        assert {q: (st.reason, st.rid, st.limit) for q, st in s.last_stops.items()} == {
            **small, 2: ("budget", "l1", 0)}
        for r in batch:
            s.on_finish(r.rid, first + 0.5)
    assert s.stats().promoted == (2,)  # l1 was stopped by the budget twice
    add_all(s, req("s21", 100))
    # the large queue goes first now and takes the whole budget
    assert rids(s.build_batch(21.0, budget_tokens=1000)) == ["l1"]
    assert s.stats().promoted == ()
    s.check_invariants()


def test_requeue_returns_to_the_arrival_position_and_frees_the_quota():
    s = make([300, 0, 0])
    add_all(s, *(req(f"s{i}", 100) for i in range(1, 6)))
    assert rids(s.build_batch(0.0)) == ["s1", "s2", "s3"]
    s.requeue("s2")  # retracted by the engine
    assert rids(s.queues.scan(0)) == ["s2", "s4", "s5"]
    assert s.ledger.held[0] == 200
    s.check_invariants()


def test_refresh_fits_queues_from_the_window_and_reroutes():
    cfg = SchedConfig(total_tokens=200_000, initial_norm=NORM, min_samples=20)
    s = MultiQueueScheduler(cfg, OutputLengthPredictor(default_out_len=10**6))
    for i in range(10):
        s.add(req(f"s{i}", 100, arrival=i * 0.1))
        s.add(req(f"l{i}", 1000, arrival=i * 0.1 + 0.05))
    # before the first fit: the prior plan queues by size against the configured normaliser
    st = s.stats()
    assert st.cutoffs == (1 / 64, 1 / 16, 1 / 4) and [q.num_queued for q in st.queues] == [0, 10, 0, 10]
    s.refresh(now=1.0)  # the window holds min_samples: the first refit does not wait 300 s
    st = s.stats()
    assert st.counts["refreshes"] == 1 and len(st.cutoffs) == 1
    assert [q.num_queued for q in st.queues] == [10, 10]
    assert sum(q.quota_tokens for q in st.queues) == 200_000 and st.quotas_feasible
    # Tok_min = S D (1/SLO + lambda), D from the timing model (no request finished yet):
    # small: 100 * (50 * 0.0002 + 50 * 0.03) * (0.2 + 10/s) = 1541; large: 1000 * 15.1 * 10.2
    assert [q.min_tokens for q in st.queues] == [1541, 154_020]
    assert st.normalizer.max_in_len == 500  # the window's p99 prompt, not the configured 1000
    assert not s.refresh(now=2.0)  # next one is due at 1 + 300 s
    assert not s.refresh(now=301.0)  # due, but everything in the window is older than 300 s
    for i in range(20):
        s.add(req(f"n{i}", 100, arrival=300.0))  # only small requests lately
    assert s.refresh(now=302.0)
    st = s.stats()
    # one queue fits the window now, plus the overflow queue above 1.5x its largest WRS: the old large requests
    # still waiting are re-routed there, not behind the small ones
    assert st.cutoffs == (1.5,) and [q.num_queued for q in st.queues] == [30, 10]
    s.check_invariants()


def test_warm_up_refits_each_time_the_window_doubles_then_waits_for_the_period():
    cfg = SchedConfig(total_tokens=200_000, initial_norm=NORM, min_samples=8, window_size=40, requeue_s=100.0,
                      window_s=1000.0)
    s = MultiQueueScheduler(cfg, OutputLengthPredictor(default_out_len=50))
    fitted_on = []
    for i in range(100):
        s.add(req(f"r{i}", 100 if i % 2 else 1000, arrival=i * 0.1))
        if s.refresh(now=i * 0.1):
            fitted_on.append(s.plan.num_samples)
    # 8 (min_samples), then each doubling of the window, until its size cap (40) stops it doubling
    assert fitted_on == [8, 16, 32] and s.stats().counts["refreshes"] == 3
    assert not s.refresh(now=50.0)  # steady window: the next refit waits for requeue_s after the last
    assert s.refresh(now=3.1 + 100.0) and s.plan.num_samples == 40
    s.check_invariants()


def test_a_set_plan_is_not_replaced_by_the_warm_up():
    cfg = SchedConfig(total_tokens=1000, initial_norm=NORM, min_samples=4, requeue_s=100.0)
    s = MultiQueueScheduler(cfg, OutputLengthPredictor(default_out_len=50))
    s.set_plan([0.5], [500, 500], now=0.0)
    for i in range(64):
        s.add(req(f"r{i}", 100, arrival=i * 0.1))
        assert not s.refresh(now=i * 0.1)
    assert s.plan.clustering.cutoffs == (0.5,) and s.refresh(now=100.0)


def test_a_request_waits_for_its_queues_quota_however_long():
    """Algorithm 1 as published: every quota held and every queue non-empty (nothing to lend), l2 waits for l1's
    quota however long it has waited."""
    s = make([300, 800, 1000])
    add_all(s, req("l1", 1000, arrival=0.0), req("l2", 1000, arrival=0.0),
            *(req(f"s{i}", 100, arrival=1.0) for i in range(1, 5)),
            *(req(f"m{i}", 400, arrival=1.0) for i in range(1, 4)))
    assert rids(s.build_batch(0.0)) == ["s1", "s2", "s3", "m1", "m2", "l1"]
    assert rids(s.build_batch(10_000.0, budget_tokens=10_000)) == []
    s.check_invariants()


def test_a_cached_prefix_makes_a_request_small():
    """A follow-up turn of 900 prompt tokens, 850 of them cached at arrival, brings 50 to compute: WRS
    0.4 x 50/1000 + 0.6 x 50/1000 = 0.05 puts it in the small queue, and it costs 100 tokens, not 950; an
    uncached prompt of the same length (0.4 x 0.9 + 0.6 x 0.05 = 0.39) is large."""
    s = make([300, 800, 1000])
    follow_up = SchedRequest("turn2", "a", in_len=900, rank=8, max_new_tokens=50, cached_len=850)
    fresh = SchedRequest("fresh", "a", in_len=900, rank=8, max_new_tokens=50)
    add_all(s, fresh, follow_up)
    assert (follow_up.new_len, follow_up.cost_tokens, follow_up.queue) == (50, 100, 0)
    assert (fresh.new_len, fresh.cost_tokens, fresh.queue) == (900, 950, 2)
    assert math.isclose(follow_up.wrs, 0.05) and math.isclose(fresh.wrs, 0.39)
    assert rids(s.build_batch(now=0.0)) == ["turn2"]  # the small queue first, though it came second
    assert rids(s.build_batch(now=1.0)) == ["fresh"]  # 900 new tokens > 8 x 50: split off to its own batch
    with pytest.raises(ValueError, match="cached tokens in a prompt"):
        s.add(SchedRequest("bad", "a", in_len=10, rank=8, cached_len=11))
    with pytest.raises(ValueError, match="negative size"):
        s.add(SchedRequest("neg", "a", in_len=10, rank=8, cached_len=-1))


def test_a_batch_splits_off_a_request_far_larger_than_those_planned_before_it():
    """A prefill forward ends for all its requests at once: the 1,000 new tokens of l1 (> 8 x m1's 110, and
    over SPLIT_MIN_TOKENS) go to the next batch, at their place and with their tokens back, once. In the next
    batch l1 goes in although a far smaller request came first again; l2, 1.7x of l1, goes with it. Large
    requests alone are not split; nor is a request under SPLIT_MIN_TOKENS, whatever the ratio."""
    from sgl_multilora.sched.multiqueue import SPLIT_MIN_TOKENS, SPLIT_RATIO
    assert (SPLIT_RATIO, SPLIT_MIN_TOKENS) == (8, 512)
    s = make([3000, 3000, 6000])
    add_all(s, req("s1", 100), req("l1", 2000), req("m1", 220))
    assert rids(s.build_batch(now=0.0)) == ["s1", "m1"]
    assert s.ledger.held == [100, 220, 0] and s.counts["deferred"] == 1 and s.queues.head(2).rid == "l1"
    s.check_invariants()
    add_all(s, req("s2", 100), req("l2", 3400))
    assert rids(s.build_batch(now=1.0)) == ["s2", "l1", "l2"]
    assert s.counts["deferred"] == 1 and s.ledger.held == [200, 220, 5400]
    s.check_invariants()

    s = make([3000, 3000, 6000])
    add_all(s, req("l1", 2000), req("l2", 2000))
    assert rids(s.build_batch(now=0.0)) == ["l1", "l2"] and s.counts["deferred"] == 0

    s = make([3000, 3000, 6000])
    add_all(s, req("t1", 10), req("u1", 1000))  # 500 new tokens, 100x t1's, under SPLIT_MIN_TOKENS
    assert rids(s.build_batch(now=0.0)) == ["t1", "u1"] and s.counts["deferred"] == 0
