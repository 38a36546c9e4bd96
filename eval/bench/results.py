"""How a live benchmark keeps what it measured: one JSON record appended per run to `<out>.jsonl`, its report in
`<out>.md` (rewritten) and on stdout; and the percentile the live reports use."""

from __future__ import annotations

import json
from collections.abc import Callable
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
