"""Per-queue token quotas: the plan (Tok_min from the M/M/1 bound, then the leftover split) and the
ledger of tokens that running requests hold against them.

Lives here: `plan_quotas` (pure) and `QuotaLedger` (the owner of held tokens). Not here: where S,
D and lambda come from (plan.py) or who gets admitted (multiqueue.py).

Quota arithmetic, per queue q (reference/seed-chameleon.md, section 4.2):
    mu = Tok / (S D);  T = 1 / (mu - lambda) <= SLO   =>   Tok_min = S D (1/SLO + lambda)
Choices the paper leaves open, and why:
- SLO is the TTFT SLO: the paper's throughput criterion is TTFT, and the sojourn T that the bound
  limits is the time until a request is served.
- Tok_min is at least S: below it, Tok/S < 1 concurrent request and a request of the queue's own
  maximal size could never fit its quota.
- The leftover Tok_total - sum(Tok_min) is split in proportion to each queue's share of recent
  token demand (the paper's undefined "initial weights"; equal shares when there is no demand),
  so spare memory follows load. Integer tokens by largest remainder: quotas sum to Tok_total.
- Infeasible (sum(Tok_min) > Tok_total): every Tok_min is scaled by Tok_total / sum(Tok_min),
  with one warning per plan. Every queue keeps a share, so none is starved outright.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class QueueLoad:
    """Recent statistics of one queue, the inputs of its Tok_min."""

    max_cost_tokens: int
    """S: the largest request cost (tokens) routed to the queue."""
    service_s: float
    """D: the expected time to process one of its requests."""
    arrival_rate: float
    """lambda: requests per second."""
    demand_tokens: int
    """Sum of the costs of its recent requests: its weight in the leftover split."""


@dataclass(frozen=True)
class QuotaPlan:
    quotas: tuple[int, ...]
    minima: tuple[int, ...]
    feasible: bool
    """False when sum(minima) > total and the quotas are the scaled-down minima."""


def min_tokens(load: QueueLoad, slo_s: float) -> int:
    """Tok_min = max(S, S D (1/SLO + lambda)), rounded up."""
    s = load.max_cost_tokens
    return max(s, math.ceil(s * load.service_s * (1.0 / slo_s + load.arrival_rate)))


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """Splits `total` integer tokens in proportion to `weights` by largest remainder (ties to the
    lower index); equal weights when they sum to 0."""
    if sum(weights) <= 0:
        weights = [1.0] * len(weights)
    wsum = sum(weights)
    exact = [total * w / wsum for w in weights]
    parts = [math.floor(e) for e in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - parts[i]), i))
    for i in order[: total - sum(parts)]:
        parts[i] += 1
    return parts


def plan_quotas(total_tokens: int, loads: Sequence[QueueLoad], slo_s: float) -> QuotaPlan:
    """Quotas summing to `total_tokens`. Raises ValueError for no queues, a negative total or a
    non-positive SLO."""
    if not loads or total_tokens < 0 or slo_s <= 0:
        raise ValueError(f"need queues, total >= 0 and SLO > 0; got {len(loads)} queues, "
                         f"total {total_tokens}, SLO {slo_s}")
    minima = [min_tokens(load, slo_s) for load in loads]
    need = sum(minima)
    if need > total_tokens:
        logger.warning("queue quota minima need %d tokens but only %d exist; each queue's minimum "
                       "is scaled down to %.0f%%", need, total_tokens, 100 * total_tokens / need)
        return QuotaPlan(tuple(apportion(total_tokens, minima)), tuple(minima), False)
    extra = apportion(total_tokens - need, [load.demand_tokens for load in loads])
    return QuotaPlan(tuple(m + e for m, e in zip(minima, extra)), tuple(minima), True)


class QuotaLedger:
    """Quota and held tokens per queue. available(q) = quota(q) - held(q); it is negative after
    an oversized admission, or when a refresh shrank the quota below what is held, and the queue
    then admits nothing until enough of its running requests finish."""

    def __init__(self, quotas: Sequence[int]) -> None:
        self.quotas = list(quotas)
        self.held = [0] * len(quotas)

    def available(self, q: int) -> int:
        return self.quotas[q] - self.held[q]

    def charge(self, charges: Iterable[tuple[int, int]]) -> None:
        for q, tokens in charges:
            self.held[q] += tokens

    def release(self, charges: Iterable[tuple[int, int]]) -> None:
        for q, tokens in charges:
            self.held[q] -= tokens
            assert self.held[q] >= 0, f"queue {q} released more than it held: double finish?"

    def reset(self, quotas: Sequence[int], charges: Iterable[Iterable[tuple[int, int]]]) -> None:
        """New quotas (a refresh); held tokens recomputed from every running request's charges."""
        self.quotas = list(quotas)
        self.held = [0] * len(quotas)
        for c in charges:
            self.charge(c)

    def check_invariants(self, charges: Iterable[Iterable[tuple[int, int]]]) -> None:
        """`charges`: those of every running request."""
        held = [0] * len(self.quotas)
        for c in charges:
            for q, tokens in c:
                assert 0 <= q < len(held) and tokens > 0, f"bad charge ({q}, {tokens})"
                held[q] += tokens
        assert held == self.held, f"held tokens {self.held} != running charges {held}"
        assert min(self.quotas, default=0) >= 0, f"negative quota in {self.quotas}"
