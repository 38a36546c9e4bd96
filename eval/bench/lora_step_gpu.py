"""What a step's LoRA work costs on a GPU, as the simulator needs it: our segmented Triton kernels (shrink + expand)
per module group of one Llama-3-8B layer, on batches of mixed ranks and skewed adapter popularity, with the dense
base GEMM of the same group beside them (one JSON line per run). `eval/sim/lora_cost.py` fits the simulator's
LoRA step term to these measurements.
Not here: the kernel-vs-SGLang comparison (`lora_kernels.py`) or the fit (`eval/sim/lora_cost.py`).

Method: bf16; module groups qkv (4096 -> 4096 + 1024 + 1024), o (4096 -> 4096), gate_up (4096 -> 2 x 14336), down
(14336 -> 4096); tokens 1..8192 spread over 1..64 adapters, ranks all one of 8..128 or mixed (adapter k of rank
8, 16, 32, 64, 128 by k mod 5), tokens per adapter uniform or Zipf (s = 1). Each shape is COPIES copies of the op,
each with weights of its own (as successive layers: no weight stays in L2 from one to the next), captured in one CUDA
graph and replayed; the figure is the median replay over the copies. Every shape's first copy is checked against
the torch reference before timing. Shapes run in a seeded random order so a run cut short by --max-seconds still
covers the grid evenly.

Usage (GPU): python3 -m eval.bench.lora_step_gpu [--max-seconds 240] [--out eval/results/lora_step_gpu/lora_step_gpu.jsonl]
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from sgl_multilora.triton_kernels import tiles
from eval.bench.lora_kernels import MODULES, device_name, time_cuda, versions
from sgl_multilora.segments import SegmentMeta
from sgl_multilora.triton_kernels.ops import lora_forward, shrink_buffer
from sgl_multilora.triton_kernels.weights import LoRAWeights

OUT = Path(__file__).resolve().parents[1] / "results" / "lora_step_gpu" / "lora_step_gpu.jsonl"
TOKENS = [1, 4, 16, 64, 256, 1024, 4096, 8192]
ADAPTERS = [1, 4, 16, 64]
RANK_SETS = {"r8": (8,), "r16": (16,), "r32": (32,), "r64": (64,), "r128": (128,), "mixed": (8, 16, 32, 64, 128)}
POPULARITY = ("uniform", "zipf")
COPIES = 4


def tokens_per_adapter(num_tokens: int, num_adapters: int, popularity: str) -> list[int]:
    """How many of the step's tokens each adapter gets: every adapter at least one (num_adapters <= num_tokens),
    the rest evenly or by Zipf weights 1/(k+1)."""
    weights = [1.0] * num_adapters if popularity == "uniform" else [1.0 / (k + 1) for k in range(num_adapters)]
    rest = num_tokens - num_adapters
    total = sum(weights)
    counts = [1 + int(rest * w / total) for w in weights]
    for k in range(num_tokens - sum(counts)):
        counts[k % num_adapters] += 1
    return counts


def build(module: str, ranks: list[int], counts: list[int], gen: torch.Generator, dev: str = "cuda",
          dtype: torch.dtype = torch.bfloat16):
    """One copy: x, base weight, layout, LoRA weights (stacked per slot at the largest rank; slot k of rank
    ranks[k]) for tokens laid out adapter by adapter."""
    in_features, widths = MODULES[module]
    n, n_sl, out, r_max = len(ranks), len(widths), sum(widths), max(ranks)
    a = torch.randn(n, n_sl * r_max, in_features, generator=gen, device=dev, dtype=dtype) / in_features**0.5
    b = torch.randn(n, out, r_max, generator=gen, device=dev, dtype=dtype) / r_max**0.5
    num_tokens = sum(counts)
    x = torch.randn(num_tokens, in_features, generator=gen, device=dev, dtype=dtype)
    base_w = torch.randn(out, in_features, generator=gen, device=dev, dtype=dtype) / in_features**0.5
    slot = torch.repeat_interleave(torch.arange(n, dtype=torch.int32), torch.tensor(counts)).to(dev)
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    weights = LoRAWeights.from_stacked(a, b, offsets, ranks, [1.0] * n)
    layout = SegmentMeta.build(slot, n)
    y = torch.zeros(num_tokens, out, dtype=dtype, device=dev)
    return x, base_w, layout, weights, y, shrink_buffer(num_tokens, weights, x.device)


def time_graph(fns, reps: int = 20) -> float:
    """Median microseconds of one replay of a CUDA graph running every fn once, divided by len(fns)."""
    return time_cuda(lambda: [fn() for fn in fns], reps=reps) / len(fns)


def shapes(seed: int = 0) -> list[tuple]:
    grid = [(m, rs, t, n, p) for m in MODULES for rs in RANK_SETS for t in TOKENS for n in ADAPTERS
            for p in POPULARITY if n <= t and not (n == 1 and p == "zipf")]
    random.Random(seed).shuffle(grid)
    return grid


def chunk_arms(chunks: Sequence[int]) -> Iterator[int]:
    """Sets the kernels' RANK_CHUNK to each of `chunks` in turn (restored after)."""
    saved = tiles.RANK_CHUNK
    try:
        for chunk in chunks:
            tiles.RANK_CHUNK = chunk
            yield chunk
    finally:
        tiles.RANK_CHUNK = saved


