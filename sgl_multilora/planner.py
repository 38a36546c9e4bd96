"""InfiniLoRA's SLO-driven provisioning of a LoRA server: how many adapters it must cache, and how many GPUs it needs.

Lives here: popularity vectors (`zipf_popularity`, `trace_popularity`), the cache model (`iar`, the immediate
admissibility rate at capacity M, Eq 2-4; `min_cached_adapters`, Eq 1 / Alg 1), the GPU counts for memory and for
TPOT (Eq 5-6) and their fixed point with the instances (`provision`). Plain numpy; the command line is
`sgl_multilora/plan.py`. Symbols follow reference/seed-infinilora.md §2.4.

The cache model. Adapter i is requested with probability p_i; a global batch of LB = L x B requests accesses it
lam_i = LB p_i times on average. A cache of M adapters holds adapter i with probability q_i = Pr[Poisson(lam_i) > tau]
(Eq 2), tau fixed by sum_i q_i = M (Eq 3), residencies independent. A request is immediately admissible when its
adapter is held, or when fewer than M others are (a free slot): IAR(M) = sum_i p_i (q_i + (1 - q_i) P_free(i)), with
P_free(i) = Pr[sum_{j != i} Bernoulli(q_j) <= M - 1] (Eq 4). M* = min{M : IAR(M) >= alpha} (Eq 1).

Choices the paper leaves open, made here and reported with every result:
- tau is an integer (the paper's Eq 2 sums k = 0..tau): the largest tau >= 0 with sum_i q_i >= M, or 0 when even
  tau = 0 gives fewer (the expected number of distinct adapters per batch is below M: nearly every request finds a
  free slot). `TAU_CONVENTION` names it. A continuous tau (the incomplete gamma) gives other figures.
- P_free(i) from truncated prefix and suffix Poisson-binomial distributions (counts 0..M-1), O(N M) per M instead of
  the listing's O(N^3). M* by scanning M upward from 1, Eq 1 exactly: under the integer tau, IAR is not monotone in
  M (it dips where tau steps), so a binary search could return a larger M than the minimum.
- SLO_Layer = TPOT SLO / layers; SLO_FFN = `ffn_share` x SLO_Layer (the share of a layer's time its expert GEMMs
  take, which hide the round trip).
- The instances and the server share `total_gpus`: L = (total - server) // gpus_per_instance, and the server's size
  depends on L through LB: iterated from the given L until it repeats.
"""

from __future__ import annotations

import csv
import json
import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

TAU_CONVENTION = "integer tau: the largest tau >= 0 with sum_i Pr[Poisson(lam_i) > tau] >= M (0 if none)"


def zipf_popularity(n: int, s: float) -> np.ndarray:
    """p_i proportional to i^-s for i = 1..n (most popular first)."""
    if n < 1 or s < 0:
        raise ValueError(f"zipf needs n >= 1 and s >= 0, got n={n}, s={s}")
    w = np.arange(1, n + 1, dtype=float) ** -s
    return w / w.sum()


def trace_popularity(path: str | Path) -> tuple[np.ndarray, list[str]]:
    """p_i from a request trace: the share of requests naming each adapter (most popular first), and the adapters.
    JSON lines with an "adapter" field, or CSV with an "adapter" column; rows without one (the base model) are
    left out."""
    path = Path(path)
    counts: Counter[str] = Counter()
    with open(path, newline="") as f:
        if path.suffix == ".csv":
            reader = csv.DictReader(f)
            if reader.fieldnames is None or "adapter" not in reader.fieldnames:
                raise ValueError(f"{path}: no 'adapter' column (columns: {reader.fieldnames})")
            counts.update(row["adapter"] for row in reader if row["adapter"])
        else:
            for k, line in enumerate(f, 1):
                if line.strip():
                    try:
                        adapter = json.loads(line).get("adapter")
                    except (json.JSONDecodeError, AttributeError):
                        raise ValueError(f"{path}:{k}: not a JSON object") from None
                    if adapter:
                        counts[str(adapter)] += 1
    if not counts:
        raise ValueError(f"{path}: no request names an adapter")
    names, c = zip(*counts.most_common())
    p = np.asarray(c, dtype=float)
    return p / p.sum(), list(names)


def poisson_tail(lam: np.ndarray, tau: int) -> np.ndarray:
    """Pr[Poisson(lam) > tau] for integer tau >= 0, elementwise (accurate to the float's resolution)."""
    lam = np.asarray(lam, dtype=float)
    term = np.exp(-lam)  # k = 0
    cdf = term.copy()
    for k in range(1, tau + 1):
        term = term * lam / k
        cdf += term
    return np.clip(1.0 - cdf, 0.0, 1.0)


