"""What the simulated ELORA experiment shows, computed from its run records: TTFT reductions,
ablation ratios, invalid-KV shares and the conclusions they support, each sentence chosen by the
numbers it quotes.

Lives here: `Findings`, `compute_findings` and `conclusions`, plus ELORA's published figures as
cited constants (`PAPER_*`, never computed). Not here: running the simulation (`compare.py`) or the
report's tables (`compare_report.py`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from eval.sim.latency import LatencyModel

# ELORA's published figures (seed-elora.md; measured on H800s), cited for comparison only.
PAPER_TTFT_REDUCTION = {"vllm": 0.457, "slora": 0.433}  # mean TTFT reduction vs each baseline
PAPER_SGLANG_TTFT_MS = 9568.9  # stock SGLang's mean TTFT, left out of the paper's averages
PAPER_INVALID_KV = {"vllm": 0.424, "ours:elora:no-tree": 0.486, "ours:elora": 0.0}
PAPER_ABLATIONS = {"ours:lru": 1.42, "ours:elora:no-tree": 1.51, "ours:elora:-lora_count": 1.21,
                   "ours:elora:-cost": 1.19, "ours:elora:-visit": 1.25, "ours:elora:-recency": 1.21}

OURS = "ours:elora"
NO_TIER = "ours:elora:no-host-kv"
BASELINES = ("vllm", "slora", "sglang", "sglang:hicache")
ORDER_ONLY = {"ours:lru": "WOS", "ours:elora:no-tree": "WOM", "ours:elora:-lora_count": "WOL",
              "ours:elora:-cost": "WOC", "ours:elora:-visit": "WOV",
              "ours:elora:no-prefetch": "no prefetch"}
"""Ablations that change only which item is evicted or prefetched first, not what is kept where."""
ABLATION_NAMES = {"ours:lru": "WOS (LRU instead of the score)",
                  "ours:elora:no-tree": "WOM (no dependency tree)",
                  "ours:elora:-lora_count": "WOL (no LoRA-count term)",
                  "ours:elora:-cost": "WOC (no cost term)",
                  "ours:elora:-visit": "WOV (no visit term)",
                  "ours:elora:-recency": "WOU (no recency term)",
                  "ours:chameleon": "Chameleon's score instead of ELORA's",
                  "ours:elora:tau=10": "ELORA with t in units of 10 s",
                  "ours:elora:tau=60": "ELORA with t in units of 60 s",
                  "ours:elora:no-prefetch": "ELORA without idle prefetch",
                  "ours:elora:no-host-kv": "ELORA without the host KV tier (evicted KV recomputed)",
                  "ours:elora:host-kv=32": "ELORA with a 32 GB host KV pool (256 GB / 8 GPUs)"}
SLO_S = 0.5  # ELORA's peak-load SLO: mean TTFT under 500 ms
NEGLIGIBLE = 0.03  # a TTFT ratio within 3% of 1.00 is reported as no effect
LITTLE_INVALID_KV = 0.05  # invalid-KV shares below this leave the dependency tree little to reclaim


def seeds_of(records: list[dict]) -> list[int]:
    """The workload seeds the records were run at, in order."""
    return sorted({r["setup"].get("seed", 0) for r in records})


def by_setting(records: list[dict], seed: int | None = None) -> dict[tuple[int, float, str], dict]:
    """{(num_adapters, conversation rate, arm): summary} of one seed's run records (`seed` None: the
    first seed's)."""
    if seed is None:
        seed = seeds_of(records)[0] if records else 0
    return {(r["setup"]["num_adapters"], r["setup"]["conversation_rate"], r["setup"]["arm"]):
            r["summary"] for r in records if r["setup"].get("seed", 0) == seed}


def peak_rate(s: dict, n: int, rates: list[float], arm: str) -> float | None:
    """Highest swept rate whose mean TTFT stays under the SLO; None when none does."""
    ok = [r for r in rates if (n, r, arm) in s and s[(n, r, arm)]["ttft_mean_s"] < SLO_S]
    return max(ok) if ok else None


