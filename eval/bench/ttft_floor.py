"""What no scheduler or memory system can beat: each session of a workload served alone, its adapter warm.

The unified-memory benchmark (`unified_memory.py`) compares mean and P99 TTFT under load against ELORA's goal (at
most half and a quarter of stock's). Part of every TTFT is not queueing at all: the request's own prefill and
first decode step. This replays a workload's sessions one at a time on a live server of one of that benchmark's
arms (same flags, same adapters, same budget): before each session, a 1-token request of its adapter (carrying the
session's shared prefix, e.g. a chatbot's system prompt) makes the adapter resident and bound to a batch slot on a
flushed cache; then the session's turns run alone, each sent when the one before it has finished, so each finds its
whole history cached (a translation request is a session of one turn). A turn's TTFT is then a floor for that
request under any admission order and any memory policy on this build and machine, whatever the load: an arm's
mean TTFT is at least the mean of the floors, and its P99 (the same nearest rank over the same requests) at least
the floors' P99 (each request at least its floor, so every order statistic is too), up to timing noise.

`--compare` takes the records of `unified_memory.py` runs (same workload, seed and arm flags) and sets, per rate,
half of the best stock arm's mean TTFT and a quarter of its P99 (ELORA's goals for ours) beside the floors: where a
floor is above its goal, that goal cannot be met on this machine at that rate. Where a record's request log is kept
beside it, the same comparison runs on the pooled figures (every repeat's requests together, the benchmark's
headline), against the floors of every repeat's requests.

Usage: .venv/bin/python -m eval.bench.ttft_floor --workload translation --param num_requests=60
           --param length_scale=0.1 --seed 0 --compare eval/results/unified_memory/unified_memory_translation_tail_seed0.jsonl
           --out eval/results/ttft_floor/ttft_floor_translation_seed0.jsonl
       .venv/bin/python -m eval.bench.ttft_floor --workload chatbot --param num_conversations=20
           --param mean_new_tokens=150 --param mean_output_tokens=16 --param think_time_s=3
           --param conversation_rate=0.5 --arm ours-mq-cap8 --seed 1
           --compare eval/results/unified_memory/unified_memory_chatbot_host_seed1.jsonl
           --out eval/results/ttft_floor/ttft_floor_chatbot_seed1.jsonl
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
from eval.live.adapters import CACHE, make_adapters, workload_from_args
from eval.live.arms import arm_spec, flush, ordered_arms
from eval.live.driver import ServedAdapter, Target, replay
from eval.live.ttft import best_stock_pooled, request_ttfts
from sgl_multilora.server import cpu_server_args, launch

REPO = Path(__file__).resolve().parents[2]


def alone(workload, request, **changes):
    """A workload of one request (arriving at 0), optionally changed."""
    return dataclasses.replace(workload, requests=(dataclasses.replace(request, arrival_s=0.0, **changes),))


def chains(workload) -> list[list]:
    """The workload's sessions as chains of turns, each turn's parent the turn before it (a translation request is
    a chain of one). Raises SystemExit naming the first session that is not such a chain."""
    by_session: dict[str, list] = {}
    for r in workload.requests:
        by_session.setdefault(r.session, []).append(r)
    out = []
    for name, turns in by_session.items():
        for prev, r in zip([None, *turns], turns):
            if r.parent_rid != (prev.rid if prev else None):
                raise SystemExit(f"session {name}: request {r.rid} does not continue the turn before it "
                                 f"(parent {r.parent_rid}); ttft_floor replays sessions as chains of turns")
        out.append(turns)
    return out


def floors(workload, url: str, served: list[ServedAdapter], log: Path) -> list[dict]:
    """Each session alone, on a flushed cache, after a warm-up request of its adapter (with the session's shared
    prefix, which under load other sessions of that adapter keep cached); its turns one after another, each sent when
    the turn before it has finished, so each finds its whole history cached. One row per request."""
    rows = []
    with tqdm(total=len(workload.requests), desc="requests alone") as bar:
        for turns in chains(workload):
            first = turns[0]
            flush(url)
            warm = alone(workload, first, rid=f"warm-{first.rid}", session=f"warm-{first.rid}",
                         new_tokens=first.shared_prefix_tokens + 4, output_tokens=1, prompt_text=None,
                         alora_invocation=False)
            replay(warm, [Target("warm", url)], log, "warm", served, timeout_s=300)
            chain = dataclasses.replace(workload, requests=tuple(dataclasses.replace(r, arrival_s=0.0)
                                                                 for r in turns))
            for res in replay(chain, [Target("alone", url)], log, "alone", served, timeout_s=300):
                rows.append({"rid": res.rid, "adapter": res.adapter, "prompt_tokens": res.prompt_tokens,
                             "cached_tokens": res.cached_tokens, "ttft_s": res.ttft_s, "error": res.error})
                bar.update()
    return rows


def compare_lines(floor_rows: list[dict], records: list[dict]) -> list[str]:
    """Per rate of the given unified_memory records: the best stock arm's mean and P99 TTFT, half and a quarter of
    them (ELORA's goals), the floor's mean and P99, and every other arm's mean and P99 (medians over repeats)."""
    ok = [r["ttft_s"] for r in floor_rows if r["ttft_s"] is not None]
    floor_mean, floor_p99 = statistics.fmean(ok), nearest_rank(ok, 99)
    lines = ["| record | rate (req/s) | best stock arm | its mean TTFT s / half (the goal) | floor: mean alone s | "
             "its P99 TTFT s / a quarter (the goal) | floor: P99 alone s | other arms: mean / P99 s |",
             "|---|---|---|---|---|---|---|---|"]
    for name, rec in records:
        rates = sorted({round(run["rate_req_s"], 2) for run in rec["runs"]})
        for rate in rates:
            by_arm: dict[str, list[dict]] = {}
            for run in rec["runs"]:
                if round(run["rate_req_s"], 2) == rate and "mean_ttft_s" in run:
                    by_arm.setdefault(run["arm"], []).append(run)

            def med(arm, key):
                return statistics.median(run[key] for run in by_arm[arm])

            stock = [a for a in by_arm if a.startswith("stock")]
            if not stock:
                continue
            best = min(stock, key=lambda a: med(a, "mean_ttft_s"))
            mean, p99 = med(best, "mean_ttft_s"), med(best, "p99_ttft_s")
            others = "; ".join(f"{a} {med(a, 'mean_ttft_s'):.2f} / {med(a, 'p99_ttft_s'):.2f}"
                               for a in by_arm if not a.startswith("stock"))
            lines.append(f"| {name} | {rate:.2f} | {best} | {mean:.2f} / {mean / 2:.2f} | {floor_mean:.2f} | "
                         f"{p99:.2f} / {p99 / 4:.2f} | {floor_p99:.2f} | {others} |")
    return lines


def pooled_compare_lines(floor_rows: list[dict], logs: list[tuple[str, dict, int]]) -> list[str]:
    """The same comparison on the pooled figures (`unified_memory.py`'s headline: every repeat's requests together).
    `logs`: (record name, its request log's TTFTs by rate and arm as `request_ttfts` reads them, its repeats). The
    floor of the pooled set is the floors of every repeat's requests: its P99 is the same nearest rank over
    repeats x the floors, which a single request that is slow even alone (a long prompt) can set when it is one of the
    pooled set's slowest few in every repeat."""
    ok = [r["ttft_s"] for r in floor_rows if r["ttft_s"] is not None]
    floor_mean = statistics.fmean(ok)
    lines = ["| record | rate (req/s) | best stock arm (pooled) | its mean TTFT s / half (the goal) | floor: mean "
             "alone s | its P99 TTFT s / a quarter (the goal) | floor: P99 alone s (pooled) | other arms: mean / "
             "P99 s |", "|---|---|---|---|---|---|---|---|"]
    for name, ttfts, repeats in logs:
        floor_p99 = nearest_rank(ok * repeats, 99)
        for rate in sorted(ttfts):
            by_arm = ttfts[rate]
            best = best_stock_pooled(by_arm)
            if best is None:
                continue
            mean, p99 = statistics.fmean(by_arm[best]), nearest_rank(by_arm[best], 99)
            others = "; ".join(f"{a} {statistics.fmean(by_arm[a]):.2f} / {nearest_rank(by_arm[a], 99):.2f}"
                               for a in ordered_arms(by_arm) if not a.startswith("stock"))
            lines.append(f"| {name} | {rate:.2f} | {best} | {mean:.2f} / {mean / 2:.2f} | {floor_mean:.2f} | "
                         f"{p99:.2f} / {p99 / 4:.2f} | {floor_p99:.2f} | {others} |")
    return lines


def request_logs(paths: list[Path]) -> list[tuple[str, dict, int]]:
    """(file name, its request log's TTFTs, its repeats) of each unified_memory record whose request log
    (`<name>_requests.jsonl` beside it) is kept."""
    out = []
    for path, (name, record) in zip(paths, last_records(paths)):
        log = path.with_name(path.stem + "_requests.jsonl")
        if log.is_file():
            out.append((name, request_ttfts(log), record["setup"]["repeats"]))
    return out


def last_records(paths: list[Path]) -> list[tuple[str, dict]]:
    """(file name, its last record) of each .jsonl record file."""
    return [(p.name, json.loads(p.read_text().strip().splitlines()[-1])) for p in paths]


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
                  "The floor is each request's own work with nothing queued ahead and its whole history cached; "
                  "under load every request takes at least its floor, so an arm's mean is at least the floor's "
                  "mean and its P99 (the same nearest rank over the same requests) at least the floor's P99. "
                  "Where the floor is above half the best stock arm's mean (a quarter of its P99), no arm can meet "
                  "ELORA's mean (P99) goal at that rate on this machine.",
                  ""]
    if record.get("compare_pooled"):
        lines += ["Against the same runs' pooled figures (every repeat's requests together, the benchmark's "
                  "headline; the floor's P99 over the floors of every repeat's requests):", "",
                  *record["compare_pooled"], ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="translation", choices=["chatbot", "translation"])
    parser.add_argument("--num-adapters", type=int, default=24)
    parser.add_argument("--ranks", default="16,32,64")
    parser.add_argument("--pool-tokens", type=int, default=6000)
    parser.add_argument("--max-loras-per-batch", type=int, default=4)
    parser.add_argument("--arm", default="stock",
                        help="whose flags and KV budget, an arm name of eval/live/arms.py (stock, stock-cap6, ours, "
                        "...); alone, the scheduler does not act")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--param", action="append", default=[], help="workload parameter NAME=VALUE")
    parser.add_argument("--compare", type=Path, action="append", default=[],
                        help="a unified_memory.py record (.jsonl, its last line) of the same workload and seed")
    parser.add_argument("--out", type=Path, default=REPO / "eval/results/ttft_floor/ttft_floor.jsonl")
    parser.add_argument("--floors-from", type=Path,
                        help="a ttft_floor record (.jsonl, its last line) whose floors to set against the --compare "
                        "records again, without a server (its workload, seed and arm are kept; the others ignored)")
    args = parser.parse_args()
    if args.floors_from:
        [(_, earlier)] = last_records([args.floors_from])
        compared = last_records(args.compare)
        earlier["compare"] = compare_lines(earlier["floors"], compared) if compared else None
        logs = request_logs(args.compare)
        earlier["compare_pooled"] = pooled_compare_lines(earlier["floors"], logs) if logs else None
        save(args.out, earlier, report)
        return

    model, workload, ranks, params = workload_from_args(args)
    chains(workload)  # fails early, before a server starts, on a workload it cannot replay
    adapters_dir = make_adapters(model, workload, CACHE / f"{args.workload}-{args.num_adapters}-{args.ranks}")
    max_rank = max(ranks)
    try:  # the arm's flags and KV budget exactly as unified_memory.py's arm of that name has them
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
    compared = last_records(args.compare)
    record = {"setup": {"workload": args.workload, "params": {k: list(v) if isinstance(v, tuple) else v
                                                            for k, v in params.items()},
                        "seed": args.seed, "arm": args.arm, "arm_flags": flags[2:], "max_total_tokens": tokens,
                        "pool_tokens": args.pool_tokens, "max_loras_per_batch": args.max_loras_per_batch},
              "device": device, "date": datetime.datetime.now(datetime.UTC).isoformat(), "floors": rows,
              "compare": compare_lines(rows, compared) if compared else None}
    logs = request_logs(args.compare)
    record["compare_pooled"] = pooled_compare_lines(rows, logs) if logs else None
    save(args.out, record, report)


if __name__ == "__main__":
    main()
