"""Every piece of the scheduler's bookkeeping holds after any sequence of operations: arrivals,
batches (with adapters loading and memory-blocked), finishes, aborts, retractions, squashes and
refits. `check_invariants` runs after every step. A hypothesis-drawn random generator picks the
operations, so that each example runs a long, busy sequence."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_multilora.sched import (
    MultiQueueScheduler,
    OutputLengthPredictor,
    SchedConfig,
    SchedRequest,
    TimingModel,
)

OPS = ["add"] * 5 + ["batch"] * 3 + ["finish"] * 2 + ["remove", "requeue", "squash", "refresh"]


def step(s: MultiQueueScheduler, rng: random.Random, now: float, n: int) -> int:
    op = rng.choice(OPS)
    if op == "add":
        adapter = rng.choice(["a", "b", "big", None])
        rank = 0 if adapter is None else rng.choice([8, 16, 64])
        in_len = rng.randint(0, 3000)
        s.add(SchedRequest(f"r{n}", adapter, in_len, rank=rank, adapter_tokens=4 * rank,
                           max_new_tokens=rng.randint(1, 600), arrival=now,
                           cached_len=rng.choice([0, rng.randint(0, in_len)])))
        return n + 1
    running = sorted(s.running)
    if op == "batch":
        big_loadable = rng.random() < 0.5
        budget = None if rng.random() < 0.3 else rng.randint(0, 4000)
        batch = s.build_batch(now, budget, {"a", "b"}.__contains__,
                              lambda a: big_loadable or a != "big")
        assert all(r.rid in s.running for r in batch)
    elif op == "finish" and running:
        s.on_finish(rng.choice(running), now, rng.randint(1, 500))
    elif op == "remove" and n:
        s.remove(f"r{rng.randrange(n)}")  # queued, running or gone: only a queued one leaves
    elif op == "requeue" and running:
        s.requeue(rng.choice(running))
    elif op == "squash":
        for sq in s.squash_candidates(rng.randint(0, 2000)):
            s.requeue(sq.victim.rid, squash=True)
    elif op == "refresh":
        s.refresh(now, total_tokens=rng.randint(1000, 20_000), force=rng.random() < 0.5)
    return n


@settings(max_examples=30, deadline=None)
@given(rng=st.randoms(use_true_random=False), num_steps=st.integers(1, 150))
def test_invariants_hold_after_every_operation(rng, num_steps):
    cfg = SchedConfig(total_tokens=5000, min_samples=4, window_size=50, requeue_s=30.0,
                      timing=TimingModel(0.001, 0.05))
    s = MultiQueueScheduler(cfg, OutputLengthPredictor(default_out_len=64, min_samples=1))
    n = 0
    for i in range(num_steps):
        n = step(s, rng, float(i), n)
        s.check_invariants()
    st_ = s.stats()
    assert st_.num_queued + st_.num_running <= n
    assert sum(q.num_queued for q in st_.queues) == st_.num_queued
