"""The report of the simulator's LoRA step term: how well the fit (lora_cost.py) matches the H100 grid it was fitted
to, held-out whole layers and the same benchmark on other GPUs, and the kernels' rank-tile A/B.

Lives here: `report`, `plot` and `python -m eval.sim.lora_cost_report` (writes
eval/results/lora_step_gpu/lora_step_gpu.md and its plot). Not here: the cost model and its fit (lora_cost.py), which the latency model imports; this report
imports the latency model, so it has its own module.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from eval.sim.latency import LatencyModel
from eval.sim.lora_cost import (
    GRID,
    GROUPS,
    OTHER_GPUS,
    RESULTS,
    LoRACostModel,
    _results,
    fit,
    layer_batch,
    measured_us,
    rank_block,
)
from sgl_multilora.triton_kernels import tiles


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
    head = json.loads([line for line in grid.read_text().splitlines() if line.strip()][-1])
    rows, layers = _results(grid)
    model = fit(rows)
    chunks = sorted(rows[0]["latency_us"].get("rank_chunk", {}), key=int, reverse=True)
    lines = [f"# A step's LoRA work on a GPU: {head['device']}", "",
             f"{head['date']}; torch {head['versions']['torch']}, triton {head['versions']['triton']}. Command: "
             "`python3 -m eval.bench.lora_step_gpu --max-seconds 200 --layers 40 --rank-chunks 128,64,32`; report: "
             "`python -m eval.sim.lora_cost_report`. " + head["note"] + " Every arm of every shape was checked "
             "against the torch reference before it was timed."]
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
