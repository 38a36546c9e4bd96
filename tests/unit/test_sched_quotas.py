"""Quota arithmetic: Tok_min from the M/M/1 bound, the leftover split, the infeasible case, and the
ledger of held tokens."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_multilora.sched.quotas import (
    QueueLoad,
    QuotaLedger,
    apportion,
    min_tokens,
    plan_quotas,
)


def test_min_tokens_by_hand():
    # S = 400 tokens, D = 2 s, SLO = 5 s, lambda = 3/s: 400 * 2 * (0.2 + 3) = 2560
    assert min_tokens(QueueLoad(400, 2.0, 3.0, 0), slo_s=5.0) == 2560
    # a quiet queue still fits one request of its largest size: 400 * 1 * 0.2 = 80 < 400
    assert min_tokens(QueueLoad(400, 1.0, 0.0, 0), slo_s=5.0) == 400


def test_leftover_follows_recent_demand():
    loads = [QueueLoad(100, 1.0, 1.0, demand_tokens=1000),   # min 100 * 1.2 = 120
             QueueLoad(500, 2.0, 0.5, demand_tokens=3000)]   # min 500 * 2 * 0.7 = 700
    plan = plan_quotas(10_000, loads, slo_s=5.0)
    assert plan.minima == (120, 700)
    # leftover 9180 split 1 : 3 -> 2295 and 6885
    assert plan.quotas == (120 + 2295, 700 + 6885)
    assert plan.feasible and sum(plan.quotas) == 10_000


def test_no_demand_splits_equally_and_remainders_are_exact():
    assert apportion(10, [0, 0, 0]) == [4, 3, 3]
    assert apportion(7, [1, 1]) == [4, 3]
    assert apportion(100, [1, 2, 7]) == [10, 20, 70]


def test_infeasible_scales_the_minima_down_with_one_warning(caplog):
    loads = [QueueLoad(1000, 2.0, 1.0, 1), QueueLoad(3000, 2.0, 1.0, 1)]  # minima 2400, 7200
    with caplog.at_level(logging.WARNING, logger="sgl_multilora.sched.quotas"):
        plan = plan_quotas(4800, loads, slo_s=5.0)
    assert plan.minima == (2400, 7200) and not plan.feasible
    assert plan.quotas == (1200, 3600)  # both at 50% of their minimum
    assert len(caplog.records) == 1 and "scaled down to 50%" in caplog.records[0].getMessage()


def test_bad_plans_raise():
    with pytest.raises(ValueError):
        plan_quotas(100, [], 5.0)
    with pytest.raises(ValueError):
        plan_quotas(100, [QueueLoad(1, 1, 1, 1)], 0.0)


def test_ledger_story():
    ledger = QuotaLedger([300, 800])
    ledger.charge([(0, 100), (1, 50)])  # a request that borrowed 50 of queue 1's spare
    assert (ledger.available(0), ledger.available(1)) == (200, 750)
    ledger.release([(0, 100), (1, 50)])
    assert ledger.held == [0, 0]
    with pytest.raises(AssertionError, match="double finish"):
        ledger.release([(0, 1)])


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 100_000),
       st.lists(st.tuples(st.integers(1, 5000), st.floats(0.01, 30), st.floats(0, 20),
                          st.integers(0, 10**6)), min_size=1, max_size=4))
def test_quotas_always_sum_to_the_total(total, raw):
    loads = [QueueLoad(*x) for x in raw]
    plan = plan_quotas(total, loads, slo_s=5.0)
    assert sum(plan.quotas) == total and min(plan.quotas) >= 0
    if plan.feasible:
        assert all(q >= m for q, m in zip(plan.quotas, plan.minima))