def matched_reductions(s: dict, n: int, rates: list[float], ours: str,
                       base: str) -> tuple[list[float], float | None]:
    """1 - TTFT(ours) / TTFT(base) at each swept rate up to the pair's knee, the lower of the two
    arms' peak loads, and that knee. No rate and knee None when either arm misses the SLO at every
    swept rate (or a run is missing): a rate where only one arm saturates is never averaged in."""
    if not all((n, r, a) in s for r in rates for a in (ours, base)):
        return [], None
    peaks = [peak_rate(s, n, rates, a) for a in (ours, base)]
    if None in peaks:
        return [], None
    knee = min(peaks)
    return [1 - s[(n, r, ours)]["ttft_mean_s"] / s[(n, r, base)]["ttft_mean_s"]
            for r in rates if r <= knee], knee


@dataclass(frozen=True)
class Findings:
    """Figures of one experiment over its seeds; nan where the records lack the arms.

    reduction / reduction_no_tier: baseline -> median over seeds of the seed's mean of
    1 - TTFT(ours) / TTFT(baseline) over the rates up to the pair's knee (`matched_reductions`;
    ours, or ours without the host tier), pooled over adapter counts; `spread` / `spread_no_tier`:
    the seeds' (min, max) of the same. knees: baseline -> adapter count -> the knee per seed (None
    where no rate matched); peaks: ours and each baseline -> adapter count -> its peak load per seed
    (None: the SLO missed at every swept rate). ablation: arm -> mean TTFT(arm) / TTFT(ours) over
    the ablation rates, adapter counts and seeds. invalid: arm -> mean invalid-KV share over all its
    runs. top: adapter count -> arm -> the first seed's run record at the top rate."""

    reduction: dict[str, float]
    reduction_no_tier: dict[str, float]
    ablation: dict[str, float]
    invalid: dict[str, float]
    top_rate: float
    top: dict[int, dict[str, dict]]
    spread: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    spread_no_tier: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    knees: dict[str, dict[int, list[float | None]]] = dataclasses.field(default_factory=dict)
    peaks: dict[str, dict[int, list[float | None]]] = dataclasses.field(default_factory=dict)
    seeds: tuple[int, ...] = (0,)


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else math.nan


def _over_seeds(per_seed: list[float]) -> tuple[float, tuple[float, float]]:
    """Median and (min, max) of the seeds' values that are numbers; nan when none is."""
    ok = [v for v in per_seed if not math.isnan(v)]
    if not ok:
        return math.nan, (math.nan, math.nan)
    return float(np.median(ok)), (min(ok), max(ok))


def compute_findings(records: list[dict], num_adapters: list[int], rates: list[float],
                     ablation_rates: list[float]) -> Findings:
    seeds = seeds_of(records)
    per_seed = {seed: by_setting(records, seed) for seed in seeds}
    reduction, spread = {}, {}
    knees: dict[str, dict[int, list[float | None]]] = {b: {n: [] for n in num_adapters} for b in BASELINES}
    for ours in (OURS, NO_TIER):
        reduction[ours], spread[ours] = {}, {}
        for base in BASELINES:
            seed_means = []
            for seed in seeds:
                values = []
                for n in num_adapters:
                    got, knee = matched_reductions(per_seed[seed], n, rates, ours, base)
                    values += got
                    if ours == OURS:
                        knees[base][n].append(knee)
                seed_means.append(_mean(values))
            reduction[ours][base], spread[ours][base] = _over_seeds(seed_means)
    ablation = {}
    for arm in dict.fromkeys(r["setup"]["arm"] for r in records):
        if arm == OURS or arm in BASELINES:
            continue
        ratios = [s[(n, r, arm)]["ttft_mean_s"] / s[(n, r, OURS)]["ttft_mean_s"]
                  for s in per_seed.values() for n in num_adapters for r in ablation_rates
                  if (n, r, arm) in s and (n, r, OURS) in s]
        if ratios:
            ablation[arm] = _mean(ratios)
    invalid = {arm: _mean([r["summary"]["invalid_kv_share"] for r in records if r["setup"]["arm"] == arm])
               for arm in ("vllm", "sglang", OURS, "ours:elora:no-tree")}
    top_rate = max(rates)
    first = seeds[0] if seeds else 0
    top = {n: {r["setup"]["arm"]: r for r in records
               if r["setup"]["num_adapters"] == n and r["setup"]["conversation_rate"] == top_rate
               and r["setup"].get("seed", 0) == first}
           for n in num_adapters}
    peaks = {arm: {n: [peak_rate(per_seed[seed], n, rates, arm) for seed in seeds] for n in num_adapters}
             for arm in (OURS, *BASELINES)}
    return Findings(reduction=reduction[OURS], reduction_no_tier=reduction[NO_TIER], ablation=ablation,
                    invalid=invalid, top_rate=top_rate, top=top, spread=spread[OURS],
                    spread_no_tier=spread[NO_TIER], knees=knees, peaks=peaks, seeds=tuple(seeds))


