"""The Markdown report of the simulated ELORA experiment: its setup, TTFT tables per adapter count,
our figures beside ELORA's and the conclusions `findings.py` computes from the same records.

Not here: running the simulation (`compare.py`) or choosing what the figures mean (`findings.py`).
"""

from __future__ import annotations

import argparse
import math

from eval.sim.findings import (
    ABLATION_NAMES,
    BASELINES,
    NO_TIER,
    OURS,
    PAPER_ABLATIONS,
    PAPER_INVALID_KV,
    PAPER_SGLANG_TTFT_MS,
    PAPER_TTFT_REDUCTION,
    Findings,
    by_setting,
    compute_findings,
    conclusions,
    mean_memory_gb,
    peak_rate,
)
from eval.sim.latency import LatencyModel
from eval.sim.memory import pool_bytes


def _header(args: argparse.Namespace, host_kv_bytes: int) -> list[str]:
    command = (f"`.venv/bin/python -m eval.sim.compare --num-adapters "
               f"{','.join(map(str, args.num_adapters))} --rates {','.join(map(str, args.rates))}`")
    return ["## Simulated ELORA experiment (chatbot, Llama-3-8B on one H100, PCIe 5)", "",
            "All figures in this section are **simulated** (eval/sim), not measured on a GPU. "
            f"Command: {command} (seed {args.seed}).", "",
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


def _tables(s: dict, n: int, arms: list[str], rates: list[float]) -> list[str]:
    lines = [f"### {n} adapters: mean TTFT (s) by conversation rate (conversations/s)", "",
             "| arm | " + " | ".join(f"{r:g}" for r in rates)
             + " | peak load (conv/s, mean TTFT < 0.5 s) |",
             "|---|" + "---|" * (len(rates) + 1)]
    for arm in arms:
        cells = [f"{s[(n, r, arm)]['ttft_mean_s']:.3f}" if (n, r, arm) in s else "" for r in rates]
        if not any(cells):
            continue
        peak = peak_rate(s, n, rates, arm)
        lines.append(f"| {arm} | " + " | ".join(cells)
                     + f" | {peak if peak is not None else '< min'} |")
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
                f"{x['invalid_kv_share']:.3f} | {x['num_adapter_loads']} | "
                f"{x.get('host_kv_mean_bytes', 0.0) / 1e9:.1f} |")
    return lines + [""]


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{-100 * x:+.1f}%"


def _share(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.1f}%"


def _beside_paper(f: Findings, ablation_rates: list[float]) -> list[str]:
    red, pre, inv = f.reduction, f.reduction_no_tier, f.invalid
    lines = ["### Beside the papers", "",
             "Reductions are averaged over the swept rates up to ours' peak load (ELORA sweeps "
             "rates from 0 to its peak load); ablation ratios are ablation / ours mean TTFT, "
             f"averaged over the rates {', '.join(map(str, ablation_rates))}. Next to saturation a "
             "small loss of hit rate turns into queueing, so ratios there are large; the "
             "per-setting tables above show where each comes from.", "",
             "The last column is `ours:elora:no-host-kv`, the model before the host KV tier "
             "(reductions averaged up to its own peak load). The ELORA column quotes the paper.",
             "",
             "| figure | ELORA (paper, measured on H800s) | ours (simulated) | "
             "ours without host KV tier |",
             "|---|---|---|---|"]
    names = {"vllm": "vLLM", "slora": "S-LoRA", "sglang": "stock SGLang",
             "sglang:hicache": "stock SGLang + HiCache (same host budget)"}
    for base in BASELINES:
        paper = (_pct(PAPER_TTFT_REDUCTION[base]) if base in PAPER_TTFT_REDUCTION
                 else f"(excluded: {PAPER_SGLANG_TTFT_MS} ms TTFT)" if base == "sglang" else "-")
        lines.append(f"| mean TTFT vs {names[base]} | {paper} | {_pct(red[base])} | "
                     f"{_pct(pre[base])} |")
    no_tree = "ours:elora:no-tree"
    lines += [f"| invalid KV share, vLLM | {_share(PAPER_INVALID_KV['vllm'])} | "
              f"{_share(inv['vllm'])} | (same run) |",
              f"| invalid KV share, no-tree ablation | {_share(PAPER_INVALID_KV[no_tree])} | "
              f"{_share(inv[no_tree])} | - |",
              f"| invalid KV share, ours | 0 | {_share(inv[OURS])} | - |"]
    for arm, ratio in f.ablation.items():
        paper = PAPER_ABLATIONS.get(arm)
        name = ABLATION_NAMES.get(arm, arm)
        lines.append(f"| {name} TTFT | {f'{paper:.2f}x' if paper else '-'} | {ratio:.2f}x | - |")
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
    s = by_setting(records)
    f = compute_findings(records, args.num_adapters, args.rates, args.ablation_rates)
    arms = list(dict.fromkeys(r["setup"]["arm"] for r in records))
    lines = _header(args, host_kv_bytes)
    for n in args.num_adapters:
        lines += _tables(s, n, arms, args.rates)
    lines += _beside_paper(f, args.ablation_rates)
    lines += ["", "### What drives the simulated differences", ""] + _drivers(f)
    lines += ["", "### What the simulated figures show", ""] + conclusions(f) + [""]
    return "\n".join(lines)
