"""Reports from results JSON lines (live or simulated `RequestResult`s): a Markdown table and PNG plots.
Not here: producing the records (`driver.py`, eval/sim/) or the simulated ELORA report
(eval/sim/compare_report.py).

Per experiment, arm and offered request rate: mean / P50 / P99 TTFT, mean / P99 TPOT, errors, prefix-cache hit
rates by request kind, hit rates by cache kind, invalid-KV share and peak memory where the records carry them; per
experiment and arm the peak load under a TTFT SLO (ELORA: the highest rate whose mean TTFT stays under the SLO);
ratios of every arm to each baseline arm at the same rate. Record fields read from `extra` (all optional):
`request_rate` (offered requests/s; else taken from the arrivals), `kind` (base / lora / alora), `hits`
({cache kind: 0..1}), `invalid_kv_share` (0..1), `memory_bytes` ({kind: bytes}) sampled at `memory_t_s` (else at
arrival_s + e2e_s). Plots: TTFT against request rate, and memory by kind over time (as ELORA's Fig. 14).

Usage: .venv/bin/python -m eval.live.report results.jsonl [...] --out-dir DIR [--baselines stock] [--slo-s 0.5]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class Row:
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
    prefix_hit_by_kind: dict = field(
        default_factory=dict
    )  # request kind -> cached tokens / prompt tokens
    hits: dict = field(default_factory=dict)  # cache kind -> mean hit
    invalid_kv_share: float | None = None
    peak_memory_bytes: dict = field(default_factory=dict)


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


def summarize_group(experiment: str, arm: str, rate: float, recs: list[dict]) -> Row:
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
        experiment,
        arm,
        rate,
        len(recs),
        len(recs) - len(ok),
        ttft[0],
        ttft[1],
        ttft[2],
        tpot[0],
        tpot[2],
        e2e[0],
        {k: cached[k] / prompt[k] for k in prompt if prompt[k]},
        {k: float(np.mean(v)) for k, v in hits.items()},
        float(np.mean(invalid)) if invalid else None,
        dict(memory),
    )


def summarize(records: list[dict]) -> list[Row]:
    """One Row per (experiment, arm, offered rate), in first-seen order of experiment and arm, rates ascending.
    Records of one (experiment, arm) carrying no request_rate form one group."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for rec in records:
        groups[(rec["experiment"], rec["arm"])].append(rec)
    rows = []
    for (experiment, arm), recs in groups.items():
        by_rate: dict[object, list[dict]] = defaultdict(list)
        for rec in recs:
            by_rate[(rec.get("extra") or {}).get("request_rate")].append(rec)
        for group in by_rate.values():
            rows.append(summarize_group(experiment, arm, _rate(group), group))
    order = {key: i for i, key in enumerate(groups)}
    return sorted(rows, key=lambda r: (order[(r.experiment, r.arm)], r.rate))


def peak_load(
    rows: list[Row], slo_s: float, metric: str = "ttft_mean"
) -> dict[tuple[str, str], float | None]:
    """Per (experiment, arm): the highest offered rate whose `metric` TTFT is within slo_s, None if none is."""
    out: dict[tuple[str, str], float | None] = {}
    for r in rows:
        key = (r.experiment, r.arm)
        value = getattr(r, metric)
        out.setdefault(key, None)
        if value is not None and value <= slo_s and r.num_errors < r.num:
            out[key] = max(out[key] or 0.0, r.rate)
    return out


def ratios(rows: list[Row], baselines: list[str]) -> list[dict]:
    """Arm / baseline ratios of mean and P99 TTFT and mean TPOT, per experiment and rate (below 1: arm is faster).
    Rows at the same experiment and rate (within 1%) are compared."""
    out = []
    for base in (r for r in rows if r.arm in baselines):
        for r in rows:
            if (
                r.experiment != base.experiment
                or r.arm == base.arm
                or abs(r.rate - base.rate) > 0.01 * base.rate
            ):
                continue
            ratio = {
                m: (getattr(r, m) / getattr(base, m))
                if getattr(r, m) and getattr(base, m)
                else None
                for m in ("ttft_mean", "ttft_p99", "tpot_mean")
            }
            out.append(
                {
                    "experiment": r.experiment,
                    "rate": r.rate,
                    "arm": r.arm,
                    "baseline": base.arm,
                    **ratio,
                }
            )
    return out


