"""WRS against hand-computed values, and the normaliser fitted to a window."""

from __future__ import annotations

import pytest

from sgl_multilora.sched.wrs import WrsNormalizer, fit_normalizer, quantile

NORM = WrsNormalizer(max_in_len=1000, max_out_len=500, max_rank=64, base_rank=8)


def test_formula_by_hand():
    # (0.4 * 250/1000 + 0.6 * 100/500) * 32/64 = (0.1 + 0.12) * 0.5
    assert NORM.wrs(250, 100, 32) == pytest.approx(0.11)
    # the largest request of the largest adapter is 1
    assert NORM.wrs(1000, 500, 64) == pytest.approx(1.0)
    # degree 2: doubling the rank doubles the WRS
    assert NORM.wrs(250, 100, 64) == pytest.approx(2 * NORM.wrs(250, 100, 32))


def test_terms_above_the_normaliser_count_as_one():
    assert NORM.wrs(5000, 9000, 256) == pytest.approx(1.0)
    assert NORM.wrs(5000, 0, 64) == pytest.approx(0.4)


def test_base_model_request_counts_as_base_rank():
    assert NORM.wrs(250, 100, 0) == pytest.approx(NORM.wrs(250, 100, 8))
    assert NORM.wrs(250, 100, 0) > 0  # a long base request is not in the smallest queue for free


def test_normaliser_is_the_window_quantile_not_the_max():
    in_lens = list(range(1, 101)) + [100_000]  # one outlier prompt
    norm = fit_normalizer(in_lens, [10] * 101, [8] * 100 + [128], NORM, q=0.99)
    assert norm.max_in_len == 100  # the outlier does not flatten everyone else
    assert norm.max_out_len == 10
    assert norm.max_rank == 128  # an adapter above the configured max raises MaxRank
    assert fit_normalizer([], [], [], NORM) is NORM


def test_bad_input_raises():
    with pytest.raises(ValueError):
        WrsNormalizer(0, 1, 1)
    with pytest.raises(ValueError):
        quantile([], 0.5)
