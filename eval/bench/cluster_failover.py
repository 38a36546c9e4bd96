"""A worker crashes mid-run, live: requests lost behind our gateway (which moves a failed worker's requests to the
others) against smg alone with its `cache_aware` policy, on the same CPU workers.
Not here: the cluster (sgl_multilora/cluster/), the moves (carry.py), the workload (cluster_live.py's chatbot).

Per repeat and arm (the order alternating per repeat): the front restarts with the arm's policy on flushed caches,
cluster_live's chatbot workload replays, and `--kill-at` seconds into the replay worker 0 is killed (SIGKILL of its
process group: a crash, not a drain). After the replay the worker is started again and the front restarted, so every
replay begins with every worker up. Per replay: requests failed, TTFT mean and P99 over the requests that
succeeded, and for the gateway the requests it moved off the dead worker. Medians (min-max) over repeats.

Usage: .venv/bin/python -m eval.bench.cluster_failover [--workers 3] [--repeats 3] [--kill-at 30]
           [--out eval/results/cluster_failover/cluster_failover.jsonl]
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from pathlib import Path

import requests
from tqdm import tqdm

from eval.bench.cluster_live import WORKLOAD_PARAMS
from eval.bench.results import median_range, run_record, save
from eval.live.adapters import make_adapters
from eval.live.driver import ServedAdapter, Target, replay
from eval.live.ttft import replay_summary
from eval.workloads import create_workload
from sgl_multilora.gateway.launch import Cluster
from sgl_multilora.server import cpu_server_args

REPO = Path(__file__).resolve().parents[2]
ARMS = ("lora_aware", "cache_aware")
VICTIM = 0


def kill(cluster: Cluster, index: int, killed: list) -> None:
    try:
        os.killpg(cluster.workers[index].process.pid, signal.SIGKILL)
        killed.append(True)
    except ProcessLookupError:
        killed.append(False)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kill-at", type=float, default=30.0, help="seconds into each replay")
    parser.add_argument("--max-total-tokens", type=int, default=3000, help="each worker's pool (token slots)")
    parser.add_argument("--max-loras-per-batch", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "eval/results/cluster_failover/cluster_failover.jsonl")
    args = parser.parse_args(argv)

    from sgl_multilora.embedded import ensure_embedded_model

    model = str(ensure_embedded_model())
    workload = create_workload("chatbot", seed=args.seed, **WORKLOAD_PARAMS["chatbot"])
    adapters_dir = make_adapters(model, workload, REPO / ".cache" / "cluster_live_adapters")
    served = [ServedAdapter(a.name) for a in workload.adapters]
    worker_args = ["--model-path", model, *cpu_server_args(args.max_total_tokens),
                   "--multilora-adapter-dir", str(adapters_dir), "--max-loras-per-batch",
                   str(args.max_loras_per_batch), "--max-lora-rank", str(max(a.rank for a in workload.adapters)),
                   "--radix-cache-backend", "multilora"]
    results_path = args.out.with_name(args.out.stem + "_requests.jsonl")
    results_path.unlink(missing_ok=True)
    load_start = list(os.getloadavg())
    rows = []
    with Cluster(args.workers, worker_args, policy=ARMS[0], log_dir=REPO / ".cache/bench_logs/cluster_failover") \
            as cluster, tqdm(total=args.repeats * len(ARMS), desc="replays", unit="replay") as bar:
        for rep in range(args.repeats):
            for arm in (ARMS if rep % 2 == 0 else ARMS[::-1]):
                if not cluster.workers[VICTIM].alive():
                    cluster.restart_worker(VICTIM)
                cluster.set_policy(arm)  # every replay starts with every worker up and a fresh front
                for url in cluster.worker_urls:
                    requests.post(url + "/flush_cache", headers=cluster.admin_headers,
                                  timeout=60).raise_for_status()
                killed: list[bool] = []
                timer = threading.Timer(args.kill_at, kill, (cluster, VICTIM, killed))
                load = os.getloadavg()[0]
                timer.start()
                try:
                    results = replay(workload, [Target(arm, cluster.url)], results_path, f"chatbot-{arm}-{rep}",
                                     served, timeout_s=900)
                finally:
                    timer.cancel()
                row = {"arm": arm, "repeat": rep, "load_avg": load, "killed": bool(killed and killed[0]),
                       "num_requests": len(results), **replay_summary(results)}
                if arm == "lora_aware":
                    view = requests.get(cluster.url + "/cluster/stats", timeout=60).json()
                    row.update(moves=view["migrations"], down=view["down"])
                rows.append(row)
                bar.write(f"rep {rep} {arm:11s} failed {row['num_failed']} of {row.get('num_requests', '?')}, "
                          f"mean TTFT {row.get('mean_ttft_s', float('nan')):.2f} s, moves {row.get('moves', '-')}")
                bar.update(1)
    setup = {"workers": args.workers, "arms": list(ARMS), "kill_at_s": args.kill_at, "victim": VICTIM,
                  "workload": {"chatbot": WORKLOAD_PARAMS["chatbot"]}, "repeats": args.repeats, "seed": args.seed,
                  "max_total_tokens": args.max_total_tokens, "worker_args": worker_args[2:], "router": "smg 1.13.0",
                  "protocol": "per replay: front restarted with the arm's policy, caches flushed, worker 0 killed "
                              "(SIGKILL) at kill_at_s, restarted after the replay; arm order alternating per repeat"}
    record = run_record(setup, rows, load_start)
    save(args.out, record, report)



def report(record: dict) -> str:
    s, rows = record["setup"], record["rows"]
    lines = [f"# A worker crashes mid-run: our gateway vs smg alone ({record['date'][:10]})", "",
             (f"{s['workers']} CPU workers, cluster_live's chatbot workload; worker {s['victim']} killed {s['kill_at_s']:.0f} s "
              f"into every replay; {s['repeats']} repeats; {s['protocol']}. Machine: {record['device']}."), "",
             "| arm | requests | failed | mean TTFT s (succeeded) | P99 TTFT s | moves by the gateway |",
             "|---|---:|---:|---:|---:|---|"]
    for arm in s["arms"]:
        rs = [r for r in rows if r["arm"] == arm]
        moves = [r.get("moves") for r in rs if r.get("moves") is not None]
        lines.append(f"| {arm} | {median_range([r.get('num_requests') for r in rs], '{:.0f}')} | "
                     f"{median_range([r['num_failed'] for r in rs], '{:.0f}')} | "
                     f"{median_range([r.get('mean_ttft_s') for r in rs])} | {median_range([r.get('p99_ttft_s') for r in rs])} | "
                     f"{'; '.join(str(m) for m in moves) if moves else '-'} |")
    lines += ["", ("TTFT covers the requests that succeeded, so the arms' TTFTs are not comparable: smg alone drops the "
                   "failed requests' work, which lightens the load on the rest, while the gateway finishes every request "
                   "on the two workers left (recomputing the moved ones). Compare failures."),
              "", "Per repeat: " + "; ".join(f"rep {r['repeat']} {r['arm']}: failed {r['num_failed']}, killed "
                                            f"{r['killed']}" for r in rows)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
