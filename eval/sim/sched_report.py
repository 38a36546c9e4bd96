"""What the simulated Chameleon scheduling comparison shows, computed from its run records, and its Markdown report.

Lives here: the SLO from the light-load runs, "sustains" and the max rate under the SLO, the headline ratios and the
report's tables and verdicts; Chameleon's published figures as cited constants (`PAPER_*`, never computed). Not
here: running the sweep or its setup (`sched_compare.py`). Definitions are those in sched_compare.py's docstring.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

SLO_FACTOR = 5.0  # Chameleon: SLO = 5 x the mean request execution time on a lightly loaded system
POLICIES = ("fcfs", "lpm", "multiqueue")
OURS, BASE = "multiqueue", "fcfs"
# Chameleon vs S-LoRA (seed-chameleon.md 7.2; Llama-7B on an A40), cited for comparison only.
PAPER_P99_REDUCTION = 0.807
PAPER_P50_REDUCTION = 0.481
PAPER_THROUGHPUT = 1.5
GOAL_P99_RATIO, GOAL_P50_RATIO, GOAL_RATE_RATIO = 0.2, 0.52, 1.5
"""The issue's goals: P99 at most a fifth of fcfs's, P50 at most about half (the paper's -48.1%), 1.5x the rate."""


def slo_from_light(light: list[dict]) -> float:
    """SLO_FACTOR x the median over seeds of fcfs's mean E2E latency at the light rate."""
    return SLO_FACTOR * float(np.median([r["summary"]["e2e_mean_s"] for r in light]))


def grid(records: list[dict]) -> dict[tuple[float, str], dict[int, dict]]:
    """{(rate, policy): {seed: summary}} of the sweep records."""
    out: dict[tuple[float, str], dict[int, dict]] = defaultdict(dict)
    for r in records:
        if r.get("kind") == "sweep":
            s = r["setup"]
            out[(s["rate"], s["policy"])][s["seed"]] = r["summary"]
    return out


def median_of(g: dict, rate: float, policy: str, key: str) -> float:
    return float(np.median([s[key] for s in g[(rate, policy)].values()]))


def _share(g: dict, rate: float, policy: str, key: str) -> str:
    """Median share over seeds; '-' for records written before the engine reported it."""
    values = [s[key] for s in g[(rate, policy)].values() if s.get(key) is not None]
    return f"{np.median(values):.0%}" if values else "-"


def spread(g: dict, rate: float, policy: str, key: str) -> tuple[float, float, float]:
    values = [s[key] for s in g[(rate, policy)].values()]
    return float(np.median(values)), float(min(values)), float(max(values))


def ratios(g: dict, rate: float, key: str, policy: str = OURS) -> tuple[float, float, float]:
    """Per-seed `key` of `policy` / fcfs's: median, min, max."""
    mine, base = g[(rate, policy)], g[(rate, BASE)]
    values = [mine[seed][key] / base[seed][key] for seed in mine if seed in base and base[seed][key] > 0]
    return float(np.median(values)), float(min(values)), float(max(values))


def max_rate(g: dict, rates: list[float], policy: str, slo_s: float) -> tuple[float | None, float | None]:
    """(highest swept rate up to which `policy` sustains every swept rate, the rate where its median P99 crosses the
    SLO by linear interpolation to the next swept rate; None for either when it does not apply)."""
    best = None
    for rate in rates:
        if median_of(g, rate, policy, "ttft_p99_s") > slo_s:
            break
        best = rate
    if best is None or best == rates[-1]:
        return best, None
    nxt = rates[rates.index(best) + 1]
    lo, hi = median_of(g, best, policy, "ttft_p99_s"), median_of(g, nxt, policy, "ttft_p99_s")
    return best, best + (nxt - best) * (slo_s - lo) / (hi - lo)


def _fmt(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _rate(x: float | None) -> str:
    return "n/a" if x is None else f"{x:g}"


def _cell(g: dict, rate: float, policy: str, key: str) -> str:
    m, lo, hi = spread(g, rate, policy, key)
    return f"{m:.3f} ({lo:.3f}-{hi:.3f})"


def _table(g: dict, rates: list[float], slo_s: float) -> list[str]:
    lines = [("| rate (req/s) | policy | P50 TTFT s, median (min-max) | P99 TTFT s, median (min-max) | "
              "P50 / fcfs | P99 / fcfs | within SLO | sustains | steps at running cap | pool held by running |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for rate in rates:
        for policy in POLICIES:
            if (rate, policy) not in g:
                continue
            r50 = r99 = "1"
            if policy != BASE:
                r50 = "{:.2f} ({:.2f}-{:.2f})".format(*ratios(g, rate, "ttft_p50_s", policy))
                r99 = "{:.2f} ({:.2f}-{:.2f})".format(*ratios(g, rate, "ttft_p99_s", policy))
            ok = "yes" if median_of(g, rate, policy, "ttft_p99_s") <= slo_s else "no"
            lines.append(f"| {rate:g} | {policy} | {_cell(g, rate, policy, 'ttft_p50_s')} | "
                         f"{_cell(g, rate, policy, 'ttft_p99_s')} | {r50} | {r99} | "
                         f"{median_of(g, rate, policy, 'within_slo'):.3f} | {ok} | "
                         f"{_share(g, rate, policy, 'running_cap_step_share')} | "
                         f"{_share(g, rate, policy, 'running_kv_mean_share')} |")
    return lines


def _groups(g: dict, rate: float) -> list[str]:
    """P50 / P99 TTFT by request size and adapter rank at one rate, fcfs against multiqueue (median over seeds)."""
    keys = sorted(next(iter(g[(rate, BASE)].values()))["ttft_by_group"],
                  key=lambda k: (k.split("=")[0], int(k.split("=")[1]) if k.startswith("rank") else k))
    lines = [f"TTFT by request class at {rate:g} req/s (median over seeds; seconds):", "",
             "| class | fcfs P50 | multiqueue P50 | fcfs P99 | multiqueue P99 |", "|---|---|---|---|---|"]
    for k in keys:
        cells = []
        for stat in ("p50", "p99"):
            for policy in (BASE, OURS):
                cells.append(_fmt(float(np.median([s["ttft_by_group"][k][stat]
                                                   for s in g[(rate, policy)].values()])), 3))
        lines.append(f"| {k} | {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} |")
    return lines


def _verdict(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def headline(g: dict, rates: list[float], slo_s: float) -> list[str]:
    base_rate, base_cross = max_rate(g, rates, BASE, slo_s)
    ours_rate, ours_cross = max_rate(g, rates, OURS, slo_s)
    lpm_rate, lpm_cross = max_rate(g, rates, "lpm", slo_s)
    out = ["## Headline", ""]
    if base_rate is None:
        return out + ["fcfs sustains no swept rate: no headline rate (lower the rates)."]
    at = [base_rate] + [r for r in rates if r > base_rate][:1]
    for i, rate in enumerate(at):
        p99, p50 = ratios(g, rate, "ttft_p99_s"), ratios(g, rate, "ttft_p50_s")
        where = "the highest rate fcfs sustains" if i == 0 else "the next swept rate, just past fcfs's knee"
        out.append(f"- At {rate:g} req/s ({where}): multiqueue / fcfs P99 TTFT {p99[0]:.3f} (per-seed "
                   f"{p99[1]:.2f}-{p99[2]:.2f}; goal <= {GOAL_P99_RATIO}: {_verdict(p99[0] <= GOAL_P99_RATIO)}), "
                   f"P50 TTFT {p50[0]:.3f} ({p50[1]:.2f}-{p50[2]:.2f}; goal <= {GOAL_P50_RATIO}: "
                   f"{_verdict(p50[0] <= GOAL_P50_RATIO)}). Chameleon vs S-LoRA: P99 "
                   f"{1 - PAPER_P99_REDUCTION:.2f}, P50 {1 - PAPER_P50_REDUCTION:.2f}.")
    gain = None if ours_rate is None else ours_rate / base_rate
    gain_i = None if ours_cross is None or base_cross is None else ours_cross / base_cross
    out.append(f"- Max rate under the SLO (swept grid / interpolated crossing): fcfs {_rate(base_rate)} / "
               f"{_fmt(base_cross)}, lpm {_rate(lpm_rate)} / {_fmt(lpm_cross)}, multiqueue {_rate(ours_rate)} / "
               f"{_fmt(ours_cross)} req/s: multiqueue / fcfs {_fmt(gain)} on the grid, {_fmt(gain_i)} "
               f"interpolated (goal >= {GOAL_RATE_RATIO}: {_verdict((gain or 0) >= GOAL_RATE_RATIO)}; "
               f"Chameleon {PAPER_THROUGHPUT}x).")
    return out


def _lpm_note(g: dict, rates: list[float]) -> str:
    same = sum(g[(r, "lpm")][s]["ttft_p99_s"] == g[(r, BASE)][s]["ttft_p99_s"]
               and g[(r, "lpm")][s]["ttft_p50_s"] == g[(r, BASE)][s]["ttft_p50_s"]
               for r in rates for s in g[(r, "lpm")])
    total = sum(len(g[(r, "lpm")]) for r in rates)
    return (f"lpm gave the same P50 and P99 TTFT as fcfs in {same} of {total} runs: this workload shares no "
            "prefix between requests (single-turn, fresh prompts), so every match is 0 and SGLang's stable sort "
            "keeps arrival order (eval/sim/admission/lpm.py).")


def _sched_note(records: list[dict], rate: float) -> str:
    rs = [r for r in records if r.get("kind") == "sweep" and r["setup"]["rate"] == rate
          and r["setup"]["policy"] == OURS]
    ks = sorted({r["sched"]["num_queues"] for r in rs})
    acc = np.median([r["sched"]["predictor"]["within_25pct"] for r in rs])
    req = np.median([r["sched"]["num_requeued"] / max(1, r["sched"]["counts"]["admitted"]) for r in rs])
    squashes = [r["sched"]["counts"].get("slot_squashes", 0) for r in rs]
    slots = (f" Slot squashes per run (median, min-max): {np.median(squashes):g} ({min(squashes)}-{max(squashes)})."
             if rs and rs[0]["setup"]["sim_config"].get("max_loras_per_batch") else "")
    return (f"Multi-queue state at {rate:g} req/s (end of run): K = {ks} queues, predictor within +-25% of the true "
            f"output length for {acc:.0%} of requests (median over seeds), re-queued after planning "
            f"{req:.2f} times per admission.{slots}")


def _cap(setup: dict) -> str:
    sim = setup["sim_config"]
    cap = sim.get("max_loras_per_batch")
    if not cap:
        return ""
    share, bound = sim.get("slot_squash_share", 0.5), sim.get("max_slot_squashes", 1)  # older records: the defaults
    return (f", at most {cap} distinct adapters per batch as SGLang's `--max-loras-per-batch`; multiqueue's slot "
            f"squash after {share:g} of the SLO, at most {bound} per request")


def markdown(records: list[dict], command: str) -> str:
    light = [r for r in records if r.get("kind") == "light"]
    sweep = [r for r in records if r.get("kind") == "sweep"]
    slo_s = slo_from_light(light)
    g = grid(records)
    rates = sorted({r["setup"]["rate"] for r in sweep})
    seeds = sorted({r["setup"]["seed"] for r in sweep})
    s0 = sweep[0]["setup"]
    p = s0["params"]
    light_e2e = [r["summary"]["e2e_mean_s"] for r in light]
    title = "# Multi-queue vs SGLang's fcfs and lpm on Chameleon's heterogeneous workload (simulated)"
    provenance = (f"All figures **simulated** ({sweep[0]['device']}), not measured on a GPU. Command: "
                  f"`{command}` ({sweep[0]['date'][:10]}; {sum(r['sim_wall_s'] for r in records):.0f} s of "
                  "simulation).")
    setup = (f"Setup: workload heterogeneous ({p['num_adapters']} adapters, ranks {p['ranks']}, uniform rank "
             f"popularity, Zipf({p['zipf_s']}) within a rank, Azure conversation lengths x {p['length_scale']}, "
             f"Poisson arrivals for {s0['window_s']:g} s per run); system `{s0['system']}` for every policy "
             f"(max {s0['sim_config']['max_running']} running, {s0['sim_config']['chunk_tokens']}-token chunked "
             f"prefill, {s0['pool_slots']} token slots{_cap(s0)}); seeds {seeds}; policies "
             f"{', '.join(POLICIES)} (eval/sim/admission/).")
    slo = (f"TTFT SLO = {SLO_FACTOR:g} x mean E2E latency of fcfs at {light[0]['setup']['rate']:g} req/s "
           f"(light load; per seed {', '.join(f'{x:.2f}' for x in light_e2e)} s) = **{slo_s:.2f} s**. A policy "
           "sustains a rate when its median P99 TTFT over seeds is within the SLO; definitions in "
           "eval/sim/sched_compare.py.")
    lines = [title, "", provenance, "", setup, "", slo, ""]
    lines += headline(g, rates, slo_s) + [""]
    base_rate, _ = max_rate(g, rates, BASE, slo_s)
    lines += ["## Per rate", "", ("Ratios are per seed (policy / fcfs), median (min-max); within SLO is the "
                                  "median share of requests whose TTFT is within the SLO; steps at running cap: "
                                  "the share of engine steps run with the running-request cap reached; pool held by "
                                  "running: the mean share of the pool's slots reserved by running requests (prompt "
                                  "and output), sampled every second."), ""]
    lines += _table(g, rates, slo_s) + [""]
    if base_rate is not None:
        nxt = [r for r in rates if r > base_rate][:1]
        for rate in [base_rate] + nxt:
            lines += _groups(g, rate) + [""]
        lines += [_sched_note(records, base_rate), ""]
    lines += [_lpm_note(g, rates), ""]
    return "\n".join(lines)
