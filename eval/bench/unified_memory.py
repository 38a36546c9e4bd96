"""Live CPU servers, same total memory: adapters and KV in one pool (ours) against SGLang's memory layout (stock).

Every arm serves the same random PEFT adapters (eval/live/adapters.py), named and ranked as the workload's, on the
embedded model. `--arms` names them in the arm grammar of eval/live/arms.py: `stock`, `ours`, `ours-mq` (the
multi-queue scheduler on top, TTFT SLO `--slo-s`) and their options (`-cap<N>`, `-hold<X>`, `-nomove`, `-host<GB>`,
`-drain`). Each side is compared at its own best setting: the headline takes, at each rate, the stock arm with
the lower median mean TTFT, whatever its cap or drainer.
Every arm's server starts once and stays up (idle ones sleep); every repeat replays the workload at every rate on each arm,
arms alternating in order, each replay on a flushed cache. A repeat of one arm at one rate gives mean / P50 / P99
TTFT; the report gives the median and spread (min, max) over repeats and the per-repeat ratios ours / stock, and
mean and P99 over every repeat's requests together (`--pooled-only` prints those from a committed request log): a
repeat's own P99 is one of its slowest few requests.

Next to the record and its report (`--out`, `.md`), the per-request log (`_requests.jsonl`) and the TTFT
distribution per rate and arm, every repeat pooled (`.png`; `--plot-only` redraws it from a committed request log).

Usage: .venv/bin/python -m eval.bench.unified_memory [--workload chatbot] [--time-scales 1,2] [--repeats 3]
           [--out eval/results/unified_memory/unified_memory.jsonl] [--plot-only] [--pooled-only]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import time
from pathlib import Path

import requests
from tqdm import tqdm

from eval.bench.results import nearest_rank, save
from eval.live.adapters import CACHE, ELEMS_PER_RANK, NUM_LAYERS, REPO, make_adapters, workload_from_args
from eval.live.arms import (
    arm_spec,
    flush,
    host_gb,
    no_kv_moves,
    ordered_arms,
    parse_arm,
    split_hold,
    stock_buffer_tokens,
)
from eval.live.driver import ServedAdapter, Target, replay
from eval.live.ttft import pooled_lines, replay_summary, request_ttfts
from sgl_multilora.server import cpu_server_args, launch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="chatbot", choices=["chatbot", "translation"])
    parser.add_argument("--num-adapters", type=int, default=24)
    parser.add_argument("--ranks", default="16,32,64")
    parser.add_argument("--pool-tokens", type=int, default=10000, help="token slots every arm gets in all")
    parser.add_argument("--max-loras-per-batch", type=int, default=4)
    parser.add_argument("--policy", default="elora")
    parser.add_argument("--time-scales", default="1,2", help="arrival compression factors (the rates)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--param", action="append", default=[], help="workload parameter NAME=VALUE")
    parser.add_argument("--server-args", default="",
                        help="more SGLang flags for every arm alike (e.g. '--lora-drain-wait-threshold 2')")
    parser.add_argument("--arms", default="ours,stock",
                        help="which arms to run (comma-separated): ours, ours-mq, stock, and any of them with "
                        "-drain appended")
    parser.add_argument("--drain-wait-s", type=float, default=2.0,
                        help="the -drain arms' --lora-drain-wait-threshold (seconds)")
    parser.add_argument("--slo-s", type=float, default=2.0, help="the ours-mq arm's --multilora-ttft-slo-s")
    parser.add_argument("--out", type=Path, default=REPO / "eval/results/unified_memory/unified_memory.jsonl")
    parser.add_argument("--plot-only", action="store_true",
                        help="only redraw the TTFT plot (.png next to --out) from its request log")
    parser.add_argument("--pooled-only", action="store_true",
                        help="only print every arm's mean and P99 TTFT over all repeats together, from the request "
                        "log next to --out")
    args = parser.parse_args()
    if args.pooled_only:
        print("\n".join(pooled_lines(request_ttfts(args.out.with_name(args.out.stem + "_requests.jsonl")))))
        return
    if args.plot_only:
        print(plot_ttft(args.out.with_name(args.out.stem + "_requests.jsonl"), args.out.with_suffix(".png")))
        return

    model, workload, ranks, params = workload_from_args(args)
    adapters_dir = make_adapters(model, workload, CACHE / f"{args.workload}-{args.num_adapters}-{args.ranks}")
    max_rank = max(ranks)
    buffer_tokens = stock_buffer_tokens(workload, args.max_loras_per_batch, max_rank)
    common = ["--multilora-adapter-dir", str(adapters_dir), "--max-lora-rank", str(max_rank),
              *shlex.split(args.server_args)]
    arms = {}
    for name in args.arms.split(","):
        try:
            arms[name] = arm_spec(name, args, workload, max_rank)
        except ValueError as exc:
            parser.error(str(exc))
    arms = {name: (tokens, [*common, *extra]) for name, (tokens, extra) in arms.items()}
    log_dir = REPO / ".cache" / "bench_logs"  # a log per output file and arm: a later run keeps this run's logs
    log_dir.mkdir(parents=True, exist_ok=True)
    servers = {}
    try:
        for name, (tokens, extra) in arms.items():
            servers[name] = launch(model, [*cpu_server_args(max_total_tokens=tokens), *extra],
                                   log_path=log_dir / f"{args.out.stem}_{name}.log")
        served = [ServedAdapter(a.name) for a in workload.adapters]
        scales = [float(s) for s in args.time_scales.split(",")]
        setup = {"workload": args.workload, "params": {k: list(v) if isinstance(v, tuple) else v
                                                       for k, v in params.items()},
                 "num_requests": len(workload.requests), "pool_tokens": args.pool_tokens,
                 "stock_kv_tokens": args.pool_tokens - buffer_tokens, "stock_buffer_tokens": buffer_tokens,
                 "max_loras_per_batch": args.max_loras_per_batch, "max_lora_rank": max_rank,
                 "policy": args.policy, "server_args": args.server_args, "time_scales": scales,
                 "arms": {name: extra[len(common):] for name, (_, extra) in arms.items()},
                 "arm_tokens": {name: tokens for name, (tokens, _) in arms.items()}, "slo_s": args.slo_s,
                 "repeats": args.repeats, "seed": args.seed,
                 "adapter_bytes_total": sum(NUM_LAYERS * a.rank * sum(ELEMS_PER_RANK[m] for m in a.target_modules)
                                            * 4 for a in workload.adapters)}
        device = {"processor": platform.processor(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
                  "load_avg_start": list(os.getloadavg())}
        runs = []
        raw = args.out.with_name(args.out.stem + "_requests.jsonl")
        raw.unlink(missing_ok=True)
        order = list(arms)
        with tqdm(total=args.repeats * len(scales) * len(order), desc="replays") as bar:
            for rep in range(args.repeats):
                for scale in scales:
                    for name in (order if rep % 2 == 0 else order[::-1]):
                        flush(servers[name].url)
                        time.sleep(1.0)
                        results = replay(workload, [Target(name, servers[name].url)], raw, f"rep{rep}", served,
                                         time_scale=scale, timeout_s=900)
                        pool = None
                        if name.startswith("ours"):
                            mem = requests.get(servers[name].url + "/multilora/stats", timeout=60).json()["memory"]
                            unified = mem[0].get("unified_pool", {})
                            pool = {**unified.get("swapper", {}),
                                    **{k: unified.get(k) for k in ("skipped_admissions", "starvation_holds",
                                                                   "budget_stops", "lora_batch_skips")}}
                            host = unified.get("host_tier") or {}
                            pool.update({f"host_{k}": host[k] for k in ("load_backs", "declined_load_backs")
                                         if k in host})
                            if mem[0].get("scheduler"):
                                pool["scheduler_counts"] = mem[0]["scheduler"]["counts"]
                        runs.append({"arm": name, "repeat": rep, "time_scale": scale,
                                     "rate_req_s": workload.offered_rate * scale, **replay_summary(results),
                                     "swapper": pool})
                        bar.update(1)
        device["load_avg_end"] = list(os.getloadavg())
        record = {"setup": setup, "device": device, "date": datetime.datetime.now(datetime.UTC).isoformat(),
                  "runs": runs, "plot": plot_ttft(raw, args.out.with_suffix(".png")).name,
                  "pooled": pooled_lines(request_ttfts(raw))}
        save(args.out, record, report)
    finally:
        for handle in servers.values():
            handle.stop()


COLORS = {"stock": "tab:gray", "ours": "tab:blue", "ours-mq": "tab:green"}


CAP_STYLES = ("-", ":", "-.", (0, (5, 1, 1, 1, 1, 1)))
"""Line style of an arm in the plot by its (cap, hold share)'s place among its base's (the common cap first); the
drainer draws the line thinner, with circles."""


def plot_ttft(raw: Path, png: Path) -> Path:
    """The TTFT distribution (CDF, log time axis) of every request in the request log `raw`, one panel per rate,
    one line per arm, all repeats pooled; saved as `png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ttfts = request_ttfts(raw)
    fig, axes = plt.subplots(1, len(ttfts), figsize=(max(7.0, 5.5 * len(ttfts)), 4), squeeze=False, sharey=True)
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    def setting(arm: str) -> tuple:  # an arm's line style follows its cap (0: the common one) and memory hold
        return parse_arm(arm)[1] or 0, split_hold(arm)[1], no_kv_moves(arm), host_gb(arm)

    caps: dict[str, list] = {}  # base -> its arms' settings in order
    for arm in ordered_arms({a for by_arm in ttfts.values() for a in by_arm}):
        if setting(arm) not in caps.setdefault(parse_arm(arm)[0], []):
            caps[parse_arm(arm)[0]].append(setting(arm))
    for ax, rate in zip(axes[0], sorted(ttfts)):
        for arm in ordered_arms(ttfts[rate]):
            xs = sorted(ttfts[rate][arm])
            base, _, drain = parse_arm(arm)
            style = CAP_STYLES[caps[base].index(setting(arm)) % len(CAP_STYLES)]
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", color=COLORS[base],
                    linestyle=style, linewidth=1.0 if drain else 1.6, marker="o" if drain else None,
                    markevery=max(1, len(xs) // 8), markersize=3,
                    label=f"{arm} (n={len(xs)}, P99 {nearest_rank(xs, 99):.1f} s)")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("TTFT (s)")
        ax.set_title(f"{rate:.2f} req/s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    axes[0][0].set_ylabel("share of requests")
    fig.suptitle("TTFT, same memory: unified pool (ours), with the multi-queue scheduler (ours-mq),\n"
                 "SGLang's memory layout (stock)", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def report(record: dict) -> str:
    s, runs = record["setup"], record["runs"]
    lines = [f"# Unified pool vs SGLang's memory layout, live CPU server ({record['date'][:10]})", "",
             f"Workload `{s['workload']}` {s['params']}, {s['num_requests']} requests; every arm {s['pool_tokens']} "
             f"token slots in all (stock: {s['stock_buffer_tokens']} to LoRA slot buffers of "
             f"{s['max_loras_per_batch']} x rank {s['max_lora_rank']}, {s['stock_kv_tokens']} to KV); adapters "
             f"{s['adapter_bytes_total'] / 2**20:.0f} MiB = {s['adapter_bytes_total'] / 46080:.0f} slots; policy "
             f"{s['policy']}; {'every arm ' + repr(s['server_args']) + '; ' if s.get('server_args') else ''}"
             f"{'arms ' + repr(s['arms']) + '; ' if s.get('arms') else ''}"
             f"{s['repeats']} repeats, arms alternating. Machine: {record['device']}.", "",
             *([f"KV token slots per arm (`--max-total-tokens`): "
                + ", ".join(f"{a} {t}" for a, t in s["arm_tokens"].items()) + ".", ""] if s.get("arm_tokens") else []),
             "| rate (req/s) | arm | mean TTFT s (min-max) | P50 TTFT s | P99 TTFT s (min-max) | cached share | "
             "failed |", "|---|---|---|---|---|---|---|"]
    arms = ordered_arms({r["arm"] for r in runs})
    baselines = [a for a in arms if a.startswith("stock")]
    hosts = {a: host_gb(a) for a in arms if host_gb(a) is not None}
    if hosts:
        lines[-2:-2] = ["Host memory beyond the pool: " + ", ".join(f"{a} {gb:g} GB" for a, gb in hosts.items())
                        + " for the KV its pool evicts; every other arm none (SGLang's HiCache, stock's way to "
                        "use host memory, does not start on the CPU path), so those arms have more memory.", ""]
    for scale in s["time_scales"]:
        for arm in arms:
            rs = [r for r in runs if r["arm"] == arm and r["time_scale"] == scale and r.get("num_ok")]
            if not rs:
                continue

            def med(key):
                return statistics.median(r[key] for r in rs)

            lines.append(
                f"| {rs[0]['rate_req_s']:.2f} | {arm} | {med('mean_ttft_s'):.2f} "
                f"({min(r['mean_ttft_s'] for r in rs):.2f}-{max(r['mean_ttft_s'] for r in rs):.2f}) | "
                f"{med('p50_ttft_s'):.2f} | {med('p99_ttft_s'):.2f} ({min(r['p99_ttft_s'] for r in rs):.2f}-"
                f"{max(r['p99_ttft_s'] for r in rs):.2f}) | {med('cached_token_share'):.2f} | "
                f"{sum(r['num_failed'] for r in rs)} |")
    for ours, stock in [(a, b) for b in baselines for a in arms if a not in baselines]:
        lines += ["", f"Ratios {ours} / {stock} per repeat (median, min-max):", ""]
        for scale in s["time_scales"]:
            mean_r, p99_r = repeat_ratios(record, ours, stock, scale)
            if mean_r:
                lines.append(f"- time scale {scale:g}: mean TTFT {statistics.median(mean_r):.2f} "
                             f"({min(mean_r):.2f}-{max(mean_r):.2f}), P99 TTFT {statistics.median(p99_r):.2f} "
                             f"({min(p99_r):.2f}-{max(p99_r):.2f})")
    lines += headline_lines(record, arms, baselines)
    for ours in [a for a in arms if a not in baselines]:
        last = [r["swapper"] for r in runs if r["arm"] == ours and r.get("swapper")]
        if last and "lora_batch_skips" in last[-1]:
            keys = ("adapter_loads", "adapter_evictions", "prefetches", "refused_loads", "unreachable_runs",
                    "kv_compactions", "kv_moved_slots", "kv_evicted_slots", "kv_evicted_slots_by_age",
                    "host_load_backs", "host_declined_load_backs", "skipped_admissions", "starvation_holds",
                    "budget_stops", "lora_batch_skips", "scheduler_counts")
            lines += ["", f"{ours}'s pool and admission counters over the whole run: "
                      + ", ".join(f"{k} {last[-1][k]}" for k in keys if last[-1].get(k) is not None) + "."]
    if record.get("pooled"):
        lines += ["", "Every repeat's requests pooled (the P99 of each run alone is one of its slowest few requests):",
                  "", *record["pooled"]]
    if record.get("plot"):
        lines += ["", f"TTFT distribution per rate, every repeat pooled: `{record['plot']}`."]
    return "\n".join(lines) + "\n"


def repeat_ratios(record: dict, ours: str, stock: str, scale: float) -> tuple[list[float], list[float]]:
    """Per repeat at time scale `scale` where both arms served requests: ours / stock mean TTFT, and P99 TTFT."""
    def run(arm, rep):
        return next((r for r in record["runs"] if r["arm"] == arm and r["repeat"] == rep and r["time_scale"] == scale
                     and r.get("num_ok")), None)

    pairs = [(o, k) for o, k in ((run(ours, rep), run(stock, rep)) for rep in range(record["setup"]["repeats"]))
             if o and k]
    return ([o["mean_ttft_s"] / k["mean_ttft_s"] for o, k in pairs],
            [o["p99_ttft_s"] / k["p99_ttft_s"] for o, k in pairs])


def headline_lines(record: dict, arms: list[str], baselines: list[str]) -> list[str]:
    """Each of our arms against the better stock arm at each rate: the stock arm (any cap, with or without the
    drainer) with the lower median mean TTFT over repeats; the ratios are the medians of the per-repeat ratios to
    it, with their spread."""
    s, runs = record["setup"], record["runs"]
    if not baselines:
        return []
    lines = ["", "Against the better stock arm at each rate (the one with the lower median mean TTFT; ELORA's goal: "
             "mean at most 0.5x, P99 at most 0.25x):", ""]
    for scale in s["time_scales"]:
        def ok(arm):
            return [r for r in runs if r["arm"] == arm and r["time_scale"] == scale and r.get("num_ok")]

        scored = [(statistics.median(r["mean_ttft_s"] for r in ok(b)), b) for b in baselines if ok(b)]
        if not scored:
            continue
        best = min(scored)[1]
        rate = ok(best)[0]["rate_req_s"]
        for ours in [a for a in arms if a not in baselines]:
            mean_r, p99_r = repeat_ratios(record, ours, best, scale)
            if mean_r:
                lines.append(f"- {rate:.2f} req/s, {ours} / {best}: mean TTFT {statistics.median(mean_r):.2f}x "
                             f"({min(mean_r):.2f}-{max(mean_r):.2f}), P99 TTFT {statistics.median(p99_r):.2f}x "
                             f"({min(p99_r):.2f}-{max(p99_r):.2f}), {len(mean_r)} repeats")
    return lines


if __name__ == "__main__":
    main()
