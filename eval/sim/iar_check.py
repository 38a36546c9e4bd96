"""The planner's cache model (sgl_multilora/planner.py) against a simulated LoRA-server cache.

The cache: M adapter slots kept across global batches, least recently used evicted first. Each global batch draws
LB requests from the popularity p (i.i.d.); a request is immediately admissible when its adapter is resident, or when
a slot can take it at once: fewer than M distinct adapters are pinned by this batch's admitted requests (a slot
holding an adapter this batch does not use is evicted for it). Otherwise it waits. The measured immediate admissibility
rate is admissible / all requests over `--batches` batches after `--warm-up`; the model's IAR(M) is Eq 2-4.

Usage: .venv/bin/python -m eval.sim.iar_check [--adapters 512] [--zipf 1.2] [--global-batch 1024]
           [--capacities 64,128,192,256,320] [--batches 300] [--out eval/results/planner/iar_check.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
from tqdm import tqdm

from sgl_multilora import planner

REPO = Path(__file__).resolve().parents[2]


def simulate(p: np.ndarray, lb: int, m: int, batches: int, warm_up: int, seed: int) -> float:
    """Measured immediate admissibility rate of the cache above (module docstring)."""
    rng = np.random.default_rng(seed)
    cache: OrderedDict[int, None] = OrderedDict()  # least recently used first
    admitted = total = 0
    for b in range(warm_up + batches):
        pinned: set[int] = set()
        ok = 0
        for a in rng.choice(len(p), size=lb, p=p).tolist():
            if a in cache:
                cache.move_to_end(a)
                pinned.add(a)
                ok += 1
            elif len(pinned) < m:
                if len(cache) >= m:  # evict the least recently used adapter this batch does not pin
                    victim = next(x for x in cache if x not in pinned)
                    del cache[victim]
                cache[a] = None
                pinned.add(a)
                ok += 1
        if b >= warm_up:
            admitted += ok
            total += lb
    return admitted / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=512)
    parser.add_argument("--zipf", type=float, default=1.2)
    parser.add_argument("--global-batch", type=int, default=1024)
    parser.add_argument("--capacities", default="64,128,192,256,320")
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--warm-up", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "eval/results/planner/iar_check.md")
    args = parser.parse_args()
    p = planner.zipf_popularity(args.adapters, args.zipf)
    rows = []
    for m in tqdm([int(x) for x in args.capacities.split(",")], desc="capacities", unit="M"):
        model, tau = planner.iar(p, args.global_batch, m)
        measured = simulate(p, args.global_batch, m, args.batches, args.warm_up, args.seed)
        rows.append((m, model, tau, measured))
    lines = [f"# The planner's IAR against a simulated cache: Zipf({args.zipf}) over {args.adapters} adapters, global "
             f"batch {args.global_batch}", "",
             f"{datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}, {os.cpu_count()} CPUs. Command: "
             f"`.venv/bin/python -m eval.sim.iar_check --adapters {args.adapters} --zipf {args.zipf} --global-batch "
             f"{args.global_batch} --capacities {args.capacities} --batches {args.batches} --warm-up {args.warm_up} "
             f"--seed {args.seed}`. Model: {planner.TAU_CONVENTION}. Simulated: an LRU cache of M slots over "
             f"{args.batches} batches after {args.warm_up} of warm-up (eval/sim/iar_check.py).", "",
             "| M | model IAR | tau | simulated | model - simulated |", "|---:|---:|---:|---:|---:|"]
    for m, model, tau, measured in rows:
        lines.append(f"| {m} | {model:.4f} | {tau} | {measured:.4f} | {model - measured:+.4f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
