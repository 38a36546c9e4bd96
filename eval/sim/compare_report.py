"""The Markdown report of the simulated ELORA experiment: its setup, TTFT tables per adapter count,
our figures beside ELORA's and the conclusions `findings.py` computes from the same records.

Not here: running the simulation (`compare.py`) or choosing what the figures mean (`findings.py`).
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from eval.sim.findings import (
    ABLATION_NAMES,
    BASELINES,
    NO_TIER,
    OURS,
    PAPER_ABLATIONS,
    PAPER_INVALID_KV,
    PAPER_SGLANG_TTFT_MS,
    PAPER_TTFT_REDUCTION,
    SLO_S,
    Findings,
    by_setting,
    compute_findings,
    conclusions,
    mean_memory_gb,
    peak_rate,
    seeds_of,
    ttft_change_range,
)
from eval.sim.latency import LatencyModel
from eval.sim.memory import pool_bytes


def _header(args: argparse.Namespace, host_kv_bytes: int) -> list[str]:
    seeds = ",".join(map(str, args.seeds))
    command = (f"`.venv/bin/python -m eval.sim.compare --num-adapters "
               f"{','.join(map(str, args.num_adapters))} --rates {','.join(map(str, args.rates))} "
               f"--seeds {seeds}`")
    several = (" Each figure is the median over the seeds' runs unless it says otherwise; the peak-load "
               "column lists every seed's." if len(args.seeds) > 1 else "")
    return ["## Simulated ELORA experiment (chatbot, Llama-3-8B on one H100, PCIe 5)", "",
            "All figures in this section are **simulated** (eval/sim), not measured on a GPU. "
            f"Command: {command} (workload seeds {seeds}).{several}", "",
            f"Workload: eval/workloads/chatbot.py, conversations arriving at the given rate for "
            f"{args.window_s:g} s, {args.mean_turns:g} turns on average, {args.think_time_s:g} s "
            f"think time, {args.mean_new_tokens:g} new tokens per turn, Zipf adapter popularity; "
            "adapters of rank 32/64 on all seven linear layers (168 / 336 MB). Pool for KV + "
            f"adapters: {pool_bytes(LatencyModel()) / 1e9:.1f} GB.", "",
            "Host KV tier (sgl_multilora/host_tier.py, the server's object): ours and its ablations "
            f"spill evicted history KV to a {host_kv_bytes / 1e9:g} GB host pool (LRU) and copy it "
            "back over PCIe (50 GB/s, FIFO with the adapter copies) instead of recomputing it; "
            "`ours:elora:no-host-kv` drops it. `sglang:hicache` is stock SGLang with its hierarchical "
            "cache, given the same host tier and budget; the other baselines have none (ELORA's vLLM "
            "and S-LoRA baselines, and the stock SGLang ELORA ran). \"KV hit\" below counts both "
            "tiers; \"from host\" is the share of prompt tokens copied back from the host.", ""]


def median_setting(per_seed: list[dict]) -> dict[tuple[int, float, str], dict]:
    """{(num_adapters, rate, arm): summary} whose numbers are the median over the seeds that ran the
    setting (`per_seed`: `by_setting` of each seed)."""
    out = {}
    for key in dict.fromkeys(k for s in per_seed for k in s):
        runs = [s[key] for s in per_seed if key in s]
        out[key] = {f: float(np.median([x[f] for x in runs])) for f, v in runs[0].items()
                    if isinstance(v, int | float) and all(f in x for x in runs)}
    return out


def _peaks(per_seed: list[dict], n: int, rates: list[float], arm: str) -> str:
    peaks = [peak_rate(s, n, rates, arm) for s in per_seed if any((n, r, arm) in s for r in rates)]
    return " / ".join(f"{p:g}" if p is not None else "< min" for p in peaks)


def _tables(per_seed: list[dict], n: int, arms: list[str], rates: list[float]) -> list[str]:
    s = median_setting(per_seed)
    lines = [f"### {n} adapters: mean TTFT (s) by conversation rate (conversations/s)", "",
             "| arm | " + " | ".join(f"{r:g}" for r in rates)
             + " | peak load (conv/s, mean TTFT < 0.5 s) |",
             "|---|" + "---|" * (len(rates) + 1)]
    for arm in arms:
        cells = [f"{s[(n, r, arm)]['ttft_mean_s']:.3f}" if (n, r, arm) in s else "" for r in rates]
        if not any(cells):
            continue
        lines.append(f"| {arm} | " + " | ".join(cells) + f" | {_peaks(per_seed, n, rates, arm)} |")
    lines += ["", "| arm (at the highest rate) | P50 TTFT | P99 TTFT | mean TPOT | KV hit | "
              "from host | adapter hit | invalid KV | adapter loads | host KV (GB, mean) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    top = max(rates)
    for arm in arms:
        if (n, top, arm) in s:
            x = s[(n, top, arm)]
            lines.append(
                f"| {arm} | {x['ttft_p50_s']:.3f} | {x['ttft_p99_s']:.3f} | "
                f"{x['tpot_mean_s']:.4f} | {x['kv_hit_rate']:.3f} | "
                f"{x.get('kv_host_hit_rate', 0.0):.3f} | {x['adapter_hit_rate']:.3f} | "
                f"{x['invalid_kv_share']:.3f} | {x['num_adapter_loads']:g} | "
                f"{x.get('host_kv_mean_bytes', 0.0) / 1e9:.1f} |")
    return lines + [""]


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{-100 * x:+.1f}%"


def _pct_spread(x: float, spread: tuple[float, float] | None) -> str:
    """A reduction as a percentage, with the seeds' range when they differ."""
    change = None if math.isnan(x) else ttft_change_range(spread)
    return _pct(x) if change is None else f"{_pct(x)} ({100 * change[0]:+.1f} to {100 * change[1]:+.1f}%)"


