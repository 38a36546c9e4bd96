"""Simulate any workload (eval/workloads) on any arms and write `RequestResult` JSON lines (simulated).
Not here: the ELORA-style sweep and its report (`compare.py`).

Usage: .venv/bin/python -m eval.sim.run --workload agent --arms vllm,ours:elora [--param num_sessions=40 ...]
       [--seed 0] [--out eval/results/sim_run/sim_agent.jsonl]
The records carry what eval/live/report.py reads (request_rate, kind, hits, invalid_kv_share, memory_bytes), so
`python -m eval.live.report <out>` tables and plots them. Arm names: eval/sim/systems/__init__.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm

from eval.sim.compare import annotate_for_report, rounded
from eval.sim.engine import SimRun, simulate
from eval.sim.systems.request import ALORA_INVOCATION_TOKENS
from eval.workloads import create_workload


def run(workload_name: str, arms: list[str], params: dict, seed: int = 0) -> list[SimRun]:
    """Generates the workload once and simulates each arm on it; records are annotated for eval/live/report.py."""
    w = create_workload(workload_name, seed=seed, **params)
    rate = len(w.requests) / w.duration_s if w.duration_s > 0 else 0.0
    kinds = {r.rid: r.tags.get("kind", "lora" if r.adapter else "base") for r in w.requests}
    invocation = int(w.params.get("invocation_tokens", ALORA_INVOCATION_TOKENS))
    runs = []
    for arm in tqdm(arms, desc=f"simulating {workload_name}", unit="arm"):
        sim = simulate(arm, w.adapters, w.requests, experiment=f"sim_{workload_name}",
                       alora_invocation_tokens=invocation)
        annotate_for_report(sim, rate, kinds)
        runs.append(sim)
    return runs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", required=True)
    ap.add_argument("--arms", default="vllm,slora,sglang,ours:elora")
    ap.add_argument("--param", action="append", default=[], help="NAME=VALUE, a workload parameter")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="default: eval/results/sim_run/sim_<workload>.jsonl")
    args = ap.parse_args(argv)
    params = {}
    for item in args.param:
        if "=" not in item:
            ap.error(f"--param needs NAME=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        params[key] = value
    runs = run(args.workload, args.arms.split(","), params, args.seed)
    out = Path(args.out or f"eval/results/sim_run/sim_{args.workload}.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for sim in runs:
            for res in sim.results:
                f.write(json.dumps(rounded(res.to_json())) + "\n")
    for sim in runs:
        s = sim.summary
        print(f"{sim.arm:24s} mean TTFT {s['ttft_mean_s']:.3f} s  KV hit {s['kv_hit_rate']:.3f}  "
              f"invalid KV {s['invalid_kv_share']:.3f}  (simulated)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
