"""The plugin-overhead benchmark's pure parts: arm order, aggregation over repeats, ratios to the
baseline, the Markdown summary with its computed conclusion, the summary of py-spy stacks.
Not here: servers, bench_serving and py-spy runs (`plugin_overhead.py`); nothing here starts one.
"""

from __future__ import annotations

import re
import shlex
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BASELINE = "no-plugin"
WITHIN = (
    0.05  # the goal: no arm worse than the baseline by more than 5% on TTFT, TPOT or throughput
)


@dataclass(frozen=True)
class Metric:
    key: (
        str  # the field in a record's measurements (bench_serving's name where it comes from there)
    )
    label: str
    higher_is_better: bool = False


METRICS: tuple[Metric, ...] = (
    Metric("mean_ttft_ms", "mean TTFT (ms)"),
    Metric("median_ttft_ms", "median TTFT (ms)"),
    Metric("mean_tpot_ms", "mean TPOT (ms)"),
    Metric("median_tpot_ms", "median TPOT (ms)"),
    Metric("mean_itl_ms", "mean ITL (ms)"),
    Metric("mean_e2e_latency_ms", "mean E2E (ms)"),
    Metric("output_throughput", "output throughput (tok/s)", higher_is_better=True),
    Metric("request_throughput", "request throughput (req/s)", higher_is_better=True),
    Metric("scheduler_cpu_s", "scheduler CPU time (s)"),
    Metric("server_cpu_s", "server CPU time, all processes (s)"),
)
HEADLINE = ("mean_ttft_ms", "mean_tpot_ms", "output_throughput")  # the goal's three
CPU = (
    "scheduler_cpu_s",
    "server_cpu_s",
)  # the same work's CPU seconds: less sensitive to other jobs than latency
_BY_KEY = {m.key: m for m in METRICS}


def round_order(arms: Sequence[str], repeat: int) -> list[str]:
    """Round-robin order of repeat `repeat` (0-based): the arm list rotated left by `repeat`."""
    shift = repeat % len(arms)
    return [*arms[shift:], *arms[:shift]]


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float
    n: int


def spread(values: Iterable[float]) -> Spread:
    values = list(values)
    return Spread(statistics.median(values), min(values), max(values), len(values))


def aggregate(records: Sequence[dict]) -> dict[str, dict[str, Spread]]:
    """Per arm and metric: median, min and max over the records' repeats (records of one run)."""
    by_arm: dict[str, dict[str, list[float]]] = {}
    for r in records:
        values = by_arm.setdefault(r["setup"]["arm"], {})
        for m in METRICS:
            if r["measurements"].get(m.key) is not None:
                values.setdefault(m.key, []).append(float(r["measurements"][m.key]))
    return {arm: {k: spread(v) for k, v in metrics.items()} for arm, metrics in by_arm.items()}


def ratios(records: Sequence[dict], baseline: str = BASELINE) -> dict[str, dict[str, Spread]]:
    """Per arm and metric: the ratio of its median to the baseline's median (`Spread.median`), and
    the min and max of the per-repeat ratios (each repeat's arm value over the same repeat's
    baseline value: interleaved rounds pair up, so a slowdown of the machine that spans a round
    cancels)."""
    summary = aggregate(records)
    if baseline not in summary:
        return {}
    values = {(r["setup"]["repeat"], r["setup"]["arm"]): r["measurements"] for r in records}
    out: dict[str, dict[str, Spread]] = {}
    for arm, metrics in summary.items():
        if arm == baseline:
            continue
        for key, arm_spread in metrics.items():
            if key not in summary[baseline]:
                continue
            paired = [
                mine[key] / base[key]
                for (repeat, a), mine in values.items()
                if a == arm
                and (base := values.get((repeat, baseline)))
                and base.get(key)
                and mine.get(key)
            ]
            if paired:
                ratio = arm_spread.median / summary[baseline][key].median
                out.setdefault(arm, {})[key] = Spread(ratio, min(paired), max(paired), len(paired))
    return out


def cost(metric: Metric, ratio: float) -> float:
    """How much worse the arm is than the baseline, as a fraction (negative: better)."""
    return 1.0 / ratio - 1.0 if metric.higher_is_better else ratio - 1.0


def meets_goal(metric: Metric, r: Spread, within: float = WITHIN) -> bool:
    """The goal is an overhead budget: an arm passes unless it is worse than the baseline by more
    than `within`."""
    return cost(metric, r.median) <= within


