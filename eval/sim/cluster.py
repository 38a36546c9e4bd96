"""MELL's instance-count experiment, simulated: the Azure conversation trace on identical instances,
MELL's packing (sgl_multilora/cluster/) against best-fit, worst-fit and a Llumnix-like balancer.

Lives here: the workload (the trace scaled to a cluster size), the epoch loop, the baselines' reserve
sweep, the result files and the conclusion computed from them. Not here: the packers.

Time model (simulated; every figure in the results follows from it):
- an instance is one model replica whose KV pool holds `--capacity-tokens` (16,384: LLaMA-2-7B fp16
  at 0.5 MiB/token in the ~8 GiB an RTX 4090 keeps after weights, about what LLaMA-13B leaves on an
  A100-40GB);
- a decode step takes `--step-ms` (40 ms) on every instance whatever its batch, and every running
  request gains one KV token per step; prefill is instantaneous at admission (ContextTokens of KV);
  a request decodes GeneratedTokens steps, then frees its KV;
- the scheduler runs every `--epoch-steps` steps (10, i.e. 0.4 s): the epoch's arrivals are admitted
  at its end and its departures, updates and arrivals reach the packer as one batch. Sizes given to
  the packer are planned ones, the KV a request holds at the end of the next epoch (now + epoch
  steps: the final length is unknown, paper F2); migrations complete at the epoch boundary
  (instantaneous, as the paper's bounds assume);
- overflow: an instance holding more actual KV than its capacity at some step (a finished request's
  KV is free from its last step on, although the packer hears of it at the next boundary).
Workload at scale N: the trace's rows and inter-arrival gaps in trace order, replayed in a loop (each
pass from a seeded offset), time-compressed so that an ideal fractional packing of the actual KV
needs N instances at peak ("ideal"); arrivals for `--window-steps` steps, then the cluster drains.
Instances needed = peak active instances: MELL as it runs (it never overflows); each baseline at its
best reserve (share of C an arrival must leave free): `--reserves` ascending up to the first without
overflow, refined by 0.01 below it, the fewest instances among the runs without overflow.

Usage: .venv/bin/python -m eval.sim.cluster [--instances 8,16,32,64] [--seeds 0,1,2]
       [--out eval/results/sim_mell/sim_mell] [--markdown-only]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import heapq
import json
import math
import platform
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from sgl_multilora.cluster import MigrationCostModel, create_packer

DATA = Path(__file__).resolve().parents[1] / "data" / "azure_conv_2023_first2000.csv"
POLICIES = ("mell", "best-fit", "worst-fit", "llumnix")
BASELINES = POLICIES[1:]
PAPER_BEST_REDUCTION = 0.31
"""MELL's largest reported GPU saving (its abstract: 9% to 31%), quoted for comparison only."""


@dataclass(frozen=True)
class TimeModel:
    capacity_tokens: int = 16_384
    step_s: float = 0.04
    epoch_steps: int = 10
    window_steps: int = 3000


@dataclass(frozen=True)
class Workload:
    arrive: np.ndarray  # admission step (a multiple of epoch_steps)
    ctx: np.ndarray
    gen: np.ndarray
    rate_scale: float  # trace seconds per simulated second
    num_dropped: int  # trace rows whose KV would not fit one instance


