"""The live hook's measured timing rates (`MeasuredRates`): prefill seconds per token weighted by the steps' tokens,
so that small extend steps' fixed cost does not pass for a per-token cost."""

from __future__ import annotations

import pytest

from sgl_multilora.sched import MeasuredRates, TimingModel


def test_small_steps_do_not_set_the_prefill_rate():
    rates = MeasuredRates(weight=0.2)
    for _ in range(20):  # a resumed request's 1-token step, then a 400-token prompt: 0.1 s fixed, 1 ms a token
        rates.observe_prefill(0.1 + 0.001 * 1, 1)
        rates.observe_prefill(0.1 + 0.001 * 400, 400)
    rate = rates.rates()["prefill_s_per_token"]
    # per-step ratios would average about (0.101 + 0.00125) / 2 = 0.05 s a token; the token-weighted rate stays
    # within the large steps' own figure (0.00125) plus the small steps' share of the fixed cost
    assert 0.00125 <= rate < 0.0016
    assert TimingModel(prefill_s_per_token=rate).exec_s(400, 0) == pytest.approx(400 * rate)


def test_one_kind_of_step_measured_leaves_the_other_rate_out():
    rates = MeasuredRates()
    assert rates.rates() == {}
    rates.observe_prefill(0.5, 0)  # a step with no new token teaches nothing
    assert rates.rates() == {}
    rates.observe_decode(0.08)
    assert rates.rates() == {"decode_s_per_token": 0.08}
    rates.observe_prefill(0.3, 100)
    assert rates.rates() == {"decode_s_per_token": 0.08, "prefill_s_per_token": pytest.approx(0.003)}


def test_rates_follow_a_change_at_the_decay_weight():
    rates = MeasuredRates(weight=0.5)
    rates.observe_decode(0.1)
    rates.observe_decode(0.3)
    assert rates.rates()["decode_s_per_token"] == pytest.approx(0.2)
    rates.observe_prefill(1.0, 100)
    rates.observe_prefill(1.0, 300)  # sums decay to 1.0 s over 200 tokens
    assert rates.rates()["prefill_s_per_token"] == pytest.approx(1.0 / 200)


@pytest.mark.parametrize("call", [lambda r: r.observe_prefill(-1.0, 5), lambda r: r.observe_prefill(1.0, -5),
                                  lambda r: r.observe_decode(-0.1), lambda r: MeasuredRates(weight=0)])
def test_bad_input_is_refused(call):
    with pytest.raises(ValueError):
        call(MeasuredRates())
