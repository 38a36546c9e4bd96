"""The simulator's LoRA step term, fitted to our segmented Triton kernels measured on an H100
(eval/results/lora_step_gpu/lora_step_gpu.jsonl, `eval/bench/lora_step_gpu.py`).

Lives here: `LoRACostModel` (microseconds of one layer's LoRA work for a batch of (tokens, rank, targets) per
adapter) and its fit (`fit`, non-negative least squares on relative error). Not here: the rest of a step
(`latency.py`) or the fit's report (`lora_cost_report.py`, which writes eval/results/lora_step_gpu/lora_step_gpu.md).

Per module group g (qkv, o, gate_up, down) of a layer, over the adapters of the batch that target g, with T their
tokens, n their number, c_a / r_a an adapter's tokens and rank, and BM the kernels' token block for (T, n):
    us_g = k0 + k1 T + k2 sum_a c_a r_a + k3 sum_a r_a + k4 n + k5 n ceil(T / BM) + k6 sum_a ceil(c_a / BM)
(launch and fixed cost; activations read and written; the rank-proportional math; weights read; per-adapter
setup; the programs the grid launches, most of which exit at once; the token blocks that do work), one set of k per
group and per rank class (the batch's largest rank rounded up to a power of two, 16 to 128: it sets the launch, the
rank tiles and split-K, so the costs differ by class). A layer is the sum over groups; a step, the layer times the
layer count.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sgl_multilora.triton_kernels import tiles
from sgl_multilora.triton_kernels.tiles import token_block

RESULTS = Path(__file__).resolve().parents[1] / "results" / "lora_step_gpu"
GRID = RESULTS / "lora_step_gpu.jsonl"
OTHER_GPUS = (RESULTS / "lora_step_gpu_h200.jsonl",)  # the same benchmark on other GPUs: the fit checked there
GROUPS = {  # module group -> the projections it fuses (a group runs when an adapter targets any of them)
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
ALL_GROUPS = frozenset(GROUPS)
FEATURES = ("fixed", "tokens", "tokens_x_rank", "ranks", "adapters", "programs", "token_blocks")
RANK_BLOCKS = (16, 32, 64, 128)


def rank_block(max_rank: int) -> int:
    """The fit's rank class of a batch: its largest rank rounded up to a power of two, within 16..128 (the grid's
    ranks; a batch with a wider rank is costed with the class of 128)."""
    return min(RANK_BLOCKS[-1], max(RANK_BLOCKS[0], 1 << (max(max_rank, 1) - 1).bit_length()))


def features(counts: Sequence[int], ranks: Sequence[int]) -> list[float]:
    """The fit's features for one group's adapters (tokens per adapter, ranks), in FEATURES order."""
    n, t = len(counts), sum(counts)
    bm = token_block(t, n)
    return [1.0, t, sum(c * r for c, r in zip(counts, ranks)), sum(ranks), n, n * -(-t // bm),
            sum(-(-c // bm) for c in counts)]


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson and Hanson's active-set method)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(3 * n + 3):
        w = a.T @ (b - a @ x)
        if passive.all() or w[~passive].max() <= 1e-10 * max(1.0, np.abs(w).max()):
            break
        passive[int(np.argmax(np.where(passive, -np.inf, w)))] = True
        for _ in range(3 * n + 3):
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            step = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + step * (z - x)
            passive &= x > 1e-12
            x[~passive] = 0.0
    return x


def _results(path: Path) -> tuple[list[dict], list[dict]]:
    """(grid shapes, held-out layers) of the newest record in `path`."""
    last = json.loads([line for line in path.read_text().splitlines() if line.strip()][-1])
    rows = [r for r in last["results"] if "setup" in r and not r.get("repeat")]
    return rows, [r for r in last["results"] if "layer" in r]


def measured_us(r: dict, chunk: int | None = None) -> float:
    """A row's microseconds at the kernels' rank tile (`tiles.RANK_CHUNK` unless `chunk`; `multilora_triton` where
    the row timed one tiling only)."""
    lat = r["latency_us"]
    chunk = tiles.RANK_CHUNK if chunk is None else chunk
    return lat["rank_chunk"][str(chunk)] if "rank_chunk" in lat else lat["multilora_triton"]


@dataclass(frozen=True)
class LoRACostModel:
    """Fitted coefficients: (group, rank class) -> k0..k6 (microseconds per feature unit)."""

    coef: dict[tuple[str, int], tuple[float, ...]]

    def group_us(self, group: str, counts: Sequence[int], ranks: Sequence[int]) -> float:
        if not counts:
            return 0.0
        k = self.coef[(group, rank_block(max(ranks)))]
        return float(sum(a * b for a, b in zip(k, features(counts, ranks))))

    def layer_us(self, batch: Iterable[tuple]) -> float:
        """One layer's LoRA microseconds for `batch`: (tokens, rank, groups targeted, ...) per adapter in the
        step (eval/sim/latency.py `LoRABatch`)."""
        per_group: dict[str, tuple[list[int], list[int]]] = {g: ([], []) for g in GROUPS}
        for count, rank, groups, *_ in batch:
            if count:
                for g in groups:
                    per_group[g][0].append(count)
                    per_group[g][1].append(rank)
        return sum(self.group_us(g, c, r) for g, (c, r) in per_group.items())


def groups_of(target_modules: Iterable[str]) -> frozenset[str]:
    """The module groups an adapter's target modules run in."""
    targets = set(target_modules)
    return frozenset(g for g, projections in GROUPS.items() if targets & set(projections))


def fit(rows: list[dict]) -> LoRACostModel:
    """One NNLS fit per (group, rank class), minimising relative error (each row weighted by 1 / measured)."""
    coef = {}
    for group in GROUPS:
        for block in RANK_BLOCKS:
            sel = [r for r in rows if r["setup"]["module"] == group and rank_block(max(r["setup"]["ranks"])) == block]
            if not sel:
                raise ValueError(f"no measurements for group {group} in rank class {block}")
            x = np.array([features(r["setup"]["tokens_per_adapter"], r["setup"]["ranks"]) for r in sel])
            y = np.array([measured_us(r) for r in sel])
            coef[(group, block)] = tuple(float(v) for v in nnls(x / y[:, None], np.ones(len(y))))
    return LoRACostModel(coef)


@functools.cache
def measured_model(path: Path = GRID) -> LoRACostModel:
    """The model fitted to the committed grid (cached per process)."""
    return fit(_results(path)[0])


def layer_batch(comp: dict) -> list[tuple[int, int, frozenset[str]]]:
    """A held-out composition (eval/bench/lora_step_gpu.py `compositions`) as `layer_us` input."""
    from eval.bench.lora_step_gpu import GROUP_TARGETS

    return [(c, r, frozenset(GROUP_TARGETS[t])) for c, r, t in
            zip(comp["tokens_per_adapter"], comp["ranks"], comp["targets"])]
