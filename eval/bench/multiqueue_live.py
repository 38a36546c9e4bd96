"""Live CPU servers of one build, three admission policies: `--multilora-scheduler multiqueue` against SGLang's
`--schedule-policy fcfs` and `lpm`, on Chameleon's heterogeneous workload (Azure conversation lengths, adapters of
ranks 8 to 128 with uniform rank popularity and a power law within a rank).

Every arm: `--radix-cache-backend multilora` (the unified pool), the same adapters (random PEFT weights named and
ranked as the workload's), the same KV budget; only the admission policy differs. The servers start once and stay
up (idle ones sleep); each repeat replays the workload at every rate on every arm, the arms' order rotating per
repeat, each replay on a flushed cache. Per arm and rate: TTFT mean / P50 / P99 and the share of requests within
the TTFT SLO (median and spread over repeats); ratios multiqueue / fcfs per repeat.

Baselines at their best: `fcfs-drain` is fcfs with SGLang's LoRA drainer (`--lora-drain-wait-threshold` at half the
SLO: an adapter waiting that long for a batch slot stops new admissions of the running adapter closest to done),
the stock answer to the per-batch adapter cap that the multi-queue's slot squash also answers. Optional arm
`multiqueue-squash25`: multiqueue with `--multilora-slot-squash-share 0.25` (a slot squash after a quarter of the SLO
spent waiting for an adapter slot, not half). Optional
arm `multiqueue-eager`: `--multilora-slot-squash-share 0.1`, the share the simulator favours at GPU scale under
SGLang's cap of 8 (eval/RESULTS.md; the server retracts a request by slot squashes at most once).

Per arm and rate also: SLO goodput (requests per second answered within the TTFT SLO) and mean end-to-end latency
(what a squash costs the requests it retracts shows there, not in TTFT). Per arm: its max rate under the TTFT SLO,
defined as the simulator defines it (`max_rate_lines`); sweep time scales from below the baselines' knee to find it.
The report gives the max rates twice: under the fixed `--slo-s`, and under Chameleon's own rule (5x the mean TTFT
of the baseline at light load, here its lowest swept rate; `light_load_slo`), which scales with the machine.

Usage: .venv/bin/python -m eval.bench.multiqueue_live [--time-scales 1,2] [--repeats 3]
           [--arms fcfs,fcfs-drain,lpm,multiqueue] [--out eval/results/multiqueue_live/multiqueue_live.jsonl]
       .venv/bin/python -m eval.bench.multiqueue_live --merge A.jsonl B.jsonl --out AB.jsonl  (one sweep, two runs)
       .venv/bin/python -m eval.bench.multiqueue_live --report A.jsonl  (rewrite A.md from A's last record)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import requests
from tqdm import tqdm

from eval.bench.results import save
from eval.live.adapters import CACHE, make_adapters
from eval.live.driver import ServedAdapter, Target, replay
from eval.live.ttft import replay_summary
from eval.sim import sched_report
from eval.workloads import create_workload
from sgl_multilora.server import cpu_server_args, launch

REPO = Path(__file__).resolve().parents[2]
ARMS = {
    "fcfs": ["--schedule-policy", "fcfs"],
    "lpm": ["--schedule-policy", "lpm"],
    "multiqueue": ["--schedule-policy", "fcfs", "--multilora-scheduler", "multiqueue"],
}


def within_slo(results, slo_s: float) -> float:
    return sum(1 for r in results if r.error is None and r.ttft_s is not None and r.ttft_s <= slo_s) / max(
        1, len(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=60)
    parser.add_argument("--num-adapters", type=int, default=10)
    parser.add_argument("--rate", type=float, default=1.0, help="requests/s at time scale 1")
    parser.add_argument("--length-scale", type=float, default=0.1)
    parser.add_argument("--max-output-tokens", type=int, default=64)
    parser.add_argument("--pool-tokens", type=int, default=12000)
    parser.add_argument("--slo-s", type=float, default=2.0, help="TTFT SLO (also the scheduler's quota SLO)")
    parser.add_argument("--max-loras-per-batch", type=int, default=8, help="SGLang's cap, every arm alike")
    parser.add_argument("--arms", default="fcfs,fcfs-drain,lpm,multiqueue", help="comma-separated")
    parser.add_argument("--time-scales", default="1,2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "eval/results/multiqueue_live/multiqueue_live.jsonl")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="JSONL",
                        help="run nothing: merge the last records of these files (one sweep split into runs) into "
                             "--out, with its report")
    parser.add_argument("--report", type=Path, metavar="JSONL",
                        help="run nothing: rewrite the report of this file's last record")
    args = parser.parse_args()
    if args.report:
        text = report(last_record(args.report))
        args.report.with_suffix(".md").write_text(text)
        print(text)
        return
    if args.merge:
        if args.out.resolve() in {m.resolve() for m in args.merge}:
            parser.error("--out must not be one of the files merged")
        try:
            merged = merge([last_record(m) for m in args.merge])
        except ValueError as err:
            parser.error(str(err))
        save(args.out, merged, report)
        return
    known = {**ARMS, "fcfs-drain": [*ARMS["fcfs"], "--lora-drain-wait-threshold", f"{args.slo_s / 2:g}"],
             "multiqueue-squash25": [*ARMS["multiqueue"], "--multilora-slot-squash-share", "0.25"],
             "multiqueue-eager": [*ARMS["multiqueue"], "--multilora-slot-squash-share", "0.1"]}
    unknown = [a for a in args.arms.split(",") if a not in known]
    if unknown:
        parser.error(f"unknown arm(s) {unknown}; choose from {sorted(known)}")
    arms = {a: known[a] for a in args.arms.split(",")}

    from sgl_multilora.embedded import ensure_embedded_model

    model = str(ensure_embedded_model())
    params = {"num_requests": args.num_requests, "num_adapters": args.num_adapters, "rate": args.rate,
              "length_scale": args.length_scale, "max_output_tokens": args.max_output_tokens}
    workload = create_workload("heterogeneous", seed=args.seed, **params)
    adapters_dir = make_adapters(model, workload, CACHE / f"heterogeneous-{args.num_adapters}")
    max_rank = max(a.rank for a in workload.adapters)
    common = ["--multilora-adapter-dir", str(adapters_dir), "--max-loras-per-batch", str(args.max_loras_per_batch),
              "--max-lora-rank",
              str(max_rank), "--radix-cache-backend", "multilora", "--multilora-ttft-slo-s", str(args.slo_s)]
    log_dir = REPO / ".cache" / "bench_logs"  # a log per output file and arm: a later run keeps this run's logs
    log_dir.mkdir(parents=True, exist_ok=True)
    servers = {}
    try:
        for name, extra in arms.items():
            servers[name] = launch(model, [*cpu_server_args(max_total_tokens=args.pool_tokens), *common, *extra],
                                   log_path=log_dir / f"{args.out.stem}_{name}.log")
        served = [ServedAdapter(a.name) for a in workload.adapters]
        scales = [float(s) for s in args.time_scales.split(",")]
        setup = {"workload": "heterogeneous", "params": params, "num_requests": len(workload.requests),
                 "pool_tokens": args.pool_tokens, "slo_s": args.slo_s, "time_scales": scales,
                 "repeats": args.repeats, "seed": args.seed, "arms": arms, "max_lora_rank": max_rank,
                 "max_loras_per_batch": args.max_loras_per_batch,
                 "offered_rate": workload.offered_rate}
        device = {"processor": platform.processor(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
                  "load_avg_start": list(os.getloadavg())}
        raw = args.out.with_name(args.out.stem + "_requests.jsonl")
        raw.unlink(missing_ok=True)
        runs, names = [], list(arms)
        with tqdm(total=args.repeats * len(scales) * len(names), desc="replays") as bar:
            for rep in range(args.repeats):
                order = names[rep % len(names):] + names[:rep % len(names)]
                for scale in scales:
                    for name in order:
                        requests.post(servers[name].url + "/flush_cache", timeout=60)
                        time.sleep(1.0)
                        results = replay(workload, [Target(name, servers[name].url)], raw, f"rep{rep}", served,
                                         time_scale=scale, timeout_s=900)
                        runs.append({"arm": name, "repeat": rep, "time_scale": scale,
                                     "rate_req_s": workload.offered_rate * scale, **replay_summary(results),
                                     "within_slo": within_slo(results, args.slo_s)})
                        bar.update(1)
        ours = next((a for a in names if a.startswith("multiqueue")), None)
        stats = {} if ours is None else \
            requests.get(servers[ours].url + "/multilora/stats", timeout=60).json()["memory"][0]
        device["load_avg_end"] = list(os.getloadavg())
        record = {"setup": setup, "device": device, "date": datetime.datetime.now(datetime.UTC).isoformat(),
                  "runs": runs, "multiqueue_stats_at_end": stats.get("scheduler")}
        save(args.out, record, report)
    finally:
        for handle in servers.values():
            handle.stop()


def merged_from(record: dict) -> list[str]:
    return [f"Merged from {len(record['merged_from'])} runs one after the other: " + "; ".join(
        f"time scales {', '.join(f'{t:g}' for t in m['time_scales'])} (ended {m['date'][:16]} UTC), load average "
        f"{m['device'].get('load_avg_start')} to {m['device'].get('load_avg_end')}" for m in record["merged_from"])
        + "."] if record.get("merged_from") else []


def report(record: dict) -> str:
    s, runs = record["setup"], record["runs"]
    lines = [f"# Multi-queue admission vs SGLang's fcfs and lpm, live CPU server ({record['date'][:10]})", "",
             f"Workload heterogeneous {s['params']} ({s['num_requests']} requests, offered "
             f"{s['offered_rate']:.2f} req/s at time scale 1); every arm the same build with "
             f"`--radix-cache-backend multilora`, {s['pool_tokens']} token slots, max rank {s['max_lora_rank']}, "
             f"`--max-loras-per-batch {s.get('max_loras_per_batch', 8)}`; TTFT SLO {s['slo_s']} s; arms "
             f"{ {a: ' '.join(f) for a, f in s['arms'].items()} }; {s['repeats']} repeats, arms rotating. "
             f"Machine: {record['device']}.", *merged_from(record), "",
             "| rate (req/s) | arm | mean TTFT s | P50 TTFT s (min-max) | P99 TTFT s (min-max) | within SLO | "
             "SLO goodput req/s | mean E2E s | failed |",
             "|---|---|---|---|---|---|---|---|---|"]

    def cell(arm, scale):
        return [r for r in runs if r["arm"] == arm and r["time_scale"] == scale and r.get("num_ok")]

    for scale in s["time_scales"]:
        for arm in s["arms"]:
            rs = cell(arm, scale)
            if not rs:
                continue

            def med(key):
                return statistics.median(r[key] for r in rs)

            lines.append(
                f"| {rs[0]['rate_req_s']:.2f} | {arm} | {med('mean_ttft_s'):.2f} | {med('p50_ttft_s'):.2f} "
                f"({min(r['p50_ttft_s'] for r in rs):.2f}-{max(r['p50_ttft_s'] for r in rs):.2f}) | "
                f"{med('p99_ttft_s'):.2f} "
                f"({min(r['p99_ttft_s'] for r in rs):.2f}-{max(r['p99_ttft_s'] for r in rs):.2f})"
                f" | {med('within_slo'):.2f} | {statistics.median(r['within_slo'] * r['rate_req_s'] for r in rs):.2f}"
                f" | {med('mean_e2e_s'):.2f} | {sum(r['num_failed'] for r in rs)} |")
    ours_arms = [a for a in s["arms"] if a.startswith("multiqueue")]
    for ours in ours_arms:
        for base in [a for a in s["arms"] if a not in ours_arms]:
            lines += ["", f"Ratios {ours} / {base} per repeat (median, min-max):", ""]
            for scale in s["time_scales"]:
                ratios = {"P50 TTFT": [], "P99 TTFT": [], "SLO goodput": []}
                for rep in range(s["repeats"]):
                    m = [r for r in cell(ours, scale) if r["repeat"] == rep]
                    b = [r for r in cell(base, scale) if r["repeat"] == rep]
                    if m and b:
                        ratios["P50 TTFT"].append(m[0]["p50_ttft_s"] / b[0]["p50_ttft_s"])
                        ratios["P99 TTFT"].append(m[0]["p99_ttft_s"] / b[0]["p99_ttft_s"])
                        if b[0]["within_slo"] > 0:
                            ratios["SLO goodput"].append(m[0]["within_slo"] / b[0]["within_slo"])
                if ratios["P50 TTFT"]:
                    lines.append("- time scale {:g}: ".format(scale) + ", ".join(
                        f"{k} {statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" for k, v in ratios.items() if v))
    lines += max_rate_lines(record)
    lines += light_load_lines(record)
    lines += p50_floor_lines(record)
    stats = record.get("multiqueue_stats_at_end") or {}
    if stats:
        counts = stats.get("counts", {})
        whole = "the last of the merged runs" if record.get("merged_from") else "the whole run"
        lines += ["", f"{ours_arms[0]}'s scheduler over {whole}: slot squashes {counts.get('slot_squashes')} "
                  f"({counts.get('slot_squashed')} requests retracted), memory squashes {counts.get('squashes')}, "
                  f"bypasses {counts.get('bypasses')}, predictor {stats.get('predictor')}."]
    return "\n".join(lines) + "\n"


PAPER_SLO_FACTOR = 5.0


def light_load_slo(record: dict) -> tuple[str, float, float, float] | None:
    """Chameleon's SLO rule, 5x the mean request execution time on a lightly loaded system, read as 5x the first
    baseline arm's mean TTFT (median over repeats) at the lowest swept rate: (that arm, that rate, that mean, the
    SLO); None when the record has no baseline arm, or when the baseline missed the record's own SLO there for any
    request (then the lowest rate is no light load)."""
    s, runs = record["setup"], record["runs"]
    base = next((a for a in s["arms"] if not a.startswith("multiqueue")), None)
    cells = [r for r in runs if r["arm"] == base and r.get("num_ok")]
    if not cells:
        return None
    rate = min(r["rate_req_s"] for r in cells)
    low = [r for r in cells if r["rate_req_s"] == rate]
    if any(r["within_slo"] < 1.0 for r in low):
        return None
    mean = statistics.median(r["mean_ttft_s"] for r in low)
    return base, rate, mean, PAPER_SLO_FACTOR * mean


def max_rate_lines(record: dict, slo_s: float | None = None) -> list[str]:
    """Each arm's max rate under a TTFT SLO (the record's own unless `slo_s` is given), with the simulator's definition
    (eval/sim/sched_compare.py): an arm sustains a rate when the median over repeats of its P99 TTFT is within the
    SLO; its max rate is the highest swept rate up to which it sustains every swept rate, interpolated linearly in P99
    to the next swept rate. The ratio to each baseline is of those rates (interpolated where both are)."""
    s, runs = record["setup"], record["runs"]
    slo_s = s["slo_s"] if slo_s is None else slo_s
    by_scale = {r["time_scale"]: r["rate_req_s"] for r in runs}
    rates = [by_scale[t] for t in s["time_scales"] if t in by_scale]
    if len(rates) < 2:
        return []
    g: dict[tuple[float, str], dict[int, dict]] = {}
    for r in runs:
        if r.get("num_ok"):
            g.setdefault((r["rate_req_s"], r["arm"]), {})[r["repeat"]] = {"ttft_p99_s": r["p99_ttft_s"]}
    arms = [a for a in s["arms"] if all((rate, a) in g for rate in rates)]
    found = {a: sched_report.max_rate(g, rates, a, slo_s) for a in arms}

    def said(best, crossing):
        if best is None:
            return f"none (P99 above the SLO already at {rates[0]:.2f} req/s)"
        if crossing is None:
            return f"at least {best:.2f} req/s (every swept rate)"
        return f"{best:.2f} req/s swept, {crossing:.2f} req/s interpolated"

    lines = ["", f"Max rate under the TTFT SLO of {slo_s:.3g} s (median P99 over repeats within it, swept "
             f"{', '.join(f'{r:.2f}' for r in rates)} req/s):", ""]
    lines += [f"- {a}: {said(*found[a])}" for a in arms]
    ours_arms = [a for a in arms if a.startswith("multiqueue")]
    for ours in ours_arms:
        for base in [a for a in arms if a not in ours_arms]:
            (ob, oc), (bb, bc) = found[ours], found[base]
            if ob is None or bb is None:
                continue
            exact = oc is not None and bc is not None
            ratio = (oc / bc) if exact else (ob / bb)
            bound = "" if exact else (" (of swept rates; at least that where an arm sustains every swept rate)"
                                      if oc is None else " (of swept rates)")
            lines.append(f"- {ours} / {base}: {ratio:.2f}x{bound}")
    return lines


def light_load_lines(record: dict) -> list[str]:
    """The max rates again under Chameleon's SLO rule (`light_load_slo`), or why that rule gives no SLO here."""
    found = light_load_slo(record)
    if found is None:
        return ["", "Chameleon's SLO rule (5x the mean TTFT at light load) gives no SLO here: no baseline arm, or "
                "the baseline's lowest swept rate already misses the record's SLO."]
    base, rate, mean, slo = found
    lines = max_rate_lines(record, slo)
    if lines:
        lines[1] = (f"Under Chameleon's SLO rule, {PAPER_SLO_FACTOR:g}x the mean TTFT at light load ({base}'s "
                    f"{mean:.3f} s at {rate:.2f} req/s, the lowest swept rate), an SLO of {slo:.3g} s; the "
                    f"scheduler's quotas stay sized for {record['setup']['slo_s']:g} s. " + lines[1])
    return lines


