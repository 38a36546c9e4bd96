"""ELORA's unified cost model (Eqs. 3-6): Eval = min(1, N / Low) * cost * visit * (1 - sigmoid(t)).

Lives here: `EloraPolicy` (the score, with ELORA's ablations as switches) and
`expected_adapters_per_batch` (Low_lora, Eq. 3). Not here: the visit / size bookkeeping (`usage.py`)
and the swapper that applies the order.

Choices the paper leaves open (shared/reference/seed-elora.md, section 6.2), and why:
- A7, units of t: seconds, divided by a temperature `tau_s` (default 1.0, the literal reading "t in
  seconds"). `1 - sigmoid(t) = sigmoid(-t)` falls below 1e-13 after 30 s, so `evaluate` underflows
  for old items; `score` returns log(Eval) instead (same order, no underflow, no ties among old
  items). The simulated experiment (eval/sim/compare.py) also runs tau_s = 10 and 60 beside the
  default, to show the effect.
- A6, direction of the adapter-count term on eviction. Read literally, an adapter scored for
  swap-out gets min(1, (N - 1) / Low) and a KV node min(1, N / Low): when fewer adapters than needed
  are resident this makes adapters *easier* to evict, the opposite of the paper's stated intent
  ("keep the number of resident LoRAs near Low_lora"). Default mode `"intent"`: when N < Low every
  KV node gets the factor N / Low and adapters 1 (KV goes first); when N > Low adapters get Low / N
  and KV 1 (surplus adapters go first); at N = Low both 1. `"literal"` keeps the paper's reading for
  fidelity checks. With Low = 0 (no traffic yet) the factor is 1.
- A1, cost_i: the seconds needed to get the item back, from the context (`reload_cost_s`): a PCIe
  copy for an adapter; for KV, a copy when a host tier holds it, else its recompute time. The paper
  says "PCIe bandwidth and size": that is the host-tier case.
- A1/A2, granularity: ELORA scores fixed 16 MB blocks; our items are variable-length KV runs and
  whole (atomic) adapters. With `block_bytes` set (default 16 MiB) cost_i is the reload time of one
  block's worth of the item, `reload_cost_s * block_bytes / size_bytes`, so that a greedy evictor
  compares what each freed block costs to get back: otherwise a 335 MB adapter and a 2-token KV run
  would rank as if they freed the same memory. `block_bytes=None` scores whole items.
- A5, visit_i: the item's visits divided by the context's total (requests seen). With
  `usage.UsageStats` a KV node's visits are the tree's match counts through it plus one (the request
  that inserted it): without the +1 every fresh node would score 0 and lose all order.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from operator import attrgetter

import numpy as np

from sgl_multilora.policy.base import BasePolicy
from sgl_multilora.policy.context import PolicyContext
from sgl_multilora.policy.registry import register

_last_access = attrgetter("last_access")

TERMS = ("lora_count", "cost", "visit", "recency")
"""Names of the factors of Eval; ELORA's ablations drop one each (WOL, WOC, WOV, WOU)."""


def expected_adapters_per_batch(probs: Iterable[float], batch_size: float) -> float:
    """Low_lora = sum_i 1 - (1 - p_i) ** BS (Eq. 3): the expected number of distinct adapters in a
    batch of `batch_size` requests when a request uses adapter i with probability p_i. Raises
    ValueError for a probability outside [0, 1] or a negative batch size."""
    if batch_size < 0:
        raise ValueError(f"batch size must be >= 0, got {batch_size}")
    total = 0.0
    for p in probs:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"adapter probability {p} is outside [0, 1]")
        total += 1.0 - (1.0 - p) ** batch_size
    return total


def _log_sigmoid_neg(x: float) -> float:
    """log(1 - sigmoid(x)) = -softplus(x), stable for large x."""
    return -(x + math.log1p(math.exp(-x))) if x > 0 else -math.log1p(math.exp(x))


