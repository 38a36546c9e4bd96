"""How a live benchmark keeps what it measured: one JSON record appended per run to `<out>.jsonl`, its report in
`<out>.md` (rewritten) and on stdout; the record's machine and date; the percentile and the "median (min-max)"
the live reports use."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path


def save(out: Path, record: dict, report: Callable[[dict], str]) -> str:
    """Appends `record` to `out`, writes `report(record)` next to it as `.md`, prints it and returns it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write(json.dumps(record) + "\n")
    text = report(record)
    print(text)
    out.with_suffix(".md").write_text(text)
    return text


def nearest_rank(values: list[float], p: float) -> float:
    """The p-th percentile (0..100) of `values` by nearest rank on the sorted list (no interpolation)."""
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def run_record(setup: dict, rows: list[dict], load_avg_start: list[float]) -> dict:
    """One run's record: its setup, the machine (CPU count, load average at the start and now), the date, the rows."""
    return {"setup": setup,
            "device": {"processor": platform.processor(), "cpu_count": os.cpu_count(),
                       "load_avg_start": load_avg_start, "load_avg_end": list(os.getloadavg())},
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "rows": rows}


def median_range(values: Iterable[float | None], fmt: str = "{:.2f}") -> str:
    """"median (min-max)" of the values that are not None, "-" when there are none."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"