def mean_memory_gb(record: dict, kind: str) -> float:
    """Mean bytes of one memory kind over a run's samples, in GB."""
    return _mean([m[kind] for m in record["memory_samples"]]) / 1e9


def _negligible(ratio: float) -> bool:
    return abs(ratio - 1) <= NEGLIGIBLE


def _effect(ratio: float) -> str:
    """'no effect' within NEGLIGIBLE of 1.00x, else how much slower or faster mean TTFT gets."""
    if _negligible(ratio):
        return f"no effect ({ratio:.2f}x)"
    return f"{ratio - 1:+.0%} mean TTFT ({ratio:.2f}x)"


def ttft_change_range(spread: tuple[float, float] | None) -> tuple[float, float] | None:
    """The seeds' (min, max) of a reduction as TTFT changes (-reduction), lowest first; None when there is none
    or the seeds agree."""
    if spread is None or math.isnan(spread[0]) or spread[0] == spread[1]:
        return None
    return min(-spread[0], -spread[1]), max(-spread[0], -spread[1])


def _seed_spread(f: Findings, spread: tuple[float, float] | None) -> str:
    """' (median of N seeds, lo to hi)' when the findings pool several seeds that differ, else ''."""
    change = ttft_change_range(spread) if len(f.seeds) > 1 else None
    return "" if change is None else f" (median of {len(f.seeds)} seeds, {change[0]:+.1%} to {change[1]:+.1%})"


def _headline(f: Findings) -> list[str]:
    out = []
    for base, name in (("vllm", "vLLM"), ("slora", "S-LoRA")):
        ours, paper = f.reduction[base], PAPER_TTFT_REDUCTION[base]
        if math.isnan(ours):
            continue
        verdict = ("matches" if abs(ours - paper) <= 0.01 else "exceeds" if ours > paper
                   else "falls short of")
        line = (f"- **Against {name}-like, ours {verdict} ELORA's published reduction**: mean "
                f"TTFT {-ours:+.1%}{_seed_spread(f, f.spread.get(base))} against the paper's "
                f"{-paper:+.1%} ({abs(ours - paper) * 100:.1f} points apart).")
        pre = f.reduction_no_tier[base]
        if not math.isnan(pre):
            line += f" Without the host KV tier: {-pre:+.1%}"
            if pre <= 0 < ours:
                line += ", so ours beats it only with the tier."
            elif 0 < pre < ours:
                line += f", so the tier brings {(ours - pre) / ours:.0%} of ours' reduction."
            else:
                line += ", so the tier does not explain the reduction."
        out.append(line)
    return out


def _median_peak(peaks: list[float | None]) -> float | None:
    """The seeds' median peak load, a seed that missed the SLO at every rate counted as 0; None when that median
    is 0."""
    m = float(np.median([p or 0.0 for p in peaks])) if peaks else 0.0
    return m or None


def _capacity(f: Findings) -> list[str]:
    """Each adapter count's peak loads, ours against each baseline's, and whether ours' gain over vLLM-like is the
    load it sustains rather than the latency below its knee."""
    names = {"vllm": "vLLM-like", "slora": "S-LoRA-like", "sglang": "stock SGLang"}
    parts, load_gain = [], False
    for n, ours_peaks in f.peaks.get(OURS, {}).items():
        ours = _median_peak(ours_peaks)
        if ours is None:
            continue
        cells = []
        for base, name in names.items():
            peak = _median_peak(f.peaks.get(base, {}).get(n, []))
            cells.append(f"{name} {peak:g} ({ours / peak:.2f}x)" if peak else f"{name} below the lowest rate")
            load_gain |= base == "vllm" and (peak is None or ours > peak)
        parts.append(f"{n} adapters: ours {ours:g} conv/s, " + ", ".join(cells))
    if not parts:
        return []
    median = " (medians over the seeds)" if len(f.seeds) > 1 else ""
    line = "- **Peak load (mean TTFT under 0.5 s)**" + median + ": " + "; ".join(parts) + "."
    if load_gain and f.reduction.get("vllm", math.nan) < PAPER_TTFT_REDUCTION["vllm"] / 2:
        line += (" Below vLLM-like's knee both serve in tens of milliseconds, so against it ours' gain is the load "
                 "it sustains more than the latency at matched rates.")
    return [line]


