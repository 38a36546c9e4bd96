"""Chameleon's scheduling comparison at GPU scale, simulated: the project's multi-queue scheduler against SGLang's
`fcfs` and `lpm` admission on Chameleon's heterogeneous workload, over rates up to past the knee and several seeds.
Lives here: the sweep, its setup and its result files. Not here: the figures' meaning and the report's text
(`sched_report.py`), the policies (`admission/`) or the workload (eval/workloads/heterogeneous.py).

Setup (fixed before any multi-queue result was seen; all figures simulated):
- workload: eval/workloads/heterogeneous.py with Chameleon's parameters: 100 adapters, ranks {8, 16, 32, 64, 128}
  (20 each, q/k/v/o), uniform rank popularity, Zipf(1.0) popularity within a rank (the paper gives no exponent),
  Poisson arrivals for `--window-s` seconds, prompt and output lengths of the Azure conversation trace (Splitwise's)
  unscaled: Chameleon scaled them down only to fit its A40, and the simulated H100 holds them (no length capped);
- system: one arm for every policy (`--system`, default `ours:chameleon`: our unified pool with Chameleon's cache
  score), so only admission differs; Llama-3-8B on one H100 (eval/sim/latency.py), SimConfig defaults;
  `--max-loras-per-batch N` gives the engine SGLang's cap on distinct adapters per batch (SGLang's default is 8;
  Chameleon's engine has none), and the multi-queue policies then count slots and squash for them as live;
- TTFT SLO, Chameleon's definition: 5 x the mean request execution time (E2E latency) on a lightly loaded system,
  measured here with fcfs at `--light-rate` (median over the seeds); the multi-queue quotas aim at it too;
- a policy *sustains* a rate when the median over seeds of its P99 TTFT is within the SLO; its *max rate under the
  SLO* is the highest swept rate up to which it sustains every swept rate (and, interpolated linearly in P99
  between that rate and the next, where P99 crosses the SLO). The headline compares at the highest rate fcfs
  sustains, and also at the next swept rate (just past fcfs's knee, as Chameleon's "high load" 9 RPS sits just
  past S-LoRA's 8.6).

Writes `<out>.jsonl` (one record per run: setup, device, date, summary with TTFT by request size and rank, the
scheduler's state for multiqueue) and `<out>.md` (sched_report.py); `--markdown-only` rewrites the .md.

Usage: .venv/bin/python -m eval.sim.sched_compare [--rates 2,6,...] [--seeds 0,1,2] [--window-s 180]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from eval.sim.compare import rounded
from eval.sim.engine import SimConfig, SimRun, simulate
from eval.sim.latency import LORA_COST_HELP, LORA_COSTS, LatencyModel
from eval.sim.memory import pool_bytes
from eval.sim.sched_report import markdown, slo_from_light
from eval.workloads.heterogeneous import HeterogeneousParams, generate

POLICIES = ("fcfs", "lpm", "multiqueue")
DEFAULT_RATES = (2.0, 6.0, 10.0, 13.0, 15.0, 16.0, 17.0, 18.0, 19.0, 20.0, 22.0, 25.0, 30.0)


def workload_params(rate: float, window_s: float) -> HeterogeneousParams:
    """Chameleon's heterogeneous mix at `rate` for `window_s` seconds, trace lengths unscaled."""
    return HeterogeneousParams(num_requests=max(1, round(rate * window_s)), num_adapters=100,
                               ranks=(8, 16, 32, 64, 128), zipf_s=1.0, rate=rate, length_scale=1.0,
                               max_prompt_tokens=8192, max_output_tokens=1024)


