"""Memory-pressure benchmark: concurrent base, LoRA and aLoRA traffic over a working set several times the KV budget.
Not here: the correctness of the same situation against PEFT (tests/e2e/test_memory_pressure.py), or pressure from
adapter weights (eval/bench/unified_memory.py).

Two arms, each a real CPU SGLang server with the bundled adapters and the same `--max-total-tokens`, both up for the
whole run (the idle one sleeps), measured in turn with the order alternating per repeat:
- `stock`: SGLang's own prefix cache (`RadixCache`, each adapter its own `extra_key` namespace, so an aLoRA check
  shares no KV with the base turn it checks), with sgl_multilora's CPU LoRA compute and extend attention underneath
  (SGLang's LoRA layers do not reach the CPU model path, so a CPU "stock" arm needs them);
- `ours`: the same plus `--radix-cache-backend multilora --multilora-stock-baseline memory` (the LoRA-aware tree;
  adapter weights stay outside the KV budget, as in the stock arm, so both trees get the same token slots).

Workload, the same for both arms: `--documents` documents of about `--document-tokens` tokens. A round visits every
document (shuffled per round) with two jobs: a chain (a base turn summarising the document, then an aLoRA check of
that answer: the document, the answer and the adapter's invocation) and a standard-LoRA turn over the same document
(the LoRA adapters cycled). `--concurrency` closed-loop clients take jobs from the round's queue; `--rounds` rounds
run back to back, so later rounds ask for prefixes the tree may have evicted. The cache is flushed before each
repeat. The working set (every prompt's distinct tokens) is reported next to the budget.

Per arm and repeat: TTFT (median, P90) and end-to-end time per request kind, requests per second, prompt tokens
served from cache, failures (any error answer counts; nothing is retried), and when idle the slot accounting
(`free + cache_evictable == total`, nothing locked). Greedy outputs are compared between the arms request by request.
The report gives medians (min-max) over repeats and the per-repeat stock / ours ratios.

Usage: .venv/bin/python -m eval.bench.memory_pressure [--documents 12] [--document-tokens 384]
           [--max-total-tokens 2048] [--repeats 3] [--out eval/results/memory_pressure/memory_pressure.jsonl]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from queue import Empty, Queue

import requests

from eval.bench.alora_pipeline import WORDS, chat
from eval.bench.results import nearest_rank, save
from eval.demo import stream_generate
from sgl_multilora.embedded import ensure_embedded_model
from sgl_multilora.server import cpu_server_args, launch

REPO = Path(__file__).resolve().parents[2]
ARMS = ("stock", "ours")
KINDS = ("base", "lora", "alora")
NEW_TOKENS = {"base": 16, "lora": 16, "alora": 2}


def document(tokenizer, num_tokens: int, seed: int) -> str:
    """A user turn of about `num_tokens` tokens, distinct per seed from its first words on."""
    rng = random.Random(seed)
    words = [f"Document {seed}."]
    while len(tokenizer(" ".join(words)).input_ids) < num_tokens - 20:
        words.extend(rng.choices(WORDS, k=24))
    return " ".join(words) + "\nSummarize the text above in one sentence."


def run_chain(url, tokenizer, doc, d, alora, log):
    base = _request(url, chat(tokenizer, [("user", doc)], True), None, "base", d, log)
    if base is None:
        return
    context = chat(tokenizer, [("user", doc), ("assistant", base["text"])], False)
    invocation = tokenizer(alora["invocation_text"], add_special_tokens=False).input_ids
    _request(url, context + invocation, alora["name"], "alora", d, log)


def _request(url, ids, lora, kind, d, log) -> dict | None:
    """One streamed greedy request over document `d`; its row goes to `log` (an error answer: a failed row)."""
    row = {"kind": kind, "lora": lora, "document": d, "prompt_tokens": len(ids)}
    try:
        out = stream_generate(url, ids, lora, NEW_TOKENS[kind])
    except Exception as exc:  # noqa: BLE001 - counted and reported: the benchmark measures failures too
        log.append({**row, "ok": False, "error": str(exc)[:300]})
        return None
    log.append({**row, "ok": True, "ttft_s": out["ttft_s"], "e2e_s": out["e2e_s"], "text": out["text"],
                "cached_tokens": out["meta_info"].get("cached_tokens", 0)})
    return out


def run_round(url, tokenizer, docs, manifest, rng, concurrency) -> list[dict]:
    loras = [e for e in manifest if e["kind"] == "lora"]
    aloras = [e for e in manifest if e["kind"] == "alora"]
    jobs: Queue = Queue()
    order = list(range(len(docs)))
    rng.shuffle(order)
    for d in order:  # both jobs of a document are queued together, so their prefixes compete for the same slots
        jobs.put(("chain", d))
        jobs.put(("lora", d))
    log: list[dict] = []

    def client():
        while True:
            try:
                job, d = jobs.get_nowait()
            except Empty:
                return
            if job == "chain":
                run_chain(url, tokenizer, docs[d], d, aloras[d % len(aloras)], log)
            else:
                lora = loras[d % len(loras)]
                _request(url, chat(tokenizer, [("user", docs[d])], True), lora["name"], "lora", d, log)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for f in [pool.submit(client) for _ in range(concurrency)]:
            f.result()
    return log


def accounting_when_idle(url, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        m = requests.get(url + "/multilora/stats", timeout=60).json()["memory"][0]
        if (m["running"] == 0 and m["waiting"] == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return {k: m[k] for k in ("total", "free", "cache_evictable", "cache_protected", "running", "waiting")} | {
        "closes": m["free"] + m["cache_evictable"] == m["total"] and m["cache_protected"] == 0}


def measure(arm, url, tokenizer, docs, manifest, args, repeat) -> dict:
    requests.post(url + "/flush_cache", timeout=60)
    rng = random.Random(args.seed + repeat)  # the same job order for both arms within a repeat
    start = time.perf_counter()
    rounds = [run_round(url, tokenizer, docs, manifest, rng, args.concurrency) for _ in range(args.rounds)]
    elapsed = time.perf_counter() - start
    rows = [dict(r, round=i) for i, log in enumerate(rounds) for r in log]
    ok = [r for r in rows if r["ok"]]
    summary = {"arm": arm, "repeat": repeat, "elapsed_s": elapsed, "requests": len(rows),
               "failures": len(rows) - len(ok), "req_per_s": len(ok) / elapsed,
               "cached_share": sum(r["cached_tokens"] for r in ok) / max(1, sum(r["prompt_tokens"] for r in ok)),
               "load_avg": os.getloadavg()[0], "accounting": accounting_when_idle(url)}
    for kind in KINDS:
        ks = [r for r in ok if r["kind"] == kind]
        if ks:
            summary[kind] = {"n": len(ks), "ttft_p50_s": statistics.median(r["ttft_s"] for r in ks),
                             "ttft_p90_s": nearest_rank([r["ttft_s"] for r in ks], 90),
                             "e2e_p50_s": statistics.median(r["e2e_s"] for r in ks),
                             "cached_share": sum(r["cached_tokens"] for r in ks) / sum(r["prompt_tokens"] for r in ks)}
    print(f"  rep {repeat} {arm:5s} {elapsed:6.1f} s  {summary['req_per_s']:.2f} req/s  failures "
          f"{summary['failures']}  cached {summary['cached_share']:.0%}  accounting closes "
          f"{summary['accounting']['closes']}", flush=True)
    return {"summary": summary, "outputs": {(r["kind"], r["document"], r["round"]): r.get("text") for r in rows}}


def start_arm(arm, model_path, args):
    extra = ["--enable-lora", "--multilora-adapter-dir", str(args.adapters_dir), "--max-loras-per-batch", "4",
             "--max-lora-rank", "32", "--chunked-prefill-size", str(args.chunked_prefill_size)]
    if arm == "ours":
        extra += ["--radix-cache-backend", "multilora", "--multilora-stock-baseline", "memory"]
    log_dir = REPO / ".cache" / "bench_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    return launch(model_path, [*cpu_server_args(args.max_total_tokens), *extra],
                  log_path=log_dir / f"memory_pressure_{arm}.log")


def working_set(tokenizer, docs, manifest) -> dict:
    """Distinct prompt tokens each arm's cache would need to keep everything (answers excluded: under 2% here)."""
    per_doc = [len(chat(tokenizer, [("user", d)], True)) for d in docs]
    inv = statistics.mean(len(tokenizer(e["invocation_text"], add_special_tokens=False).input_ids)
                          for e in manifest if e["kind"] == "alora")
    base, lora = sum(per_doc), sum(per_doc)
    # stock keys the aLoRA check under its adapter; ours reuses the base turn's KV and adds the suffix
    return {"stock": int(base + lora + base + len(docs) * (inv + NEW_TOKENS["base"])),
            "ours": int(base + lora + len(docs) * (inv + NEW_TOKENS["base"]))}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=12)
    parser.add_argument("--document-tokens", type=int, default=384)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-total-tokens", type=int, default=2048)
    parser.add_argument("--chunked-prefill-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--adapters-dir", type=Path, default=REPO / "assets" / "adapters")
    parser.add_argument("--out", type=Path, default=REPO / "eval" / "results" / "memory_pressure" / "memory_pressure.jsonl")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    model_path = ensure_embedded_model()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    manifest = json.loads((args.adapters_dir / "manifest.json").read_text())["adapters"]
    docs = [document(tokenizer, args.document_tokens, 100 + i) for i in range(args.documents)]
    load_start = list(os.getloadavg())
    servers, runs = {}, []
    try:
        for arm in ARMS:
            print(f"arm {arm}: starting a CPU server", flush=True)
            servers[arm] = start_arm(arm, model_path, args)
        for rep in range(args.repeats):
            for arm in (ARMS if rep % 2 == 0 else ARMS[::-1]):
                runs.append(measure(arm, servers[arm].url, tokenizer, docs, manifest, args, rep))
    finally:
        for server in servers.values():
            server.stop()

    same, compared = 0, 0
    for rep in range(args.repeats):
        outs = {r["summary"]["arm"]: r["outputs"] for r in runs if r["summary"]["repeat"] == rep}
        for key, text in outs["stock"].items():
            if text is not None and outs["ours"].get(key) is not None:
                compared += 1
                same += text == outs["ours"][key]
    setup = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"}
    record = {
        "setup": {**setup, "working_set_tokens": working_set(tokenizer, docs, manifest), "arms": {
            "stock": "SGLang's RadixCache; sgl_multilora CPU LoRA compute and extend attention",
            "ours": "stock + --radix-cache-backend multilora --multilora-stock-baseline memory"},
            "protocol": "both servers up (idle one sleeps); repeats alternate the arm order; cache flushed per "
                        "repeat; the same job order for both arms within a repeat"},
        "device": {"processor": platform.processor(), "cpu_count": os.cpu_count(), "load_avg_start": load_start,
                   "load_avg_end": list(os.getloadavg())},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "outputs_identical": {"same": same, "compared": compared},
        "runs": [r["summary"] for r in runs],
    }
    save(args.out, record, report)


