"""The host tier on a GPU: a history's KV copied back by the server's own store (`patches/host_kv.HostKVStore`)
against recomputing that history's prefill, and how much of a copy hides behind compute on the side stream.

Setup: Llama-3-8B shapes (32 layers, 8 KV heads of 128, bf16), SGLang's per-layer KV buffers, the pinned
slot-major host pool. Recompute: the prefill of the same tokens through a Llama-3-8B-shaped model
(transformers' `LlamaForCausalLM`, random weights, bf16, SDPA attention); it is what a server without a host tier
does for a returning history. Load-back: `store.read` of the history's host slots (one run, or fragmented into
runs of 16) into device slots, timed on the current stream until the KV is scattered into the buffers.
Overlap: a spill (device -> host, side stream) or load-back issued while the current stream runs a fixed amount of
compute; time of both vs each alone. All times are medians of CUDA-event timings after a warm-up.

Not here: SGLang's HiCache, which cannot run here (no SGLang on the lent GPU machine; see eval/results/host_tier/host_tier_probe.md).

Usage: python -m eval.bench.host_copy_gpu [--out eval/results/host_copy_gpu/host_copy_gpu.jsonl] [--tokens 512,2048,8192]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
from pathlib import Path

import torch

from sgl_multilora.patches.host_kv import HostKVStore

OUT = Path(__file__).resolve().parents[1] / "results" / "host_copy_gpu" / "host_copy_gpu.jsonl"
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128


def cuda_ms(fn, reps: int = 7) -> tuple[float, list[float]]:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), times


def llama8b():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=LAYERS,
                         num_attention_heads=32, num_key_value_heads=KV_HEADS, vocab_size=128256,
                         max_position_embeddings=16384, rope_theta=500000.0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    return model.eval()


def fragmented(store: HostKVStore, n: int, run: int) -> list[int]:
    """`n` host slots in runs of `run`, each run apart from the next (every second run of the pool)."""
    ids = [i for start in range(0, 2 * n, 2 * run) for i in range(start, start + run)][:n]
    taken = set(ids)
    store._free = [i for i in range(store.capacity - 1, -1, -1) if i not in taken]
    return ids


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--tokens", default="512,2048,8192")
    args = parser.parse_args(argv)
    token_counts = [int(t) for t in args.tokens.split(",")]
    dev = torch.device("cuda")
    slots = 2 * max(token_counts) + 64
    k = [torch.randn(slots, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    v = [torch.randn(slots, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    bytes_per_token = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2
    model = llama8b()
    results = []
    for n in token_counts:
        ids = torch.randint(0, 128256, (1, n), device=dev)

        def recompute():
            with torch.no_grad():
                model.model(input_ids=ids, use_cache=False)

        recompute_ms, recompute_all = cuda_ms(recompute, reps=5)
        row = {"tokens": n, "kv_bytes": n * bytes_per_token, "recompute_prefill_ms": recompute_ms,
               "recompute_all_ms": recompute_all}
        for layout, run in (("one run", None), ("runs of 16", 16)):
            store = HostKVStore(k, v, capacity=2 * n + 64)
            host = store.alloc(n) if run is None else fragmented(store, n, run)
            dev_slots = list(range(n))
            store.write(host, dev_slots)
            torch.cuda.synchronize()
            read_ms, read_all = cuda_ms(lambda: store.read(host, dev_slots))
            write_ms, _ = cuda_ms(lambda: (store.write(host, dev_slots),
                                           torch.cuda.current_stream().wait_stream(store.copy_stream)))
            row[layout] = {"load_back_ms": read_ms, "load_back_all_ms": read_all, "spill_ms": write_ms,
                           "load_back_GBps": n * bytes_per_token / (read_ms * 1e-3) / 1e9,
                           "recompute_over_load_back": recompute_ms / read_ms}
        # Overlap: compute of about the copy's duration on the current stream, a copy on the side stream.
        store = HostKVStore(k, v, capacity=2 * n + 64)
        host = store.alloc(n)
        store.write(host, list(range(n)))
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        one_mm, _ = cuda_ms(lambda: a @ a)
        reps = max(1, round(row["one run"]["spill_ms"] / one_mm))

        def compute():
            for _ in range(reps):
                a @ a

        def spill_and_compute():
            store.write(host, list(range(n)))
            compute()
            torch.cuda.current_stream().wait_stream(store.copy_stream)

        def load_back_behind_compute():
            compute()  # queued first: the side-stream copy starts at once, beside it
            store.read(host, list(range(n)))

        compute_ms, _ = cuda_ms(compute)
        row["overlap"] = {"compute_ms": compute_ms, "spill_ms": row["one run"]["spill_ms"],
                          "spill_with_compute_ms": cuda_ms(spill_and_compute)[0],
                          "load_back_ms": row["one run"]["load_back_ms"],
                          "load_back_behind_compute_ms": cuda_ms(load_back_behind_compute)[0]}
        results.append(row)
        print(json.dumps(row), flush=True)
    record = {"experiment": "host_copy_gpu",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(), "versions": {"torch": torch.__version__,
                                                                   "python": platform.python_version()},
              "setup": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bf16",
                        "bytes_per_token": bytes_per_token, "model": "Llama-3-8B shape, random weights, SDPA"},
              "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"appended 1 record to {args.out}")


if __name__ == "__main__":
    main()