def p50_floor_lines(record: dict) -> list[str]:
    """How far any scheduler could bring P50 TTFT down where a baseline arm misses the SLO (median P99 over repeats
    above it): no request's first token comes sooner than when it runs alone, so at a higher rate no scheduler's P50
    falls much below the P50 at light load, read as the lowest median P50 of any arm at the lowest swept rate. The
    lines give that floor over the baseline's median P50 at each such rate: the smallest P50 ratio reachable there,
    approximately (requests at light load wait a little, so the floor is a slight overestimate)."""
    s, runs = record["setup"], record["runs"]
    cells: dict[tuple[str, float], list[dict]] = {}
    for r in runs:
        if r.get("num_ok"):
            cells.setdefault((r["arm"], r["rate_req_s"]), []).append(r)
    if not cells:
        return []
    lowest = min(rate for _, rate in cells)
    floor = min(statistics.median(r["p50_ttft_s"] for r in rs) for (_, rate), rs in cells.items() if rate == lowest)
    lines = []
    for base in [a for a in s["arms"] if not a.startswith("multiqueue")]:
        past = sorted((rate, statistics.median(r["p50_ttft_s"] for r in rs)) for (arm, rate), rs in cells.items()
                      if arm == base and statistics.median(r["p99_ttft_s"] for r in rs) > s["slo_s"])
        if past:
            lines += ["", f"P50 TTFT at light load: {floor:.2f} s (the lowest arm's median at {lowest:.2f} req/s). No "
                      f"request starts sooner than alone, so where {base} misses the {s['slo_s']:g} s SLO the "
                      f"smallest P50 ratio to {base} any scheduler could reach is about "
                      + ", ".join(f"{floor / p50:.2f} at {rate:.2f} req/s" for rate, p50 in past) + "."]
    return lines


