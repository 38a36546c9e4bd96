"""What every workload generator shares: the `Workload` container, seeded samplers and the Azure trace reader.

Lives here: Zipf popularity, Poisson arrivals, length draws, the parameter-dataclass plumbing. Not here: any one
workload's shape (one module each) or anything that talks to a server (eval/live/driver.py).
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from eval.workloads.records import AdapterInfo, Request

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
AZURE_CONV_CSV = DATA_DIR / "azure_conv_2023_first2000.csv"


@dataclass(frozen=True)
class Workload:
    """A generated workload: requests sorted by arrival, the adapters they name, and how it was made."""

    name: str
    seed: int
    params: dict
    adapters: tuple[AdapterInfo, ...]
    requests: tuple[Request, ...]
    notes: dict = field(default_factory=dict, compare=False)

    def check_invariants(self) -> None:
        """Raises AssertionError naming the offending request when the workload breaks the Request contract."""
        names = {a.name for a in self.adapters}
        seen: dict[str, Request] = {}
        last = -1.0
        for r in self.requests:
            assert r.rid not in seen, f"duplicate rid {r.rid}"
            assert r.arrival_s >= last, f"{r.rid} arrives before the request listed before it"
            assert r.adapter is None or r.adapter in names, (
                f"{r.rid} names unknown adapter {r.adapter}"
            )
            assert r.new_tokens >= 1 and r.output_tokens >= 1, (
                f"{r.rid} has an empty prompt or output"
            )
            if r.parent_rid is not None:
                parent = seen.get(r.parent_rid)
                assert parent is not None, f"{r.rid}: parent {r.parent_rid} does not arrive earlier"
                assert r.history_tokens == parent.prompt_tokens + parent.output_tokens, (
                    f"{r.rid}: history_tokens is not the parent's prompt + output"
                )
            else:
                assert r.history_tokens == 0, f"{r.rid} has history but no parent"
            last = r.arrival_s
            seen[r.rid] = r

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    @property
    def offered_rate(self) -> float:
        """Requests per second over the arrival span (0 for fewer than two requests)."""
        span = self.duration_s - (self.requests[0].arrival_s if self.requests else 0.0)
        return (len(self.requests) - 1) / span if len(self.requests) > 1 and span > 0 else 0.0


def make_params(cls, overrides: dict):
    """Builds the parameter dataclass `cls` from `overrides`; strings are converted to the field's type.
    Raises ValueError naming an unknown parameter (with the known ones) or a value of the wrong type."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in overrides.items():
        if key not in fields:
            raise ValueError(
                f"unknown parameter {key!r} for {cls.__name__}; known: {', '.join(fields)}"
            )
        default = getattr(cls(), key)
        if isinstance(value, str) and not isinstance(default, str):
            try:
                if isinstance(default, bool):
                    value = value.lower() in ("1", "true", "yes")
                elif isinstance(default, tuple):
                    value = tuple(type(default[0])(v) for v in value.split(","))
                elif default is None:
                    value = float(value)
                else:
                    value = type(default)(value)
            except ValueError as e:
                raise ValueError(
                    f"parameter {key}={value!r}: expected {type(default).__name__}"
                ) from e
        kwargs[key] = value
    return cls(**kwargs)


def zipf_probs(n: int, s: float) -> np.ndarray:
    """P(i) proportional to 1 / i**s for i = 1..n (rank 1 most popular)."""
    if n < 1:
        raise ValueError(f"need at least one item for a Zipf distribution, got {n}")
    weights = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return weights / weights.sum()


def poisson_arrivals(
    rng: np.random.Generator, num: int, rate: float, start_s: float = 0.0
) -> np.ndarray:
    """`num` arrival times of a Poisson process of `rate` per second (exponential gaps), the first at start_s."""
    if rate <= 0:
        raise ValueError(f"arrival rate must be positive, got {rate}")
    gaps = rng.exponential(1.0 / rate, size=num)
    gaps[0] = 0.0
    return start_s + np.cumsum(gaps)


def draw_len(rng: np.random.Generator, mean: float, minimum: int = 1) -> int:
    """A length drawn from a geometric distribution of the given mean (>= minimum): memoryless, heavy-ish tail."""
    if mean < minimum:
        raise ValueError(f"mean length {mean} is below the minimum {minimum}")
    if mean == minimum:
        return minimum
    return minimum - 1 + int(rng.geometric(1.0 / (mean - minimum + 1)))


def rank_adapters(
    num: int, rank: int | tuple[int, ...], prefix: str = "lora"
) -> tuple[AdapterInfo, ...]:
    """`num` LoRA adapters named prefix-000...; a tuple of ranks is cycled (adapter i gets ranks[i % len])."""
    ranks = rank if isinstance(rank, tuple) else (rank,)
    return tuple(AdapterInfo(f"{prefix}-{i:03d}", ranks[i % len(ranks)]) for i in range(num))


@dataclass(frozen=True)
class TraceRow:
    arrival_s: float
    context_tokens: int
    generated_tokens: int


def read_azure_trace(path: Path = AZURE_CONV_CSV) -> list[TraceRow]:
    """Rows of an Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens), arrival times in
    seconds from the first row. Raises ValueError naming the line of a malformed row."""
    rows: list[TraceRow] = []
    t0 = None
    with open(path, newline="") as f:
        for lineno, row in enumerate(csv.DictReader(f), start=2):
            try:
                stamp = datetime.datetime.fromisoformat(row["TIMESTAMP"][:26])
                t0 = t0 or stamp
                rows.append(
                    TraceRow(
                        (stamp - t0).total_seconds(),
                        int(row["ContextTokens"]),
                        int(row["GeneratedTokens"]),
                    )
                )
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: malformed Azure trace row {row}: {e}") from e
    return rows


def count_capped(
    workload_name: str, rows: list[TraceRow], scale: float, max_prompt: int, max_output: int
) -> int:
    """How many of `rows` scale_len caps; warns once when any is (never clamp silently)."""
    num = sum(
        1
        for r in rows
        if round(r.context_tokens * scale) > max_prompt
        or round(r.generated_tokens * scale) > max_output
    )
    if num:
        warnings.warn(
            f"{workload_name}: {num} of {len(rows)} trace lengths capped at max_prompt_tokens="
            f"{max_prompt} / max_output_tokens={max_output}",
            stacklevel=3,
        )
    return num


def scale_len(tokens: int, scale: float, cap: int) -> int:
    """A trace length scaled down by `scale` (as Chameleon does to fit its testbed), at least 1, at most cap."""
    return max(1, min(cap, round(tokens * scale)))
