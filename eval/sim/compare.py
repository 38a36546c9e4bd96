"""The ELORA-style experiment, simulated: chatbot conversations on Llama-3-8B / one H100, our tree + unified
pool with each policy against vLLM-, S-LoRA- and stock-SGLang-like baselines, plus ELORA's ablations.
Lives here: the sweep and its result files. Not here: the report's text (`compare_report.py`,
`findings.py`).

Writes (all figures simulated):
- `<out>_runs.jsonl`: one record per (adapter count, rate, arm): setup, summary, memory by kind every 5 s;
- `<out>.jsonl`: `RequestResult` lines of the main arms at the highest rate ours sustains (first seed), for
  eval/live/report.py (extra: request_rate, kind, hits, invalid_kv_share, memory_bytes at memory_t_s);
- `<out>.md`: the tables, our figures beside ELORA's published ones and the conclusions computed
  from the runs (`compare_report.py`, `findings.py`); `<out>.png`: mean TTFT against the rate per arm (median
  over the seeds, their range as a band); `--markdown-only` rewrites both from `<out>_runs.jsonl`.

Ours and its ablations have ELORA's host KV tier (sgl_multilora/host_tier.py, `--host-kv-gb`, default 128 GB),
and so does `sglang:hicache` (stock SGLang with its hierarchical cache, the same budget); the arm
`ours:elora:no-host-kv` (swept at every rate) is ours without it. `--host-kv-gb 0` turns the tier off in every
arm.

Usage: .venv/bin/python -m eval.sim.compare [--num-adapters 20,100] [--rates 4,8,12,16] [--seeds 0,1,2]
       [--out PREFIX]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from eval.sim.compare_report import markdown, plot
from eval.sim.engine import SimConfig, SimRun, simulate
from eval.sim.findings import by_setting, peak_rate
from eval.sim.hostkv import HOST_KV_BYTES
from eval.sim.latency import LORA_COST_HELP, LORA_COSTS, LatencyModel
from eval.sim.memory import pool_bytes
from eval.workloads.chatbot import ChatbotParams, generate
from eval.workloads.records import AdapterInfo

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAIN_ARMS = ("vllm", "slora", "sglang", "ours:elora")
SWEEP_ARMS = ("ours:elora:no-host-kv", "sglang:hicache")
"""Run at every rate like the main arms (ours without the tier; stock SGLang with HiCache on the same host
budget), not written to <out>.jsonl."""
ABLATION_ARMS = ("ours:lru", "ours:chameleon", "ours:elora:no-tree", "ours:elora:-lora_count",
                 "ours:elora:-cost", "ours:elora:-visit", "ours:elora:-recency", "ours:elora:tau=10",
                 "ours:elora:tau=60", "ours:elora:no-prefetch", "ours:elora:host-kv=32")


def workload(num_adapters: int, rate: float, args: argparse.Namespace, seed: int = 0):
    """The chatbot workload (eval/workloads/chatbot.py, seeded by `seed`) at `rate` new conversations
    per second for `args.window_s` seconds, its adapters targeting every linear layer."""
    params = ChatbotParams(num_conversations=max(1, round(rate * args.window_s)), num_adapters=num_adapters,
                           conversation_rate=rate, think_time_s=args.think_time_s,
                           mean_turns=args.mean_turns, mean_new_tokens=args.mean_new_tokens)
    w = generate(params, seed=seed)
    adapters = tuple(AdapterInfo(a.name, a.rank, a.kind, ALL_LINEAR) for a in w.adapters)
    return w, params, adapters


def annotate_for_report(run: SimRun, rate_rps: float, kinds: dict[str, str], memory_period_s: float = 5.0) -> None:
    """Adds the extras eval/live/report.py reads to each record; the memory sample (by kind) goes on
    the first request submitted after each `memory_period_s`, enough for memory-over-time plots."""
    times = [s["t_s"] for s in run.samples]
    next_memory = 0.0
    for r in sorted(run.results, key=lambda r: r.extra["submit_s"]):
        r.extra.update({
            "request_rate": rate_rps, "kind": kinds.get(r.rid, "lora"),
            "hits": {"kv": r.cached_tokens / r.prompt_tokens,
                     "adapter": float(r.extra["adapter_was_resident"])},
            "invalid_kv_share": run.summary["invalid_kv_share"],
        })
        if r.extra["submit_s"] >= next_memory:
            i = max(0, int(np.searchsorted(times, r.extra["submit_s"], side="right")) - 1)
            s = run.samples[i]
            r.extra["memory_t_s"] = s["t_s"]
            r.extra["memory_bytes"] = {k: s[k] for k in ("adapter", "kv_cached", "kv_running", "in_flight",
                                                          "free")}
            next_memory = s["t_s"] + memory_period_s


def rounded(x):
    """JSON-ready copy with floats rounded to microseconds / 6 decimals (keeps the results file small)."""
    if isinstance(x, float):
        return round(x, 6)
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [rounded(v) for v in x]
    return x


def run_all(args: argparse.Namespace) -> tuple[list[dict], list]:
    lat = LatencyModel(lora_cost=args.lora_cost)
    jobs = []
    for seed in args.seeds:
        for n in args.num_adapters:
            for rate in args.rates:
                arms = MAIN_ARMS + SWEEP_ARMS + (ABLATION_ARMS if rate in args.ablation_rates else ())
                jobs += [(seed, n, rate, arm) for arm in arms]
    records, request_runs = [], {}
    cache = {}
    for seed, n, rate, arm in tqdm(jobs, desc="simulating", unit="run"):
        if (seed, n, rate) not in cache:
            cache = {(seed, n, rate): workload(n, rate, args, seed)}
        w, params, adapters = cache[(seed, n, rate)]
        start = time.perf_counter()
        run = simulate(arm, adapters, w.requests, experiment=f"sim_elora_{n}lora", lat=lat,
                       config=SimConfig(host_kv_bytes=host_kv_bytes(args)))
        wall = time.perf_counter() - start
        rate_rps = len(w.requests) / max(1e-9, w.duration_s)
        records.append({
            "setup": {"workload": "chatbot", "params": dataclasses.asdict(params), "seed": seed,
                      "num_adapters": n, "conversation_rate": rate, "arm": arm, "target_modules": ALL_LINEAR,
                      "pool_bytes": pool_bytes(lat), "pool_slots": pool_bytes(lat) // lat.model.kv_bytes_per_token,
                      "slot_bytes": lat.model.kv_bytes_per_token, "host_kv_bytes": host_kv_bytes(args)},
            "device": lat.device,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "host": platform.node(), "sim_wall_s": round(wall, 2), "request_rate": rate_rps,
            "summary": rounded(run.summary),
            "memory_samples": rounded([s for i, s in enumerate(run.samples) if i % 5 == 0]),
        })
        if arm in MAIN_ARMS and n == args.num_adapters[0] and seed == args.seeds[0]:
            kinds = {r.rid: r.tags.get("kind", "lora") for r in w.requests}
            annotate_for_report(run, rate_rps, kinds)
            request_runs[(n, rate, arm)] = run.results
    return records, request_runs


def host_kv_bytes(args: argparse.Namespace) -> int:
    """Host KV pool of the arms with a host tier (unless the arm's own suffix says otherwise)."""
    gb = getattr(args, "host_kv_gb", None)
    return HOST_KV_BYTES if gb is None else int(gb * 1e9)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--num-adapters", type=lambda s: [int(x) for x in s.split(",")], default=[20, 100])
    ap.add_argument("--rates", type=floats, default=[4.0, 8.0, 12.0, 14.0, 16.0])
    ap.add_argument("--ablation-rates", type=floats, default=[12.0, 14.0])
    ap.add_argument("--window-s", type=float, default=60.0)
    ap.add_argument("--think-time-s", type=float, default=10.0)
    ap.add_argument("--mean-turns", type=float, default=5.0)
    ap.add_argument("--mean-new-tokens", type=float, default=200.0)
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2],
                    help="workload seeds, each a full sweep; the report gives medians over them and "
                         "each reduction's range")
    ap.add_argument("--host-kv-gb", type=float, default=None,
                    help=f"host KV pool of ours and its ablations, GB (default {HOST_KV_BYTES / 1e9:g}; 0: off)")
    ap.add_argument("--lora-cost", choices=LORA_COSTS, default="measured", help=LORA_COST_HELP)
    ap.add_argument("--out", default="eval/results/sim_elora/sim_elora")
    ap.add_argument("--markdown-only", action="store_true",
                    help="rewrite <out>.md from an earlier run's <out>_runs.jsonl (same sweep arguments)")
    args = ap.parse_args(argv)
    args.ablation_rates = [r for r in args.ablation_rates if r in args.rates] or sorted(args.rates)[-2:]
    out = Path(args.out)
    args.plot_name = f"{out.name}.png"
    if args.markdown_only:
        records = [json.loads(line) for line in open(f"{out}_runs.jsonl")]
        Path(f"{out}.md").write_text(markdown(records, args, host_kv_bytes(args)) + "\n")
        plot(records, args, f"{out}.png")
        print(f"rewrote {out}.md and {out}.png from {out}_runs.jsonl")
        return
    records, request_runs = run_all(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{out}_runs.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    s = by_setting(records)
    with open(f"{out}.jsonl", "w") as f:
        n = args.num_adapters[0]
        rate = peak_rate(s, n, args.rates, "ours:elora") or min(args.rates)
        for arm in MAIN_ARMS:
            for res in request_runs[(n, rate, arm)]:
                f.write(json.dumps(rounded(res.to_json())) + "\n")
    md = markdown(records, args, host_kv_bytes(args))
    Path(f"{out}.md").write_text(md + "\n")
    plot(records, args, f"{out}.png")
    print(md)


if __name__ == "__main__":
    main()
