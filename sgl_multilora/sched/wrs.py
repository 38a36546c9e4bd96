"""Weighted Request Size: WRS = (0.4 In/MaxIn + 0.6 PredOut/MaxOut) x (Rank/MaxRank).

Lives here: the formula (`WrsNormalizer.wrs`) and how its normalisers are fitted to a window of
recent requests (`fit_normalizer`). Not here: routing by WRS (queues.py) or the predicted output
length itself (predictor.py).

Choices the paper leaves open (reference/seed-chameleon.md, section 8.4), and why:
- MaxIn and MaxOut are the 99th percentiles of the recent window's prompt and predicted output
  lengths, refitted at every refresh and frozen in between. Observed, not the model's limits: with
  MaxIn = a 32k context every prompt term would be near 0 and the 0.4 / 0.6 weights would mean
  nothing. A quantile, not the maximum: one outlier prompt would otherwise flatten every other
  request's term for a whole epoch. Frozen between refreshes so that the cut-offs, fitted on WRS
  values, keep their meaning; terms above the normaliser count as 1 (such a request is in the
  largest queue whatever its exact value).
- MaxRank is the configured maximum LoRA rank (the server knows it at start), raised to the
  largest rank seen in the window if an adapter exceeds it: ranks are a small known set, so an
  observed quantile would add nothing.
- A base-model request (rank 0) counts as `base_rank` (by default the smallest common LoRA rank,
  8): the base model's work is still there, and a rank term of 0 would put every base request,
  however long, in the smallest queue.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

IN_WEIGHT = 0.4
OUT_WEIGHT = 0.6


@dataclass(frozen=True)
class WrsNormalizer:
    max_in_len: float
    max_out_len: float
    max_rank: float
    base_rank: float = 8.0

    def __post_init__(self) -> None:
        if min(self.max_in_len, self.max_out_len, self.max_rank, self.base_rank) <= 0:
            raise ValueError(f"WRS normalisers must be > 0, got {self}")

    def wrs(self, in_len: int, out_len: int, rank: int, *, clamp: bool = True) -> float:
        """In [0, 1]; 0 only for an empty request. With `clamp` False the terms are not capped at 1, so a request
        beyond the normalisers keeps its size (routing uses it: plan.py's overflow queue)."""
        cap = 1.0 if clamp else float("inf")
        length = (IN_WEIGHT * min(cap, in_len / self.max_in_len)
                  + OUT_WEIGHT * min(cap, out_len / self.max_out_len))
        size = min(cap, (rank if rank > 0 else self.base_rank) / self.max_rank)
        return length * size


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of unsorted `values`; raises ValueError if empty."""
    if not values:
        raise ValueError("quantile of no values")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def fit_normalizer(in_lens: Sequence[int], out_lens: Sequence[int], ranks: Sequence[int],
                   initial: WrsNormalizer, q: float = 0.99) -> WrsNormalizer:
    """The normaliser for the next epoch; `initial` (the configured one) when the window is
    empty. Pure: the caller installs the result."""
    if not in_lens:
        return initial
    return WrsNormalizer(
        max_in_len=max(1.0, quantile(in_lens, q)),
        max_out_len=max(1.0, quantile(out_lens, q)),
        max_rank=max(initial.max_rank, max(ranks)),
        base_rank=initial.base_rank,
    )
