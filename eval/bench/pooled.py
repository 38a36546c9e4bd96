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
from pathlib import Path

from eval.live import ttft
from eval.live.ttft import request_ttfts


def pooled_lines(ttfts: dict[float, dict[str, list[float]]], baseline: str) -> list[str]:
    """One line per rate: every arm's pooled mean / P99 TTFT (arms by name) and, for the others, their ratios to the
    baseline arm (of the arms whose name starts with `baseline`, the one with the lowest pooled mean)."""
    return ttft.pooled_lines(ttfts, baseline, order=sorted)


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
