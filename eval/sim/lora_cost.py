"""The simulator's LoRA step term, fitted to our segmented Triton kernels measured on an H100
(eval/results/lora_step_gpu.jsonl, `eval/bench/lora_step_gpu.py`).

Lives here: `LoRACostModel` (microseconds of one layer's LoRA work for a batch of (tokens, rank, targets) per
adapter), its fit (`fit`, non-negative least squares on relative error) and the fit's report
(`python -m eval.sim.lora_cost` writes eval/results/lora_step_gpu.md). Not here: the rest of a step (`latency.py`).

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

RESULTS = Path(__file__).resolve().parents[1] / "results"
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


def _q(values: list[float]) -> str:
    v = sorted(values)
    return f"{np.median(v):.3f} (P90 {np.percentile(v, 90):.3f}, max {v[-1]:.3f})"


def _geomean(values: list[float]) -> float:
    return float(np.exp(np.mean(np.log(values))))


def other_gpu_lines(model: LoRACostModel, paths: Sequence[Path]) -> list[str]:
    """The fit (made on the main grid's GPU) predicting the same benchmark run on other GPUs, and the rank tile
    there: does the simulator's LoRA term carry over to a GPU it was not fitted on?"""
    lines: list[str] = []
    for path in paths:
        head = json.loads([line for line in path.read_text().splitlines() if line.strip()][-1])
        rows, layers = _results(path)
        grid = [model.group_us(r["setup"]["module"], r["setup"]["tokens_per_adapter"], r["setup"]["ranks"])
                / measured_us(r) for r in rows]
        text = (f"{head['date']}; torch {head['versions']['torch']}, triton {head['versions']['triton']}; the same "
                "command and grid generator. The fit above, made on the other GPU and not refitted, predicting this "
                f"one: grid fit / measured {_q(grid)} over {len(rows)} shapes")
        if layers:
            held = [model.layer_us(layer_batch(r["layer"])) / measured_us(r) for r in layers]
            text += f"; held-out whole layers fit / measured {_q(held)} over {len(layers)}"
        for label, sel in (("grid", rows), ("held-out layers", layers)):
            tiles_ = [r["latency_us"]["rank_chunk"] for r in sel if "rank_chunk" in r["latency_us"]]
            if tiles_:
                arms = sorted(tiles_[0], key=int, reverse=True)[1:]
                text += f"; rank tile / 128 on the {label}, median: " + ", ".join(
                    f"{c}: {np.median([x[c] / x['128'] for x in tiles_]):.2f}" for c in arms)
        lines += ["", f"## The same benchmark on another GPU: {head['device']} ({path.name})", "", text + "."]
    return lines


def report(grid: Path = GRID) -> str:
    from eval.sim.latency import LatencyModel

    head = json.loads([line for line in grid.read_text().splitlines() if line.strip()][-1])
    rows, layers = _results(grid)
    model = fit(rows)
    chunks = sorted(rows[0]["latency_us"].get("rank_chunk", {}), key=int, reverse=True)
    lines = [f"# A step's LoRA work on a GPU: {head['device']}", "",
             f"{head['date']}; torch {head['versions']['torch']}, triton {head['versions']['triton']}. Command: "
             "`python3 -m eval.bench.lora_step_gpu --max-seconds 200 --layers 40 --rank-chunks 128,64,32`; report: "
             "`python -m eval.sim.lora_cost`. " + head["note"] + " Every arm of every shape was checked against the "
             "torch reference before it was timed."]
    if chunks:
        lines += ["", "## The kernels' rank tile (RANK_CHUNK), interleaved on the same weights", "",
                  "128 is the tiling before the cap (every adapter of a launch computed at the batch's largest rank, "
                  "rounded up to a power of two). The default was to be the arm of the lowest geometric mean over "
                  f"the grid: {tiles.RANK_CHUNK}. Ratios against 128, median (min-max):", "",
                  "| rank set | shapes | " + " | ".join(f"{c} / 128" for c in chunks[1:]) + " |",
                  "|---|---|" + "---|" * (len(chunks) - 1)]
        for rank_set in sorted({r["setup"]["rank_set"] for r in rows}, key=lambda k: (k == "mixed", len(k), k)):
            sel = [r["latency_us"]["rank_chunk"] for r in rows if r["setup"]["rank_set"] == rank_set]
            cells = []
            for c in chunks[1:]:
                v = [x[c] / x["128"] for x in sel]
                cells.append(f"{np.median(v):.2f} ({min(v):.2f}-{max(v):.2f})")
            lines.append(f"| {rank_set} | {len(sel)} | " + " | ".join(cells) + " |")
        for label, sel in (("grid shapes", [r["latency_us"]["rank_chunk"] for r in rows]),
                           ("held-out layers", [r["latency_us"]["rank_chunk"] for r in layers])):
            if sel:
                lines.append(f"| all {label} | {len(sel)} | " + " | ".join(
                    f"{np.median([x[c] / x['128'] for x in sel]):.2f} (geomean us {_geomean([x[c] for x in sel]):.1f}"
                    f" vs {_geomean([x['128'] for x in sel]):.1f})" for c in chunks[1:]) + " |")
        same = [r["latency_us"]["rank_chunk"] for r in rows if max(r["setup"]["ranks"]) <= min(map(int, chunks))]
        noise = [abs(x[c] / x["128"] - 1) for x in same for c in chunks[1:]]
        lines += ["", f"Run-to-run on one machine: where the arms run the same launch (largest rank <= "
                  f"{min(map(int, chunks))}, {len(same)} shapes), |arm / 128 - 1| {_q(noise)}."]
    lines += ["", f"## The simulator's fit (eval/sim/lora_cost.py), at RANK_CHUNK {tiles.RANK_CHUNK}", "",
              "Per module group and rank class (the batch's largest rank, rounded up), microseconds = k . (fixed, "
              "tokens, tokens x rank, sum of ranks, adapters, programs launched, token blocks), non-negative least "
              "squares on relative error. "
              "|fit / measured - 1| on the grid (in-sample), median (P90, max):", "",
              "| group | rank class | shapes | fit error |", "|---|---|---|---|"]
    for (group, block) in model.coef:
        sel = [r for r in rows if r["setup"]["module"] == group and rank_block(max(r["setup"]["ranks"])) == block]
        err = [abs(model.group_us(group, r["setup"]["tokens_per_adapter"], r["setup"]["ranks"]) / measured_us(r) - 1)
               for r in sel]
        lines.append(f"| {group} | {block} | {len(sel)} | {_q(err)} |")
    if layers:
        err = [model.layer_us(layer_batch(r["layer"])) / measured_us(r) for r in layers]
        lines += ["", f"Held out: {len(layers)} whole layers (the four groups in one graph; tokens log-uniform in "
                  "1..8192, 1..96 adapters of random ranks 8..128, Zipf tokens, a third of the adapters on "
                  f"attention only): fit / measured {_q(err)}; |fit / measured - 1| {_q([abs(e - 1) for e in err])}."]
    lines += other_gpu_lines(model, [p for p in OTHER_GPUS if p.exists()])
    lat = LatencyModel()
    lines += ["", "A step of the simulated Llama-3-8B (32 layers, every adapter on all seven projections), LoRA term "
              "in ms: the fit against the roofline guess it replaces (launch floor 1.02 ms + (weights + tokens x "
              "7.2 MB) / HBM), beside the measured base GEMMs of the four groups x 32 layers (no lm_head) and the "
              "simulator's linear term:", "",
              "| tokens | adapters | ranks | fit | old guess | base GEMMs measured | simulated linear |",
              "|---|---|---|---|---|---|---|"]
    base = {}
    for r in rows:
        base[(r["setup"]["module"], r["setup"]["num_tokens"])] = r["latency_us"]["base_gemm"]
    every = frozenset(GROUPS)
    for tokens, n, ranks in ((1, 1, (16,)), (64, 8, (16,)), (256, 32, (16,)), (256, 32, (8, 16, 32, 64, 128)),
                             (256, 64, (64,)), (1024, 8, (64,)), (8192, 8, (16,)), (8192, 16, (8, 16, 32, 64, 128))):
        rk = [ranks[k % len(ranks)] for k in range(n)]
        counts = [tokens // n + (k < tokens % n) for k in range(n)]
        fit_ms = lat.model.num_layers * model.layer_us([(c, r, every) for c, r in zip(counts, rk)]) / 1e3
        weights = sum(lat.model.adapter_bytes(r, tuple(p for g in GROUPS.values() for p in g)) for r in rk)
        old_ms = 1e3 * (lat.hw.lora_launch_floor_s + (weights + tokens * lat.hw.lora_act_bytes_per_token) / lat._hbm)
        gemm = sum(base.get((g, tokens), float("nan")) for g in GROUPS) * lat.model.num_layers / 1e3
        linear = 1e3 * max(lat.model.weight_bytes / lat._hbm, tokens * 2 * lat.model.num_params / lat._flops)
        label = "8-128" if len(ranks) > 1 else str(ranks[0])
        lines.append(f"| {tokens} | {n} | {label} | {fit_ms:.2f} | {old_ms:.2f} | {gemm:.2f} | {linear:.2f} |")
    return "\n".join(lines) + "\n"


def plot(path: Path, grid: Path = GRID) -> None:
    """Two panels: the rank tile's A/B per rank set (each cap against no cap, every grid shape), and the fit against
    the held-out layers' measured times."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, layers = _results(grid)
    model = fit(rows)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    sets = sorted({r["setup"]["rank_set"] for r in rows}, key=lambda k: (k == "mixed", len(k), k))
    chunks = sorted(rows[0]["latency_us"].get("rank_chunk", {}), key=int, reverse=True)[1:]
    for i, chunk in enumerate(chunks):
        data = [[r["latency_us"]["rank_chunk"][chunk] / r["latency_us"]["rank_chunk"]["128"]
                 for r in rows if r["setup"]["rank_set"] == rs] for rs in sets]
        pos = [k + (i - (len(chunks) - 1) / 2) * 0.35 for k in range(len(sets))]
        box = left.boxplot(data, positions=pos, widths=0.3, showfliers=False, patch_artist=True)
        for patch in box["boxes"]:
            patch.set_facecolor(f"C{i}")
        left.plot([], [], color=f"C{i}", lw=6, label=f"rank tile <= {chunk}")
    left.axhline(1.0, color="gray", lw=0.8)
    left.set_xticks(range(len(sets)), sets)
    left.set_ylabel("time / time at the old tiling (128)")
    left.set_title(f"{len(rows)} batches over the four module groups, arms interleaved")
    left.legend(fontsize=8)
    if layers:
        measured = [measured_us(r) for r in layers]
        fitted = [model.layer_us(layer_batch(r["layer"])) for r in layers]
        right.loglog(measured, fitted, "o", ms=4)
        lo, hi = min(measured + fitted) * 0.8, max(measured + fitted) * 1.25
        right.plot([lo, hi], [lo, hi], color="gray", lw=0.8)
        right.set_xlabel("measured us per layer (held out)")
        right.set_ylabel("simulator's fit, us per layer")
        right.set_title(f"{len(layers)} held-out whole layers, rank tile {tiles.RANK_CHUNK}")
    fig.suptitle(json.loads([line for line in grid.read_text().splitlines() if line.strip()][-1])["device"])
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    text = report()
    out = RESULTS / "lora_step_gpu.md"
    out.write_text(text + "\nPlot: `lora_step_gpu.png` (the rank tile per rank set; the fit against the held-out "
                   "layers).\n")
    plot(RESULTS / "lora_step_gpu.png")
    print(text)
    print(f"wrote {out} and lora_step_gpu.png")


if __name__ == "__main__":
    main()
