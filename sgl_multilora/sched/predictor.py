"""Output-length predictor learned online from finished requests, with its accuracy record.

Lives here: `OutputLengthPredictor` (observe / predict) and `PredictorStats`. Not here: any
external model. The paper uses muServe's BERT proxy, which does not exist for our base models;
this learns from the requests it serves instead.

Choices, and why:
- One exponentially weighted mean of observed output lengths per key, most specific key first:
  (adapter, prompt-length bucket), then the adapter, then all requests, then `default_out_len`.
  A key answers once it has `min_samples` observations. Adapters are tasks (a summariser, a
  classifier), so their output lengths cluster; the bucket catches length-dependent tasks.
- The mean, not a median or quantile: quotas add request costs, and a sum of means estimates the
  sum of lengths without bias, where a sum of medians under-counts skewed lengths.
- Weight `alpha` (0.1), with a plain running mean until a key has 1 / alpha observations, so early
  estimates are not biased towards the first value. Old behaviour fades over about ten requests.
- Accuracy over the last `window` observations: mean absolute error in tokens and the share of
  predictions within +-25% of the true length (the paper reports an "80% accuracy" without a
  definition; this is ours), measured on the prediction the scheduler actually used when given.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

DEFAULT_BUCKET_EDGES = (128, 512, 2048, 8192)
"""Prompt-length bucket edges in tokens: [0, 128), [128, 512), ..., [8192, inf)."""


@dataclass(frozen=True)
class PredictorStats:
    num_observed: int
    window_len: int
    mae_tokens: float
    within_25pct: float
    """Share of the window's predictions within +-25% of the true output length."""
    num_keys: int


@dataclass(slots=True)
class _Mean:
    mean: float = 0.0
    n: int = 0

    def add(self, x: float, alpha: float) -> None:
        self.n += 1
        self.mean += (x - self.mean) * max(alpha, 1.0 / self.n)


class OutputLengthPredictor:
    """Raises ValueError on bad settings and on negative lengths (a caller bug, never normal)."""

    def __init__(self, default_out_len: int = 256, alpha: float = 0.1, min_samples: int = 3,
                 bucket_edges: tuple[int, ...] = DEFAULT_BUCKET_EDGES, window: int = 500) -> None:
        if default_out_len < 1 or not 0 < alpha <= 1 or min_samples < 1 or window < 1:
            raise ValueError(
                "need default_out_len >= 1, 0 < alpha <= 1, min_samples >= 1, window >= 1; "
                f"got {default_out_len}, {alpha}, {min_samples}, {window}")
        if list(bucket_edges) != sorted(set(bucket_edges)):
            raise ValueError(f"bucket_edges must be strictly increasing, got {bucket_edges}")
        self.default_out_len = default_out_len
        self.alpha = alpha
        self.min_samples = min_samples
        self.bucket_edges = tuple(bucket_edges)
        self._by_key: dict[tuple[str | None, int], _Mean] = {}
        self._by_adapter: dict[str | None, _Mean] = {}
        self._global = _Mean()
        self._errors: deque[tuple[int, bool]] = deque(maxlen=window)
        self._abs_err_sum = 0
        self._num_within = 0
        self._num_observed = 0

    def bucket(self, in_len: int) -> int:
        return bisect.bisect_right(self.bucket_edges, in_len)

    def predict(self, adapter: str | None, in_len: int) -> int:
        """Predicted output tokens, >= 1. Does not modify anything."""
        for m in (self._by_key.get((adapter, self.bucket(in_len))),
                  self._by_adapter.get(adapter), self._global):
            if m is not None and m.n >= self.min_samples:
                return max(1, round(m.mean))
        return self.default_out_len

    def observe(self, adapter: str | None, in_len: int, out_len: int,
                predicted: int | None = None) -> None:
        """Learns from one finished request. `predicted`: the prediction the scheduler used for it
        (recorded for accuracy); None records what `predict` says now, before learning."""
        if in_len < 0 or out_len < 0:
            raise ValueError(f"negative length: in_len={in_len}, out_len={out_len}")
        if predicted is None:
            predicted = self.predict(adapter, in_len)
        self._record_error(predicted, out_len)
        key = (adapter, self.bucket(in_len))
        for table, k in ((self._by_key, key), (self._by_adapter, adapter)):
            m = table.get(k)
            if m is None:
                m = table[k] = _Mean()
            m.add(out_len, self.alpha)
        self._global.add(out_len, self.alpha)
        self._num_observed += 1

    def _record_error(self, predicted: int, actual: int) -> None:
        errors = self._errors
        if len(errors) == errors.maxlen:
            old_err, old_within = errors[0]
            self._abs_err_sum -= old_err
            self._num_within -= old_within
        err = abs(predicted - actual)
        within = err <= 0.25 * actual
        errors.append((err, within))
        self._abs_err_sum += err
        self._num_within += within

    def stats(self) -> PredictorStats:
        n = len(self._errors)
        return PredictorStats(
            num_observed=self._num_observed, window_len=n,
            mae_tokens=self._abs_err_sum / n if n else 0.0,
            within_25pct=self._num_within / n if n else 0.0,
            num_keys=len(self._by_key),
        )

    def check_invariants(self) -> None:
        assert self._abs_err_sum == sum(e for e, _ in self._errors), "error window sum drifted"
        assert self._num_within == sum(w for _, w in self._errors), "within-25% count drifted"
        assert self._global.n == self._num_observed, "global mean missed an observation"
        assert sum(m.n for m in self._by_key.values()) == self._num_observed, \
            "a (adapter, bucket) key missed an observation"