def load_trace() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gaps to the next arrival (s; the last one the mean), ContextTokens, GeneratedTokens."""
    with open(DATA) as f:
        rows = list(csv.DictReader(f))
    t = np.array([datetime.datetime.fromisoformat(r["TIMESTAMP"][:26]).timestamp() for r in rows])
    gaps = np.diff(t, append=t[-1] + (t[-1] - t[0]) / (len(t) - 1))
    return gaps, np.array([int(r["ContextTokens"]) for r in rows]), \
        np.array([int(r["GeneratedTokens"]) for r in rows])


def build_workload(trace, rate_scale: float, seed: int, tm: TimeModel) -> Workload:
    gaps, ctx, gen = trace
    rng = np.random.default_rng(seed)
    horizon = tm.window_steps * tm.step_s * rate_scale  # in trace seconds
    passes = [np.roll(np.arange(len(gaps)), -int(rng.integers(len(gaps))))
              for _ in range(int(horizon // gaps.sum()) + 1)]
    idx = np.concatenate(passes)
    t = np.concatenate([[0.0], np.cumsum(gaps[idx])[:-1]])
    idx, t = idx[t < horizon], t[t < horizon]
    epoch_s = tm.epoch_steps * tm.step_s
    arrive = (np.ceil(t / rate_scale / epoch_s) * tm.epoch_steps).astype(np.int64)
    fits = ctx[idx] + gen[idx] + tm.epoch_steps <= tm.capacity_tokens
    return Workload(arrive[fits], ctx[idx][fits], gen[idx][fits], rate_scale, int((~fits).sum()))


def fluid_peak_tokens(w: Workload) -> int:
    """Peak over steps of the actual KV of all running requests (request i holds ctx + s - arrive
    at steps arrive..arrive+gen)."""
    end = w.arrive + w.gen + 1
    size = int(end.max()) + 1
    d0, d1 = np.zeros(size), np.zeros(size)
    np.add.at(d0, w.arrive, w.ctx - w.arrive)
    np.add.at(d0, end, -(w.ctx - w.arrive))
    np.add.at(d1, w.arrive, 1)
    np.add.at(d1, end, -1)
    return int((np.cumsum(d0) + np.arange(size) * np.cumsum(d1)).max())


def calibrate(trace, num_instances: int, seed: int, tm: TimeModel) -> Workload:
    """The workload whose ideal packing needs `num_instances` at peak (bisection on the rate)."""
    lo, hi = 0.01, 1000.0
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        peak = fluid_peak_tokens(build_workload(trace, mid, seed, tm)) / tm.capacity_tokens
        lo, hi = (lo, mid) if peak > num_instances - 0.5 else (mid, hi)
    return build_workload(trace, lo, seed, tm)


class SlotMap:
    """Instance id -> GPU slot: a new instance takes the lowest free slot; machine = slot // 8
    (the cost model's `instances_per_machine`). Only the KV-vs-recompute kinds depend on it."""

    def __init__(self, per_machine: int) -> None:
        self.per_machine = per_machine
        self.slot: dict[int, int] = {}
        self._free: list[int] = []

    def machine(self, iid: int) -> int:
        if iid not in self.slot:
            self.slot[iid] = heapq.heappop(self._free) if self._free else len(self.slot)
        return self.slot[iid] // self.per_machine

    def sync(self, alive: dict[int, int]) -> None:
        for iid in [i for i in self.slot if i not in alive]:
            heapq.heappush(self._free, self.slot.pop(iid))
        for iid in alive:
            self.machine(iid)


def simulate(policy: str, w: Workload, tm: TimeModel, reserve: float = 0.0, check: bool = False) -> dict:
    """Runs the trace through one packer; `check` also verifies the packer's invariants and that the
    caller's view built from placements and migrations matches the packer at every epoch."""
    C, E = tm.capacity_tokens, tm.epoch_steps
    cost = MigrationCostModel(epoch_s=E * tm.step_s)
    slots = SlotMap(cost.instances_per_machine)
    kwargs = {} if policy == "mell" else {"reserve_fraction": reserve}
    packer = create_packer(policy, C, cost=cost, machine_of=slots.machine, **kwargs)
    arrive, ctx, gen = w.arrive, w.ctx, w.gen
    order = np.argsort(arrive, kind="stable")
    finishing: list[tuple[int, int]] = []
    inst: dict[int, int] = {}
    kinds: Counter[str] = Counter()
    peak = overflow_steps = overflow_tokens = max_epoch_migrations = moves_before = moved_tokens = 0
    inst_sum = util_sum = 0.0
    epochs, ptr, t = 0, 0, 0
    while ptr < len(order) or inst:
        departs = []
        while finishing and finishing[0][0] <= t:
            departs.append(heapq.heappop(finishing)[1])
        updates = {rid: int(ctx[rid] + t - arrive[rid] + E) for rid in inst if rid not in departs}
        allocs = {}
        while ptr < len(order) and arrive[order[ptr]] <= t:
            rid = int(order[ptr])
            allocs[rid] = int(ctx[rid]) + E
            heapq.heappush(finishing, (int(arrive[rid] + gen[rid]), rid))
            ptr += 1
        res = packer.apply_batch(departs, updates, allocs)
        for rid in departs:
            del inst[rid]
        inst.update(res.placements)
        for m in res.migrations:
            assert inst[m.rid] == m.src, f"migration of {m.rid} from {m.src}, caller has {inst[m.rid]}"
            inst[m.rid] = m.dst
            kinds[m.kind] += 1
            kinds["over_budget"] += m.over_budget
            moved_tokens += m.kv_tokens
        slots.sync(packer.instances())
        moves_before += res.num_moves_before
        max_epoch_migrations = max(max_epoch_migrations, len(res.migrations))
        if check:
            packer.check_invariants()
            assert inst == {rid: packer.instance_of(rid) for rid in inst}, "caller view diverged"
        num = packer.num_instances
        peak = max(peak, num)
        if inst:
            rids = np.fromiter(inst, dtype=np.int64, count=len(inst))
            _, where = np.unique(np.fromiter(inst.values(), dtype=np.int64, count=len(inst)),
                                 return_inverse=True)
            age = t - arrive[rids]
            for k in range(1, E + 1):
                kv = np.where(age + k <= gen[rids], ctx[rids] + age + k, 0)
                load = np.bincount(where, weights=kv, minlength=num)
                overflow_steps += int((load > C).sum())
                overflow_tokens = max(overflow_tokens, int(load.max()) - C)
                if k == 1:
                    util_sum += float(load.sum()) / (num * C)
            inst_sum += num
            epochs += 1
        t += E
    stats = packer.op_stats
    num_migrations = kinds["kv"] + kinds["recompute"]
    return {"policy": policy, "reserve_fraction": reserve, "instances_peak": peak,
            "instances_mean": inst_sum / max(1, epochs), "memory_util_mean": util_sum / max(1, epochs),
            "overflow_steps": overflow_steps, "overflow_tokens_max": max(0, overflow_tokens),
            "migrations": num_migrations, "migrations_per_s": num_migrations / (t * tm.step_s),
            "migrated_gb_per_s": moved_tokens * cost.kv_bytes_per_token / 1e9 / (t * tm.step_s),
            "migrations_per_epoch_max": max_epoch_migrations, "request_moves_before_batching": moves_before,
            "migration_kinds": dict(kinds), "num_ops": stats.num_ops,
            "unit_moves_per_op_mean": stats.unit_moves / max(1, stats.num_ops),
            "unit_moves_per_op_max": stats.max_unit_moves,
            "request_moves_per_op_mean": stats.request_moves / max(1, stats.num_ops),
            "rebalance_moves_max": packer.settle_stats.max_unit_moves, "sim_steps": t,
            "max_moves_per_op": getattr(packer, "max_moves_per_op", None)}


def needed(policy: str, w: Workload, tm: TimeModel, reserves: list[float], check: bool) -> dict:
    """MELL as it runs. A baseline: reserves on the grid in ascending order up to the first without
    overflow, then every 0.01 between the last one that overflowed and it; the run without overflow
    with the fewest instances counts (`instances_needed` None if every reserve overflows)."""
    if policy == "mell":
        run = simulate(policy, w, tm, check=check)
        return {**run, "instances_needed": run["instances_peak"] if not run["overflow_steps"] else None}
    runs = []
    for i, h in enumerate(reserves):
        runs.append(simulate(policy, w, tm, h, check))
        if not runs[-1]["overflow_steps"]:
            if i:
                fine = np.arange(reserves[i - 1] + 0.01, h - 0.005, 0.01)
                runs += [simulate(policy, w, tm, round(float(x), 2), check) for x in fine]
            break
    sweep = [{k: r[k] for k in ("reserve_fraction", "instances_peak", "overflow_steps")} for r in runs]
    clean = [r for r in runs if not r["overflow_steps"]]
    best = min(clean, key=lambda r: (r["instances_peak"], r["reserve_fraction"])) if clean else runs[-1]
    return {**best, "instances_needed": best["instances_peak"] if clean else None, "sweep": sweep}


def run_all(args: argparse.Namespace, command: str = "") -> list[dict]:
    tm = TimeModel(args.capacity_tokens, args.step_ms / 1000, args.epoch_steps, args.window_steps)
    trace = load_trace()
    jobs = [(n, s) for n in args.instances for s in args.seeds]
    records = []
    bar = tqdm(total=len(jobs) * len(args.policies), desc="simulating", unit="run")
    for n, seed in jobs:
        w = calibrate(trace, n, seed, tm)
        setup = {"scale_instances": n, "seed": seed, **asdict(tm), "rate_scale": w.rate_scale,
                 "num_requests": len(w.arrive), "num_dropped": w.num_dropped,
                 "arrival_rate_rps": w.rate_scale * len(trace[0]) / float(trace[0].sum()),
                 "ideal_instances": math.ceil(fluid_peak_tokens(w) / tm.capacity_tokens),
                 "reserves": args.reserves, "trace": DATA.name,
                 "cost_model": asdict(MigrationCostModel(epoch_s=tm.epoch_steps * tm.step_s))}
        for policy in args.policies:
            bar.set_postfix_str(f"N={n} seed={seed} {policy}")
            start = time.perf_counter()
            result = needed(policy, w, tm, args.reserves, args.check)
            records.append({"setup": setup, **result, "simulated": True, "command": command,
                            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                            "machine": f"{platform.node()} ({platform.machine()}, "
                                       f"Python {platform.python_version()})",
                            "sim_wall_s": round(time.perf_counter() - start, 2)})
            bar.update()
    bar.close()
    return records


# ---- report: every figure below is computed from the records -------------------------------------


def outcomes(records: list[dict]) -> dict[tuple[int, int], dict]:
    """(scale, seed) -> instances needed per policy, the best baseline and MELL's change against it
    (mell / best - 1; None where either is missing)."""
    out: dict[tuple[int, int], dict] = {}
    for r in records:
        key = (r["setup"]["scale_instances"], r["setup"]["seed"])
        out.setdefault(key, {"ideal": r["setup"]["ideal_instances"], "needed": {}})
        out[key]["needed"][r["policy"]] = r["instances_needed"]
    for o in out.values():
        base = {p: o["needed"][p] for p in BASELINES if o["needed"].get(p) is not None}
        o["best"] = min(base, key=lambda p: (base[p], p)) if base else None
        mell = o["needed"].get("mell")
        o["change"] = mell / base[o["best"]] - 1 if mell is not None and base else None
        o["vs"] = {p: mell / n - 1 for p, n in base.items()} if mell is not None else {}
    return out


def _med(xs: list[float]) -> str:
    return "-" if not xs else f"{statistics.median(xs):g} [{min(xs):g}-{max(xs):g}]"


def _pct(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):+.1%} [{min(xs):+.1%}, {max(xs):+.1%}]"