def _spread(values, fmt="{:.2f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def report(record: dict) -> str:
    s, runs = record["setup"], record["runs"]
    by = {(r["arm"], r["repeat"]): r for r in runs}
    reps = sorted({r["repeat"] for r in runs})
    ws = s["working_set_tokens"]
    lines = [f"# Memory pressure: base, LoRA and aLoRA traffic, live CPU servers ({record['date'][:10]})", "",
             f"{s['documents']} documents of ~{s['document_tokens']} tokens, {s['rounds']} rounds, "
             f"{s['concurrency']} clients; KV budget {s['max_total_tokens']} tokens, working set "
             f"{ws['ours']} tokens for ours ({ws['ours'] / s['max_total_tokens']:.1f}x the budget), "
             f"{ws['stock']} for stock ({ws['stock'] / s['max_total_tokens']:.1f}x). {s['repeats']} repeats, arms "
             f"alternating. Machine: {record['device']}.", "",
             f"Greedy outputs identical between the arms: {record['outputs_identical']['same']} of "
             f"{record['outputs_identical']['compared']} requests.", "",
             "| metric | stock | ours | stock / ours (per repeat) |", "|---|---:|---:|---:|"]

    def row(name, get, fmt="{:.2f}"):
        st = [get(by[("stock", r)]) for r in reps]
        ou = [get(by[("ours", r)]) for r in reps]
        ratios = ", ".join(f"{a / b:.2f}" if b else "-" for a, b in zip(st, ou))
        lines.append(f"| {name} | {_spread(st, fmt)} | {_spread(ou, fmt)} | {ratios} |")

    for kind in KINDS:
        row(f"{kind} TTFT P50 s", lambda r, k=kind: r[k]["ttft_p50_s"])
        row(f"{kind} TTFT P90 s", lambda r, k=kind: r[k]["ttft_p90_s"])
        row(f"{kind} prompt tokens from cache", lambda r, k=kind: r[k]["cached_share"], "{:.0%}")
    row("requests per second", lambda r: r["req_per_s"])
    row("prompt tokens from cache, all", lambda r: r["cached_share"], "{:.0%}")
    failures = {arm: sum(by[(arm, r)]["failures"] for r in reps) for arm in ARMS}
    closes = {arm: all(by[(arm, r)]["accounting"]["closes"] for r in reps) for arm in ARMS}
    requests_ = {arm: sum(by[(arm, r)]["requests"] for r in reps) for arm in ARMS}
    lines += ["", f"Failures: stock {failures['stock']} of {requests_['stock']}, ours {failures['ours']} of "
              f"{requests_['ours']}. Slot accounting closes when idle after every repeat: stock {closes['stock']}, "
              f"ours {closes['ours']}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
