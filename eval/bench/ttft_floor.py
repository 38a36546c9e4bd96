"""What no scheduler or memory system can beat: each request of a workload served alone, its adapter warm.

The unified-memory benchmark (`unified_memory.py`) compares mean and P99 TTFT under load against ELORA's goal (at
most half and a quarter of stock's). Part of every TTFT is not queueing at all: the request's own prefill and
first decode step. This replays a workload's requests one at a time on a live server of one of that benchmark's
arms (same flags, same adapters, same budget): before each request, a 1-token request of the same adapter makes
the adapter resident and bound to a batch slot; then the request runs alone on a flushed cache. Its TTFT is then a
floor for that request under any admission order and any memory policy on this build and machine: the mean of the
floors bounds every arm's mean TTFT from below (up to timing noise), whatever the load.

`--compare` takes the records of `unified_memory.py` runs (same workload, seed and arm flags) and sets, per rate,
half of the best stock arm's mean TTFT (ELORA's goal for ours) beside the floor: where the floor is above it, the
goal cannot be met on this machine at that rate.

Usage: .venv/bin/python -m eval.bench.ttft_floor --workload translation --param num_requests=60
           --param length_scale=0.1 --seed 0 --compare eval/results/unified_memory_translation_fixedrate_seed0.jsonl
           --out eval/results/ttft_floor_translation_seed0.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

from tqdm import tqdm

from eval.bench.results import nearest_rank, save
from eval.bench.unified_memory import CACHE, arm_spec, flush, make_adapters, workload_from_args
from eval.live.driver import ServedAdapter, Target, replay
from sgl_multilora.server import cpu_server_args, launch

REPO = Path(__file__).resolve().parents[2]


def alone(workload, request, **changes):
    """A workload of one request (arriving at 0), optionally changed."""
    return dataclasses.replace(workload, requests=(dataclasses.replace(request, arrival_s=0.0, **changes),))


def floors(workload, url: str, served: list[ServedAdapter], log: Path) -> list[dict]:
    """Each request alone, after a warm-up request of its adapter; one row per request."""
    rows = []
    for r in tqdm(workload.requests, desc="requests alone"):
        flush(url)
        warm = alone(workload, r, rid=f"warm-{r.rid}", session=f"warm-{r.rid}", new_tokens=4, output_tokens=1,
                     prompt_text=None, shared_prefix=None, shared_prefix_tokens=0)
        replay(warm, [Target("warm", url)], log, "warm", served, timeout_s=300)
        [res] = replay(alone(workload, r), [Target("alone", url)], log, "alone", served, timeout_s=300)
        rows.append({"rid": r.rid, "adapter": r.adapter, "prompt_tokens": res.prompt_tokens,
                     "cached_tokens": res.cached_tokens, "ttft_s": res.ttft_s, "error": res.error})
    return rows


def compare_lines(floor_rows: list[dict], records: list[dict]) -> list[str]:
    """Per rate of the given unified_memory records: the best stock arm's mean TTFT, half of it, the floor."""
    ok = [r["ttft_s"] for r in floor_rows if r["ttft_s"] is not None]
    floor = statistics.fmean(ok)
    lines = ["| record | rate (req/s) | best stock arm: mean TTFT s (median over repeats) | half of it (the goal) | "
             "floor: mean TTFT alone s | ours-mq mean TTFT s |", "|---|---|---|---|---|---|"]
    for name, rec in records:
        rates = sorted({round(run["rate_req_s"], 2) for run in rec["runs"]})
        for rate in rates:
            by_arm: dict[str, list[float]] = {}
            for run in rec["runs"]:
                if round(run["rate_req_s"], 2) == rate and "mean_ttft_s" in run:
                    by_arm.setdefault(run["arm"], []).append(run["mean_ttft_s"])
            stock = {a: statistics.median(v) for a, v in by_arm.items() if a.startswith("stock")}
            if not stock:
                continue
            best = min(stock, key=stock.get)
            ours = statistics.median(by_arm["ours-mq"]) if "ours-mq" in by_arm else float("nan")
            lines.append(f"| {name} | {rate:.2f} | {stock[best]:.2f} ({best}) | {stock[best] / 2:.2f} | {floor:.2f} | "
                         f"{ours:.2f} |")
    return lines