def _share(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.1f}%"


def _beside_paper(f: Findings, ablation_rates: list[float]) -> list[str]:
    red, pre, inv = f.reduction, f.reduction_no_tier, f.invalid
    seeds = len(f.seeds)
    over = (f"; the median over {seeds} seeds, their range in brackets" if seeds > 1 else "")
    lines = ["### Beside the papers", "",
             "Reductions are computed at matched rates up to each baseline's knee: at every swept "
             "rate up to the lower of the two arms' peak loads (mean TTFT under 0.5 s, ELORA's rule), "
             "averaged over those rates and the adapter counts; a rate where only one arm "
             "saturates is never averaged in, and an adapter count where the baseline misses the "
             f"SLO at every swept rate adds nothing (the knee column says so){over}. Ablation ratios "
             "are ablation / ours mean TTFT, averaged over the rates "
             f"{', '.join(map(str, ablation_rates))}. Next to saturation a small loss of hit rate "
             "turns into queueing, so ratios there are large; the per-setting tables above show "
             "where each comes from.", "",
             "The last column is `ours:elora:no-host-kv`, the model before the host KV tier "
             "(matched the same way, up to its own knee with the baseline). The ELORA column quotes "
             "the paper.",
             "",
             "| figure | ELORA (paper, measured on H800s) | ours (simulated) | "
             "ours without host KV tier | knee (conv/s) per adapter count, per seed |",
             "|---|---|---|---|---|"]
    names = {"vllm": "vLLM", "slora": "S-LoRA", "sglang": "stock SGLang",
             "sglang:hicache": "stock SGLang + HiCache (same host budget)"}
    for base in BASELINES:
        paper = (_pct(PAPER_TTFT_REDUCTION[base]) if base in PAPER_TTFT_REDUCTION
                 else f"(excluded: {PAPER_SGLANG_TTFT_MS} ms TTFT)" if base == "sglang" else "-")
        knees = "; ".join(f"{n}: " + " / ".join("none" if k is None else f"{k:g}" for k in ks)
                          for n, ks in f.knees.get(base, {}).items())
        lines.append(f"| mean TTFT vs {names[base]} | {paper} | {_pct_spread(red[base], f.spread.get(base))} | "
                     f"{_pct_spread(pre[base], f.spread_no_tier.get(base))} | {knees} |")
    no_tree = "ours:elora:no-tree"
    lines += [f"| invalid KV share, vLLM | {_share(PAPER_INVALID_KV['vllm'])} | "
              f"{_share(inv['vllm'])} | (same run) | |",
              f"| invalid KV share, no-tree ablation | {_share(PAPER_INVALID_KV[no_tree])} | "
              f"{_share(inv[no_tree])} | - | |",
              f"| invalid KV share, ours | 0 | {_share(inv[OURS])} | - | |"]
    for arm, ratio in f.ablation.items():
        paper = PAPER_ABLATIONS.get(arm)
        name = ABLATION_NAMES.get(arm, arm)
        lines.append(f"| {name} TTFT | {f'{paper:.2f}x' if paper else '-'} | {ratio:.2f}x | - | |")
    return lines


