"""The simulated LoRA-server cache of eval/sim/iar_check.py: every request admissible when every adapter fits, none
beyond the first M distinct ones when one slot set is all a batch has, and the same rate for the same seed."""

from __future__ import annotations

import numpy as np

from eval.sim.iar_check import simulate
from sgl_multilora import planner


def test_full_cache_admits_everything_and_a_tiny_one_admits_only_what_fits():
    p = planner.zipf_popularity(40, 1.0)
    assert simulate(p, lb=64, m=40, batches=20, warm_up=2, seed=1) == 1.0
    one = simulate(p, lb=64, m=1, batches=200, warm_up=2, seed=1)
    # one slot: a batch admits only the requests of the first adapter it pins (and that one's repeats)
    assert 0 < one < 0.5
    assert simulate(p, lb=64, m=8, batches=50, warm_up=2, seed=3) == simulate(p, lb=64, m=8, batches=50, warm_up=2,
                                                                            seed=3)


def test_uniform_popularity_with_room_for_a_batch_admits_everything():
    p = np.full(100, 0.01)
    assert simulate(p, lb=10, m=10, batches=50, warm_up=1, seed=0) == 1.0  # at most 10 distinct per batch
