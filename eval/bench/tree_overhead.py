"""Tree overhead: match + insert per request, `--radix-cache-backend multilora` vs SGLang's `RadixCache`, one process.
Not here: the tree (sgl_multilora/) or whole-server latency (eval/live/).

The request stream replays the Azure conversation trace (eval/data): each request belongs to one of
`--conversations` multi-turn conversations (a shared system prompt, then the conversation's history), is served by
one of `--adapters` LoRA adapters (Zipf popularity, fixed per conversation) and has the trace's prompt and output
lengths (divided by `--length-divisor` to keep memory small). For each request both caches do what the scheduler
does: match the prompt, then insert prompt + output. Stock SGLang keys adapters by `extra_key = lora_id`; ours
by the structured (namespace, adapter identity) key, through the same class the server uses.

Usage: .venv/bin/python -m eval.bench.tree_overhead [--requests 2000] [--out eval/results/tree_overhead.jsonl]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import platform
import random
import time
from array import array
from pathlib import Path
from types import SimpleNamespace

import torch

DATA = Path(__file__).resolve().parents[1] / "data" / "azure_conv_2023_first2000.csv"


def load_trace(num_requests: int) -> list[tuple[int, int]]:
    with open(DATA) as f:
        rows = [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]
    return [rows[i % len(rows)] for i in range(num_requests)]


def build_stream(args) -> list[dict]:
    rng = random.Random(args.seed)
    weights = [1.0 / (i + 1) ** args.zipf for i in range(args.adapters)]
    conv_adapter = [rng.choices(range(args.adapters), weights)[0] for _ in range(args.conversations)]
    history: list[list[int]] = [[] for _ in range(args.conversations)]
    system = [rng.randrange(1000, 50000) for _ in range(64)]
    stream = []
    for context_len, output_len in load_trace(args.requests):
        c = rng.randrange(args.conversations)
        new_len = max(1, context_len // args.length_divisor - len(history[c]) // 4)
        prompt = system + history[c] + [rng.randrange(1000, 50000) for _ in range(new_len)]
        output = [rng.randrange(1000, 50000) for _ in range(max(1, output_len // args.length_divisor))]
        stream.append({"adapter": conv_adapter[c], "prompt": prompt, "full": prompt + output})
        history[c] = (prompt + output)[64:][-args.max_history :]
    return stream


def run_stock(stream, num_adapters):
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    cache = RadixCache.create_simulated()
    lora_ids = [f"{i:032x}" for i in range(num_adapters)]
    start = time.perf_counter()
    for r in stream:
        extra = lora_ids[r["adapter"]]
        cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", r["prompt"]), extra_key=extra)))
        full = r["full"]
        cache.insert(InsertParams(key=RadixKey(array("q", full), extra_key=extra), value=torch.arange(len(full))))
    elapsed = time.perf_counter() - start

    def count(node):
        return 1 + sum(count(c) for c in node.children.values())

    return elapsed, count(cache.root_node) - 1


def run_ours(stream, num_adapters):
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sgl_multilora.adapters import AdapterSpec
    from sgl_multilora.patches.radix_backend import MultiLoRARadixCache
    from sgl_multilora.patches.state import process_state

    lora_ids = [f"{i:032x}" for i in range(num_adapters)]
    for i, lid in enumerate(lora_ids):  # as the LoRA manager hooks register loaded adapters
        spec = AdapterSpec(f"a{i}", "", f"identity-{i}", 8, 16.0, 2.0, ("q_proj",), None)
        process_state().adapters.add(lid, spec)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None, page_size=1)
    cache = MultiLoRARadixCache(params, model_id="bench-model")
    start = time.perf_counter()
    for i, r in enumerate(stream):
        lid = lora_ids[r["adapter"]]
        req = SimpleNamespace(rid=str(i), lora_id=lid, extra_key=lid, cache_salt=None, origin_input_ids=r["prompt"])
        cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", r["prompt"]), extra_key=lid), req=req))
        full = r["full"]
        cache.tree.insert(cache._key_for_req(req, full), torch.arange(len(full)).tolist())
    elapsed = time.perf_counter() - start
    return elapsed, cache.tree.stats().num_kv_nodes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--conversations", type=int, default=400)
    parser.add_argument("--adapters", type=int, default=20)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--length-divisor", type=int, default=4)
    parser.add_argument("--max-history", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("eval/results/tree_overhead.jsonl"))
    args = parser.parse_args(argv)

    stream = build_stream(args)
    results = {"stock": [], "ours": []}
    nodes = {}
    for _ in range(args.repeats):  # alternate arms so background load hits both alike
        for arm, fn in (("stock", run_stock), ("ours", run_ours)):
            elapsed, nodes[arm] = fn(stream, args.adapters)
            results[arm].append(elapsed)
    per_req_ms = {arm: min(v) / len(stream) * 1000 for arm, v in results.items()}
    record = {
        "setup": {k: v for k, v in vars(args).items() if k != "out"},
        "device": {"processor": platform.processor(), "cpu_count": __import__("os").cpu_count()},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "measurements": {
            "per_request_ms": per_req_ms,
            "ratio_ours_to_stock": per_req_ms["ours"] / per_req_ms["stock"],
            "tree_nodes_at_end": nodes,
            "mean_prompt_tokens": sum(len(r["prompt"]) for r in stream) / len(stream),
            "statistic": f"min of {args.repeats} runs over the whole stream",
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    print("| arm | ms per request (match + insert) | tree nodes at end |")
    print("|---|---:|---:|")
    for arm in ("stock", "ours"):
        print(f"| {arm} | {per_req_ms[arm]:.3f} | {nodes[arm]} |")
    print(f"ratio ours / stock: {record['measurements']['ratio_ours_to_stock']:.2f} "
          f"(mean prompt {record['measurements']['mean_prompt_tokens']:.0f} tokens)")


if __name__ == "__main__":
    main()