def gpu_records(max_seconds: float | None, limit: int | None = None, chunks: Sequence[int] = ()):
    """Per grid shape: our op at the kernels' RANK_CHUNK (`multilora_triton`) and, interleaved on the same weights,
    at each of `chunks` (`rank_chunk`), every arm checked against the torch reference first."""
    began = time.monotonic()
    base_us: dict[tuple[str, int], float] = {}
    grid = shapes()[:limit]
    default = tiles.RANK_CHUNK
    for i, (module, rank_set, num_tokens, num_adapters, popularity) in enumerate(grid):
        if max_seconds is not None and time.monotonic() - began > max_seconds:
            yield {"truncated": f"stopped after {i} of {len(grid)} shapes: --max-seconds {max_seconds:g}"}
            return
        choices = RANK_SETS[rank_set]
        ranks = [choices[k % len(choices)] for k in range(num_adapters)]
        counts = tokens_per_adapter(num_tokens, num_adapters, popularity)
        gen = torch.Generator(device="cuda").manual_seed(i)
        copies = [build(module, ranks, counts, gen) for _ in range(COPIES)]
        x, _, layout, weights, y, t = copies[0]
        ref = lora_forward(x, torch.zeros_like(y), layout, weights, impl="torch")
        by_chunk = {}
        for chunk in chunk_arms([default, *[c for c in chunks if c != default]]):
            got = lora_forward(x, torch.zeros_like(y), layout, weights, impl="triton", t=t)
            torch.testing.assert_close(got.float(), ref.float(), atol=8e-2, rtol=8e-2)
            by_chunk[chunk] = time_graph([lambda c=c: lora_forward(c[0], c[4], c[2], c[3], impl="triton", t=c[5])
                                          for c in copies])
        if (module, num_tokens) not in base_us:
            base_us[(module, num_tokens)] = time_graph([lambda c=c: torch.matmul(c[0], c[1].t()) for c in copies])
        del copies, x, layout, weights, y, t, got, ref
        latency = {"multilora_triton": by_chunk[default], "base_gemm": base_us[(module, num_tokens)]}
        if chunks:
            latency["rank_chunk"] = {str(c): by_chunk[c] for c in chunks}
        yield {
            "setup": {"module": module, "rank_set": rank_set, "num_tokens": num_tokens, "num_adapters": num_adapters,
                      "popularity": popularity, "ranks": ranks, "tokens_per_adapter": counts, "dtype": "bf16",
                      "copies": COPIES, "rank_chunk": default},
            "latency_us": latency,
        }


GROUP_TARGETS = {"all": tuple(MODULES), "attn": ("qkv", "o")}