def _pcts(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    a = np.asarray(values)
    return {"n": len(a), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
            "mean": float(a.mean())}


def summarize(run: SimRun, tags: dict[str, dict], slo_s: float | None) -> dict:
    """The engine's summary plus P90 TTFT, mean E2E, the share of requests within the SLO and TTFT by request size
    (the workload's short / long tag) and by adapter rank."""
    ttft = [r.ttft_s for r in run.results]
    out = dict(run.summary)
    out["ttft_p90_s"] = float(np.percentile(ttft, 90))
    out["e2e_mean_s"] = float(np.mean([r.e2e_s for r in run.results]))
    out["within_slo"] = None if slo_s is None else float(np.mean([t <= slo_s for t in ttft]))
    groups: dict[str, list[float]] = {}
    for r in run.results:
        tag = tags[r.rid]
        groups.setdefault(f"size={tag['size']}", []).append(r.ttft_s)
        groups.setdefault(f"rank={tag['rank']}", []).append(r.ttft_s)
    out["ttft_by_group"] = {k: _pcts(v) for k, v in sorted(groups.items())}
    return out


def sched_state(run: SimRun) -> dict | None:
    """The multi-queue scheduler's state at the end of a run (None for the other policies)."""
    adm = run.admission
    if adm is None or not adm.name.startswith("multiqueue"):
        return None
    s = adm.mq.stats()
    return {"num_queues": len(s.queues), "cutoffs": list(s.cutoffs), "quota_tokens": [q.quota_tokens for q in s.queues],
            "min_tokens": [q.min_tokens for q in s.queues], "quotas_feasible": s.quotas_feasible, "counts": s.counts, "num_passes": adm.num_passes,
            "num_requeued": adm.num_requeued, "predictor": dataclasses.asdict(s.predictor)}


def run_one(rate: float, seed: int, policy: str, args: argparse.Namespace, slo_s: float | None,
            lat: LatencyModel, kind: str = "sweep") -> dict:
    params = workload_params(rate, args.window_s)
    w = generate(params, seed)
    config = SimConfig(admission=policy, ttft_slo_s=slo_s or SimConfig.ttft_slo_s,
                       max_loras_per_batch=args.max_loras_per_batch, slot_squash_share=args.slot_squash_share,
                       max_slot_squashes=args.max_slot_squashes)
    start = time.perf_counter()
    run = simulate(args.system, w.adapters, w.requests, experiment="sim_chameleon", lat=lat, config=config)
    wall = time.perf_counter() - start
    if len(run.results) != len(w.requests):
        raise RuntimeError(f"{policy} at {rate} req/s, seed {seed}: {len(run.results)} of {len(w.requests)} "
                           "requests finished")
    return {
        "kind": kind,
        "setup": {"workload": "heterogeneous", "params": dataclasses.asdict(params), "seed": seed, "rate": rate,
                  "policy": policy, "system": args.system, "window_s": args.window_s,
                  "sim_config": dataclasses.asdict(config), "ttft_slo_s": slo_s,
                  "pool_slots": pool_bytes(lat) // lat.model.kv_bytes_per_token},
        "device": lat.device, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(), "sim_wall_s": round(wall, 2),
        "request_rate": len(w.requests) / max(1e-9, w.duration_s),
        "summary": rounded(summarize(run, {r.rid: r.tags for r in w.requests}, slo_s)),
        "sched": rounded(sched_state(run)),
    }


def run_all(args: argparse.Namespace) -> list[dict]:
    """The light-load runs first (they set the SLO), then every (rate, seed, policy)."""
    lat = LatencyModel(lora_cost=args.lora_cost)
    light = [run_one(args.light_rate, seed, "fcfs", args, None, lat, kind="light")
             for seed in tqdm(args.seeds, desc="light load (SLO)", unit="run")]
    slo_s = slo_from_light(light)
    jobs = [(rate, seed, policy) for rate in args.rates for seed in args.seeds for policy in args.policies]
    records = light
    for rate, seed, policy in tqdm(jobs, desc="simulating", unit="run"):
        records.append(run_one(rate, seed, policy, args, slo_s, lat))
    return records


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=list(DEFAULT_RATES))
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2, 3, 4])
    ap.add_argument("--window-s", type=float, default=180.0, help="seconds of arrivals per run")
    ap.add_argument("--light-rate", type=float, default=1.0, help="the lightly loaded rate that sets the SLO")
    ap.add_argument("--system", default="ours:chameleon", help="the simulated system every policy runs on")
    ap.add_argument("--max-loras-per-batch", type=int, default=None,
                    help="SGLang's cap on distinct adapters per batch, every policy alike (default: none)")
    ap.add_argument("--slot-squash-share", type=float, default=SimConfig.slot_squash_share,
                    help="multiqueue's --multilora-slot-squash-share (with a cap)")
    ap.add_argument("--max-slot-squashes", type=int, default=SimConfig.max_slot_squashes,
                    help="multiqueue's --multilora-max-slot-squashes (with a cap)")
    ap.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES),
                    help=f"comma-separated, fcfs first (default: {','.join(POLICIES)})")
    ap.add_argument("--lora-cost", choices=LORA_COSTS, default="measured", help=LORA_COST_HELP)
    ap.add_argument("--out", default="eval/results/sim_chameleon/sim_chameleon")
    ap.add_argument("--markdown-only", action="store_true", help="rewrite <out>.md from <out>.jsonl")
    args = ap.parse_args(argv)
    unknown = [p for p in args.policies if p not in POLICIES]
    if unknown or not args.policies or args.policies[0] != "fcfs":
        ap.error(f"--policies: fcfs first, then any of {', '.join(POLICIES[1:])} (got {','.join(args.policies)})")
    if args.max_slot_squashes < 0:
        ap.error(f"--max-slot-squashes: a non-negative integer (got {args.max_slot_squashes})")
    out = Path(args.out)
    if args.markdown_only:
        with open(f"{out}.jsonl") as f:
            records = [json.loads(line) for line in f]
    else:
        records = run_all(args)
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{out}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    if {r["setup"]["policy"] for r in records if r["kind"] == "sweep"} != set(POLICIES):
        print(f"wrote {out}.jsonl; the report ({out}.md) compares every policy: run without --policies for it")
        return
    argv = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--markdown-only"]
    md = markdown(records, command=" ".join([".venv/bin/python -m eval.sim.sched_compare", *argv]))
    Path(f"{out}.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