def _tier_and_order(f: Findings, lat: LatencyModel) -> list[str]:
    order = {a: f.ablation[a] for a in ORDER_ONLY if a in f.ablation}
    if not order:
        return []
    short = ", ".join(ORDER_ONLY[a] for a in order)
    lo, hi = min(order.values()), max(order.values())
    span = f"{lo:.2f}x" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}x"
    paper = [PAPER_ABLATIONS[a] for a in order if a in PAPER_ABLATIONS]
    paper_range = f" (ELORA: {min(paper):.2f}-{max(paper):.2f}x)" if paper else ""
    if all(_negligible(r) for r in order.values()):
        line = (f"- **The eviction order barely matters here.** The ablations that only change "
                f"what goes first ({short}) land at {span} ours' mean TTFT{paper_range}.")
    else:
        worst = max(order, key=order.get)
        line = (f"- **The eviction order matters.** The order-only ablations ({short}) land at "
                f"{span}{paper_range}; the largest is {ABLATION_NAMES[worst]} at "
                f"{order[worst]:.2f}x.")
    tier = f.ablation.get(NO_TIER)
    if tier is not None:
        biggest = max(f.ablation, key=f.ablation.get)
        line += f" Without the host KV tier: {_effect(tier)}"
        line += (", more than any other ablation." if biggest == NO_TIER else
                 f", less than {ABLATION_NAMES[biggest]} ({f.ablation[biggest]:.2f}x).")
    m, hw = lat.model, lat.hw
    copy_us = m.kv_bytes_per_token / hw.pcie_bytes_per_s * 1e6
    line += (f" In the latency model a token's KV comes back from the host in {copy_us:.1f} us "
             f"({m.kv_bytes_per_token // 1024} KiB at {hw.pcie_bytes_per_s / 1e9:g} GB/s) against "
             f"{lat.recompute_s_per_token() * 1e6:.0f} us to recompute it")
    if tier is not None and not _negligible(tier):
        line += ", so with the tier a wrong eviction costs a copy, not a recompute"
    line += "."
    small = f.ablation.get("ours:elora:host-kv=32")
    if small is not None:
        line += f" A 32 GB host pool instead of the default: {_effect(small)}."
    return [line]


def _kv_or_adapters(f: Findings, lat: LatencyModel) -> list[str]:
    out = []
    for n, runs in f.top.items():
        if OURS not in runs or "vllm" not in runs:
            continue
        o, v = runs[OURS]["summary"], runs["vllm"]["summary"]
        kv_gap = o["kv_hit_rate"] - v["kv_hit_rate"]
        adapter_gap = o["adapter_hit_rate"] - v["adapter_hit_rate"]
        if max(kv_gap, adapter_gap) <= 0.01:
            verdict = "ours' hit rates are no higher than vLLM-like's"
        elif kv_gap > adapter_gap:
            verdict = "ours' edge over vLLM-like is KV reuse, not adapter residency"
        else:
            verdict = "ours' edge over vLLM-like is adapter residency, not KV reuse"
        area_gb = 0.2 * runs["vllm"]["setup"]["pool_bytes"] / 1e9
        used_gb = mean_memory_gb(runs["vllm"], "adapter")
        out.append(
            f"- **{n} adapters at {f.top_rate:g} conversations/s: {verdict}** (KV hit rate "
            f"{kv_gap:+.3f}, adapter hit rate {adapter_gap:+.3f}). "
            f"vLLM's static adapter area held {used_gb:.1f} of its {area_gb:.1f} GB on average "
            f"({1 - used_gb / area_gb:.0%} idle) while ours kept "
            f"{mean_memory_gb(runs[OURS], 'kv_cached'):.1f} GB of history KV against vLLM's "
            f"{mean_memory_gb(runs['vllm'], 'kv_cached'):.1f} GB.")
    setup = next((r["setup"] for runs in f.top.values() for r in runs.values()), None)
    if out and setup and "params" in setup and "target_modules" in setup:
        rank = max(setup["params"]["ranks"])
        size = lat.model.adapter_bytes(rank, tuple(setup["target_modules"]))
        out.append(f"  A rank-{rank} adapter on these modules is {size / 1e6:.0f} MB: "
                   f"{lat.h2d_time(size) * 1e3:.1f} ms over PCIe, overlapped with compute, "
                   f"against {1000 * lat.recompute_s_per_token() * 1e3:.0f} ms to recompute "
                   "1,000 prompt tokens.")
    return out