def markdown(records: list[dict]) -> str:
    out = outcomes(records)
    scales = sorted({k[0] for k in out})
    s0, r0 = records[0]["setup"], records[0]
    command = f"`{r0['command']}`"
    lines = [
        "# MELL vs best-fit, worst-fit and Llumnix-like: instances needed (simulated)", "",
        (f"Simulated, not measured: {command} ({r0['date'][:10]}, {r0['machine']}). Trace: "
         f"{s0['trace']} replayed in a loop, time-compressed per scale. Instance KV capacity "
         f"{s0['capacity_tokens']} tokens; decode step {s0['step_s'] * 1000:g} ms on every instance; "
         f"scheduler epoch {s0['epoch_steps']} steps; arrivals for {s0['window_steps']} steps, then "
         "drain; migrations complete at the epoch boundary. Model and decisions: eval/sim/cluster.py "
         "and sgl_multilora/cluster/."), "",
        ("Scale N: the load at which an ideal fractional packing of the actual KV needs N instances "
         "at peak. Instances needed: peak active instances with no KV overflow at any step; each "
         "baseline at its best reserve (the share of C an arrival must leave free; grid "
         f"{s0['reserves']}, refined by 0.01), shown in parentheses. Median over seeds [min-max]."),
        "",
        "| N | ideal | MELL | best-fit | worst-fit | Llumnix-like | MELL vs best baseline |",
        "|---:|---:|---:|---:|---:|---:|---:|"]
    runs = {(r["setup"]["scale_instances"], r["setup"]["seed"], r["policy"]): r for r in records}
    for n in scales:
        keys = [k for k in out if k[0] == n]
        cells = [_med([out[k]["ideal"] for k in keys])]
        for p in POLICIES:
            if not any(p in out[k]["needed"] for k in keys):
                cells.append("not run")
                continue
            got = [out[k]["needed"].get(p) for k in keys]
            vals = [x for x in got if x is not None]
            cell = _med(vals) + ("" if len(vals) == len(got) else
                                  f" ({len(got) - len(vals)} overflow at every reserve)")
            if p != "mell" and vals:
                cell += f" ({_med([runs[(*k, p)]['reserve_fraction'] for k in keys])})"
            cells.append(cell)
        cells.append(_pct([out[k]["change"] for k in keys if out[k]["change"] is not None]))
        lines.append(f"| {n} | {' | '.join(cells)} |")
    lines += ["", ("At the configurations counted above (median over all runs; unit moves: max). A unit "
                   "move moves one item as the paper counts them (a multi-item of tiny requests once); "
                   "operations: every allocate, update and depart:"), "",
              ("| policy | KV used / active capacity | migrations / s | migrated KV (GB/s) | "
               "migrations / epoch (max) | unit moves / op (mean, max) | request moves / op (mean) "
               "| request moves removed by batching |"),
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for p in POLICIES:
        lines += _activity_row(p, [r for r in records if r["policy"] == p and r["instances_needed"]])
    kinds: Counter[str] = Counter()
    for r in records:
        if r["policy"] == "mell":
            kinds.update(r["migration_kinds"])
    over = kinds["over_budget"] / max(1, kinds["kv"] + kinds["recompute"])
    cm = s0["cost_model"]
    lines += ["", (f"MELL's migrations by kind (all runs): {kinds['kv']} KV transfers, "
                   f"{kinds['recompute']} token transfers + recompute; {kinds['over_budget']} of them "
                   f"({over:.0%}) beyond both per-epoch budgets of the cost model "
                   f"({cm['instances_per_machine']} instances per machine, "
                   f"{cm['intra_bytes_per_s'] / 1e9:g} GB/s inside one, "
                   f"{cm['inter_bytes_per_s'] * 8 / 1e9:g} Gbit/s between machines, "
                   f"{cm['recompute_tokens_per_epoch']} recompute tokens per instance and epoch, "
                   f"{cm['kv_bytes_per_token']} B of KV per token; sgl_multilora/cluster/cost.py); "
                   "an executor would defer those."),
              "", "## Conclusion (computed from the runs)", ""]
    changes = [o["change"] for o in out.values() if o["change"] is not None]
    return "\n".join(lines + conclusion(out, records, changes)) + "\n"


def _activity_row(policy: str, rs: list[dict]) -> list[str]:
    if not rs:
        return []
    removed = [1 - r["migrations"] / r["request_moves_before_batching"] for r in rs
               if r["request_moves_before_batching"]]
    per_op = (f"{statistics.median(r['unit_moves_per_op_mean'] for r in rs):.3f}, "
              f"{max(r['unit_moves_per_op_max'] for r in rs)}")
    if policy == "llumnix":
        per_op = f"none; rebalancing: up to {max(r['rebalance_moves_max'] for r in rs)} per epoch"
    cells = [f"{statistics.median(r['memory_util_mean'] for r in rs):.1%}",
             f"{statistics.median(r['migrations_per_s'] for r in rs):.2f}",
             f"{statistics.median(r['migrated_gb_per_s'] for r in rs):.2f}",
             f"{statistics.median(r['migrations_per_epoch_max'] for r in rs):g}", per_op,
             f"{statistics.median(r['request_moves_per_op_mean'] for r in rs):.3f}",
             f"{statistics.median(removed):.1%}" if removed else "-"]
    return [f"| {policy} | {' | '.join(cells)} |"]


def conclusion(out: dict, records: list[dict], changes: list[float]) -> list[str]:
    """The report's closing paragraphs, each chosen by the numbers it quotes."""
    if not changes:
        return ["No run has both MELL's and a baseline's instance count: nothing to compare."]
    med = statistics.median(changes)
    vs = {p: [o["vs"][p] for o in out.values() if p in o["vs"]] for p in BASELINES}
    against = ", ".join(f"{p} {_pct(v)}" for p, v in vs.items() if v)
    by_scale = ", ".join(
        f"N={n}: {statistics.median(c):+.1%}" for n in sorted({k[0] for k in out})
        if (c := [o["change"] for k, o in out.items() if k[0] == n and o["change"] is not None]))
    met = med <= -PAPER_BEST_REDUCTION
    goal = (f"The goal, at least the paper's best saving of -{PAPER_BEST_REDUCTION:.0%} against the "
            f"best baseline, is **{'met' if met else 'not met'}** in the median"
            + ("." if met else f" ({med:+.1%}); the paper reports -9% to -31% across its setups."))
    mell = [r for r in records if r["policy"] == "mell"]
    bound = max(r["unit_moves_per_op_max"] for r in mell)
    # no placement needs fewer instances than the ideal fractional packing of the same KV at its peak
    runs = [o for o in out.values() if o["change"] is not None]
    floor = [o["ideal"] / o["needed"][o["best"]] - 1 for o in runs]
    reached = [o["change"] / f for o, f in zip(runs, floor) if f < 0]
    limit = (f"No placement needs fewer instances than the ideal fractional packing (column `ideal`): against "
             f"the best baseline of each run the most any policy could save is {_pct(floor)} (median [min, max])"
             + (f"; MELL's saving is {statistics.median(reached):.0%} of that, in the median." if reached else "."))
    return [
        (f"Simulated: MELL needs **{med:+.1%}** instances against the best baseline of each run "
         f"(median of {len(changes)} runs; from {min(changes):+.1%} to {max(changes):+.1%}). "
         f"Against each baseline (median [min, max]): {against}. By scale: {by_scale}."), "", goal, "",
        limit, "",
        (f"MELL's largest number of unit moves in one operation: {bound} (bound "
         f"{mell[0]['max_moves_per_op']}); KV overflow in MELL's runs: "
         f"{sum(r['overflow_steps'] for r in mell)} instance-steps.")]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",")]

    ap.add_argument("--instances", type=ints, default=[8, 16, 32, 64])
    ap.add_argument("--seeds", type=ints, default=[0, 1, 2])
    ap.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES))
    ap.add_argument("--reserves", type=lambda s: [float(x) for x in s.split(",")],
                    default=[round(0.05 * i, 2) for i in range(13)])
    ap.add_argument("--capacity-tokens", type=int, default=TimeModel.capacity_tokens)
    ap.add_argument("--step-ms", type=float, default=TimeModel.step_s * 1000)
    ap.add_argument("--epoch-steps", type=int, default=TimeModel.epoch_steps)
    ap.add_argument("--window-steps", type=int, default=TimeModel.window_steps)
    ap.add_argument("--check", action="store_true", help="check every packer's invariants each epoch")
    ap.add_argument("--out", type=Path, default=Path("eval/results/sim_mell/sim_mell"))
    ap.add_argument("--markdown-only", action="store_true", help="rewrite <out>.md from <out>.jsonl")
    args = ap.parse_args(argv)
    if set(args.policies) - set(POLICIES) or "mell" not in args.policies:
        ap.error(f"--policies must include mell and only {', '.join(POLICIES)}")
    if args.markdown_only:
        records = [json.loads(x) for x in args.out.with_suffix(".jsonl").read_text().splitlines()]
    else:
        shown = sys.argv[1:] if argv is None else argv
        records = run_all(args, " ".join([".venv/bin/python -m eval.sim.cluster", *shown]))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out.with_suffix(".jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    md = markdown(records)
    args.out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
