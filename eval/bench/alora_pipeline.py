"""Multi-adapter pipeline benchmark: base turn, aLoRA checks on the same context, base continuation.
Not here: the pipeline workload the live harness and the simulator replay
(eval/workloads/alora_pipeline.py).

Two arms in one run, each a real CPU SGLang server with the bundled adapters, both up for the whole run (the idle
one sleeps), measured in turn, the order alternating per repeat:
- `stock`: SGLang's own prefix cache (each adapter its own namespace), with sgl_multilora's CPU LoRA compute and CPU
  extend attention underneath (SGLang's LoRA layers do not reach the CPU model path, so a CPU "stock" arm needs them);
- `ours`: the same plus `--radix-cache-backend multilora` (aLoRA checks reuse the base model's prefix KV).
For each context length, `--conversations` conversations run at once; each does a base turn over a context of that
many tokens, one check per bundled aLoRA (cycled to `--checks`), then a base continuation, on a flushed cache. TTFT
and end-to-end latency are recorded per turn type; the report (`<out>.md`) gives the median and spread over repeats
and the per-repeat stock / ours ratios.

Usage: .venv/bin/python -m eval.bench.alora_pipeline [--contexts 256 1024 2048] [--repeats 3]
           [--out eval/results/alora_pipeline/alora_pipeline.jsonl]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from eval.bench.results import save
from eval.demo import stream_generate
from sgl_multilora.embedded import ensure_embedded_model
from sgl_multilora.server import cpu_server_args, launch

REPO = Path(__file__).resolve().parents[2]
ARMS = ("stock", "ours")
TURNS = ("base turn", "aLoRA check", "base continuation")
WORDS = ("river city garden music winter stone light market story bridge forest window paper ocean "
         "mountain letter harbor school engine silver").split()


def long_question(tokenizer, num_tokens: int, seed: int) -> str:
    """A user turn of about `num_tokens` tokens (distinct per seed so conversations share nothing)."""
    words, i = [f"Conversation {seed}."], 0
    while len(tokenizer(" ".join(words)).input_ids) < num_tokens - 40:
        words.extend(WORDS[(seed * 7 + i * 3 + j) % len(WORDS)] for j in range(20))
        i += 1
    return " ".join(words) + "\nSummarize the text above in one sentence."


def chat(tokenizer, turns: list[tuple[str, str]], generation_prompt: bool) -> list[int]:
    messages = [{"role": role, "content": text} for role, text in turns]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return tokenizer(text, add_special_tokens=False).input_ids


def conversation(url, tokenizer, aloras, ctx_len, seed, num_checks, records):
    question = long_question(tokenizer, ctx_len, seed)
    base = stream_generate(url, chat(tokenizer, [("user", question)], True), None, 16)
    records.append(("base turn", base))
    turns = [("user", question), ("assistant", base["text"])]
    context = chat(tokenizer, turns, False)
    for i in range(num_checks):
        entry = aloras[i % len(aloras)]
        invocation = tokenizer(entry["invocation_text"], add_special_tokens=False).input_ids
        records.append(("aLoRA check", stream_generate(url, context + invocation, entry["name"], 2)))
    follow = turns + [("user", "Now say it in five words.")]
    records.append(("base continuation", stream_generate(url, chat(tokenizer, follow, True), None, 16)))


def start_arm(arm, model_path, adapters_dir, args):
    extra = ["--multilora-adapter-dir", str(adapters_dir), "--max-loras-per-batch", "8"]
    if arm == "ours":
        extra += ["--radix-cache-backend", "multilora"]
    log_dir = REPO / ".cache" / "bench_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    return launch(model_path, [*cpu_server_args(args.max_total_tokens), *extra],
                  log_path=log_dir / f"alora_pipeline_{arm}.log")


def measure(arm, url, aloras, tokenizer, args, repeat: int) -> list[dict]:
    """One pass over every context length on a flushed cache; one row per (context, turn type)."""
    rows = []
    for ctx_len in args.contexts:
        requests.post(url + "/flush_cache", timeout=60)
        records: list = []
        with ThreadPoolExecutor(max_workers=args.conversations) as pool:
            futures = [pool.submit(conversation, url, tokenizer, aloras, ctx_len, 1000 * ctx_len + c,
                                   args.checks, records) for c in range(args.conversations)]
            for f in futures:
                f.result()
        for turn in TURNS:
            outs = [o for t, o in records if t == turn]
            rows.append({
                "arm": arm, "repeat": repeat, "context_tokens": ctx_len, "turn": turn, "num": len(outs),
                "ttft_s": statistics.mean(o["ttft_s"] for o in outs),
                "e2e_s": statistics.mean(o["e2e_s"] for o in outs),
                "cached_tokens": statistics.mean(o["meta_info"]["cached_tokens"] for o in outs),
                "prompt_tokens": statistics.mean(o["meta_info"]["prompt_tokens"] for o in outs),
                "load_avg": os.getloadavg()[0],
            })
            print(f"  rep {repeat} {arm:5s} ctx {ctx_len:5d} {turn:18s} TTFT {rows[-1]['ttft_s']:.2f} s  "
                  f"cached {rows[-1]['cached_tokens']:.0f}/{rows[-1]['prompt_tokens']:.0f}", flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--conversations", type=int, default=2)
    parser.add_argument("--checks", type=int, default=3, help="aLoRA checks per conversation (2 to 4)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--adapters-dir", type=Path, default=REPO / "assets" / "adapters")
    parser.add_argument("--max-total-tokens", type=int, default=32768)
    parser.add_argument("--out", type=Path, default=REPO / "eval" / "results" / "alora_pipeline" / "alora_pipeline.jsonl")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    model_path = ensure_embedded_model()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    manifest = json.loads((args.adapters_dir / "manifest.json").read_text())
    aloras = [e for e in manifest["adapters"] if e["kind"] == "alora"]
    load_start = list(os.getloadavg())
    servers = {}
    rows = []
    try:
        for arm in ARMS:
            print(f"arm {arm}: starting a CPU server", flush=True)
            servers[arm] = start_arm(arm, model_path, args.adapters_dir, args)
        for rep in range(args.repeats):
            for arm in (ARMS if rep % 2 == 0 else ARMS[::-1]):
                rows += measure(arm, servers[arm].url, aloras, tokenizer, args, rep)
    finally:
        for server in servers.values():
            server.stop()

    setup = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"}
    record = {
        "setup": {**setup, "arms": {
            "stock": "SGLang's prefix cache; sgl_multilora CPU LoRA compute and extend attention",
            "ours": "stock + --radix-cache-backend multilora"},
            "protocol": "both servers up (idle one sleeps); repeats alternate the arm order; cache flushed "
                        "before each context length"},
        "device": {"processor": platform.processor(), "cpu_count": os.cpu_count(), "load_avg_start": load_start,
                   "load_avg_end": list(os.getloadavg())},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "rows": rows,
    }
    save(args.out, record, report)


def _spread(values) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def report(record: dict) -> str:
    """Median (min-max) over repeats of each turn type's mean TTFT, and of the per-repeat stock / ours ratios."""
    rows, s = record["rows"], record["setup"]
    lines = [f"# Multi-adapter pipeline, live CPU servers ({record['date'][:10]})", "",
             f"{s['conversations']} conversations at once per context, {s['checks']} aLoRA checks each; "
             f"{s['repeats']} repeats, arms alternating, caches flushed per context. Machine: {record['device']}.", "",
             "| context | turn | stock TTFT s | ours TTFT s | stock / ours (per repeat) | cached (ours) |",
             "|---:|---|---:|---:|---:|---:|"]
    for ctx_len in s["contexts"]:
        for turn in TURNS:
            by = {(r["arm"], r["repeat"]): r for r in rows if r["context_tokens"] == ctx_len and r["turn"] == turn}
            reps = sorted({rep for _, rep in by})
            st = [by[("stock", rep)]["ttft_s"] for rep in reps if ("stock", rep) in by]
            ou = [by[("ours", rep)]["ttft_s"] for rep in reps if ("ours", rep) in by]
            ratios = [by[("stock", rep)]["ttft_s"] / by[("ours", rep)]["ttft_s"] for rep in reps
                      if ("stock", rep) in by and ("ours", rep) in by]
            if not ratios:
                continue
            cached = statistics.median(by[("ours", rep)]["cached_tokens"] for rep in reps if ("ours", rep) in by)
            prompt = statistics.median(by[("ours", rep)]["prompt_tokens"] for rep in reps if ("ours", rep) in by)
            lines.append(f"| {ctx_len} | {turn} | {_spread(st)} | {_spread(ou)} | {_spread(ratios)}x | "
                         f"{cached:.0f}/{prompt:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