def _fmt(x: float | None, scale: float = 1000.0, digits: int = 0) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def markdown(rows: list[Row], baselines: list[str], slo_s: float) -> str:
    peaks = peak_load(rows, slo_s)
    lines = [
        "| experiment | arm | rate (req/s) | n | errors | TTFT mean / P50 / P99 (ms) "
        + "| TPOT mean / P99 (ms) | prefix hit by kind | hit by cache kind | invalid KV "
        + "| peak memory (MiB) |",
        "|---|---|---:|---:|---:|---:|---:|---|---|---:|---|",
    ]
    for r in rows:
        hit_kind = ", ".join(f"{k} {v:.0%}" for k, v in sorted(r.prefix_hit_by_kind.items())) or "-"
        hits = ", ".join(f"{k} {v:.0%}" for k, v in sorted(r.hits.items())) or "-"
        mem = (
            ", ".join(f"{k} {v / 2**20:.0f}" for k, v in sorted(r.peak_memory_bytes.items())) or "-"
        )
        lines.append(
            f"| {r.experiment} | {r.arm} | {r.rate:.3g} | {r.num} | {r.num_errors} | "
            f"{_fmt(r.ttft_mean)} / {_fmt(r.ttft_p50)} / {_fmt(r.ttft_p99)} | "
            f"{_fmt(r.tpot_mean, digits=1)} / {_fmt(r.tpot_p99, digits=1)} | {hit_kind} | {hits} | "
            f"{_fmt(r.invalid_kv_share, 100, 1) + ' %' if r.invalid_kv_share is not None else '-'} | {mem} |"
        )
    lines += [
        "",
        f"Peak load under the TTFT SLO (mean TTFT <= {slo_s * 1000:.0f} ms, highest offered rate):",
        "",
        "| experiment | arm | peak load (req/s) |",
        "|---|---|---:|",
    ]
    lines += [f"| {e} | {a} | {'-' if p is None else f'{p:.3g}'} |" for (e, a), p in peaks.items()]
    table = ratios(rows, baselines)
    if table:
        lines += [
            "",
            "Ratios to each baseline at the same rate (arm / baseline; below 1 is better):",
            "",
            "| experiment | rate | arm | baseline | mean TTFT | P99 TTFT | mean TPOT |",
            "|---|---:|---|---|---:|---:|---:|",
        ]
        for t in table:
            lines.append(
                f"| {t['experiment']} | {t['rate']:.3g} | {t['arm']} | {t['baseline']} | "
                + " | ".join(
                    "-" if t[m] is None else f"{t[m]:.2f}x"
                    for m in ("ttft_mean", "ttft_p99", "tpot_mean")
                )
                + " |"
            )
    return "\n".join(lines) + "\n"


def plot_ttft_vs_rate(rows: list[Row], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for experiment in dict.fromkeys(r.experiment for r in rows):
        fig, ax = plt.subplots(figsize=(6, 4))
        for arm in dict.fromkeys(r.arm for r in rows if r.experiment == experiment):
            pts = [
                (r.rate, r.ttft_mean)
                for r in rows
                if r.experiment == experiment and r.arm == arm and r.ttft_mean is not None
            ]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=arm)
        ax.set(
            xlabel="offered request rate (req/s)",
            ylabel="mean TTFT (s)",
            title=f"{experiment}: TTFT vs rate",
        )
        ax.grid(alpha=0.3)
        ax.legend()
        path = out_dir / f"ttft_vs_rate_{experiment}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_memory(records: list[dict], out_dir: Path) -> list[Path]:
    """Memory by kind over time for every (experiment, arm) whose records carry `memory_bytes`: one stacked panel
    per offered request rate (each replay starts its clock at 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[tuple[str, str], dict[float, list[tuple[float, dict]]]] = defaultdict(lambda: defaultdict(list))
    for rec in records:
        extra = rec.get("extra") or {}
        if extra.get("memory_bytes"):
            t = extra.get("memory_t_s", rec["arrival_s"] + (rec.get("e2e_s") or 0.0))
            series[(rec["experiment"], rec["arm"])][extra.get("request_rate") or 0.0].append((t, extra["memory_bytes"]))
    paths = []
    for (experiment, arm), by_rate in series.items():
        rates = sorted(by_rate)
        peak = max(sum(m.values()) for points in by_rate.values() for _, m in points)
        unit, scale = ("GiB", 2**30) if peak >= 2**30 else ("MiB", 2**20)
        kinds = sorted({k for points in by_rate.values() for _, m in points for k in m})
        fig, axes = plt.subplots(len(rates), 1, figsize=(7, 2.6 * len(rates) + 0.8), squeeze=False, sharex=False)
        for ax, rate in zip(axes[:, 0], rates):
            points = sorted(by_rate[rate], key=lambda p: p[0])
            times = [t for t, _ in points]
            ax.stackplot(times, *[[m.get(k, 0) / scale for _, m in points] for k in kinds], labels=kinds)
            ax.set(xlabel="time (s)", ylabel=f"memory ({unit})",
                   title=f"{experiment} / {arm}" + (f" at {rate:.3g} req/s" if rate else "") + ": memory by kind")
            ax.legend(loc="upper left", fontsize="small")
        path = out_dir / f"memory_{experiment}_{arm.replace(':', '_')}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def write_report(
    records: list[dict],
    out_dir: str | Path,
    baselines: list[str],
    slo_s: float = 0.5,
    title: str = "Results",
    setup: str = "",
) -> tuple[Path, list[Path]]:
    """Writes report.md (title, the `setup` Markdown if any, tables, plots) and the PNGs into out_dir; returns their
    paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = summarize(records)
    pngs = plot_ttft_vs_rate(rows, out_dir) + plot_memory(records, out_dir)
    text = f"# {title}\n\n" + (setup.rstrip("\n") + "\n\n" if setup else "") + markdown(rows, baselines, slo_s)
    text += "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in pngs) + "\n"
    md = out_dir / "report.md"
    md.write_text(text)
    return md, pngs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--baselines", default="stock", help="comma-separated baseline arm names")
    parser.add_argument(
        "--slo-s", type=float, default=0.5, help="TTFT SLO for the peak load (ELORA: 0.5 s)"
    )
    args = parser.parse_args(argv)
    md, pngs = write_report(
        load_results(args.results), args.out_dir, args.baselines.split(","), args.slo_s
    )
    print(md.read_text())
    print("wrote", md, *pngs)


if __name__ == "__main__":
    main()