def last_record(path: Path) -> dict:
    """The last record of a results file."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise SystemExit(f"{path}: no record")
    return json.loads(lines[-1])


def merge(records: list[dict]) -> dict:
    """One record of several runs that differ only in their time scales (a sweep split into runs one after the
    other): the runs together, the time scales in order, every run's date and machine kept; the scheduler's counters
    are the last run's. Raises ValueError when anything else in their setups differs, or when two runs share a time
    scale."""
    first, seen = records[0]["setup"], set()
    for rec in records:
        diff = sorted(k for k in set(first) | set(rec["setup"])
                      if k != "time_scales" and first.get(k) != rec["setup"].get(k))
        if diff:
            raise ValueError(f"runs differ in {diff}; only time scales may")
        shared = seen & set(rec["setup"]["time_scales"])
        if shared:
            raise ValueError(f"time scales {sorted(shared)} are in more than one run")
        seen |= set(rec["setup"]["time_scales"])
    setup = {**first, "time_scales": sorted({t for rec in records for t in rec["setup"]["time_scales"]})}
    return {"setup": setup, "device": records[0]["device"], "date": records[0]["date"],
            "runs": [run for rec in records for run in rec["runs"]],
            "merged_from": [{"date": rec["date"], "device": rec["device"],
                             "time_scales": rec["setup"]["time_scales"]} for rec in records],
            "multiqueue_stats_at_end": records[-1].get("multiqueue_stats_at_end")}


if __name__ == "__main__":
    main()
