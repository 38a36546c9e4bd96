"""TTFT figures the load benchmarks share: one replay's summary, and every repeat's requests pooled.

Lives here: `replay_summary` (one replay of one arm: mean / P50 / P99 TTFT, mean end-to-end, cached share),
`request_ttfts` (a request log's TTFTs by rate and arm, every repeat together), `best_stock_pooled` and `pooled_lines`
(the pooled comparison). A run's own P99 is one of its slowest few requests; pooled over repeats it rests on several.
Not here: the experiment reports of eval/live/report.py (median and spread over repeats of `RequestResult` records).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path

from eval.bench.results import nearest_rank
from eval.live.arms import ordered_arms


def replay_summary(results) -> dict:
    """One replay's served requests (`RequestResult`s): counts, TTFT mean / P50 / P99 in seconds, mean end-to-end
    seconds and the share of prompt tokens served from cache."""
    ok = [r for r in results if r.error is None and r.ttft_s is not None]
    ttft = sorted(r.ttft_s for r in ok)
    if not ttft:
        return {"num_ok": 0, "num_failed": len(results)}

    def pct(p):
        return nearest_rank(ttft, p)

    return {"num_ok": len(ok), "num_failed": len(results) - len(ok), "mean_ttft_s": statistics.fmean(ttft),
            "p50_ttft_s": pct(50), "p99_ttft_s": pct(99),
            "mean_e2e_s": statistics.fmean(r.e2e_s for r in ok),
            "cached_token_share": sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok))}


def request_ttfts(raw: Path) -> dict[float, dict[str, list[float]]]:
    """TTFTs of the request log's served requests by rate (req/s, rounded to 0.01) and arm, every repeat together."""
    ttfts: dict[float, dict[str, list[float]]] = {}
    for line in raw.read_text().splitlines():
        r = json.loads(line)
        if r.get("error") is None and r.get("ttft_s") is not None:
            rate = round(r["extra"]["request_rate"], 2)
            ttfts.setdefault(rate, {}).setdefault(r["arm"], []).append(r["ttft_s"])
    return ttfts


def best_pooled(by_arm: dict[str, list[float]], baseline: str = "stock") -> str | None:
    """Of the arms whose name starts with `baseline` (stock: any cap or drainer), the one with the lowest mean over
    every repeat's requests; None when there is none."""
    bases = [a for a in by_arm if a.startswith(baseline)]
    return min(bases, key=lambda a: statistics.fmean(by_arm[a])) if bases else None


def best_stock_pooled(by_arm: dict[str, list[float]]) -> str | None:
    """The stock arm (any cap or drainer) with the lower mean over every repeat's requests, None when there is none."""
    return best_pooled(by_arm, "stock")


def pooled_lines(ttfts: dict[float, dict[str, list[float]]], baseline: str = "stock",
                 order: Callable[[Iterable[str]], list[str]] = ordered_arms) -> list[str]:
    """Per rate, every arm's mean and P99 TTFT over every repeat's requests together (arms in `order`), and each arm
    not named like `baseline` against the baseline arm with the lowest pooled mean (`best_pooled`). A run's P99 is
    one of its slowest few requests and moves with them from repeat to repeat; pooled over repeats it rests on
    several (nearest rank of n times the repeats)."""
    lines = []
    for rate in sorted(ttfts):
        by_arm = ttfts[rate]
        best = best_pooled(by_arm, baseline)
        parts = []
        for arm in order(by_arm):
            v = by_arm[arm]
            text = f"{arm} {statistics.fmean(v):.2f} / {nearest_rank(v, 99):.2f} s (n {len(v)})"
            if best and not arm.startswith(baseline):
                b = by_arm[best]
                text += (f", {statistics.fmean(v) / statistics.fmean(b):.2f}x / "
                         f"{nearest_rank(v, 99) / nearest_rank(b, 99):.2f}x {best}'s")
            parts.append(text)
        lines.append(f"- {rate:.2f} req/s, mean / P99 TTFT: " + "; ".join(parts))
    return lines
