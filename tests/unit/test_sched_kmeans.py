"""1-D k-means and the elbow rule on hand-made WRS distributions, with exact cut-offs."""

from __future__ import annotations

from statistics import NormalDist

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sgl_multilora.sched.kmeans import choose_clustering, kmeans_1d


def test_one_value_is_one_queue():
    c = choose_clustering([0.3] * 50)
    assert (c.k, c.cutoffs, c.wcss_by_k) == (1, (), (0.0,))
    assert c.centroids == pytest.approx((0.3,))


def test_two_groups_are_two_queues_cut_at_the_midpoint():
    values = [0.1] * 90 + [0.9] * 10  # uneven sizes do not matter
    c = choose_clustering(values)
    assert c.k == 2
    assert c.centroids == pytest.approx((0.1, 0.9))
    assert c.cutoffs == pytest.approx((0.5,))
    assert c.wcss_by_k[0] == pytest.approx(100 * 0.9 * 0.1 * 0.8**2)
    assert c.wcss_by_k[1] == pytest.approx(0.0)


def test_three_and_four_groups_with_jitter():
    three = [x + d for x in (0.1, 0.5, 0.9) for d in (-0.01, 0.0, 0.01) for _ in range(10)]
    c = choose_clustering(three)
    assert c.k == 3
    assert c.cutoffs == pytest.approx((0.3, 0.7))
    four = [x + d for x in (0.05, 0.35, 0.65, 0.95) for d in (-0.01, 0.01)]
    c = choose_clustering(four)
    assert c.k == 4
    assert c.cutoffs == pytest.approx((0.2, 0.5, 0.8))


def test_four_equal_groups_keep_four_queues():
    # merging two of four equal groups costs 1/10 of the variance: above the 6% bar
    c = choose_clustering([x for x in (0.05, 0.35, 0.65, 0.95) for _ in range(25)])
    w = c.wcss_by_k
    assert (w[2] - w[3]) / w[0] == pytest.approx(0.1)
    assert c.k == 4 and c.cutoffs == pytest.approx((0.2, 0.5, 0.8))


def test_uniform_spread_takes_three_queues_and_a_normal_one_four():
    # WCSS(K) = WCSS(1) / K^2 on a uniform spread: the gains are 75%, 14% and 4.9% of WCSS(1),
    # so the third queue pays for itself and the fourth does not.
    values = [(i + 0.5) / 1200 for i in range(1200)]
    c = choose_clustering(values)
    assert c.k == 3
    assert c.cutoffs == pytest.approx((1 / 3, 2 / 3), abs=1e-3)
    w = c.wcss_by_k
    assert [(w[i] - w[i + 1]) / w[0] for i in range(3)] == pytest.approx([0.75, 5 / 36, 7 / 144],
                                                                         abs=1e-3)
    assert choose_clustering(values, min_gain=0.04).k == 4  # a lower bar buys the 4th queue
    assert choose_clustering(values, min_gain=0.8).k == 1
    assert choose_clustering(values, max_k=2).k == 2
    normal = [NormalDist().inv_cdf((i + 0.5) / 2000) for i in range(2000)]
    c = choose_clustering(normal)
    w = c.wcss_by_k
    assert (w[2] - w[3]) / w[0] == pytest.approx(0.073, abs=2e-3) and c.k == 4


def test_fewer_distinct_values_than_k():
    assert choose_clustering([0.2, 0.2, 0.7]).k == 2
    with pytest.raises(ValueError):
        kmeans_1d([0.2, 0.2], 2)
    with pytest.raises(ValueError):
        choose_clustering([])


def test_a_far_small_group_is_found_not_averaged_away():
    # quantile starts put every centroid in the big group; the evenly spaced start finds the tail
    values = [0.01 * (i % 10) for i in range(200)] + [0.95, 0.96, 0.97]
    c = choose_clustering(values)
    assert c.cutoffs[-1] > 0.09 and c.centroids[-1] == pytest.approx(0.96)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0, 1, allow_nan=False), min_size=1, max_size=60))
@example([0.0, 5e-324])  # adjacent floats: their midpoint rounds onto the lower one
def test_properties_deterministic_sorted_monotone(values):
    c = choose_clustering(values)
    assert c == choose_clustering(list(reversed(values)))  # deterministic, order-free
    assert 1 <= c.k <= min(4, len(set(values)))
    assert list(c.centroids) == sorted(set(c.centroids))
    assert len(c.cutoffs) == c.k - 1
    assert all(a < cut < b for a, cut, b in zip(c.centroids, c.cutoffs, c.centroids[1:]))
    assert all(a >= b - 1e-12 for a, b in zip(c.wcss_by_k, c.wcss_by_k[1:]))