def tau_for(lam: np.ndarray, m: int) -> int:
    """The integer tau of TAU_CONVENTION for capacity m."""
    if poisson_tail(lam, 0).sum() < m:
        return 0
    lo, hi = 0, 1
    while poisson_tail(lam, hi).sum() >= m:  # the tail sum falls to 0 as tau grows
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if poisson_tail(lam, mid).sum() >= m:
            lo = mid
        else:
            hi = mid
    return lo


def p_free(q: np.ndarray, m: int) -> np.ndarray:
    """P_free(i) = Pr[sum_{j != i} Bernoulli(q_j) <= m - 1] for every i, from truncated prefix and suffix
    distributions (mass above m - 1 is dropped, which never matters for the sum asked)."""
    n = len(q)
    if m <= 0:
        return np.zeros(n)
    pre = np.zeros((n + 1, m))  # pre[i]: count distribution over j < i, counts 0..m-1
    pre[0, 0] = 1.0
    for i in range(n):
        pre[i + 1] = pre[i] * (1 - q[i])
        pre[i + 1, 1:] += pre[i, :-1] * q[i]
    suf = np.zeros((n + 1, m))  # suf[i]: over j >= i
    suf[n, 0] = 1.0
    for i in range(n - 1, -1, -1):
        suf[i] = suf[i + 1] * (1 - q[i])
        suf[i, 1:] += suf[i + 1, :-1] * q[i]
    suf_cdf = np.cumsum(suf, axis=1)  # suf_cdf[i][b] = Pr[count over j >= i <= b]
    # P_free(i) = sum_a pre[i][a] * Pr[count over j > i <= m-1-a]
    return np.einsum("ia,ia->i", pre[:n], suf_cdf[1:, ::-1])


def iar(p: np.ndarray, lb: float, m: int) -> tuple[float, int]:
    """(IAR(m), the tau used) for popularity p and global batch lb (Eq 2-4, TAU_CONVENTION)."""
    p = np.asarray(p, dtype=float)
    if m >= len(p):
        return 1.0, 0
    lam = lb * p
    tau = tau_for(lam, m)
    q = poisson_tail(lam, tau)
    return float(np.sum(p * (q + (1 - q) * p_free(q, m)))), tau


@dataclass(frozen=True)
class CacheResult:
    min_cached_adapters: int
    iar: float
    tau: int
    alpha: float
    global_batch: float
    num_adapters: int
    tau_convention: str = TAU_CONVENTION


def min_cached_adapters(p: np.ndarray, lb: float, alpha: float,
                        progress: Callable[[int], None] | None = None) -> CacheResult:
    """M* = min{M in 1..N : IAR(M) >= alpha} (Eq 1), scanning M upward (module docstring). `progress(m)` is called
    for each M tried. Raises ValueError for alpha outside (0, 1]."""
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    n = len(p)
    for m in range(1, n + 1):  # IAR(N) = 1 >= alpha: the scan always ends
        value, tau = iar(p, lb, m)
        if progress is not None:
            progress(m)
        if value >= alpha:
            return CacheResult(m, value, tau, alpha, lb, n)
    raise AssertionError("unreachable: IAR(N) = 1")


def iar_curve(p: np.ndarray, lb: float, ms: list[int],
              progress: Callable[[int], None] | None = None) -> list[tuple[int, float]]:
    out = []
    for m in ms:
        out.append((m, iar(p, lb, m)[0]))
        if progress is not None:
            progress(m)
    return out


@dataclass(frozen=True)
class StageTimes:
    """The LoRA server's per-instance receive, compute and send times for one MoE layer call, at batch B, on a
    server of `gpus` GPUs (profiled)."""

    gpus: int
    recv_s: float
    compute_s: float
    send_s: float


