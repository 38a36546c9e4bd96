"""What moving a running request between workers costs, live: KV transfer and token transfer + recompute through
the cluster's gateway (sgl_multilora/gateway/carry.py, moves.py) against the same request left where it is.
Not here: the cluster itself, or MELL's packing (simulated in eval/sim/cluster.py).

Two CPU workers with the plugin behind smg and our gateway. Per prompt length (`--lengths`, tokens) and adapter
(the base model and one LoRA), each repeat sends four fresh prompts of that length, one per arm, arm order rotating:
`stay` streams `--new-tokens` greedy tokens where placement put it; `recompute`, `kv` and `kv_relay` are moved to the
other worker (`POST /cluster/migrate` with that kind; `kv` pulled by the destination from the source, worker to
worker, `kv_relay` streamed through the gateway) once `--move-after` tokens are out. Per request: TTFT, the median gap
between chunks, and for a move the stall (the gap from the last chunk before the move to the first one after it:
the abort, for `kv` the export, transfer and import of the KV, the destination's prefill of what did not arrive, and
its first decode step) and the end-to-end time. Greedy tokens of each moved request are checked against the same
prompt left in place (sent once more afterwards). The report gives medians (min-max) over repeats, each stall over
the stay arm's TTFT at that length, the KV stall over the recompute stall per repeat, and the pulled KV stall over
the relayed one.

Usage: .venv/bin/python -m eval.bench.migration_cost [--lengths 256,1024,2048] [--repeats 3]
           [--out eval/results/migration_cost/migration_cost.jsonl]
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
from sgl_multilora.gateway.launch import Cluster
from sgl_multilora.server import cpu_server_args

REPO = Path(__file__).resolve().parents[2]
ADAPTER = "caps"


MOVES = ("recompute", "kv", "kv_relay")
ARMS = ("stay", *MOVES)
# what each moving arm asks `/cluster/migrate` for: a KV transfer goes worker to worker ("pull") or through the gateway
MOVE_BODY = {"recompute": {"kind": "recompute"}, "kv": {"kind": "kv", "route": "pull"},
             "kv_relay": {"kind": "kv", "route": "relay"}}


def run_one(url: str, ids: list[int], lora: str | None, new_tokens: int, rid: str,
            move_after: int | None, kind: str | None = None, admin: dict[str, str] | None = None) -> dict:
    """Streams one request; with `move_after`, moves it (by `kind`; `admin`: the headers `/cluster/migrate` wants)
    once that many tokens are out. Times per chunk."""
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
                res = requests.post(url + "/cluster/migrate", json={"rid": rid, **MOVE_BODY[kind]}, headers=admin,
                                    timeout=60)
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
    parser.add_argument("--out", type=Path, default=REPO / "eval/results/migration_cost/migration_cost.jsonl")
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
            prompts = {arm: prompt_ids(tokenizer, f"migration {tag} {arm}", length) for arm in ARMS}
            order = ARMS[rep % len(ARMS):] + ARMS[:rep % len(ARMS)]
            out = {}
            for arm in order:
                out[arm] = run_one(cluster.url, prompts[arm], lora, args.new_tokens, f"{arm}-{tag}",
                                   None if arm == "stay" else args.move_after, None if arm == "stay" else arm,
                                   cluster.admin_headers)
            row = {"repeat": rep, "length": length, "adapter": lora or "base", "load_avg": os.getloadavg()[0]}
            for arm in MOVES:
                # the moved request's tokens against the same prompt left in place (its prefix is cached by now,
                # which changes no greedy token)
                check = run_one(cluster.url, prompts[arm], lora, args.new_tokens, f"check-{arm}-{tag}", None)
                row[f"{arm}_tokens_equal"] = check["output_ids"] == out[arm]["output_ids"]
            for arm in ARMS:
                row.update({f"{arm}_{k}": v for k, v in out[arm].items() if k != "output_ids"})
            rows.append(row)
            bar.write(f"rep {rep} {length:5d} tokens {row['adapter']:5s} TTFT {row['stay_ttft_s']:.2f} s, stall "
                      f"recompute {row['recompute_stall_s']:.2f} s, kv {row['kv_stall_s']:.2f} s (relayed "
                      f"{row['kv_relay_stall_s']:.2f} s) "
                      f"({row['kv_migrations'][0].get('kv_tokens')} tokens moved), tokens equal "
                      f"{row['recompute_tokens_equal']} {row['kv_tokens_equal']} {row['kv_relay_tokens_equal']}")
            bar.update(1)
        view = requests.get(cluster.url + "/cluster/stats", timeout=60).json()
        moves = {**view["migrations"], "kv_pulled": view["kv_transfer"]["pulled"],
                 "kv_relayed": view["kv_transfer"]["relayed"]}
    setup = {"workers": 2, "lengths": lengths, "new_tokens": args.new_tokens, "move_after": args.move_after,
                  "repeats": args.repeats, "adapters": ["base", ADAPTER], "max_total_tokens": args.max_total_tokens,
                  "worker_args": worker_args[2:], "router": "smg 1.13.0", "migrations_counted": moves,
                  "protocol": "fresh prompt per request; arm order rotates per repeat; one request at a time"}
    record = run_record(setup, rows, load_start)
    save(args.out, record, report)



def report(record: dict) -> str:
    s, rows = record["setup"], record["rows"]
    title = f"# Moving a running request between workers: KV transfer vs token transfer + recompute ({record['date'][:10]})"
    lines = [title, "",
             (f"Two CPU workers behind smg and the gateway; {s['new_tokens']} greedy tokens per request, moved after "
              f"{s['move_after']}; {s['repeats']} repeats; {s['protocol']}. Machine: {record['device']}. Stall: the "
              f"gap in the client's stream at the move. Medians (min-max) over repeats."), "",
             ("| prompt tokens | adapter | stay TTFT s | recompute stall s | kv stall s | kv / recompute stall | "
              "recompute stall / TTFT | kv stall / TTFT | kv stall relayed s | kv pulled / relayed stall | "
              "KV moved (tokens, MB) | inter-chunk gap s | tokens equal (recompute, kv, kv relayed) |"),
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for length in s["lengths"]:
        for adapter in s["adapters"]:
            rs = [r for r in rows if r["length"] == length and r["adapter"] == adapter]
            if not rs:
                continue
            moved = [r["kv_migrations"][0] for r in rs]
            tokens = statistics.median(m.get("kv_tokens") or 0 for m in moved)
            mb = statistics.median((m.get("kv_bytes") or 0) / 1e6 for m in moved)
            lines.append(
                f"| {length} | {adapter} | {median_range([r['stay_ttft_s'] for r in rs])} | "
                f"{median_range([r['recompute_stall_s'] for r in rs])} | {median_range([r['kv_stall_s'] for r in rs])} | "
                f"{median_range([r['kv_stall_s'] / r['recompute_stall_s'] for r in rs])} | "
                f"{median_range([r['recompute_stall_s'] / r['stay_ttft_s'] for r in rs])} | "
                f"{median_range([r['kv_stall_s'] / r['stay_ttft_s'] for r in rs])} | "
                f"{median_range([r['kv_relay_stall_s'] for r in rs])} | "
                f"{median_range([r['kv_stall_s'] / r['kv_relay_stall_s'] for r in rs])} | {tokens:.0f}, {mb:.1f} | "
                f"{median_range([r['stay_median_gap_s'] for r in rs], '{:.3f}')} | "
                f"{sum(r['recompute_tokens_equal'] for r in rs)}/{len(rs)}, {sum(r['kv_tokens_equal'] for r in rs)}/"
                f"{len(rs)}, {sum(r['kv_relay_tokens_equal'] for r in rs)}/{len(rs)} |")
    lines += ["", f"Moves counted by the gateway: {s['migrations_counted']}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