def compositions(count: int, seed: int = 1) -> list[dict]:
    """Held-out whole-layer batches: tokens log-uniform in [1, 8192] (off the grid), 1..96 adapters of random ranks
    8..128 with Zipf-distributed tokens (exponent 0..1.5), each adapter on every module group or on attention only."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        num_tokens = int(round(2 ** rng.uniform(0, 13)))
        n = rng.randint(1, min(num_tokens, 96))
        s = rng.uniform(0, 1.5)
        weights = [1.0 / (k + 1) ** s for k in range(n)]
        rest, total = num_tokens - n, sum(weights)
        counts = [1 + int(rest * w / total) for w in weights]
        for k in range(num_tokens - sum(counts)):
            counts[k % n] += 1
        ranks = [rng.choice((8, 16, 32, 64, 128)) for _ in range(n)]
        targets = [rng.choice(("all", "all", "attn")) for _ in range(n)]
        out.append({"num_tokens": num_tokens, "tokens_per_adapter": counts, "ranks": ranks, "targets": targets})
    return out


def layer_records(count: int, chunks: Sequence[int] = ()):
    """Each composition's four module groups in one graph (COPIES layers of their own weights): the measured
    microseconds of one layer's LoRA work (at RANK_CHUNK, and at each of `chunks`), to check a fit of the per-group
    grid against."""
    default = tiles.RANK_CHUNK
    for i, comp in enumerate(compositions(count)):
        gen = torch.Generator(device="cuda").manual_seed(10_000 + i)
        fns = []
        for module in MODULES:
            keep = [k for k, tg in enumerate(comp["targets"]) if module in GROUP_TARGETS[tg]]
            if not keep:
                continue
            ranks = [comp["ranks"][k] for k in keep]
            counts = [comp["tokens_per_adapter"][k] for k in keep]
            for _ in range(COPIES):
                c = build(module, ranks, counts, gen)
                fns.append(lambda c=c: lora_forward(c[0], c[4], c[2], c[3], impl="triton", t=c[5]))
        by_chunk = {chunk: time_graph(fns) * len(fns) / COPIES
                    for chunk in chunk_arms([default, *[c for c in chunks if c != default]])}
        del fns
        latency = {"multilora_triton": by_chunk[default]}
        if chunks:
            latency["rank_chunk"] = {str(c): by_chunk[c] for c in chunks}
        yield {"layer": {**comp, "rank_chunk": default}, "latency_us": latency}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-seconds", type=float, default=None, help="stop adding shapes after this long")
    parser.add_argument("--out", type=Path, default=OUT, help=f"one JSON line appended here (default {OUT})")
    parser.add_argument("--layers", type=int, default=0,
                        help="after the grid, this many held-out whole-layer batches (a check of the fit)")
    parser.add_argument("--no-grid", action="store_true", help="skip the per-group grid")
    parser.add_argument("--repeat-grid", type=int, default=0,
                        help="time this many grid shapes (the first of the shuffled grid) a second time (noise)")
    parser.add_argument("--rank-chunks", default="",
                        help="comma-separated RANK_CHUNK values also timed on every shape, interleaved (an A/B)")
    args = parser.parse_args(argv)
    chunks = tuple(int(c) for c in args.rank_chunks.split(",") if c)
    if not torch.cuda.is_available():
        raise SystemExit("lora_step_gpu measures GPU kernels and needs a CUDA device; the fit of its committed "
                         "results runs anywhere: python -m eval.sim.lora_cost_report")
    records = []
    if not args.no_grid:
        for r in gpu_records(args.max_seconds, chunks=chunks):
            records.append(r)
            print(json.dumps(r), flush=True)
    for r in layer_records(args.layers, chunks):
        records.append(r)
        print(json.dumps(r), flush=True)
    if args.repeat_grid:
        for r in gpu_records(None, limit=args.repeat_grid, chunks=chunks):
            r["repeat"] = True
            records.append(r)
            print(json.dumps(r), flush=True)
    record = {
        "experiment": "lora_step_gpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(),
        "versions": versions(),
        "note": "Our Triton LoRA op per module group of one Llama-3-8B layer, bf16, CUDA-graph replay of "
                f"{COPIES} copies with their own weights, median of 20; the group's base GEMM beside it.",
        "results": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"appended 1 record ({len(records)} shapes) to {args.out}")


if __name__ == "__main__":
    main()
