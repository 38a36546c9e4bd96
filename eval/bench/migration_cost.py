"""What moving a running request between workers costs, live: token transfer + recompute through the cluster's
gateway (sgl_multilora/cluster/carry.py) against the same request left where it is.
Not here: the cluster itself, or MELL's packing (simulated in eval/sim/cluster.py).

Two CPU workers with the plugin behind smg and our gateway. Per prompt length (`--lengths`, tokens) and adapter
(the base model and one LoRA), each repeat sends two fresh prompts of that length, one per arm, arm order
alternating: `stay` streams `--new-tokens` greedy tokens where placement put it; `move` is moved to the other worker
(`POST /cluster/migrate`) once `--move-after` tokens are out. Per request: TTFT, the median gap between chunks, and
for `move` the stall (the gap from the last chunk before the move to the first one after it, which holds the abort,
the destination's prefill of prompt + tokens so far, and its first decode step) and the end-to-end time. Greedy
tokens of the two arms are checked equal per prompt (the same prompt is sent once more in the other arm, afterwards,
to compare). The report gives medians (min-max) over repeats, and the stall over the stay arm's TTFT at that
length (a move costs about one prefill of what the request holds).

Usage: .venv/bin/python -m eval.bench.migration_cost [--lengths 256,1024,2048] [--repeats 3]
           [--out eval/results/migration_cost.jsonl]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from pathlib import Path

import requests
from tqdm import tqdm

from eval.bench.results import median_range, run_record, save
from eval.workloads.text import words
from sgl_multilora.cluster.launch import Cluster
from sgl_multilora.server import cpu_server_args

REPO = Path(__file__).resolve().parents[2]
ADAPTER = "caps"


def run_one(url: str, ids: list[int], lora: str | None, new_tokens: int, rid: str,
            move_after: int | None) -> dict:
    """Streams one request; with `move_after`, moves it once that many tokens are out. Times per chunk."""
    body = {"input_ids": ids, "lora_path": lora, "rid": rid, "stream": True,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}
    sent = time.perf_counter()
    times, counts, final, moved_at = [], [], None, None
    with requests.post(url + "/generate", json=body, stream=True, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"request {rid}: {chunk['error']}")
            times.append(time.perf_counter() - sent)
            counts.append(len(chunk["output_ids"]))
            final = chunk
            if move_after is not None and moved_at is None and counts[-1] >= move_after:
                res = requests.post(url + "/cluster/migrate", json={"rid": rid}, timeout=60)
                res.raise_for_status()
                moved_at = len(times) - 1
    gaps = [b - a for a, b in itertools.pairwise(times)]
    row = {"ttft_s": times[0], "e2e_s": times[-1], "median_gap_s": statistics.median(gaps) if gaps else None,
           "output_ids": final["output_ids"], "prompt_tokens": final["meta_info"]["prompt_tokens"]}
    migrations = final["meta_info"].get("migrations") or []
    if move_after is not None:
        if not migrations:
            raise RuntimeError(f"request {rid} finished before its move took effect")
        at = migrations[0]["at_token"]
        after = next(i for i, c in enumerate(counts) if c > at)  # the first chunk the destination produced
        row.update(stall_s=times[after] - times[after - 1], moved_at_token=at, migrations=migrations)
    return row


def prompt_ids(tokenizer, seed_key: str, length: int) -> list[int]:
    ids = tokenizer(words(seed_key, length), add_special_tokens=False)["input_ids"]
    return ids[:length]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="256,1024,2048", help="prompt lengths (tokens)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--move-after", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-total-tokens", type=int, default=8192, help="each worker's pool (token slots)")
    parser.add_argument("--out", type=Path, default=REPO / "eval/results/migration_cost.jsonl")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from sgl_multilora.embedded import ensure_embedded_model

    model = str(ensure_embedded_model())
    tokenizer = AutoTokenizer.from_pretrained(model)
    lengths = [int(x) for x in args.lengths.split(",")]
    worker_args = ["--model-path", model, *cpu_server_args(args.max_total_tokens),
                   "--multilora-adapter-dir", str(REPO / "assets/adapters"), "--max-loras-per-batch", "8",
                   "--max-lora-rank", "32", "--radix-cache-backend", "multilora"]
    load_start = list(os.getloadavg())
    rows = []
    trials = [(rep, length, lora) for rep in range(args.repeats) for length in lengths for lora in (None, ADAPTER)]
    with Cluster(2, worker_args, policy="lora_aware", log_dir=REPO / ".cache/bench_logs/migration_cost") as cluster, \
            tqdm(total=len(trials), desc="trials", unit="trial") as bar:
        for rep, length, lora in trials:
            tag = f"{rep}-{length}-{lora or 'base'}"
            prompts = {arm: prompt_ids(tokenizer, f"migration {tag} {arm}", length) for arm in ("stay", "move")}
            order = ("stay", "move") if rep % 2 == 0 else ("move", "stay")
            out = {}
            for arm in order:
                out[arm] = run_one(cluster.url, prompts[arm], lora, args.new_tokens, f"{arm}-{tag}",
                                   args.move_after if arm == "move" else None)
            # the moved request's tokens against the same prompt left in place (its prefix is cached by now, which
            # changes no greedy token)
            check = run_one(cluster.url, prompts["move"], lora, args.new_tokens, f"check-{tag}", None)
            row = {"repeat": rep, "length": length, "adapter": lora or "base", "load_avg": os.getloadavg()[0],
                   "tokens_equal": check["output_ids"] == out["move"]["output_ids"]}
            for arm in ("stay", "move"):
                row.update({f"{arm}_{k}": v for k, v in out[arm].items() if k != "output_ids"})
            rows.append(row)
            bar.write(f"rep {rep} {length:5d} tokens {row['adapter']:5s} TTFT {row['stay_ttft_s']:.2f} s, stall "
                      f"{row['move_stall_s']:.2f} s at token {row['move_moved_at_token']}, e2e stay "
                      f"{row['stay_e2e_s']:.2f} s move {row['move_e2e_s']:.2f} s, tokens equal {row['tokens_equal']}")
            bar.update(1)
        moves = requests.get(cluster.url + "/cluster/stats", timeout=60).json()["migrations"]
    setup = {"workers": 2, "lengths": lengths, "new_tokens": args.new_tokens, "move_after": args.move_after,
                  "repeats": args.repeats, "adapters": ["base", ADAPTER], "max_total_tokens": args.max_total_tokens,
                  "worker_args": worker_args[2:], "router": "smg 1.13.0", "migrations_counted": moves,
                  "protocol": "fresh prompt per request; arms alternate order per repeat; one request at a time"}
    record = run_record(setup, rows, load_start)
    save(args.out, record, report)



def report(record: dict) -> str:
    s, rows = record["setup"], record["rows"]
    lines = [f"# Moving a running request between workers: token transfer + recompute ({record['date'][:10]})", "",
             (f"Two CPU workers behind smg and the gateway; {s['new_tokens']} greedy tokens per request, moved after "
             f"{s['move_after']}; {s['repeats']} repeats; {s['protocol']}. Machine: {record['device']}."), "",
             ("| prompt tokens | adapter | stay TTFT s | move stall s | stall / TTFT | inter-chunk gap s | "
             "e2e stay s | e2e move s | tokens equal |"),
             "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for length in s["lengths"]:
        for adapter in s["adapters"]:
            rs = [r for r in rows if r["length"] == length and r["adapter"] == adapter]
            if not rs:
                continue
            ratio = [r["move_stall_s"] / r["stay_ttft_s"] for r in rs]
            lines.append(f"| {length} | {adapter} | {median_range([r['stay_ttft_s'] for r in rs])} | "
                         f"{median_range([r['move_stall_s'] for r in rs])} | {median_range(ratio)} | "
                         f"{median_range([r['stay_median_gap_s'] for r in rs], '{:.3f}')} | "
                         f"{median_range([r['stay_e2e_s'] for r in rs])} | {median_range([r['move_e2e_s'] for r in rs])} | "
                         f"{sum(r['tokens_equal'] for r in rs)}/{len(rs)} |")
    lines += ["", f"Moves counted by the gateway: {s['migrations_counted']}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