def verdict(metric: Metric, r: Spread, within: float = WITHIN) -> str:
    """One clause on an arm's ratio for `metric`, from the numbers alone."""
    worse = cost(metric, r.median)
    size = f"{abs(worse) * 100:.1f}% {'worse' if worse > 0 else 'better' if worse < 0 else 'apart'}"
    status = (
        "over the" if worse > within else "within the" if worse >= -within else "better than the"
    )
    same_side = r.low > 1.0 or r.high < 1.0
    if r.n == 1:
        sides = "one repeat only"
    else:
        sides = f"all {r.n} repeats on one side of 1" if same_side else "repeats on both sides of 1"
    return f"{size} ({status} {within * 100:.0f}% budget; {sides})"


def render_markdown(records: Sequence[dict], baseline: str = BASELINE) -> str:
    """The run's summary: setup, machine, a table of medians / spreads / ratios, the conclusion."""
    if not records:
        return "No records.\n"
    first, setup = records[0], records[0]["setup"]
    summary, rel = aggregate(records), ratios(records, baseline)
    arms = [a for a in setup["arms"] if a in summary]
    others = [a for a in arms if a != baseline]
    machine = first["machine"]
    loads = [
        r["machine"][k][0] for r in records for k in ("load_average_start", "load_average_end")
    ]
    lines = [
        f"# Plugin overhead on base-model traffic ({first['date'][:10]})",
        "",
        f"- command: `{setup['command']}`",
        f"- workload: `{setup['bench_serving']}`",
        f"- server: `launch_server {shlex.join(setup['server_args'])}`",
        *(f"- arm `{a}`: {setup['arm_setup'][a]}" for a in arms),
        (
            f"- {_repeats(records)}, arms interleaved (round-robin order rotated per "
            f"repeat); servers {setup['servers']}; prefix cache flushed before each measurement"
        ),
        (
            f"- machine: {machine['cpu_model']}, {machine['nproc']} cores, shared with other jobs: "
            f"load average (1 min) {min(loads):.2f} to {max(loads):.2f} over the run; "
            f"git {machine.get('git_commit')}"
        ),
        "",
        (
            f"Median over repeats [min, max]; ratio = arm median / `{baseline}` median "
            "[range of the per-repeat ratios]."
        ),
        "",
        (
            "| metric | "
            + " | ".join(f"`{a}`" for a in arms)
            + " | "
            + " | ".join(f"`{a}` / `{baseline}`" for a in others)
            + " |"
        ),
        "|---|" + "---:|" * (len(arms) + len(others)),
    ]
    for m in METRICS:
        cells = [_cell(summary[a].get(m.key), ".1f") for a in arms]
        cells += [_cell(rel.get(a, {}).get(m.key), ".3f") for a in others]
        lines.append(f"| {m.label} | " + " | ".join(cells) + " |")
    lines += ["", "Conclusion (computed from the table):", ""]
    for a in others:
        headline = [k for k in HEADLINE if k in rel.get(a, {})]
        if not headline:
            continue
        ok = all(meets_goal(_BY_KEY[k], rel[a][k]) for k in headline)
        clauses = "; ".join(
            f"{_BY_KEY[k].label}: {verdict(_BY_KEY[k], rel[a][k])}" for k in headline
        )
        lines.append(
            f"- `{a}` {'meets' if ok else 'misses'} the {WITHIN * 100:.0f}% goal: {clauses}."
        )
        cpu = [k for k in CPU if k in rel[a]]
        if cpu:
            lines.append(
                "  CPU seconds for the same requests: "
                + "; ".join(f"{_BY_KEY[k].label}: {verdict(_BY_KEY[k], rel[a][k])}" for k in cpu)
                + "."
            )
    noise = [(k, summary[baseline][k]) for k in HEADLINE if k in summary.get(baseline, {})]
    if noise:
        own = ", ".join(
            f"{_BY_KEY[k].label} {(s.high / s.low - 1) * 100:.0f}%" for k, s in noise if s.low > 0
        )
        lines.append(
            f"- Noise: `{baseline}`'s own max / min over its {noise[0][1].n} repeats: {own}."
        )
    pairs = [rel[a][k] for a in others for k in HEADLINE if k in rel.get(a, {})]
    if pairs:
        one_side = sum(r.low > 1.0 or r.high < 1.0 for r in pairs)
        lines.append(
            f"- Of the {len(pairs)} ratios above (arm x the goal's three metrics), {one_side} have "
            "every repeat on the same side of 1; the others move with the repeat, not with the arm."
        )
    return "\n".join(lines) + "\n"


