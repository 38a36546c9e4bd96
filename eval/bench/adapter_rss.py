"""What adapters cost outside the pool: the resident memory (RSS) of a CPU server's processes with many adapters
loaded and used, against the same server with none, for the unified pool and for separate adapter tensors.

Arms (one server each, started one after the other, the same device pool of `--pool-tokens` slots):
- `none`: LoRA enabled for the same ranks and target modules, no adapter loaded;
- `unified`: the random PEFT adapters of the unified-memory benchmark (`--multilora-adapter-dir`), the tree and the
  unified pool: adapters live in KV slots, the process keeps one host copy of each;
- `separate`: the same with `--multilora-stock-baseline memory` (each adapter in its own tensors, for comparison).
In every arm the KV pool is first filled once with base prompts (distinct token ids, more tokens than the pool
holds, so every slot has been written): a buffer's pages count in RSS once written, and the unified arm writes
adapters into pool pages, so every arm's pool is written whole before anything is read (SGLang zero-fills its CPU
pool, so on this path they are resident from the start anyway: RSS after the fill is recorded too). Then one base
request and one request per adapter run (so each adapter has been resident), and the process tree's RSS is read
when idle, in all and split by mapping (the adapters' own files, mapped; anonymous memory; other files). The
report gives each arm's RSS minus `none`'s next to the adapters' weight
bytes (fp32, what one host copy takes): the issue's rule is "memory outside the pool grows by at most one host copy
per adapter loaded".

Usage: .venv/bin/python -m eval.bench.adapter_rss [--pool-tokens 6000] [--out eval/results/adapter_rss/adapter_rss.jsonl]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path

import requests

from eval.bench.soak import process_tree_rss
from eval.live.adapters import CACHE, ELEMS_PER_RANK, NUM_LAYERS, make_adapters
from eval.workloads import create_workload
from sgl_multilora.server import cpu_server_args, launch

REPO = Path(__file__).resolve().parents[2]


FILL_PROMPT_TOKENS = 1000


def rss_by_kind(pid: int, adapters_dir: Path) -> dict[str, int]:
    """Resident bytes of a process tree by kind of mapping: `adapter_files` (pages of the adapters' own files, mapped:
    file-backed, dropped by the OS under pressure and read back), `anonymous` (heap and anonymous maps: what the
    process allocated) and `other` (the model's and libraries' files)."""
    import psutil

    root = str(adapters_dir.resolve())
    out = {"adapter_files": 0, "anonymous": 0, "other": 0}
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    for proc in procs:
        try:
            maps = proc.memory_maps(grouped=True)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for m in maps:
            path = m.path or ""
            kind = ("adapter_files" if path.startswith(root) else
                    "anonymous" if not path.startswith("/") else "other")
            out[kind] += m.rss
    return out


def fill_pool(url: str, pool_tokens: int) -> None:
    """Base prompts of distinct token ids whose KV, cached in the tree, takes more slots than the pool has: every
    slot is written once (the pool fills before anything is evicted)."""
    base, total = 1000, 0
    while total < pool_tokens * 1.2:
        ids = list(range(base, base + FILL_PROMPT_TOKENS))
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        res = requests.post(url + "/generate", json=body, timeout=600)
        res.raise_for_status()
        base, total = base + FILL_PROMPT_TOKENS, total + FILL_PROMPT_TOKENS


def exercise(url: str, names: list[str]) -> None:
    for lora in [None, *names]:
        body = {"text": "Write one line about rivers.", "lora_path": lora,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        res = requests.post(url + "/generate", json=body, timeout=600)
        res.raise_for_status()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool-tokens", type=int, default=6000)
    parser.add_argument("--num-adapters", type=int, default=24)
    parser.add_argument("--ranks", default="16,32,64")
    parser.add_argument("--out", type=Path, default=REPO / "eval/results/adapter_rss/adapter_rss.jsonl")
    args = parser.parse_args(argv)

    from sgl_multilora.embedded import ensure_embedded_model

    model = str(ensure_embedded_model())
    ranks = tuple(int(r) for r in args.ranks.split(","))
    workload = create_workload("chatbot", seed=0, num_adapters=args.num_adapters, ranks=ranks)
    adapters_dir = make_adapters(model, workload, CACHE / f"chatbot-{args.num_adapters}-{args.ranks}")
    modules = sorted({m for a in workload.adapters for m in a.target_modules})
    weight_bytes = sum(NUM_LAYERS * a.rank * sum(ELEMS_PER_RANK[m] for m in a.target_modules) * 4
                       for a in workload.adapters)
    lora = ["--max-loras-per-batch", "4", "--max-lora-rank", str(max(ranks))]
    arms = {
        "none": [*lora, "--enable-lora", "--lora-target-modules", *modules, "--radix-cache-backend", "multilora"],
        "unified": [*lora, "--multilora-adapter-dir", str(adapters_dir), "--radix-cache-backend", "multilora"],
        "separate": [*lora, "--multilora-adapter-dir", str(adapters_dir), "--radix-cache-backend", "multilora",
                     "--multilora-stock-baseline", "memory"],
    }
    log_dir = REPO / ".cache" / "bench_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    rss = {}
    for name, extra in arms.items():
        server = launch(model, [*cpu_server_args(max_total_tokens=args.pool_tokens), *extra],
                        log_path=log_dir / f"adapter_rss_{name}.log")
        try:
            fill_pool(server.url, args.pool_tokens)
            time.sleep(2.0)
            after_fill, _ = process_tree_rss(server.process.pid)
            exercise(server.url, [] if name == "none" else [a.name for a in workload.adapters])
            time.sleep(2.0)
            total, by_process = process_tree_rss(server.process.pid)
            rss[name] = {"total": total, "by_process": by_process, "after_fill": after_fill,
                         "by_kind": rss_by_kind(server.process.pid, adapters_dir)}
            print(f"{name}: RSS {total / 2**20:.0f} MiB", flush=True)
        finally:
            server.stop()
    record = {
        "setup": {"pool_tokens": args.pool_tokens, "num_adapters": args.num_adapters, "ranks": list(ranks),
                  "target_modules": modules, "adapter_weight_bytes": weight_bytes, "arms": arms},
        "device": {"processor": platform.processor(), "cpu_count": os.cpu_count(), "load_avg": list(os.getloadavg())},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "rss": rss,
        "method": "pool filled with base prompts first (every slot written), then one request per adapter",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    mib = 2**20
    lines = [f"# Adapter memory outside the pool ({record['date'][:10]})", "",
             f"{args.num_adapters} random PEFT adapters of rank {', '.join(map(str, ranks))} ({weight_bytes / mib:.0f} "
             f"MiB of fp32 weights: one host copy); every arm {args.pool_tokens} pool slots; RSS of the server's "
             "process tree when idle, after the pool was filled once with base prompts (every slot written, so "
             "pool pages count in every arm alike) and one request per adapter. One run per arm (RSS, not timing).",
             "", "| arm | RSS after the fill MiB | RSS MiB | minus `none` MiB | / one host copy | adapter files "
             "mapped MiB | anonymous MiB | anonymous minus `none` MiB |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in arms:
        delta = rss[name]["total"] - rss["none"]["total"]
        kind, anon_none = rss[name]["by_kind"], rss["none"]["by_kind"]["anonymous"]
        lines.append(f"| {name} | {rss[name]['after_fill'] / mib:.0f} | {rss[name]['total'] / mib:.0f} | "
                     f"{delta / mib:.0f} | {delta / weight_bytes:.2f} | {kind['adapter_files'] / mib:.0f} | "
                     f"{kind['anonymous'] / mib:.0f} | {(kind['anonymous'] - anon_none) / mib:.0f} |")
    lines += ["", "Adapter files mapped: pages of the adapters' own files mapped into the processes (file-backed); "
              "anonymous: what the processes allocated. Since 2026-11-26 13:12 UTC the weights are read into memory "
              "(no tensor maps a file that may be rewritten under the server), so the host copy is anonymous."]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