def load_profile(path: str | Path) -> list[StageTimes]:
    """A profile file: JSON {"<gpus>": {"recv_s": .., "compute_s": .., "send_s": ..}, ...}."""
    raw = json.loads(Path(path).read_text())
    try:
        return sorted((StageTimes(int(g), float(t["recv_s"]), float(t["compute_s"]), float(t["send_s"]))
                       for g, t in raw.items()), key=lambda s: s.gpus)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{path}: expected {{\"<gpus>\": {{\"recv_s\", \"compute_s\", \"send_s\"}}}}: {e}") from None


@dataclass(frozen=True)
class Plan:
    cache: CacheResult
    instances: int
    server_gpus: int
    gpus_for_memory: int
    gpus_for_tpot: int | None
    slo_layer_s: float | None
    slo_ffn_s: float | None
    why: list[str] = field(default_factory=list)
    iterations: int = 1

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(d.pop("cache"))
        return d


def provision(p: np.ndarray, *, batch: int, instances: int, alpha: float, adapter_gb: float, gpu_gb: float,
              profile: list[StageTimes] | None = None, tpot_slo_s: float | None = None,
              num_layers: int | None = None, ffn_share: float = 0.5, total_gpus: int | None = None,
              gpus_per_instance: int = 1, progress: Callable[[int], None] | None = None) -> Plan:
    """The LoRA server for `instances` instances of batch `batch` (§3.2 of the reference): M* for the tail-TTFT SLO,
    GPUs for caching M* adapters of `adapter_gb` in `gpu_gb` each, GPUs for TPOT from `profile` (Eq 5 and 6; needs
    `tpot_slo_s` and `num_layers`), the larger of the two; with `total_gpus`, the instances left beside the server,
    iterated to a fixed point. Raises ValueError for inputs that give no plan."""
    if batch < 1 or instances < 1 or adapter_gb <= 0 or gpu_gb <= 0:
        raise ValueError("batch and instances must be >= 1, adapter_gb and gpu_gb > 0")
    if adapter_gb > gpu_gb:
        raise ValueError(f"one adapter ({adapter_gb} GB) does not fit one GPU's {gpu_gb} GB")
    if profile is not None and (tpot_slo_s is None or num_layers is None):
        raise ValueError("a profile needs the TPOT SLO and the number of layers")
    seen, why = [], []
    plan = None
    for iteration in range(1, 33):
        cache = min_cached_adapters(p, instances * batch, alpha, progress)
        per_gpu = int(gpu_gb // adapter_gb)
        m_mem = math.ceil(cache.min_cached_adapters / per_gpu)
        m_tpot, slo_layer, slo_ffn = None, None, None
        if profile is not None:
            slo_layer = tpot_slo_s / num_layers
            slo_ffn = ffn_share * slo_layer
            for st in profile:
                if (st.recv_s + st.compute_s + st.send_s <= slo_ffn
                        and max(st.recv_s, st.compute_s, st.send_s) * instances <= slo_layer):
                    m_tpot = st.gpus
                    break
            if m_tpot is None:
                raise ValueError(f"no profiled server size meets Eq 5 ({slo_ffn:.4g} s) and Eq 6 ({slo_layer:.4g} s "
                                 f"for {instances} instances): profile larger servers or relax the TPOT SLO")
        server = max(m_mem, m_tpot or 0)
        why = [f"M* = {cache.min_cached_adapters} adapters give IAR {cache.iar:.4f} >= alpha {alpha} at LB = "
               f"{instances} x {batch}",
               f"memory: {cache.min_cached_adapters} x {adapter_gb} GB in GPUs of {gpu_gb} GB ({per_gpu} each) -> "
               f"{m_mem} GPU(s)"]
        if m_tpot is not None:
            why.append(f"TPOT: the smallest profiled server meeting Eq 5 (recv + compute + send <= SLO_FFN = "
                       f"{slo_ffn:.4g} s) and Eq 6 (max stage x {instances} <= SLO_Layer = {slo_layer:.4g} s) has "
                       f"{m_tpot} GPU(s)")
        why.append(f"server: {server} GPU(s), the larger")
        plan = Plan(cache, instances, server, m_mem, m_tpot, slo_layer, slo_ffn, why, iteration)
        if total_gpus is None:
            break
        left = (total_gpus - server) // gpus_per_instance
        if left < 1:
            raise ValueError(f"a server of {server} GPU(s) leaves no instance of {gpus_per_instance} GPU(s) in "
                             f"{total_gpus}")
        if left == instances or left in seen:
            why.append(f"instances: {total_gpus} GPUs - {server} = {left} instance(s) of {gpus_per_instance} "
                       f"(fixed point after {iteration} iteration(s))")
            plan = Plan(cache, left if left == instances else instances, server, m_mem, m_tpot, slo_layer, slo_ffn,
                        why, iteration)
            break
        seen.append(instances)
        instances = left
    return plan


def as_json(plan: Plan, extra: Mapping | None = None) -> str:
    return json.dumps({**plan.as_dict(), **(extra or {})})
