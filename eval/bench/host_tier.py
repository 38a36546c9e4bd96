"""Live CPU servers: returning chat turns with the host tier (history copied back) against the same server without
it (history recomputed), and what stock SGLang's own host tier (HiCache) does on this path.

Arms (the same build, flags and device pool; random PEFT adapters named and ranked as the workload's):
- `host`: `--radix-cache-backend multilora --multilora-host-kv-gb G`: KV the pool evicts goes to a host tier of
  G GB and is copied back when its conversation returns;
- `no-host`: `--radix-cache-backend multilora`: evicted history is recomputed.
- `stock-hicache` (checked, not replayed unless it starts): stock SGLang (no plugin) with
  `--enable-hierarchical-cache --hicache-size G` on the same device pool; the record keeps what it answered.
Workload: chatbot conversations with a long first message of their own (`first_turn_tokens`, a pasted document),
so every returning turn carries a history of about that many tokens, and think times long enough for the other
conversations' KV to push it out of the device pool. Both servers start once (idle ones sleep); every repeat
replays the workload on each arm, arms alternating, each on a flushed cache (a flush empties the host tier too).

Reported per repeat: TTFT of first turns and of returning turns (mean, P50, P99), by history length, and the
host tier's counters (tokens spilled, copied back, dropped) next to the prefill tokens each arm computed; the
headline is the ratio of returning-turn TTFT no-host / host (median and spread over repeats).

Usage: .venv/bin/python -m eval.bench.host_tier [--repeats 3] [--pool-tokens 4000] [--host-kv-gb 2]
           [--param first_turn_tokens=2000] [--out eval/results/host_tier/host_tier.jsonl] [--hicache-check-only]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import requests
from tqdm import tqdm

from eval.bench.results import nearest_rank, save
from eval.live.adapters import CACHE, make_adapters
from eval.live.arms import flush
from eval.live.driver import ServedAdapter, Target, replay
from eval.workloads import create_workload
from sgl_multilora.server import cpu_server_args, free_port, launch

REPO = Path(__file__).resolve().parents[2]
WORKLOAD = {"num_conversations": 14, "num_adapters": 4, "ranks": [16], "conversation_rate": 0.25,
            "mean_turns": 3.0, "think_time_s": 25.0, "mean_new_tokens": 40.0, "mean_output_tokens": 24.0,
            "system_tokens": 0, "first_turn_tokens": 2000}
HISTORY_BINS = (0, 1000, 1800, 2600, 10**9)


def summarize(results) -> dict:
    """TTFT of first and returning turns (by history length) and the cached-token shares."""
    ok = [r for r in results if r.error is None and r.ttft_s is not None]
    out = {"num_ok": len(ok), "num_failed": len(results) - len(ok)}
    for label, group in (("first", [r for r in ok if r.extra.get("turn") == 0]),
                         ("returning", [r for r in ok if r.extra.get("turn", 0) > 0])):
        if not group:
            continue
        ttft = [r.ttft_s for r in group]
        out[label] = {"n": len(group), "mean_ttft_s": statistics.fmean(ttft), "p50_ttft_s": nearest_rank(ttft, 50),
                      "p99_ttft_s": nearest_rank(ttft, 99), "mean_prompt_tokens": statistics.fmean(r.prompt_tokens
                                                                                         for r in group),
                      "cached_token_share": sum(r.cached_tokens for r in group)
                      / max(1, sum(r.prompt_tokens for r in group))}
    returning = [r for r in ok if r.extra.get("turn", 0) > 0]
    bins = []
    for lo, hi in zip(HISTORY_BINS, HISTORY_BINS[1:]):
        group = [r.ttft_s for r in returning if lo <= r.prompt_tokens < hi]
        if group:
            bins.append({"prompt_tokens": [lo, hi], "n": len(group), "mean_ttft_s": statistics.fmean(group),
                         "p50_ttft_s": nearest_rank(group, 50)})
    out["returning_by_prompt_tokens"] = bins
    return out


def probe(url: str, tokenizer, adapters: list[str | None], num_conversations: int, context_tokens: int,
          seed: int) -> list[dict]:
    """One request at a time (no queueing): conversation i's first turn (a fresh ~context_tokens message), and after
    it the returning turn of conversation i - 2, whose history the two newer ones have pushed out of the device pool.
    Returns one row per request: turn, prompt and cached tokens, TTFT."""
    from eval.bench.alora_pipeline import chat, long_question
    from eval.demo import stream_generate

    rows, history = [], {}

    def send(conv: int, turn: str, ids: list[int]):
        out = stream_generate(url, ids, adapters[conv % len(adapters)], 8)
        meta = out["meta_info"]
        rows.append({"conversation": conv, "turn": turn, "ttft_s": out["ttft_s"], "prompt_tokens":
                     meta["prompt_tokens"], "cached_tokens": meta.get("cached_tokens", 0)})
        return out["text"]

    for i in range(num_conversations):
        question = long_question(tokenizer, context_tokens, 7919 * seed + i)
        answer = send(i, "first", chat(tokenizer, [("user", question)], True))
        history[i] = [("user", question), ("assistant", answer)]
        j = i - 2
        if j >= 0:
            send(j, "returning", chat(tokenizer, [*history[j], ("user", "And in three words?")], True))
    return rows


def memory_stats(url: str) -> dict:
    m = requests.get(url + "/multilora/stats", timeout=60).json()["memory"][0].get("unified_pool") or {}
    return {"host_tier": m.get("host_tier"), "prefill_tokens": m.get("prefill_tokens"),
            "swapper": m.get("swapper")}


def summarize_probe(rows: list[dict]) -> dict:
    """The probe's rows in `summarize`'s shape (first / returning turns), the rows kept."""
    out = {"num_ok": len(rows), "num_failed": 0, "rows": rows, "returning_by_prompt_tokens": []}
    for label in ("first", "returning"):
        group = [r for r in rows if r["turn"] == label]
        ttft = [r["ttft_s"] for r in group]
        out[label] = {"n": len(group), "mean_ttft_s": statistics.fmean(ttft), "p50_ttft_s": nearest_rank(ttft, 50),
                      "p99_ttft_s": nearest_rank(ttft, 99),
                      "mean_prompt_tokens": statistics.fmean(r["prompt_tokens"] for r in group),
                      "cached_token_share": sum(r["cached_tokens"] for r in group)
                      / max(1, sum(r["prompt_tokens"] for r in group))}
    return out


def _delta(before: dict | None, after: dict | None) -> dict | None:
    """Counters of one replay: lifetime counters after minus before (sizes and rates as they are after)."""
    if after is None:
        return None
    cumulative = ("tokens", "spills", "runs", "restores", "load_backs", "declined", "evictions", "slots", "loads",
                  "prefetches")
    return {k: (v - (before or {}).get(k, 0) if isinstance(v, int) and k.endswith(cumulative)
                and not k.startswith(("capacity", "used")) else v) for k, v in after.items()}


def check_stock_hicache(model: str, pool_tokens: int, host_kv_gb: float, log_path: Path) -> dict:
    """Starts stock SGLang (no plugin) with HiCache on this path and records whether it serves one request."""
    port = free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--port", str(port),
           *cpu_server_args(max_total_tokens=pool_tokens), "--enable-hierarchical-cache",
           "--hicache-size", str(max(1, round(host_kv_gb)))]  # SGLang takes whole GB
    env = {**os.environ, "SGLANG_PLUGINS": "no-such-plugin"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline, served = time.monotonic() + 240, False
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                r = requests.post(f"http://127.0.0.1:{port}/generate", timeout=30,
                                  json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}})
                served = r.status_code == 200
                break
            except requests.RequestException:
                time.sleep(3)
        proc.kill()
        proc.wait()
    lines = log_path.read_text(errors="replace").splitlines()
    errors = [ln.strip() for ln in lines if "Error" in ln and "Ignore import error" not in ln]
    where = [ln.strip() for ln in lines if 'File "' in ln and "sglang" in ln]
    return {"command": " ".join(cmd[1:]), "served": served, "error": errors[-1] if errors else None,
            "last_sglang_frame": where[-1] if where else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pool-tokens", type=int, default=4000, help="device pool (token slots) of every arm")
    parser.add_argument("--host-kv-gb", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--param", action="append", default=[], help="workload parameter NAME=VALUE")
    parser.add_argument("--mode", choices=["replay", "probe"], default="replay",
                        help="replay: the chatbot workload at its arrival times (queueing included); probe: one "
                        "request at a time, each returning turn after two newer conversations pushed its history out")
    parser.add_argument("--probe-conversations", type=int, default=8)
    parser.add_argument("--skip-hicache-check", action="store_true")
    parser.add_argument("--hicache-check-only", action="store_true",
                        help="run only the stock HiCache check and put it in the last record of --out (and its .md)")
    parser.add_argument("--out", type=Path, default=REPO / "eval/results/host_tier/host_tier.jsonl")
    args = parser.parse_args()

    from sgl_multilora.embedded import ensure_embedded_model

    model = str(ensure_embedded_model())
    log_dir = REPO / ".cache" / "bench_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.hicache_check_only:
        lines = args.out.read_text().splitlines()
        record = json.loads(lines[-1])
        record["stock_hicache"] = check_stock_hicache(model, record["setup"]["pool_tokens"],
                                                      record["setup"]["host_kv_gb"],
                                                      log_dir / "host_tier_stock_hicache.log")
        args.out.write_text("\n".join([*lines[:-1], json.dumps(record)]) + "\n")
        args.out.with_suffix(".md").write_text(report(record))
        print(report(record))
        return
    params = dict(WORKLOAD)
    for item in args.param:
        key, value = item.split("=", 1)
        params[key] = json.loads(value)
    params["ranks"] = tuple(params["ranks"])
    workload = create_workload("chatbot", seed=args.seed, **params)
    adapters_dir = make_adapters(model, workload, CACHE / f"host_tier-{params['num_adapters']}-{params['ranks']}")
    common = ["--multilora-adapter-dir", str(adapters_dir), "--max-loras-per-batch", str(params["num_adapters"]),
              "--max-lora-rank", str(max(params["ranks"])), "--radix-cache-backend", "multilora"]
    arms = {"host": [*common, "--multilora-host-kv-gb", str(args.host_kv_gb)], "no-host": common}
    device = {"processor": platform.processor(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
              "load_avg_start": list(os.getloadavg())}
    hicache = None if args.skip_hicache_check else check_stock_hicache(
        model, args.pool_tokens, args.host_kv_gb, log_dir / "host_tier_stock_hicache.log")
    servers = {}
    try:
        for name, extra in arms.items():
            servers[name] = launch(model, [*cpu_server_args(max_total_tokens=args.pool_tokens), *extra],
                                   log_path=log_dir / f"host_tier_{name}.log")
        served = [ServedAdapter(a.name) for a in workload.adapters]
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        setup = {"mode": args.mode, "probe_conversations": args.probe_conversations, "workload": "chatbot", "params": {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()},
                 "num_requests": len(workload.requests), "pool_tokens": args.pool_tokens,
                 "host_kv_gb": args.host_kv_gb, "repeats": args.repeats, "seed": args.seed,
                 "arms": {name: " ".join(extra[len(common):]) or "(tree, no host tier)" for name, extra in arms.items()}}
        runs = []
        raw = args.out.with_name(args.out.stem + "_requests.jsonl")
        raw.unlink(missing_ok=True)
        order = list(arms)
        with tqdm(total=args.repeats * len(order), desc="replays") as bar:
            for rep in range(args.repeats):
                for name in (order if rep % 2 == 0 else order[::-1]):
                    url = servers[name].url
                    flush(url)
                    time.sleep(1.0)
                    before = memory_stats(url)
                    if args.mode == "probe":
                        rows = probe(url, tokenizer, [a.name for a in workload.adapters], args.probe_conversations,
                                     params["first_turn_tokens"], rep)
                        summary = summarize_probe(rows)
                    else:
                        results = replay(workload, [Target(name, url)], raw, f"rep{rep}", served, timeout_s=900)
                        summary = summarize(results)
                    after = memory_stats(url)
                    runs.append({"arm": name, "repeat": rep, **summary,
                                 "prefill_tokens": (after["prefill_tokens"] or 0) - (before["prefill_tokens"] or 0),
                                 "host_tier": _delta(before["host_tier"], after["host_tier"]),
                                 "swapper": _delta(before["swapper"], after["swapper"]),
                                 "load_avg": list(os.getloadavg())})
                    bar.update(1)
        device["load_avg_end"] = list(os.getloadavg())
        record = {"setup": setup, "device": device, "date": datetime.datetime.now(datetime.UTC).isoformat(),
                  "stock_hicache": hicache, "runs": runs}
        save(args.out, record, report)
    finally:
        for handle in servers.values():
            handle.stop()


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def report(record: dict) -> str:
    s, runs = record["setup"], record["runs"]
    probe_mode = s.get("mode") == "probe"
    what = (f"Probe: one request at a time; {s['probe_conversations']} conversations, each a first turn of about "
            f"{s['params']['first_turn_tokens']} tokens, and the returning turn of each conversation after two newer "
            "ones (its history pushed out of the device pool); no queueing." if probe_mode else
            f"Workload: chatbot {s['params']}, {s['num_requests']} requests (replayed at its arrival times).")
    lines = [f"# Host tier vs recomputation, live CPU server ({record['date'][:10]})", "",
             f"{what} Every arm: device pool "
             f"{s['pool_tokens']} token slots; `host` adds a {s['host_kv_gb']} GB host tier. {s['repeats']} repeats, "
             f"arms alternating, flushed caches. Machine: {record['device']}.", "",
             "| arm | turns | mean TTFT s (min-max over repeats) | P50 TTFT s | P99 TTFT s | mean prompt tokens | "
             "cached share |", "|---|---|---|---|---|---|---|"]
    for arm in ("no-host", "host"):
        for label in ("first", "returning"):
            rs = [r[label] for r in runs if r["arm"] == arm and label in r]
            if not rs:
                continue
            lines.append(f"| {arm} | {label} ({rs[0]['n']}) | {_spread([r['mean_ttft_s'] for r in rs])} | "
                         f"{_spread([r['p50_ttft_s'] for r in rs])} | {_spread([r['p99_ttft_s'] for r in rs])} | "
                         f"{statistics.median(r['mean_prompt_tokens'] for r in rs):.0f} | "
                         f"{statistics.median(r['cached_token_share'] for r in rs):.2f} |")
    if not probe_mode:
        lines += ["", "Returning turns by prompt length (history + new turn), median over repeats of the mean TTFT:", "",
                  "| prompt tokens | no-host s | host s | no-host / host |", "|---|---|---|---|"]
    for lo, hi in zip(HISTORY_BINS, HISTORY_BINS[1:]):
        per = {}
        for arm in ("no-host", "host"):
            vals = [b["mean_ttft_s"] for r in runs if r["arm"] == arm for b in r["returning_by_prompt_tokens"]
                    if b["prompt_tokens"] == [lo, hi]]
            per[arm] = statistics.median(vals) if vals else None
        if per["no-host"] and per["host"]:
            lines.append(f"| {lo}-{hi if hi < 10**9 else ''} | {per['no-host']:.3f} | {per['host']:.3f} | "
                         f"{per['no-host'] / per['host']:.2f}x |")
    ratios = []
    for rep in sorted({r["repeat"] for r in runs}):
        by = {r["arm"]: r for r in runs if r["repeat"] == rep and "returning" in r}
        if "host" in by and "no-host" in by:
            ratios.append(by["no-host"]["returning"]["mean_ttft_s"] / by["host"]["returning"]["mean_ttft_s"])
    if ratios:
        lines += ["", f"**Returning-turn mean TTFT, no-host / host: {_spread(ratios)}x** (per-repeat ratios: "
                  + ", ".join(f"{x:.2f}" for x in ratios) + ")."]
    lines += ["", "Host tier counters (per repeat, host arm) and prefill tokens computed by each arm:", "",
              "| repeat | host: spilled | copied back | dropped | declined | prefill tokens host | no-host |",
              "|---|---|---|---|---|---|---|"]
    for rep in sorted({r["repeat"] for r in runs}):
        by = {r["arm"]: r for r in runs if r["repeat"] == rep}
        h = (by.get("host") or {}).get("host_tier") or {}
        lines.append(f"| {rep} | {h.get('spilled_tokens')} | {h.get('restored_tokens')} | {h.get('dropped_tokens')} "
                     f"| {h.get('declined_tokens')} | {(by.get('host') or {}).get('prefill_tokens')} | "
                     f"{(by.get('no-host') or {}).get('prefill_tokens')} |")
    hc = record.get("stock_hicache")
    if hc is not None:
        lines += ["", f"Stock SGLang with HiCache on the same pool (`{hc['command']}`, no plugin): "
                  + ("served a request." if hc["served"] else
                     f"did not serve: `{hc['error']}` (last SGLang frame: `{hc['last_sglang_frame']}`), so it has "
                     "no arm here.")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
