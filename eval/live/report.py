"""Reports from results JSON lines (live or simulated `RequestResult`s): Markdown tables and PNG plots.
Not here: producing the records (`driver.py`, eval/sim/), the figures themselves (`summary.py`) or the simulated
ELORA report (eval/sim/compare_report.py).

Per experiment, arm and offered request rate, each figure as its median over repeats with (min-max): mean / P50 /
P99 TTFT, mean / P99 TPOT, prefix-cache hit rates by request kind, hit rates by cache kind, invalid-KV share and
peak memory where the records carry them, with the requests and errors of all repeats; per experiment and arm the
peak load under a TTFT SLO (ELORA: the highest rate whose median mean TTFT stays under the SLO); ratios of every
arm to each baseline arm, taken within each repeat at the same rate, as median (min-max). Record fields read from
`extra` (all optional): `repeat` (0, 1, ...; absent: one repeat), `request_rate` (offered requests/s; else taken
from the arrivals), `kind` (base / lora / alora), `hits` ({cache kind: 0..1}), `invalid_kv_share` (0..1),
`memory_bytes` ({kind: bytes}) sampled at `memory_t_s` (else at arrival_s + e2e_s). Plots: median TTFT against
request rate with the min-max as error bars, and memory by kind over time in the first repeat (ELORA's Fig. 14).

Usage: .venv/bin/python -m eval.live.report results.jsonl [...] --out-dir DIR [--baselines stock] [--slo-s 0.5]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from eval.live.summary import (  # noqa: F401 (re-exported: the report's public names)
    Row,
    Spread,
    Summary,
    load_results,
    peak_load,
    ratios,
    summarize,
)


def fmt_spread(s: Spread | None, scale: float = 1000.0, digits: int = 0, unit: str = "") -> str:
    """`median (min-max)`, or just the value for a single repeat; "-" for None."""
    if s is None:
        return "-"
    value = f"{s.median * scale:.{digits}f}{unit}"
    if s.num == 1:
        return value
    return f"{value} ({s.low * scale:.{digits}f}-{s.high * scale:.{digits}f}{unit})"


def _by_kind(spreads: dict[str, Spread], scale: float, unit: str = "") -> str:
    return ", ".join(f"{k} {fmt_spread(v, scale, 0, unit)}" for k, v in spreads.items()) or "-"


def markdown(summaries: list[Summary], baselines: list[str], slo_s: float) -> str:
    peaks = peak_load(summaries, slo_s)
    lines = [
        "Each figure: median over repeats (min-max); n and errors: all repeats together.",
        "",
        "| experiment | arm | rate (req/s) | repeats | n | errors | TTFT mean / P50 / P99 (ms) "
        + "| TPOT mean / P99 (ms) | prefix hit by kind | hit by cache kind | invalid KV "
        + "| peak memory (MiB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|---|",
    ]
    for s in summaries:
        ttft = " / ".join(fmt_spread(s.spread(m)) for m in ("ttft_mean", "ttft_p50", "ttft_p99"))
        tpot = " / ".join(fmt_spread(s.spread(m), digits=1) for m in ("tpot_mean", "tpot_p99"))
        lines.append(
            f"| {s.experiment} | {s.arm} | {s.rate:.3g} | {s.num_repeats} | {s.num} | {s.num_errors} | "
            f"{ttft} | {tpot} | {_by_kind(s.spread_by_kind('prefix_hit_by_kind'), 100, '%')} | "
            f"{_by_kind(s.spread_by_kind('hits'), 100, '%')} | "
            f"{fmt_spread(s.spread('invalid_kv_share'), 100, 1, ' %')} | "
            f"{_by_kind(s.spread_by_kind('peak_memory_bytes'), 2**-20)} |"
        )
    lines += [
        "",
        f"Peak load under the TTFT SLO (median mean TTFT <= {slo_s * 1000:.0f} ms, highest offered rate):",
        "",
        "| experiment | arm | peak load (req/s) |",
        "|---|---|---:|",
    ]
    lines += [f"| {e} | {a} | {'-' if p is None else f'{p:.3g}'} |" for (e, a), p in peaks.items()]
    table = ratios(summaries, baselines)
    if table:
        lines += [
            "",
            "Ratios to each baseline (arm / baseline, each within one repeat at the same rate; "
            + "median (min-max) over repeats; below 1 is better):",
            "",
            "| experiment | rate | arm | baseline | repeats | mean TTFT | P99 TTFT | mean TPOT |",
            "|---|---:|---|---|---:|---:|---:|---:|",
        ]
        for t in table:
            cells = " | ".join(fmt_spread(t[m], 1, 2, "x") for m in ("ttft_mean", "ttft_p99", "tpot_mean"))
            lines.append(
                f"| {t['experiment']} | {t['rate']:.3g} | {t['arm']} | {t['baseline']} | {t['num_repeats']} | "
                f"{cells} |"
            )
    return "\n".join(lines) + "\n"


BENCH_FIELDS = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "output_throughput")


def bench_serving_table(out_dir: Path) -> str:
    """A Markdown table of the bench_serving_<arm>.jsonl files in out_dir (one JSON line per run, one run per
    repeat): each field as median (min-max) over the runs; "" without such files."""
    files = sorted(Path(out_dir).glob("bench_serving_*.jsonl"))
    if not files:
        return ""
    lines = [
        "",
        "`python -m sglang.bench_serving` (random ids, `--lora-name` over the served LoRAs; "
        + "one run per repeat, median (min-max)):",
        "",
        "| arm | runs | " + " | ".join(BENCH_FIELDS) + " |",
        "|---|---:|" + "---:|" * len(BENCH_FIELDS),
    ]
    for path in files:
        runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        cells = [
            fmt_spread(Spread.of(r.get(k) if isinstance(r.get(k), (int, float)) else None for r in runs), 1, 1)
            for k in BENCH_FIELDS
        ]
        lines.append(f"| {path.stem.removeprefix('bench_serving_')} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_ttft_vs_rate(summaries: list[Summary], out_dir: Path) -> list[Path]:
    """Per experiment: median mean TTFT against offered rate per arm, the min-max over repeats as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for experiment in dict.fromkeys(s.experiment for s in summaries):
        fig, ax = plt.subplots(figsize=(6, 4))
        for arm in dict.fromkeys(s.arm for s in summaries if s.experiment == experiment):
            pts = [
                (s.rate, s.spread("ttft_mean"))
                for s in summaries
                if s.experiment == experiment and s.arm == arm and s.spread("ttft_mean") is not None
            ]
            if pts:
                rates, spreads = zip(*pts)
                medians = [p.median for p in spreads]
                errors = [[p.median - p.low for p in spreads], [p.high - p.median for p in spreads]]
                ax.errorbar(rates, medians, yerr=errors, marker="o", capsize=3, label=arm)
        ax.set(
            xlabel="offered request rate (req/s)",
            ylabel="mean TTFT (s), median over repeats",
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


def memory_series(records: list[dict]) -> dict[tuple[str, str], dict[float, tuple[int, list]]]:
    """Per (experiment, arm) whose records carry `memory_bytes`, per offered rate (0.0 when unknown): the lowest
    repeat at that rate and its (time, {kind: bytes}) samples in time order. One repeat only: each replay starts
    its clock at 0, so samples of several repeats on one time axis would interleave."""
    from eval.live.summary import repeat_of

    series: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for rec in records:
        extra = rec.get("extra") or {}
        if extra.get("memory_bytes"):
            t = extra.get("memory_t_s", rec["arrival_s"] + (rec.get("e2e_s") or 0.0))
            by_rate = series[(rec["experiment"], rec["arm"])]
            by_rate[extra.get("request_rate") or 0.0][repeat_of(rec)].append((t, extra["memory_bytes"]))
    return {
        key: {
            rate: (min(by_repeat), sorted(by_repeat[min(by_repeat)], key=lambda p: p[0]))
            for rate, by_repeat in sorted(by_rate.items())
        }
        for key, by_rate in series.items()
    }


def plot_memory(records: list[dict], out_dir: Path) -> list[Path]:
    """Memory by kind over time (`memory_series`): per (experiment, arm) one stacked panel per offered rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for (experiment, arm), by_rate in memory_series(records).items():
        peak = max(sum(m.values()) for _, points in by_rate.values() for _, m in points)
        unit, scale = ("GiB", 2**30) if peak >= 2**30 else ("MiB", 2**20)
        kinds = sorted({k for _, points in by_rate.values() for _, m in points for k in m})
        fig, axes = plt.subplots(len(by_rate), 1, figsize=(7, 2.6 * len(by_rate) + 0.8), squeeze=False)
        for ax, (rate, (repeat, points)) in zip(axes[:, 0], by_rate.items()):
            times = [t for t, _ in points]
            ax.stackplot(times, *[[m.get(k, 0) / scale for _, m in points] for k in kinds], labels=kinds)
            where = (f" at {rate:.3g} req/s" if rate else "") + f", repeat {repeat}"
            ax.set(xlabel="time (s)", ylabel=f"memory ({unit})",
                   title=f"{experiment} / {arm}{where}: memory by kind")
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
    """Writes report.md (title, the `setup` Markdown if any, tables, plots, the bench_serving table if out_dir has
    its files) and the PNGs into out_dir; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = summarize(records)
    pngs = plot_ttft_vs_rate(summaries, out_dir) + plot_memory(records, out_dir)
    text = f"# {title}\n\n" + (setup.rstrip("\n") + "\n\n" if setup else "")
    text += markdown(summaries, baselines, slo_s)
    text += "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in pngs) + "\n" + bench_serving_table(out_dir)
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
