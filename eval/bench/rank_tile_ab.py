"""The segmented kernels' one-tile path against their general rank path, interleaved on one GPU (one JSON line).

A launch whose largest rank fits one rank tile (`tiles.one_tile`) compiles the kernels without the rank split and
the rank loop (`tiles.ONE_TILE_PATH`); this times the same launch both ways on the same weights, arms alternating
shape by shape and round by round, so the ratio is free of the drift between machines and days. Shapes: the
Llama-3-8B projections of `lora_kernels.py` at ranks 8, 16 and 32 (one tile: the arms differ) and 64 (above the
tile: both arms run the general path, so its ratio is the run's noise). Every arm is checked against the torch
reference before it is timed. Report: `python -m eval.bench.rank_tile_ab --report` writes
eval/results/rank_tile_ab/rank_tile_ab.md.

Usage (GPU): python3 -m eval.bench.rank_tile_ab --max-seconds 150 --out eval/results/rank_tile_ab/rank_tile_ab.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from eval.bench.lora_kernels import (ADAPTERS, DECODE_TOKENS, MODULES, PREFILL_TOKENS, device_name, problem,
                                     time_cuda, versions)
from sgl_multilora.segments import SegmentMeta
from sgl_multilora.triton_kernels import tiles
from sgl_multilora.triton_kernels.ops import lora_forward

RESULTS = Path(__file__).resolve().parents[1] / "results" / "rank_tile_ab"
RANKS = (16, 32, 8, 64)
ARMS = {"one_tile": True, "general": False}


def shapes() -> list[tuple]:
    out = [(m, r, t, n, "decode") for r in RANKS for m in MODULES for t in DECODE_TOKENS for n in ADAPTERS if n <= t]
    out += [(m, r, t, n, "prefill") for r in RANKS for m in MODULES for t in PREFILL_TOKENS for n in (1, 8)]
    # The core shapes of every rank first, so a run cut short still covers each rank and module.
    out.sort(key=lambda s: not (s[2] in (1, 32, 256, 2048) and s[3] in (1, 8)))
    return out


def run(max_seconds: float, rounds: int = 3) -> list[dict]:
    dtype, dev = torch.bfloat16, torch.device("cuda")
    began, rows = time.monotonic(), []
    for module, rank, num_tokens, num_adapters, phase in shapes():
        if time.monotonic() - began > max_seconds:
            break
        num_requests = num_tokens if phase == "decode" else max(num_adapters, num_tokens // 512)
        x, base_w, token_slot, weights, _ = problem(module, rank, num_tokens, num_adapters, num_requests, dtype, dev)
        layout = SegmentMeta.build(token_slot, num_adapters)
        y0 = x @ base_w.t()
        y_ref = lora_forward(x, y0.clone(), layout, weights, impl="torch")
        for flag in ARMS.values():
            tiles.ONE_TILE_PATH = flag
            y = lora_forward(x, y0.clone(), layout, weights, impl="triton")
            torch.testing.assert_close(y.float(), y_ref.float(), atol=8e-2, rtol=8e-2)
        times: dict[str, list[float]] = defaultdict(list)
        y = y0.clone()
        for k in range(rounds):  # ABAB..., the first arm alternating by round
            order = list(ARMS.items()) if k % 2 == 0 else list(reversed(ARMS.items()))
            for name, flag in order:
                tiles.ONE_TILE_PATH = flag  # read at capture: each graph holds its arm's launch
                times[name].append(time_cuda(lambda: lora_forward(x, y, layout, weights, impl="triton")))
        tiles.ONE_TILE_PATH = True
        rows.append({"setup": {"module": module, "rank": rank, "num_tokens": num_tokens,
                               "num_adapters": num_adapters, "num_requests": num_requests, "phase": phase,
                               "dtype": "bf16", "one_tile": tiles.one_tile(rank)},
                     "latency_us": {name: statistics.median(v) for name, v in times.items()},
                     "rounds_us": dict(times)})
    return rows


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def report(record: dict) -> str:
    rows = [r for r in record["results"] if "setup" in r]
    lines = [f"# Rank tiles: the one-tile path against the general path, {record['device']}", "",
             f"{record['date']}; torch {record['versions']['torch']}, triton {record['versions']['triton']}. "
             f"Command: `{record['command']}`. " + record["note"], "",
             "one-tile / general latency per shape (median of the rounds' CUDA-graph medians), median (min-max):", "",
             "| rank | phase | module | one-tile / general | shapes |", "|---|---|---|---|---|"]
    groups: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        s = r["setup"]
        groups[(s["rank"], s["phase"], s["module"])].append(r["latency_us"]["one_tile"] / r["latency_us"]["general"])
    for (rank, phase, module), v in sorted(groups.items()):
        lines.append(f"| {rank} | {phase} | {module} | {_spread(v)} | {len(v)} |")
    one = [r["latency_us"]["one_tile"] / r["latency_us"]["general"] for r in rows if r["setup"]["one_tile"]]
    same = [r["latency_us"]["one_tile"] / r["latency_us"]["general"] for r in rows if not r["setup"]["one_tile"]]
    lines += [""]
    if one:
        lines.append(f"Ranks within one tile ({len(one)} shapes): {_spread(one)}; faster on "
                     f"{sum(x < 1 for x in one)}.")
    if same:
        lines.append(f"Rank 64, the same launch in both arms (the run's noise, {len(same)} shapes): {_spread(same)}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-seconds", type=float, default=150.0, help="stop adding shapes after this long")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per shape, arms alternating")
    parser.add_argument("--out", type=Path, default=RESULTS / "rank_tile_ab.jsonl", help="JSON lines appended here")
    parser.add_argument("--report", action="store_true", help="write the report of the last record in --out")
    args = parser.parse_args(argv)
    if args.report:
        record = json.loads(args.out.read_text().strip().splitlines()[-1])
        (RESULTS / "rank_tile_ab.md").write_text(report(record))
        print(report(record))
        return
    if not torch.cuda.is_available():
        sys.exit("rank_tile_ab times CUDA kernels: no GPU here")
    record = {
        "experiment": "rank_tile_ab",
        "command": " ".join(["python3 -m eval.bench.rank_tile_ab", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(),
        "versions": versions(),
        "note": "bf16, Llama-3-8B projection shapes (shrink + expand), uniform popularity (request k on adapter k "
                "mod n), each arm replayed from its own CUDA graph (median of 50), arms interleaved.",
        "results": run(args.max_seconds, args.rounds),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(report(record))
    print(f"appended 1 record ({len(record['results'])} shapes) to {args.out}")


if __name__ == "__main__":
    main()
