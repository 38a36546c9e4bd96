"""The CPU serving path's LoRA op (`--multilora-lora-ops cpu`, the default on a CPU) against the torch references it
replaced there (`--multilora-lora-ops torch`), over one whole forward step's projections, same run.

A step is what the server computes for one batch: every decoder projection of the model (SmolLM2-135M: 30 layers x
q, k, v, o, gate, up, down), each a base linear plus the LoRA delta of the step's adapters, on `T` new tokens spread
over `S` adapters (decode: one token per request, requests dealt to adapters round-robin, so rows interleave;
prefill: a few long requests). Adapter ranks cycle through `--ranks` (the bundled adapters' 16 / 32 / 64 by
default), every adapter on every projection. The two ops are called in turn, `--rounds` times per shape; the report
gives each one's median (min-max) step time, the LoRA share over the base linears alone, and the ratio per round.
Results are checked equal (to float32 rounding) before timing.

    .venv/bin/python -m eval.bench.cpu_lora_op [--rounds 7] [--threads 2] [--out eval/results/cpu_lora_op.jsonl]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from eval.bench.results import median_range, run_record, save
from sgl_multilora.segments import SegmentMeta
from sgl_multilora.triton_kernels.ops import LoRAWeights, lora_forward

HIDDEN, INTERMEDIATE, KV, LAYERS = 576, 1536, 192, 30  # SmolLM2-135M
MODULES = {"q_proj": (HIDDEN, HIDDEN), "k_proj": (HIDDEN, KV), "v_proj": (HIDDEN, KV), "o_proj": (HIDDEN, HIDDEN),
           "gate_proj": (HIDDEN, INTERMEDIATE), "up_proj": (HIDDEN, INTERMEDIATE), "down_proj": (INTERMEDIATE, HIDDEN)}
# (label, requests, new tokens per request, adapters)
SHAPES = [("decode", 8, 1, 4), ("decode", 16, 1, 8), ("decode", 32, 1, 8), ("prefill", 4, 64, 4),
          ("prefill", 2, 256, 1)]
IMPLS = ("torch", "cpu")
RESULTS = Path(__file__).resolve().parents[1] / "results" / "cpu_lora_op.jsonl"


class Step:
    """One step's inputs, base weights and per-projection weight tables (distinct tensors per layer, as served)."""

    def __init__(self, requests: int, tokens: int, adapters: int, ranks: list[int], max_slots: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.layers = []
        for _ in range(LAYERS):
            layer = []
            for i, o in MODULES.values():
                a = [torch.randn(ranks[s % len(ranks)], i, generator=g) * 0.01 for s in range(adapters)]
                b = [torch.randn(o, ranks[s % len(ranks)], generator=g) * 0.01 for s in range(adapters)]
                empty = max_slots - adapters
                table = LoRAWeights.from_list(a + [None] * empty, b + [None] * empty,
                                              [2.0] * adapters + [0.0] * empty, (0, o))
                layer.append((torch.randn(o, i, generator=g) * 0.02, table))
            self.layers.append(layer)
        self.x = {i: torch.randn(requests * tokens, i, generator=g) for i, _ in MODULES.values()}
        self.meta = SegmentMeta.make(requests * tokens, max_slots, "cpu")
        self.meta.prepare_requests([f"adapter-{r % adapters}" for r in range(requests)], [tokens] * requests)

    def run(self, impl: str | None) -> list[torch.Tensor]:
        """The step's outputs (impl None: the base linears alone)."""
        outs = []
        for layer in self.layers:
            for (base, table), (i, _) in zip(layer, MODULES.values()):
                y = F.linear(self.x[i], base)
                if impl is not None:
                    lora_forward(self.x[i], y, self.meta, table, impl=impl)
                outs.append(y)
        return outs


def measure(args) -> list[dict]:
    rows = []
    for label, requests, tokens, adapters in SHAPES:
        step = Step(requests, tokens, adapters, args.ranks, args.max_slots, seed=requests + adapters)
        ref, got = step.run("torch"), step.run("cpu")
        worst = max(float((r - o).abs().max()) for r, o in zip(ref, got))
        if worst > 1e-4:
            raise SystemExit(f"{label} {requests}x{tokens} on {adapters} adapters: ops differ by {worst:.2e}")
        times = {k: [] for k in ("base", *IMPLS)}
        for _ in range(args.rounds):
            for key in times:  # in turn, every round
                t0 = time.perf_counter()
                step.run(None if key == "base" else key)
                times[key].append(time.perf_counter() - t0)
        row = {"shape": label, "requests": requests, "tokens_per_request": tokens, "adapters": adapters,
               "max_abs_diff": worst, "step_s": times,
               "ratio_cpu_over_torch": [c / t for c, t in zip(times["cpu"], times["torch"])],
               "lora_ratio_cpu_over_torch": [(c - b) / (t - b) for c, t, b in
                                             zip(times["cpu"], times["torch"], times["base"])]}
        rows.append(row)
        print(report_row(row), flush=True)
    return rows


def report_row(row: dict) -> str:
    t = row["step_s"]
    ms = {k: [v * 1e3 for v in vs] for k, vs in t.items()}
    base = statistics.median(ms["base"])
    lora = {k: statistics.median(ms[k]) - base for k in IMPLS}
    return (f"| {row['shape']} | {row['requests']} x {row['tokens_per_request']} | {row['adapters']} | "
            f"{median_range(ms['base'], '{:.1f}')} | {median_range(ms['torch'], '{:.1f}')} | "
            f"{median_range(ms['cpu'], '{:.1f}')} | {lora['torch'] / base:.2f}x / {lora['cpu'] / base:.2f}x | "
            f"{median_range(row['ratio_cpu_over_torch'])} | {median_range(row['lora_ratio_cpu_over_torch'])} |")


def report(record: dict) -> str:
    s, d = record["setup"], record["device"]
    lines = [
        f"# CPU LoRA op vs the torch references, one forward step ({record['date'][:10]})", "",
        f"SmolLM2-135M projections ({LAYERS} layers x {len(MODULES)}), fp32, ranks {s['ranks']} cycled over the "
        f"step's adapters, every adapter on every projection, {s['max_slots']} slots; {s['rounds']} rounds, the "
        f"three arms in turn each round; torch threads {s['threads']}. Machine: {d['cpu_count']} CPUs, load "
        f"average {d['load_avg_start'][0]:.2f} at the start, {d['load_avg_end'][0]:.2f} at the end.", "",
        "| step | requests x new tokens | adapters | base linears ms | + LoRA, torch refs ms | + LoRA, cpu op ms "
        "| LoRA / base (torch / cpu) | step cpu / torch | LoRA part cpu / torch |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [report_row(r) for r in record["rows"]]
    lines += ["", "Times are median (min-max) over rounds; the ratios are per round. The LoRA part is a step's time "
              "less the same round's base linears.", "",
              "`.venv/bin/python -m eval.bench.cpu_lora_op " + s["argv"] + "`"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[16, 32, 64])
    p.add_argument("--max-slots", type=int, default=8)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    load = list(os.getloadavg())
    rows = measure(args)
    setup = {"ranks": args.ranks, "rounds": args.rounds, "threads": args.threads, "max_slots": args.max_slots,
             "argv": " ".join(argv) if argv is not None else " ".join(os.sys.argv[1:]), "torch": torch.__version__}
    save(args.out, run_record(setup, rows, load), report)


if __name__ == "__main__":
    main()