@register("elora")
class EloraPolicy(BasePolicy):
    """ELORA's Eval as an eviction score; higher means keep.

    `drop`: factor names from `TERMS` to leave out (ELORA's ablations). `lora_mode`: "intent" or
    "literal" (see the module docstring). `tau_s`: the time unit of t in seconds. `block_bytes`:
    score per block of this size (see the module docstring), or None for whole items. Raises
    ValueError for an unknown term or mode, or tau_s <= 0.
    """

    def __init__(self, context: PolicyContext, tau_s: float = 1.0, drop: Iterable[str] = (),
                 lora_mode: str = "intent", block_bytes: int | None = 16 * 2**20) -> None:
        drop = frozenset(drop)
        unknown = drop - set(TERMS)
        if unknown:
            raise ValueError(f"unknown ELORA terms {sorted(unknown)}; known: {', '.join(TERMS)}")
        if lora_mode not in ("intent", "literal"):
            raise ValueError(f"lora_mode must be 'intent' or 'literal', got {lora_mode!r}")
        if tau_s <= 0:
            raise ValueError(f"tau_s must be > 0, got {tau_s}")
        self.context = context
        self.tau_s = tau_s
        self.drop = drop
        self.lora_mode = lora_mode
        self.block_bytes = block_bytes

    def lora_factor(self, item: object) -> float:
        """LoRA_Eval (Eq. 4) of `item` for a swap-out decision, in the chosen mode."""
        if "lora_count" in self.drop:
            return 1.0
        ctx = self.context
        low = ctx.expected_adapters_per_batch()
        if low <= 0:
            return 1.0
        n = ctx.num_resident_adapters()
        is_adapter = ctx.is_adapter(item)
        if self.lora_mode == "literal":
            return min(1.0, max(0, n - 1 if is_adapter else n) / low)
        if is_adapter:
            return 1.0 if n <= low else low / n
        return min(1.0, n / low)

    def cost(self, item: object) -> float:
        """cost_i: seconds to get the item back, per `block_bytes` of it when that is set."""
        c = self.context.reload_cost_s(item)
        if self.block_bytes is None:
            return c
        return c * self.block_bytes / max(1, self.context.size_bytes(item))

    def log_parts(self, item: object, now: float) -> dict[str, float]:
        """The natural log of each kept factor (a dropped factor adds 0, i.e. a factor of 1)."""
        ctx = self.context
        parts = {}
        if "lora_count" not in self.drop:
            f = self.lora_factor(item)
            parts["lora_count"] = math.log(f) if f > 0 else -math.inf
        if "cost" not in self.drop:
            c = self.cost(item)
            parts["cost"] = math.log(c) if c > 0 else -math.inf
        if "visit" not in self.drop:
            v = ctx.visits(item) / ctx.total_visits()
            parts["visit"] = math.log(v) if v > 0 else -math.inf
        if "recency" not in self.drop:
            t = max(0.0, now - item.last_access)
            parts["recency"] = _log_sigmoid_neg(t / self.tau_s)
        return parts

    def score(self, item: object, now: float) -> float:
        """log(Eval): orders exactly as Eval does, without underflow for items idle for minutes.
        (The sum of `log_parts`, written out: the evictor calls this once per candidate.)"""
        ctx, drop = self.context, self.drop
        total = 0.0
        if "lora_count" not in drop:
            f = self.lora_factor(item)
            if f <= 0:
                return -math.inf
            total += math.log(f)
        if "cost" not in drop:
            c = self.cost(item)
            if c <= 0:
                return -math.inf
            total += math.log(c)
        if "visit" not in drop:
            v = ctx.visits(item) / ctx.total_visits()
            if v <= 0:
                return -math.inf
            total += math.log(v)
        if "recency" not in drop:
            total += _log_sigmoid_neg(max(0.0, now - item.last_access) / self.tau_s)
        return total

    def score_many(self, items: Iterable[object], now: float) -> list[float]:
        """`score` of each item (equal up to the last bits of the logarithms: array maths), computed over
        arrays: the adapter-count factor once per kind, each item's own numbers in one `columns` call."""
        items = items if isinstance(items, (list, tuple)) else list(items)
        if not items:
            return []
        ctx, drop = self.context, self.drop
        n = len(items)
        is_adapter, size, cost, visits = ctx.columns(items)
        total = np.zeros(n)
        if "lora_count" not in drop:
            num_adapters = int(np.count_nonzero(is_adapter))
            for kind in (False, True):
                count = num_adapters if kind else n - num_adapters
                if not count:
                    continue
                at = int(np.argmax(is_adapter == kind)) if count < n else 0
                f = self.lora_factor(items[at])
                factor = math.log(f) if f > 0 else -math.inf
                if count == n:
                    total = np.full(n, factor)  # 0 + factor, as the masked add below gives
                else:
                    total[is_adapter == kind] += factor
        if "cost" not in drop:
            if self.block_bytes is not None:
                cost = cost * self.block_bytes / np.maximum(1, size)
            total += np.log(cost, out=np.full(n, -np.inf), where=cost > 0)
        if "visit" not in drop:
            v = visits / ctx.total_visits()
            total += np.log(v, out=np.full(n, -np.inf), where=v > 0)
        if "recency" not in drop:
            last = np.fromiter(map(_last_access, items), np.float64, n)
            t = np.maximum(0.0, now - last) / self.tau_s
            total -= t + np.log1p(np.exp(-t))  # log(1 - sigmoid(t)) for t >= 0
        return total.tolist()

    def evaluate(self, item: object, now: float) -> float:
        """Eval itself (Eq. 6); underflows to 0 for items idle for more than about 700 * tau_s."""
        return math.exp(self.score(item, now))