def _score_terms(f: Findings) -> list[str]:
    out = []
    lru = f.ablation.get("ours:lru")
    if lru is not None:
        if _negligible(lru):
            verdict = "ELORA's score evicts in LRU's order here"
        elif lru > 1:
            verdict = "ELORA's score beats LRU"
        else:
            verdict = "LRU beats ELORA's score"
        line = f"- **{verdict}** (WOS {lru:.2f}x; ELORA: {PAPER_ABLATIONS['ours:lru']:.2f}x)."
        units = [(u, f.ablation[f"ours:elora:tau={u}"]) for u in (10, 60)
                 if f"ours:elora:tau={u}" in f.ablation]
        if units:
            line += " Measuring t in units of "
            line += "; ".join(f"{u} s: {_effect(r)}" for u, r in units) + "."
        if _negligible(lru):
            line += (" With t in seconds, 1 - sigmoid(t) falls by about e per second, so recency "
                     "decides the order of anything idle for more than a few seconds "
                     "(sgl_multilora/policy/elora.py).")
        out.append(line)
    for arm in ("ours:elora:-recency", "ours:chameleon"):
        if arm in f.ablation:
            paper = PAPER_ABLATIONS.get(arm)
            cited = f"; ELORA: {paper:.2f}x" if paper else ""
            out.append(f"- **{ABLATION_NAMES[arm]}: {_effect(f.ablation[arm])}**{cited}.")
    return out


def _invalid_kv(f: Findings) -> list[str]:
    ours = f.invalid.get(OURS, math.nan)
    if math.isnan(ours):
        return []
    line = ("- **The dependency tree keeps invalid KV at 0.**" if ours == 0 else
            f"- **Ours holds invalid KV ({ours:.1%}), which the dependency invariant forbids.**")
    parts = []
    for arm, name in (("vllm", "vLLM-like"), ("ours:elora:no-tree", "the no-tree ablation")):
        share = f.invalid.get(arm, math.nan)
        if math.isnan(share):
            continue
        paper = PAPER_INVALID_KV[arm]
        scale = "far below" if share < paper / 4 else "below" if share < 0.8 * paper else "close to"
        parts.append(f"{name} {share:.1%}, {scale} ELORA's {paper:.1%}")
    if parts:
        line += " Invalid KV elsewhere: " + "; ".join(parts) + "."
    wom = f.ablation.get("ours:elora:no-tree")
    if wom is not None:
        line += f" Without the tree: {_effect(wom)}"
        little = _negligible(wom) and all(f.invalid.get(a, 0.0) < LITTLE_INVALID_KV
                                          for a in ("vllm", "ours:elora:no-tree"))
        line += ", so the tree has little to fix on this workload." if little else "."
    return [line]


MODEL_LIMITS = """Model limits (properties of the simulator, the same in every run):
- The host tier is inclusive, its GPU->host writes are not timed and the idle prefetch of host
  KV (which the server does) is not modelled (eval/sim/hostkv.py); the host pool size is an
  assumption (`--host-kv-gb`).
- vLLM-, S-LoRA- and plain SGLang-like have no host KV tier, as in the paper, so reductions
  against them include the tier's gain; `sglang:hicache` has the same tier and budget as ours.
- The workload is synthetic (eval/workloads/chatbot.py), not LMSYS-33k. The latency model
  (eval/sim/latency.py) is a roofline whose LoRA term is fitted to our kernels measured on an
  H100 (eval/results/lora_step_gpu/lora_step_gpu.md; every arm is costed with them); its base-model and copy
  terms have no GPU measurement behind them."""


def conclusions(f: Findings, lat: LatencyModel | None = None) -> list[str]:
    """Markdown bullets, each a conclusion chosen by the figures it quotes, then the model's limits.
    Does not modify `f`."""
    lat = lat or LatencyModel()
    bullets = _headline(f) + _capacity(f) + _tier_and_order(f, lat) + _kv_or_adapters(f, lat) + _score_terms(f)
    return bullets + _invalid_kv(f) + ["", MODEL_LIMITS]
