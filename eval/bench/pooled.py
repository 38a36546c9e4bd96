"""Every repeat's requests pooled, from any live benchmark's request log (`<out>_requests.jsonl`): per rate and
arm, the mean and P99 TTFT over all repeats together, and each arm against a baseline arm. A run's own P99 over
60-90 requests is its slowest one or two; pooled over the repeats it rests on several. Unlike
`eval/live/ttft.pooled_lines` (the unified-memory benchmark's, against the better stock arm), any arm names can be
the baseline. Not here: reading the log (`eval/live/ttft.request_ttfts`), the per-repeat figures and their spread
(each benchmark's own report).

Usage: .venv/bin/python -m eval.bench.pooled LOG [LOG ...] [--baseline fcfs]
       (the baseline is the arm, or the lowest pooled mean among the arms, whose name starts with it)
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from eval.bench.results import nearest_rank
from eval.live.ttft import request_ttfts


def pooled_lines(ttfts: dict[float, dict[str, list[float]]], baseline: str) -> list[str]:
    """One line per rate: every arm's pooled mean / P99 TTFT and, for the others, their ratios to the baseline arm
    (of the arms whose name starts with `baseline`, the one with the lowest pooled mean)."""
    lines = []
    for rate in sorted(ttfts):
        by_arm = ttfts[rate]
        bases = [a for a in by_arm if a.startswith(baseline)]
        base = min(bases, key=lambda a: statistics.fmean(by_arm[a])) if bases else None
        parts = []
        for arm in sorted(by_arm):
            v = by_arm[arm]
            text = f"{arm} {statistics.fmean(v):.2f} / {nearest_rank(v, 99):.2f} s (n {len(v)})"
            if base is not None and arm != base and not arm.startswith(baseline):
                b = by_arm[base]
                text += (f", {statistics.fmean(v) / statistics.fmean(b):.2f}x / "
                         f"{nearest_rank(v, 99) / nearest_rank(b, 99):.2f}x {base}'s")
            parts.append(text)
        lines.append(f"- {rate:.2f} req/s, mean / P99 TTFT: " + "; ".join(parts))
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", type=Path, help="request logs (<out>_requests.jsonl)")
    parser.add_argument("--baseline", default="fcfs", help="the baseline arm's name or its prefix (stock: any cap)")
    args = parser.parse_args(argv)
    for log in args.logs:
        print(f"{log}:")
        print("\n".join(pooled_lines(request_ttfts(log), args.baseline)))


if __name__ == "__main__":
    main()
