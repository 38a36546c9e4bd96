"""Figures from results JSON lines: per-replay rows, their median and spread over repeats, peak load and ratios.
Not here: producing the records (`driver.py`, eval/sim/) or writing tables and plots (`report.py`).

A replay is one pass of a workload over one arm at one offered rate; the harness repeats it (`extra.repeat`: 0, 1,
...; records without it are repeat 0). Each replay gives one `Row`; a `Summary` gathers the rows of one
(experiment, arm, rate) over repeats and reports each metric as a `Spread` (median, min, max over repeats). Ratios
of an arm to a baseline are taken within a repeat (same repeat, same rate), then summarised the same way.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SCALAR_METRICS = ("ttft_mean", "ttft_p50", "ttft_p99", "tpot_mean", "tpot_p99", "e2e_mean", "invalid_kv_share")
BY_KIND_METRICS = ("prefix_hit_by_kind", "hits", "peak_memory_bytes")
RATIO_METRICS = ("ttft_mean", "ttft_p99", "tpot_mean")


@dataclass
class Row:
    """One replay: one (experiment, arm, rate, repeat)."""

    experiment: str
    arm: str
    rate: float
    num: int
    num_errors: int
    ttft_mean: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_mean: float | None
    tpot_p99: float | None
    e2e_mean: float | None
    prefix_hit_by_kind: dict = field(default_factory=dict)  # request kind -> cached tokens / prompt tokens
    hits: dict = field(default_factory=dict)  # cache kind -> mean hit
    invalid_kv_share: float | None = None
    peak_memory_bytes: dict = field(default_factory=dict)
    repeat: int = 0


@dataclass(frozen=True)
class Spread:
    """Median, min and max of one metric over repeats; num: how many repeats had a value."""

    median: float
    low: float
    high: float
    num: int

    @classmethod
    def of(cls, values) -> Spread | None:
        """None when no value is given; None values are left out."""
        values = [float(v) for v in values if v is not None]
        if not values:
            return None
        return cls(statistics.median(values), min(values), max(values), len(values))


@dataclass
class Summary:
    """The replays of one (experiment, arm, offered rate), `rows` in repeat order. `rate`: their median rate."""

    experiment: str
    arm: str
    rate: float
    rows: list[Row]

    @property
    def num_repeats(self) -> int:
        return len(self.rows)

    @property
    def num(self) -> int:
        return sum(r.num for r in self.rows)

    @property
    def num_errors(self) -> int:
        return sum(r.num_errors for r in self.rows)

    def spread(self, metric: str) -> Spread | None:
        return Spread.of(getattr(r, metric) for r in self.rows)

    def spread_by_kind(self, metric: str) -> dict[str, Spread]:
        """Per kind of a dict metric (`prefix_hit_by_kind`, `hits`, `peak_memory_bytes`); a repeat without the
        kind does not count."""
        kinds = sorted({k for r in self.rows for k in getattr(r, metric)})
        return {k: Spread.of(getattr(r, metric).get(k) for r in self.rows) for k in kinds}


def load_results(paths: list[str | Path]) -> list[dict]:
    """Every record of the given JSON-lines files. Raises ValueError naming the file and line of a bad line."""
    records = []
    for path in paths:
        for lineno, line in enumerate(Path(path).read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                rec["experiment"], rec["arm"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a RequestResult record ({e})") from e
            records.append(rec)
    return records


def repeat_of(rec: dict) -> int:
    return int((rec.get("extra") or {}).get("repeat") or 0)


def _rate(recs: list[dict]) -> float:
    rates = [r.get("extra", {}).get("request_rate") for r in recs]
    if all(x is not None for x in rates) and rates:
        return round(float(np.mean(rates)), 4)
    times = sorted(r["arrival_s"] for r in recs)
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    return round((len(times) - 1) / span, 4) if span > 0 else 0.0


def _stats(values: list[float]) -> tuple[float | None, float | None, float | None]:
    if not values:
        return None, None, None
    arr = np.asarray(values, dtype=np.float64)
    return float(arr.mean()), float(np.percentile(arr, 50)), float(np.percentile(arr, 99))


def summarize_group(experiment: str, arm: str, rate: float, recs: list[dict], repeat: int = 0) -> Row:
    ok = [r for r in recs if not r.get("error")]
    ttft = _stats([r["ttft_s"] for r in ok if r.get("ttft_s") is not None])
    tpot = _stats([r["tpot_s"] for r in ok if r.get("tpot_s") is not None])
    e2e = _stats([r["e2e_s"] for r in ok if r.get("e2e_s") is not None])
    cached, prompt = defaultdict(int), defaultdict(int)
    hits, invalid, memory = defaultdict(list), [], defaultdict(int)
    for r in ok:
        extra = r.get("extra") or {}
        kind = extra.get("kind") or ("lora" if r.get("adapter") else "base")
        cached[kind] += r.get("cached_tokens", 0)
        prompt[kind] += r.get("prompt_tokens", 0)
        for k, v in (extra.get("hits") or {}).items():
            hits[k].append(float(v))
        if extra.get("invalid_kv_share") is not None:
            invalid.append(float(extra["invalid_kv_share"]))
        for k, v in (extra.get("memory_bytes") or {}).items():
            memory[k] = max(memory[k], int(v))
    return Row(
        experiment, arm, rate, len(recs), len(recs) - len(ok), *ttft, tpot[0], tpot[2], e2e[0],
        {k: cached[k] / prompt[k] for k in prompt if prompt[k]},
        {k: float(np.mean(v)) for k, v in hits.items()},
        float(np.mean(invalid)) if invalid else None,
        dict(memory),
        repeat,
    )


def summarize(records: list[dict]) -> list[Summary]:
    """One Summary per (experiment, arm, offered rate), in first-seen order of experiment and arm, rates ascending;
    within it one Row per repeat. Records of one (experiment, arm) carrying no request_rate form one rate group."""
    groups: dict[tuple[str, str], dict] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for rec in records:
        rate_key = (rec.get("extra") or {}).get("request_rate")
        groups[(rec["experiment"], rec["arm"])][rate_key][repeat_of(rec)].append(rec)
    out = []
    for (experiment, arm), by_rate in groups.items():
        for by_repeat in by_rate.values():
            rows = [
                summarize_group(experiment, arm, _rate(recs), recs, repeat)
                for repeat, recs in sorted(by_repeat.items())
            ]
            out.append(Summary(experiment, arm, statistics.median(r.rate for r in rows), rows))
    order = {key: i for i, key in enumerate(groups)}
    return sorted(out, key=lambda s: (order[(s.experiment, s.arm)], s.rate))


def peak_load(
    summaries: list[Summary], slo_s: float, metric: str = "ttft_mean"
) -> dict[tuple[str, str], float | None]:
    """Per (experiment, arm): the highest offered rate whose median `metric` TTFT over repeats is within slo_s,
    None if none is."""
    out: dict[tuple[str, str], float | None] = {}
    for s in summaries:
        key = (s.experiment, s.arm)
        value = s.spread(metric)
        out.setdefault(key, None)
        if value is not None and value.median <= slo_s and s.num_errors < s.num:
            out[key] = max(out[key] or 0.0, s.rate)
    return out


def ratios(summaries: list[Summary], baselines: list[str]) -> list[dict]:
    """Arm / baseline ratios of mean and P99 TTFT and mean TPOT (below 1: the arm is faster) per experiment and
    rate (within 1%): one ratio per repeat both ran, each against the baseline's replay of the same repeat; each
    metric a Spread over those repeats (None where no repeat has both values)."""
    out = []
    for base in (s for s in summaries if s.arm in baselines):
        base_rows = {r.repeat: r for r in base.rows}
        for s in summaries:
            if s.experiment != base.experiment or s.arm == base.arm or abs(s.rate - base.rate) > 0.01 * base.rate:
                continue
            pairs = [(r, base_rows[r.repeat]) for r in s.rows if r.repeat in base_rows]
            ratio = {
                m: Spread.of(getattr(r, m) / getattr(b, m) if getattr(r, m) and getattr(b, m) else None
                             for r, b in pairs)
                for m in RATIO_METRICS
            }
            out.append({"experiment": s.experiment, "rate": s.rate, "arm": s.arm, "baseline": base.arm,
                        "num_repeats": len(pairs), **ratio})
    return out
