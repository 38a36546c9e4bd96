"""What reading adapter weights in place from the unified pool costs the LoRA kernels on a GPU.

The same Triton shrink + expand, the same adapters and batch, two weight layouts: SGLang's stacked slot buffers
(`LoRAWeights.from_stacked`, what `--lora-backend multilora` reads with the pool off) and views of a KV buffer (each
matrix copied into the K / V rows of its own slot run, Llama-3-8B's 1,024-element rows, as `LiveMemory` places them,
read through a `TableSet`: what it reads with the pool on). Then what a rebinding costs the host: refilling the
`TableSet` of all 128 LoRA modules of Llama-3-8B (32 layers x qkv, o, gate_up, down) for 8 batch slots, with
adapters bound for the first time (each adapter's rows computed) and bound again (rows cached). Both replayed
from CUDA graphs, arms interleaved, median of `--repeats` medians; outputs compared first (equal up to the order of
split-K's atomic adds). bf16, Llama-3-8B shapes.
Not here: the kernels (sgl_multilora/triton_kernels/) or how the pool picks slots (sgl_multilora/slot_layout.py).

Usage: python -m eval.bench.pool_views_gpu [--repeats 3] [--out eval/results/pool_views_gpu/pool_views_gpu.jsonl]  (GPU only)
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

from eval.bench.lora_kernels import MODULES, device_name, problem, time_cuda, versions
from sgl_multilora.segments import SegmentMeta
from sgl_multilora.triton_kernels.ops import lora_forward, shrink_buffer
from sgl_multilora.triton_kernels.weights import LoRAWeights, TableSet

OUT = Path(__file__).resolve().parents[1] / "results" / "pool_views_gpu" / "pool_views_gpu.jsonl"
ROW = 8 * 128  # one KV row of Llama-3-8B (8 KV heads x 128), the pool's unit of placement
SHAPES = [  # (tokens, adapters, requests, rank)
    (1, 1, 1, 16), (32, 8, 32, 16), (128, 8, 128, 64), (256, 32, 256, 16), (2048, 4, 8, 16), (8192, 8, 16, 64),
]


def pool_copy(stacked: tuple[torch.Tensor, torch.Tensor], rank: int, k: torch.Tensor, v: torch.Tensor,
              offsets) -> LoRAWeights:
    """Each slot's A (in K's rows) and B (in V's rows) copied into a slot run of its own, runs spread over the
    buffers with a gap between them; the weights as views of those rows."""
    a_buf, b_buf = stacked
    a_views, b_views = [], []
    row = 7
    for s in range(a_buf.shape[0]):
        a, b = a_buf[s], b_buf[s, :, :rank]
        rows = max(-(-a.numel() // ROW), -(-b.numel() // ROW))
        va = k[row:row + rows].view(-1)[: a.numel()].view(a.shape)
        vb = v[row:row + rows].view(-1)[: b.numel()].view(b.shape)
        va.copy_(a)
        vb.copy_(b)
        a_views.append(va)
        b_views.append(vb)
        row += rows + 13
    ts = TableSet({"m": (a_buf.shape[2], offsets)}, len(a_views), rank, a_buf.dtype, a_buf.device)
    ts.refill([{"m": (va, vb)} for va, vb in zip(a_views, b_views)], [1.0] * len(a_views))
    return ts.weights("m")


def measure(module: str, tokens: int, adapters: int, requests: int, rank: int, repeats: int, k, v) -> dict:
    dev = torch.device("cuda")
    x, _, token_slot, stacked_w, bufs = problem(module, rank, tokens, adapters, requests, torch.bfloat16, dev)
    pool_w = pool_copy(bufs, rank, k, v, stacked_w.slice_offsets)
    meta = SegmentMeta.build(token_slot.to(torch.int32), adapters)
    out = stacked_w.out_features
    ys = {name: torch.zeros(tokens, out, dtype=torch.bfloat16, device=dev) for name in ("stacked", "pool")}
    ts = {name: shrink_buffer(tokens, w, dev) for name, w in (("stacked", stacked_w), ("pool", pool_w))}
    arms = {
        "stacked": lambda: lora_forward(x, ys["stacked"].zero_(), meta, stacked_w, impl="triton", t=ts["stacked"]),
        "pool": lambda: lora_forward(x, ys["pool"].zero_(), meta, pool_w, impl="triton", t=ts["pool"]),
    }
    for fn in arms.values():
        fn()
    torch.cuda.synchronize()
    # Equal up to the order of split-K's float32 atomic adds (bf16 outputs): a layout mistake is far larger.
    diff = (ys["stacked"].float() - ys["pool"].float()).abs().max().item()
    scale = ys["stacked"].float().abs().max().item()
    if diff > 1e-2 * scale:
        raise AssertionError(f"{module} {tokens} tokens: the two layouts disagree (max |diff| {diff}, max {scale})")
    times = {name: [] for name in arms}
    for _ in range(repeats):
        for name, fn in arms.items():  # interleaved
            times[name].append(time_cuda(fn))
    med = {name: statistics.median(t) for name, t in times.items()}
    return {"module": module, "tokens": tokens, "adapters": adapters, "requests": requests, "rank": rank,
            "us": times, "stacked_us": med["stacked"], "pool_us": med["pool"],
            "pool_over_stacked": med["pool"] / med["stacked"], "max_abs_diff": diff, "max_abs": scale}


def rebinding_cost(num_slots: int = 8, rank: int = 16, num_adapters: int = 24, repeats: int = 30) -> dict:
    """Host milliseconds per `TableSet.refill` at Llama-3-8B's 128 modules (synchronised: the copy included)."""
    dev = torch.device("cuda")
    offsets = {}
    for module, (in_f, widths) in MODULES.items():
        offs = [0]
        for w in widths:
            offs.append(offs[-1] + w)
        offsets[module] = (in_f, tuple(offs))
    modules = {(layer, m): offsets[m] for layer in range(32) for m in MODULES}
    ts = TableSet(modules, num_slots, 64, torch.bfloat16, dev)
    adapters = [{key: (torch.empty((len(offs) - 1) * rank, in_f, dtype=torch.bfloat16, device=dev),
                       torch.empty(offs[-1], rank, dtype=torch.bfloat16, device=dev))
                 for key, (in_f, offs) in modules.items()} for _ in range(num_adapters)]
    scalings = [1.0] * num_slots

    def timed(slots) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        ts.refill(slots, scalings)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    first = [timed(adapters[i:i + num_slots]) for i in range(0, num_adapters, num_slots)]
    again = [timed([adapters[(i + k) % num_adapters] for k in range(num_slots)]) for i in range(repeats)]
    return {"modules": len(modules), "slots": num_slots, "rank": rank,
            "first_binding_ms": first, "first_binding_ms_median": statistics.median(first),
            "rebinding_ms": again, "rebinding_ms_median": statistics.median(again)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("pool_views_gpu needs a CUDA GPU")
    k = torch.zeros(1 << 16, ROW, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros_like(k)
    rows = []
    for module in MODULES:
        for tokens, adapters, requests, rank in SHAPES:
            row = measure(module, tokens, adapters, requests, rank, args.repeats, k, v)
            print(json.dumps({key: val for key, val in row.items() if key != "us"}), flush=True)
            rows.append(row)
    ratios = sorted(r["pool_over_stacked"] for r in rows)
    record = {"experiment": "pool_views_gpu",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": device_name(), "versions": versions(), "repeats": args.repeats,
              "summary": {"shapes": len(rows), "median_pool_over_stacked": statistics.median(ratios),
                          "min": ratios[0], "max": ratios[-1]},
              "results": rows, "rebinding": rebinding_cost()}
    print(json.dumps({k: v for k, v in record["rebinding"].items() if not isinstance(v, list)}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record["summary"]))


if __name__ == "__main__":
    main()
