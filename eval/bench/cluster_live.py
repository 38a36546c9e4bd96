"""Many instances, live: CPU workers with the plugin behind SGLang's router smg, our LoRA-aware placement (and with
MELL's live KV balancing on top, arm `mell`) against smg's own `cache_aware` and `round_robin` policies on the same
workers. Not here: the cluster (sgl_multilora/gateway/launch.py, app.py; sgl_multilora/cluster/placement.py,
balance.py).

`--workers` workers (the embedded model, `--radix-cache-backend multilora`: the unified pool of
`--max-total-tokens` slots holds adapters and KV) start once and stay up; each arm restarts only the front (smg
with the arm's policy; for `lora_aware`, smg's consistent_hashing behind our gateway). Every worker serves the same
random PEFT adapters, named and ranked as the workloads' (more adapters than one worker's pool holds with its KV).
Each repeat replays every workload on every arm, the arm order rotating per repeat, on flushed caches. Per replay:
TTFT (mean, P50, P99), prompt tokens served from cache (the prefix-hit rate the workers report per request), failed
requests, and from the workers' `/multilora/stats`: KV and adapter evictions and adapter loads during the replay
(overflow events: what the pools had to drop to take new work). For the gateway's arms, the moves it made by kind,
and for `mell` the most workers its packing used at once (the rest an elastic deployment would stop). The report
gives the median (min-max) over repeats and per-repeat ratios to `lora_aware`.

Usage: .venv/bin/python -m eval.bench.cluster_live [--workers 3] [--workloads chatbot,agent] [--repeats 3]
           [--out eval/results/cluster_live/cluster_live.jsonl]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import requests
from tqdm import tqdm

from eval.bench.results import median_range, run_record, save
from eval.live.adapters import make_adapters
from eval.live.driver import ServedAdapter, Target, replay
from eval.live.ttft import replay_summary
from eval.workloads import create_workload
from sgl_multilora.gateway.launch import Cluster
from sgl_multilora.server import cpu_server_args

REPO = Path(__file__).resolve().parents[2]
ARMS = ("lora_aware", "mell", "cache_aware", "round_robin")
GATEWAY_ARMS = {"lora_aware": [], "mell": ["--balancer", "mell"]}  # arm -> our gateway's arguments
WORKLOAD_PARAMS = {  # small enough for 3 CPU workers on 2 cores; adapters shared by both (same names and ranks)
    "chatbot": {"num_conversations": 8, "num_adapters": 12, "ranks": (16, 32), "mean_new_tokens": 40,
                "mean_output_tokens": 10, "think_time_s": 3.0, "conversation_rate": 0.5, "mean_turns": 3,
                "system_tokens": 64},
    "agent": {"num_sessions": 6, "num_adapters": 12, "ranks": (16, 32), "session_rate": 0.5, "min_turns": 3,
              "max_turns": 5, "scene_tokens": 256, "mean_new_tokens": 30, "mean_output_tokens": 10,
              "tool_time_s": 2.0},
}


def pool_counters(urls: list[str]) -> dict:
    """Evictions and loads so far, summed over the workers (unified pool's swapper and the tree)."""
    total = {"kv_evicted_tokens": 0, "adapter_evictions": 0, "adapter_loads": 0}
    for url in urls:
        stats = requests.get(url + "/multilora/stats", timeout=60).json()
        swapper = (((stats.get("memory") or [{}])[0] or {}).get("unified_pool") or {}).get("swapper") or {}
        tree = (stats.get("schedulers") or [{}])[0] or {}
        # with the unified pool the swapper evicts (KV slots by run); else the tree does
        total["kv_evicted_tokens"] += int(swapper.get("kv_evicted_slots", tree.get("num_evicted_tokens", 0)))
        total["adapter_evictions"] += int(swapper.get("adapter_evictions", 0))
        total["adapter_loads"] += int(swapper.get("adapter_loads", 0)) + int(swapper.get("prefetches", 0))
    return total


def measure(cluster: Cluster, arm: str, name: str, workload, served, results_path: Path, repeat: int) -> dict:
    for url in cluster.worker_urls:
        requests.post(url + "/flush_cache", headers=cluster.admin_headers, timeout=60).raise_for_status()
    before = pool_counters(cluster.worker_urls)
    load = os.getloadavg()[0]
    results = replay(workload, [Target(arm, cluster.url)], results_path, name, served, timeout_s=900)
    after = pool_counters(cluster.worker_urls)
    row = {"arm": arm, "workload": name, "repeat": repeat, "load_avg": load, **replay_summary(results),
           **{k: after[k] - before[k] for k in after}}
    if arm in GATEWAY_ARMS:
        view = requests.get(cluster.url + "/cluster/stats", timeout=60).json()
        row["placement"], row["migrations"] = view["placement"], view["migrations"]
        if view.get("balancer"):
            row["balancer"] = view["balancer"]
            row["peak_workers_in_use"] = view["balancer"]["peak_workers_in_use"]
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--workloads", default="chatbot,agent")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-total-tokens", type=int, default=3000, help="each worker's pool (token slots)")
    parser.add_argument("--max-loras-per-batch", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "eval/results/cluster_live/cluster_live.jsonl")
    args = parser.parse_args(argv)

    from sgl_multilora.embedded import ensure_embedded_model

    model = str(ensure_embedded_model())
    names, arms = args.workloads.split(","), args.arms.split(",")
    workloads = {n: create_workload(n, seed=args.seed, **WORKLOAD_PARAMS[n]) for n in names}
    first = workloads[names[0]]
    adapters_dir = make_adapters(model, first, REPO / ".cache" / "cluster_live_adapters")
    served = [ServedAdapter(a.name) for a in first.adapters]
    max_rank = max(a.rank for a in first.adapters)
    worker_args = ["--model-path", model, *cpu_server_args(args.max_total_tokens),
                   "--multilora-adapter-dir", str(adapters_dir), "--max-loras-per-batch",
                   str(args.max_loras_per_batch), "--max-lora-rank", str(max_rank),
                   "--radix-cache-backend", "multilora"]
    log_dir = REPO / ".cache" / "bench_logs" / "cluster_live"
    results_path = args.out.with_name(args.out.stem + "_requests.jsonl")
    results_path.unlink(missing_ok=True)
    load_start = list(os.getloadavg())
    rows = []
    total = args.repeats * len(names) * len(arms)
    first_policy = "lora_aware" if arms[0] in GATEWAY_ARMS else arms[0]
    with Cluster(args.workers, worker_args, policy=first_policy, log_dir=log_dir,
                 gateway_args=GATEWAY_ARMS.get(arms[0], [])) as cluster, \
            tqdm(total=total, desc="replays", unit="replay") as bar:
        for rep in range(args.repeats):
            order = arms[rep % len(arms):] + arms[:rep % len(arms)]  # every arm takes every position
            for arm in order:
                policy = "lora_aware" if arm in GATEWAY_ARMS else arm
                gateway_args = GATEWAY_ARMS.get(arm, [])
                if cluster.policy != policy or cluster.gateway_args != gateway_args:
                    cluster.gateway_args = gateway_args
                    cluster.set_policy(policy)  # a fresh front per arm (the workers stay)
                elif arm in GATEWAY_ARMS:
                    cluster.set_policy(policy)  # the gateway's counters start at zero
                time.sleep(1.0)
                for name in names:
                    rows.append(measure(cluster, arm, name, workloads[name], served, results_path, rep))
                    r = rows[-1]
                    bar.write(f"rep {rep} {arm:12s} {name:8s} mean TTFT {r.get('mean_ttft_s', float('nan')):.2f} s "
                              f"P99 {r.get('p99_ttft_s', float('nan')):.2f} s cached "
                              f"{r.get('cached_token_share', 0):.0%} failed {r['num_failed']} KV evicted "
                              f"{r['kv_evicted_tokens']} adapter loads {r['adapter_loads']}")
                    bar.update(1)
    setup = {"workers": args.workers, "arms": arms, "workloads": {n: WORKLOAD_PARAMS[n] for n in names},
                  "max_total_tokens": args.max_total_tokens, "max_loras_per_batch": args.max_loras_per_batch,
                  "repeats": args.repeats, "seed": args.seed, "adapters": len(first.adapters),
                  "worker_args": worker_args[2:], "router": "smg 1.13.0",
                  "protocol": "workers up for the whole run; per arm the front restarts; caches flushed per "
                              "replay; arm order rotating per repeat"}
    record = run_record(setup, rows, load_start)
    save(args.out, record, report)