def report(record: dict) -> str:
    s = record["setup"]
    rows = record["floors"]
    ok = sorted(r["ttft_s"] for r in rows if r["ttft_s"] is not None)
    lines = [f"# TTFT floor: each request alone, its adapter warm ({record['date'][:10]})", "",
             f"Workload `{s['workload']}` {s['params']}, seed {s['seed']}, {len(rows)} requests, arm `{s['arm']}` "
             f"(flags {s['arm_flags']}, {s['max_total_tokens']} KV token slots). Machine: {record['device']}.", "",
             f"Alone: mean TTFT {statistics.fmean(ok):.3f} s, P50 {nearest_rank(ok, 50):.3f} s, P99 "
             f"{nearest_rank(ok, 99):.3f} s, max {ok[-1]:.3f} s; failed {sum(r['ttft_s'] is None for r in rows)}.",
             ""]
    if record.get("compare"):
        lines += ["Against the load runs (`unified_memory.py`) of the same workload and seed:", "",
                  *record["compare"], "",
                  "Where the floor is above half the best stock arm's mean, no arm can meet ELORA's mean-TTFT goal "
                  "at that rate on this machine: the floor is each request's own work with nothing queued ahead.",
                  ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="translation", choices=["chatbot", "translation"])
    parser.add_argument("--num-adapters", type=int, default=24)
    parser.add_argument("--ranks", default="16,32,64")
    parser.add_argument("--pool-tokens", type=int, default=6000)
    parser.add_argument("--max-loras-per-batch", type=int, default=4)
    parser.add_argument("--arm", default="stock",
                        help="whose flags and KV budget, an arm name of unified_memory.py (stock, stock-cap6, ours, "
                        "...); alone, the scheduler does not act")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--param", action="append", default=[], help="workload parameter NAME=VALUE")
    parser.add_argument("--compare", type=Path, action="append", default=[],
                        help="a unified_memory.py record (.jsonl, its last line) of the same workload and seed")
    parser.add_argument("--out", type=Path, default=REPO / "eval/results/ttft_floor.jsonl")
    args = parser.parse_args()

    model, workload, ranks, params = workload_from_args(args)
    if any(r.parent_rid is not None for r in workload.requests):
        raise SystemExit(f"{args.workload}: requests with a history (a parent) have no TTFT alone without their "
                         "parent's KV; this benchmark takes workloads of single turns (translation)")
    adapters_dir = make_adapters(model, workload, CACHE / f"{args.workload}-{args.num_adapters}-{args.ranks}")
    max_rank = max(ranks)
    try:  # the arm's flags and KV budget exactly as unified_memory.py gives them
        tokens, own = arm_spec(args.arm, argparse.Namespace(**vars(args), policy="elora", slo_s=2.0, drain_wait_s=2.0),
                               workload, max_rank)
    except ValueError as exc:
        parser.error(str(exc))
    flags = ["--multilora-adapter-dir", str(adapters_dir), "--max-lora-rank", str(max_rank), *own]
    log_dir = REPO / ".cache" / "bench_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    server = launch(model, [*cpu_server_args(max_total_tokens=tokens), *flags],
                    log_path=log_dir / f"ttft_floor_{args.arm}.log")
    try:
        device = {"processor": platform.processor(), "cpu_count": os.cpu_count(),
                  "python": platform.python_version(), "load_avg_start": list(os.getloadavg())}
        served = [ServedAdapter(a.name) for a in workload.adapters]
        with tempfile.TemporaryDirectory() as tmp:
            rows = floors(workload, server.url, served, Path(tmp) / "requests.jsonl")
        device["load_avg_end"] = list(os.getloadavg())
    finally:
        server.stop()
    compared = [(p.name, json.loads(p.read_text().strip().splitlines()[-1])) for p in args.compare]
    record = {"setup": {"workload": args.workload, "params": {k: list(v) if isinstance(v, tuple) else v
                                                            for k, v in params.items()},
                        "seed": args.seed, "arm": args.arm, "arm_flags": flags[2:], "max_total_tokens": tokens,
                        "pool_tokens": args.pool_tokens, "max_loras_per_batch": args.max_loras_per_batch},
              "device": device, "date": datetime.datetime.now(datetime.UTC).isoformat(), "floors": rows,
              "compare": compare_lines(rows, compared) if compared else None}
    save(args.out, record, report)


if __name__ == "__main__":
    main()