def _drivers(f: Findings) -> list[str]:
    """One line per adapter count, read from the runs at the highest rate: hit rates, memory."""
    out = []
    nan = math.nan
    for n, runs in f.top.items():
        if "vllm" not in runs or OURS not in runs:
            continue
        o, v = runs[OURS]["summary"], runs["vllm"]["summary"]
        host = (f" ({o.get('kv_host_hit_rate', 0.0):.3f} of the prompt tokens copied back from "
                "the host)" if o.get("kv_host_hit_rate") else "")
        history = (f"; conversation history in the prompts recomputed: ours "
                   f"{o.get('history_recompute_share', nan):.3f} vs vLLM "
                   f"{v.get('history_recompute_share', nan):.3f}")
        if NO_TIER in runs:
            p = runs[NO_TIER]["summary"]
            history += (f" (without the host tier: KV hit {p['kv_hit_rate']:.3f}, history "
                        f"recomputed {p.get('history_recompute_share', nan):.3f})")
        area_gb = 0.2 * runs["vllm"]["setup"]["pool_bytes"] / 1e9
        out.append(
            f"- {n} adapters at {f.top_rate:g} conversations/s: KV hit rate ours "
            f"{o['kv_hit_rate']:.3f}{host} vs vLLM {v['kv_hit_rate']:.3f}{history}; adapter hit "
            f"rate {o['adapter_hit_rate']:.3f} vs {v['adapter_hit_rate']:.3f}; mean adapter "
            f"memory {mean_memory_gb(runs[OURS], 'adapter'):.1f} GB vs "
            f"{mean_memory_gb(runs['vllm'], 'adapter'):.1f} GB (vLLM's area: {area_gb:.1f} GB); "
            f"mean history KV {mean_memory_gb(runs[OURS], 'kv_cached'):.1f} GB vs "
            f"{mean_memory_gb(runs['vllm'], 'kv_cached'):.1f} GB.")
    return out


def markdown(records: list[dict], args: argparse.Namespace, host_kv_bytes: int) -> str:
    """The whole report. `args` carries the sweep (num_adapters, rates, ablation_rates) and the
    workload flags; every figure and conclusion is computed from `records`."""
    per_seed = [by_setting(records, seed) for seed in seeds_of(records)]
    f = compute_findings(records, args.num_adapters, args.rates, args.ablation_rates)
    arms = list(dict.fromkeys(r["setup"]["arm"] for r in records))
    lines = _header(args, host_kv_bytes)
    if getattr(args, "plot_name", None):
        lines += [f"Mean TTFT against the rate, every swept arm: `{args.plot_name}`.", ""]
    for n in args.num_adapters:
        lines += _tables(per_seed, n, arms, args.rates)
    lines += _beside_paper(f, args.ablation_rates)
    first = f" (seed {f.seeds[0]}'s runs)" if len(f.seeds) > 1 else ""
    lines += ["", f"### What drives the simulated differences{first}", ""] + _drivers(f)
    lines += ["", "### What the simulated figures show", ""] + conclusions(f) + [""]
    return "\n".join(lines)


def plot(records: list[dict], args: argparse.Namespace, path) -> None:
    """One panel per adapter count: each swept arm's mean TTFT against the conversation rate, the median over the
    seeds as a line and their min-max as a band, with ELORA's 0.5 s peak-load SLO; written to `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_seed = [by_setting(records, seed) for seed in seeds_of(records)]
    arms = [a for a in dict.fromkeys(r["setup"]["arm"] for r in records)
            if all(any((n, r, a) in s for s in per_seed) for n in args.num_adapters for r in args.rates)]
    fig, axes = plt.subplots(1, len(args.num_adapters), figsize=(6 * len(args.num_adapters), 4.5), squeeze=False)
    for ax, n in zip(axes[0], args.num_adapters):
        for i, arm in enumerate(arms):
            values = [[s[(n, r, arm)]["ttft_mean_s"] for s in per_seed if (n, r, arm) in s] for r in args.rates]
            ax.plot(args.rates, [np.median(v) for v in values], marker="o", ms=3, color=f"C{i}", label=arm)
            ax.fill_between(args.rates, [min(v) for v in values], [max(v) for v in values], color=f"C{i}",
                            alpha=0.2, lw=0)
        ax.axhline(SLO_S, color="gray", lw=0.8, ls="--", label=f"peak-load SLO ({SLO_S:g} s)")
        ax.set(yscale="log", xlabel="new conversations per second", ylabel="mean TTFT (s, simulated)",
               title=f"{n} adapters: median over seeds {', '.join(map(str, args.seeds))}, band min-max")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