METRICS = (("mean TTFT s", "mean_ttft_s", "{:.2f}"), ("P99 TTFT s", "p99_ttft_s", "{:.2f}"),
           ("prompt tokens from cache", "cached_token_share", "{:.0%}"),
           ("KV tokens evicted", "kv_evicted_tokens", "{:.0f}"), ("adapter loads", "adapter_loads", "{:.0f}"),
           ("failed", "num_failed", "{:.0f}"), ("most workers in use (mell's packing)", "peak_workers_in_use", "{:.0f}"))


def report(record: dict) -> str:
    s, rows = record["setup"], record["rows"]
    by = {(r["workload"], r["arm"], r["repeat"]): r for r in rows}
    reps = sorted({r["repeat"] for r in rows})
    lines = [f"# {s['workers']} CPU workers behind smg: LoRA-aware placement vs smg's policies "
             f"({record['date'][:10]})", "",
             f"Each worker: the embedded model, `--radix-cache-backend multilora` (unified pool of "
             f"{s['max_total_tokens']} slots for adapters and KV), {s['adapters']} random PEFT adapters. "
             f"{s['repeats']} repeats; {s['protocol']}. Machine: {record['device']}.", ""]
    for workload in s["workloads"]:
        lines += [f"## {workload}", "", "| metric | " + " | ".join(s["arms"]) + " | per-repeat ratio to lora_aware |",
                  "|---|" + "---:|" * len(s["arms"]) + "---|"]
        for label, key, fmt in METRICS:
            cells = [median_range([by[(workload, a, r)].get(key) for r in reps if (workload, a, r) in by], fmt)
                     for a in s["arms"]]
            ratios = []
            for a in s["arms"][1:]:
                per = [by[(workload, a, r)].get(key) / by[(workload, "lora_aware", r)][key] for r in reps
                       if (workload, a, r) in by and by.get((workload, "lora_aware", r), {}).get(key)
                       and by[(workload, a, r)].get(key) is not None]
                if per:
                    ratios.append(f"{a} {median_range(per)}")
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {'; '.join(ratios) or '-'} |")
        lines.append("")
        placements = [by[(workload, "lora_aware", r)].get("placement") for r in reps
                      if (workload, "lora_aware", r) in by]
        if placements and placements[-1]:
            p = placements[-1]
            lines += [f"Placement (last repeat): routed per worker {p['routed']}, affinity {p['affinity']}, "
                      f"balanced {p['balanced']}, replica moves {p['moves']}; adapters on 2+ workers: "
                      f"{sum(len(w) > 1 for w in p['workers_of'].values())} of {len(p['workers_of'])}.", ""]
        for arm in (a for a in s["arms"] if a in GATEWAY_ARMS):
            moved = [by[(workload, arm, r)].get("migrations") for r in reps if (workload, arm, r) in by]
            if moved and moved[-1] is not None:
                lines.append(f"Moves by the gateway, {arm} (per repeat): {moved}.")
            bal = [by[(workload, arm, r)].get("balancer") for r in reps if (workload, arm, r) in by]
            if bal and bal[-1]:
                b = bal[-1]
                lines.append(f"MELL's packing ({arm}, last repeat): capacity {b['capacity_tokens']} tokens per worker, "
                             f"{b['operations']} operations, {b['planned_moves']} planned moves, "
                             f"{b['moves_started']} started, {b['dropped_moves']} dropped, overcommitted "
                             f"{b['overcommitted']}, unit moves per operation {b['unit_moves_per_op']}.")
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
