"""Tree overhead: the prefix cache's per-request work on the server's path, `--radix-cache-backend multilora` vs
SGLang's `RadixCache`, with eviction, at several KV pool sizes, in one process on the CPU.
Not here: the arms and the scheduler loop (`tree_overhead_arms.py`), the tree itself (sgl_multilora/), whole-server
latency (eval/live/).

The request stream replays the Azure conversation trace (eval/data): each request belongs to one of
`--conversations` multi-turn conversations (a shared system prompt, then the conversation's history; a
conversation starts over once its history passes `--max-history` tokens), is served by
one of `--adapters` LoRA adapters (Zipf popularity, fixed per conversation) and has the trace's prompt and output
lengths (divided by `--length-divisor`). Every arm gets the same stream, a backlog of `--window` waiting requests
and at most `--window` in flight; SGLang's memory objects of `--kv-tokens` slots, so the working set (hundreds of
thousands of tokens) is several times larger than the pool and eviction runs. The first `--warmup` requests fill
the pool; the next `--requests` are timed (mean of each request's cache work, see `tree_overhead_arms.py`). The
arms run interleaved request by request (`drive`), in an order that rotates, so load drifts on a shared machine
hit them alike. Per size the report gives each arm's median (min-max) over repeats, the per-repeat ratios to stock
(arms of one repeat paired), the time by phase, evicted KV tokens (and adapters, unified), the hit rate over the
timed requests and the tree's nodes at the end. After each repeat (not timed) every slot is accounted for, no lock
is left and our tree's invariants hold.

Usage: .venv/bin/python -m eval.bench.tree_overhead [--kv-tokens 20000,60000,200000] [--requests 4000]
           [--warmup 2000] [--repeats 3] [--arms stock,ours,ours:unified] [--out eval/results/tree_overhead/tree_overhead.jsonl]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import os
import platform
import random
import statistics
from pathlib import Path

from eval.bench.results import nearest_rank, save

PHASES = ("admission", "extend_alloc", "checkpoint", "decode_alloc", "release", "pass")
DATA = Path(__file__).resolve().parents[1] / "data" / "azure_conv_2023_first2000.csv"


def load_trace(num_requests: int) -> list[tuple[int, int]]:
    with open(DATA) as f:
        rows = [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]
    return [rows[i % len(rows)] for i in range(num_requests)]


def build_stream(args) -> list[tuple[int, list[int], list[int]]]:
    """(adapter index, prompt, prompt + output) per request; the same for every arm."""
    rng = random.Random(args.seed)
    weights = [1.0 / (i + 1) ** args.zipf for i in range(args.adapters)]
    conv_adapter = [rng.choices(range(args.adapters), weights)[0] for _ in range(args.conversations)]
    history: list[list[int]] = [[] for _ in range(args.conversations)]
    system = [rng.randrange(1000, 50000) for _ in range(64)]
    stream = []
    for context_len, output_len in load_trace(args.warmup + args.requests):
        c = rng.randrange(args.conversations)
        new_len = max(1, context_len // args.length_divisor - len(history[c]) // 4)
        prompt = system + history[c] + [rng.randrange(1000, 50000) for _ in range(new_len)]
        output = [rng.randrange(1000, 50000) for _ in range(max(1, output_len // args.length_divisor))]
        stream.append((conv_adapter[c], prompt, prompt + output))
        # The next turn's prompt extends this one (its prefix is reusable) until the history passes
        # `max_history` tokens; then the conversation starts over (a cut history would share no prefix).
        history[c] = (prompt + output)[64:] if len(prompt) + len(output) - 64 <= args.max_history else []
    return stream


def drive(arms: list[str], kv_tokens: int, stream, lora_ids: list[str], args) -> dict:
    """Drives `stream` through a fresh instance of each arm, interleaved: request i arrives at every arm in turn
    (the order rotates with i), each arm then runs its scheduler iterations until its backlog is below `window`;
    so load drifts on a shared machine hit every arm alike. Ends when every request is released.
    Returns {arm: (driver, index of the request that arrived when KV was first evicted, or None)}."""
    from eval.bench.tree_overhead_arms import Driver

    gc.collect()  # every repeat starts with the same garbage collector state
    drivers = {arm: Driver(arm, kv_tokens, lora_ids, args.window, args.decode_chunk) for arm in arms}
    first_eviction_at = dict.fromkeys(arms)
    for driver in drivers.values():
        driver.timed_from = args.warmup
    for index, (adapter, prompt, full) in enumerate(stream):
        k = index % len(arms)
        for arm in arms[k:] + arms[:k]:
            driver = drivers[arm]
            driver.arrive(index, adapter, prompt, full)
            while len(driver.waiting) >= args.window:  # a backlog of `window` arrived requests
                driver.step()
            if first_eviction_at[arm] is None and driver.evictions()["kv_tokens"]:
                first_eviction_at[arm] = index
    for driver in drivers.values():
        driver.drain()
    return {arm: (drivers[arm], first_eviction_at[arm]) for arm in arms}


def measurements(arm: str, driver, first_eviction_at, args) -> dict:
    """One arm's figures after `drive`. Raises AssertionError if the slots do not add up, a lock is left or
    (ours) a tree invariant breaks after the stream."""
    accounting = driver.accounting()
    assert accounting["available"] + accounting["tree_tokens"] + accounting["adapter_slots"] == driver.kv_tokens, (
        f"{arm}: slots do not add up after the stream: {accounting}")
    assert driver.num_locked_nodes() == 0, f"{arm}: locks left after every request was released"
    if arm != "stock":
        driver.cache.check_invariants()
    times_ms = [s * 1e3 for s in driver.seconds[args.warmup:]]
    phases_ms = {k: v * 1e3 / len(times_ms) for k, v in driver.phase_seconds.items()}
    return {"mean_ms": statistics.fmean(times_ms), "p50_ms": nearest_rank(times_ms, 50),
            "p99_ms": nearest_rank(times_ms, 99), "phases_ms": phases_ms, "hit_tokens": driver.hit_tokens,
            "prompt_tokens": driver.prompt_tokens, "hit_rate": driver.hit_tokens / driver.prompt_tokens,
            "evicted": driver.evictions(), "first_eviction_at_request": first_eviction_at,
            "nodes_at_end": driver.num_nodes(), "accounting": accounting}


def measure_size(kv_tokens: int, stream, lora_ids, args) -> dict:
    arms = args.arms.split(",")
    load_start = os.getloadavg()
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    for r in range(args.repeats):
        order = arms[r % len(arms):] + arms[:r % len(arms)]  # which arm starts the interleaving rotates too
        for arm, (driver, first) in drive(order, kv_tokens, stream, lora_ids, args).items():
            runs[arm].append(measurements(arm, driver, first, args))
    summary = {}
    for arm, rs in runs.items():
        means = [x["mean_ms"] for x in rs]
        summary[arm] = {
            "mean_ms_median": statistics.median(means), "mean_ms_range": [min(means), max(means)],
            "p99_ms_median": statistics.median(x["p99_ms"] for x in rs),
            "phases_ms_median": {k: statistics.median(x["phases_ms"].get(k, 0.0) for x in rs) for k in PHASES},
            "ratio_to_stock_per_repeat": ([a["mean_ms"] / b["mean_ms"] for a, b in zip(rs, runs["stock"])]
                                          if "stock" in runs else None),
            "hit_rate": rs[-1]["hit_rate"], "hit_tokens": rs[-1]["hit_tokens"],
            "evicted": rs[-1]["evicted"], "nodes_at_end": rs[-1]["nodes_at_end"],
            "first_eviction_at_request": rs[-1]["first_eviction_at_request"],
        }
    return {"kv_tokens": kv_tokens, "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
            "summary": summary, "all_runs": runs}


def report(record: dict) -> str:
    s, d = record["setup"], record["device"]
    lines = [
        f"# Tree overhead on the server's per-request path, with eviction ({record['date'][:10]})", "",
        f"Command: `{record['command']}`. {s['requests']} timed requests after {s['warmup']} warm-up requests, "
        f"{s['adapters']} adapters, {s['conversations']} conversations, window {s['window']}, decode chunk "
        f"{s['decode_chunk']}, {s['repeats']} repeats. Machine: {d['processor']}, {d['cpu_count']} cores, "
        f"Python {d['python']}; load average (1 min) per size, start / end: "
        + ", ".join(f"{m['kv_tokens']}: {m['load_avg_start'][0]:.2f} / {m['load_avg_end'][0]:.2f}"
                    for m in record["sizes"]) + ".", "",
        ("Per request: match, lock, extend allocation (evicting when short), req_to_token rows, checkpoint after "
         "prefill, decode allocations, release with checkpoint, through SGLang's own functions on real `Req`s "
         "(`tree_overhead_arms.py`). ms/request: median (min-max) over repeats of the mean over timed requests."), "",
        ("| KV slots | arm | ms/request | p99 ms | ratio to stock (per repeat) | hit rate | hit tokens | "
         "evicted KV tokens (whole stream) | first eviction at request | tree nodes at end |"),
        "|---:|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for m in record["sizes"]:
        for arm, x in m["summary"].items():
            lo, hi = x["mean_ms_range"]
            ratios = x["ratio_to_stock_per_repeat"]
            rt = ", ".join(f"{r:.2f}" for r in ratios) if ratios and arm != "stock" else ""
            lines.append(f"| {m['kv_tokens']} | {arm} | {x['mean_ms_median']:.3f} ({lo:.3f}-{hi:.3f}) | "
                         f"{x['p99_ms_median']:.3f} | {rt} | {x['hit_rate']:.3f} | {x['hit_tokens']} | "
                         f"{_evicted(x['evicted'])} | {x['first_eviction_at_request']} | {x['nodes_at_end']} |")
    lines += ["", ("ms/request by phase (median over repeats; admission = match + lock, and for the unified arm "
                   "the adapter's admission; pass = each admission pass's budget read and, unified, the pool's "
                   "per-pass, per-step and arrival hooks):"), "",
              "| KV slots | arm | " + " | ".join(PHASES) + " |", "|---:|---|" + "---:|" * len(PHASES)]
    for m in record["sizes"]:
        for arm, x in m["summary"].items():
            lines.append(f"| {m['kv_tokens']} | {arm} | "
                         + " | ".join(f"{x['phases_ms_median'][k]:.3f}" for k in PHASES) + " |")
    lines.append("")
    for m in record["sizes"]:
        summary = m["summary"]
        if "stock" not in summary:
            continue
        base = summary["stock"]["hit_tokens"]
        lines.append(f"- {m['kv_tokens']} slots, hit tokens vs stock: " + ", ".join(
            f"{arm} {x['hit_tokens'] - base:+d} ({(x['hit_tokens'] - base) / max(base, 1):+.1%})"
            for arm, x in summary.items() if arm != "stock"))
    return "\n".join(lines) + "\n"


def _evicted(e: dict) -> str:
    if "adapters" not in e:
        return str(e["kv_tokens"])
    return f"{e['kv_tokens']} + {e['adapters']} adapters ({e['adapter_slots']} slots; {e['adapter_loads']} loads)"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-tokens", default="20000,60000,200000", help="comma-separated KV pool sizes (slots)")
    ap.add_argument("--requests", type=int, default=4000, help="timed requests (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=2000, help="requests run before timing starts")
    ap.add_argument("--conversations", type=int, default=400)
    ap.add_argument("--adapters", type=int, default=20)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--length-divisor", type=int, default=4)
    ap.add_argument("--max-history", type=int, default=1024)
    ap.add_argument("--window", type=int, default=8, help="requests in flight at most (and arrived, waiting)")
    ap.add_argument("--decode-chunk", type=int, default=4, help="output tokens allocated per request per step")
    ap.add_argument("--arms", default="stock,ours,ours:unified")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("eval/results/tree_overhead/tree_overhead.jsonl"))
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from eval.bench.tree_overhead_arms import registered_adapters, setup_sglang

    setup_sglang()
    stream = build_stream(args)
    rng = random.Random(args.seed + 1)
    lora_ids = [f"{i:032x}" for i in range(args.adapters)]
    ranks = [rng.choice((8, 16, 32, 64)) for _ in lora_ids]
    sizes = []
    with registered_adapters(lora_ids, ranks):
        for kv_tokens in (int(x) for x in str(args.kv_tokens).split(",")):
            sizes.append(measure_size(kv_tokens, stream, lora_ids, args))
    record = {
        "setup": {k: v for k, v in vars(args).items() if k != "out"} | {"adapter_ranks": ranks},
        "command": ".venv/bin/python -m eval.bench.tree_overhead " + " ".join(argv if argv is not None else
                                                                              __import__("sys").argv[1:]),
        "device": {"processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                   "python": platform.python_version()},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "stream": {"mean_prompt_tokens": statistics.fmean(len(p) for _, p, _ in stream),
                   "mean_output_tokens": statistics.fmean(len(f) - len(p) for _, p, f in stream)},
        "sizes": sizes,
        "statistic": "per arm and size: median (min-max) over repeats of the mean cache work per timed request; "
                     "ratios pair each arm with stock's run of the same repeat",
    }
    save(args.out, record, report)
    return record


if __name__ == "__main__":
    main()