def _repeats(records: Sequence[dict]) -> str:
    """How many repeats the records hold, and how many were planned when that differs."""
    done = len({r["setup"]["repeat"] for r in records})
    planned = records[0]["setup"]["repeats"]
    return f"{done} repeats" if done == planned else f"{done} repeats (of {planned} planned)"


def _cell(s: Spread | None, fmt: str) -> str:
    return f"{s.median:{fmt}} [{s.low:{fmt}}, {s.high:{fmt}}]" if s else "-"


# ---- py-spy stacks -------------------------------------------------------------------------------

ROLES = (("scheduler", "run_scheduler_process"), ("detokenizer", "run_detokenizer_process"))
OURS_FRAME = ("(sgl_multilora/", "(patches/")  # how py-spy prints frames of this package's files
_LINE = re.compile(r":\d+\)$")


def _role(frames: list[str]) -> str:
    return next((role for role, needle in ROLES if any(needle in f for f in frames)), "http")


def summarize_stacks(raw: str, top: int = 12) -> dict:
    """Where py-spy's samples fell, per server process.

    `raw`: py-spy `--format raw` lines (`frame;frame;... count`, outermost first, each frame
    `function (file:line)`), from any of the server's processes. Per process role (scheduler,
    detokenizer, http): its samples and the share of them with a frame of this package on the
    stack; for the scheduler also the shares in extend and decode steps and in their attention
    calls; and this package's frames by function (the outermost one of each sample, so a hook counts
    with everything it calls), as shares of their process's samples.
    """
    samples, ours, by_function, scheduler = Counter(), Counter(), Counter(), Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n, frames = int(count), stack.split(";")
        role = _role(frames)
        samples[role] += n
        mine = [f for f in frames if any(tag in f for tag in OURS_FRAME)]
        if mine:
            ours[role] += n
            by_function[f"{role}: {_LINE.sub(')', mine[0])}"] += n
        if role == "scheduler":
            text = ";".join(frames)
            for step in ("extend", "decode"):
                if f"_execute_{step}" in text:
                    scheduler[f"{step}_share"] += n
                    if f"run_sdpa_forward_{step}" in text:  # SGLang's method or our hook of it
                        scheduler[f"{step}_attention_share"] += n
    return {
        "samples": dict(samples),
        "ours_share": {role: ours[role] / samples[role] for role in samples},
        "scheduler": {k: v / (samples["scheduler"] or 1) for k, v in sorted(scheduler.items())},
        "ours_by_function": {
            k: v / samples[k.split(":", 1)[0]] for k, v in by_function.most_common(top)
        },
    }


def render_profile_markdown(records: Sequence[dict]) -> str:
    """A table of where each arm's samples fell (records with a `profile` from `summarize_stacks`),
    and this package's functions with their sample shares and the wall time they add up to per
    request."""
    header = (
        "| arm | scheduler samples | extend steps | extend attention | decode steps "
        "| decode attention | sgl_multilora frames (scheduler) | sgl_multilora frames (http) |"
    )
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    functions = []
    for r in records:
        p, arm = r["profile"], r["setup"]["arm"]
        sched = p["scheduler"]
        shares = [
            sched.get(k, 0.0)
            for k in (
                "extend_share",
                "extend_attention_share",
                "decode_share",
                "decode_attention_share",
            )
        ]
        ours = [p["ours_share"].get(role, 0.0) for role in ("scheduler", "http")]
        lines.append(
            f"| `{arm}` | {p['samples'].get('scheduler', 0)} | "
            + " | ".join(f"{x:.1%}" for x in shares + ours)
            + " |"
        )
        rate, num_requests = r["setup"]["py_spy"]["rate_hz"], r["setup"]["num_requests"]
        for name, share in p["ours_by_function"].items():
            role = name.split(":", 1)[0]
            ms = share * p["samples"][role] / rate * 1e3 / num_requests
            functions.append(f"| `{arm}` | `{name}` | {share:.3%} | {ms:.2f} |")
    if functions:
        header = (
            "| arm | function (outermost sgl_multilora frame) | share of its process's samples "
            "| sampled wall ms per request |"
        )
        lines += ["", header, "|---|---|---:|---:|", *functions]
    return "\n".join(lines) + "\n"
