"""Adapters on demand over a source of many adapters, against stock SGLang with every adapter named at start-up.

The source (built once under .cache/, seeded): `--num-adapters` PEFT LoRA adapters with random weights, ranks 8-64
(8: 60%, 16: 25%, 32: 10%, 64: 5%) on q/v or q/k/v/o, one in 50 an aLoRA (its traffic carries the invocation).
Arms, one server at a time, with the same KV budget, `--max-lora-rank 64`, the same target modules and batch cap:
- `ours`: `--multilora-adapter-source SRC --multilora-host-adapter-gb G --radix-cache-backend multilora`; nothing
  is read at start-up, each adapter on its first request.
- `stock`: `--lora-paths name=path` for every adapter (SGLang's own way to serve many: all read at start-up) and
  SGLang's radix cache. A start that fails or times out is recorded as such.
Per arm: start-up seconds (launch until ready), the server's RSS (whole process tree) after start and after the
traffic, then Zipf(`--zipf`) traffic over the adapters: `--num-requests` requests of `--prompt-tokens` random tokens
and `--new-tokens` greedy tokens at `--rate` req/s (Poisson arrivals, seeded; the same requests for every arm):
TTFT mean / P99 from the client (first streamed chunk), errors, and the outputs (each arm's greedy text for the same
request must agree). Then, ours only, the first-request cost: `--probes` adapters no request named yet, each
requested twice in a row; TTFT of the first against the second, the server's split of the first (resolve, read and
validate, load; `/multilora/stats`) and the weight file's read time in the client.

Usage: .venv/bin/python -m eval.bench.on_demand [--num-adapters 1000] [--arms ours,stock]
           [--out eval/results/on_demand/on_demand.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import requests
from tqdm import tqdm

from eval.bench.results import nearest_rank, run_record, save
from sgl_multilora.embedded import ensure_embedded_model
from sgl_multilora.server import ServerStartError, cpu_server_args, launch

REPO = Path(__file__).resolve().parents[2]
RANKS = (8, 16, 32, 64)
RANK_SHARE = (0.6, 0.25, 0.1, 0.05)
TARGETS = (("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj"))
INVOCATION = "<|im_start|>verify\n"


def build_source(model: str, n: int, seed: int) -> Path:
    """`n` adapters under .cache/on_demand_source_<n>_<seed>/ (built once; a marker file says it is complete)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    root = REPO / ".cache" / f"on_demand_source_{n}_{seed}"
    if (root / ".complete").is_file():
        return root
    cfg = AutoConfig.from_pretrained(model)
    invocation = AutoTokenizer.from_pretrained(model)(INVOCATION, add_special_tokens=False).input_ids
    hidden, heads, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    out = {"q_proj": hidden, "k_proj": hidden // heads * kv, "v_proj": hidden // heads * kv, "o_proj": hidden}
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for i in tqdm(range(n), desc="adapter source", unit="adapter"):
        rank = rng.choices(RANKS, RANK_SHARE)[0]
        targets = rng.choice(TARGETS)
        alora = i % 50 == 49
        d = root / f"adapter-{i:04d}"
        d.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(cfg.num_hidden_layers):
            for t in targets:
                prefix = f"base_model.model.model.layers.{layer}.self_attn.{t}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) / hidden ** 0.5
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(out[t], rank, generator=gen) * 0.02
        save_file(tensors, str(d / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
                  "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none", "base_model_name_or_path": None}
        if alora:
            config["alora_invocation_tokens"] = invocation
        (d / "adapter_config.json").write_text(json.dumps(config))
    (root / ".complete").write_text(str(n))
    return root


def rss_bytes(pid: int) -> int:
    import psutil

    total = 0
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def workload(args, names: list[str], tokenizer) -> list[dict]:
    rng = random.Random(args.seed)
    ranks = np.arange(1, len(names) + 1, dtype=float) ** -args.zipf
    weights = list(ranks / ranks.sum())
    order = names[:]
    rng.shuffle(order)  # popularity unrelated to rank or size
    vocab = [i for w, i in tokenizer.get_vocab().items() if w.isalpha() and len(w) > 3]
    invocation = tokenizer(INVOCATION, add_special_tokens=False).input_ids
    t, reqs = 0.0, []
    for _ in range(args.num_requests):
        t += rng.expovariate(args.rate)
        name = rng.choices(order, weights)[0]
        ids = rng.choices(vocab, k=args.prompt_tokens)
        if name.endswith(("49", "99")):  # the aLoRAs (every 50th adapter)
            ids += invocation
        reqs.append({"at": t, "lora": name, "ids": ids})
    return reqs


def timed(url: str, lora: str | None, ids: list[int], new_tokens: int) -> dict:
    body = {"input_ids": ids, "lora_path": lora, "stream": True,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}
    began, first, text = time.monotonic(), None, None
    try:
        with requests.post(url + "/generate", json=body, stream=True, timeout=1800) as res:
            if res.status_code != 200:
                return {"error": f"HTTP {res.status_code}: {res.text[:200]}"}
            for line in res.iter_lines():
                if not line or not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                if first is None:
                    first = time.monotonic() - began
                text = json.loads(line[5:]).get("text", text)
    except requests.RequestException as e:
        return {"error": str(e)[:200]}
    return {"ttft_s": first, "e2e_s": time.monotonic() - began, "text": text}


def replay(url: str, reqs: list[dict], new_tokens: int) -> list[dict]:
    start = time.monotonic()

    def one(r):
        time.sleep(max(0.0, start + r["at"] - time.monotonic()))
        return timed(url, r["lora"], r["ids"], new_tokens)

    with ThreadPoolExecutor(max_workers=64) as ex:
        return list(tqdm(ex.map(one, reqs), total=len(reqs), desc="traffic", unit="req", leave=False))


def probe_first_requests(url: str, source: Path, names: list[str], args, tokenizer) -> list[dict]:
    rng = random.Random(args.seed + 1)
    vocab = [i for w, i in tokenizer.get_vocab().items() if w.isalpha() and len(w) > 3]
    rows = []
    for name in names:
        ids = rng.choices(vocab, k=args.prompt_tokens)
        weights = source / name / "adapter_model.safetensors"
        t0 = time.perf_counter()
        weights.read_bytes()
        read_s = time.perf_counter() - t0
        first = timed(url, name, ids, args.new_tokens)
        split = requests.get(url + "/multilora/stats", timeout=60).json()["adapter_tiers"]["source"]["last_load"]
        second = timed(url, name, ids[::-1], args.new_tokens)
        rows.append({"adapter": name, "bytes": weights.stat().st_size, "client_read_s": read_s,
                     "first_ttft_s": first.get("ttft_s"), "second_ttft_s": second.get("ttft_s"), "split": split})
    return rows


def run_arm(arm: str, args, model: str, source: Path, names: list[str], reqs: list[dict], tokenizer) -> dict:
    common = [*cpu_server_args(max_total_tokens=args.max_total_tokens), "--enable-lora", "--max-lora-rank", "64",
              "--lora-target-modules", "q_proj", "k_proj", "v_proj", "o_proj", "--max-loras-per-batch", "8"]
    if arm == "ours":
        extra = ["--radix-cache-backend", "multilora", "--multilora-adapter-source", str(source),
                 "--multilora-host-adapter-gb", str(args.host_gb)]
    else:
        extra = ["--lora-paths", *(f"{n}={source / n}" for n in names)]
    log = Path(tempfile.gettempdir()) / f"on_demand_{arm}.log"
    began = time.monotonic()
    try:
        handle = launch(model, [*common, *extra], log_path=log, ready_timeout_s=args.ready_timeout_s)
    except ServerStartError as e:
        return {"arm": arm, "started": False, "error": str(e)[-600:], "startup_s": time.monotonic() - began}
    handle.stop_grace_s = 0.5
    row = {"arm": arm, "started": True, "startup_s": time.monotonic() - began}
    try:
        row["rss_start"] = rss_bytes(handle.process.pid)
        results = replay(handle.url, reqs, args.new_tokens)
        row["rss_end"] = rss_bytes(handle.process.pid)
        row["results"] = results
        if arm == "ours":
            requested = {r["lora"] for r in reqs}
            fresh = [n for n in names if n not in requested][: args.probes]
            row["probes"] = probe_first_requests(handle.url, source, fresh, args, tokenizer)
            row["tiers"] = requests.get(handle.url + "/multilora/stats", timeout=60).json()["adapter_tiers"]
            row["tiers"]["host"].pop("resident", None)
    finally:
        handle.stop()
    return row


def report(record: dict) -> str:
    setup, rows = record["setup"], record["rows"]
    lines = [f"# Adapters on demand: {setup['num_adapters']} adapters, Zipf({setup['zipf']}) traffic",
             "", f"{record['date']}, {record['device']['cpu_count']} CPUs, load average "
             f"{record['device']['load_avg_start']} at the start, {record['device']['load_avg_end']} at the end. "
             f"Source: {setup['source_gb']:.2f} GB of weight files. {setup['num_requests']} requests at "
             f"{setup['rate']} req/s ({setup['distinct_requested']} distinct adapters), {setup['prompt_tokens']}-token "
             f"prompts, {setup['new_tokens']} new tokens. Command: `{setup['command']}`.", "",
             "| arm | start-up s | RSS after start GB | RSS after traffic GB | TTFT mean s | TTFT P99 s | errors |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    texts = {}
    for r in rows:
        if not r["started"]:
            lines.append(f"| {r['arm']} | did not start ({r['startup_s']:.0f} s) | - | - | - | - | - |")
            continue
        ok = [x for x in r["results"] if "ttft_s" in x and x["ttft_s"] is not None]
        ttfts = [x["ttft_s"] for x in ok]
        texts[r["arm"]] = [x.get("text") for x in r["results"]]
        lines.append(f"| {r['arm']} | {r['startup_s']:.1f} | {r['rss_start'] / 1e9:.2f} | {r['rss_end'] / 1e9:.2f} | "
                     f"{statistics.mean(ttfts):.3f} | {nearest_rank(ttfts, 99):.3f} | "
                     f"{len(r['results']) - len(ok)} |")
    if len(texts) == 2:
        a, b = texts.values()
        same = sum(x == y and x is not None for x, y in zip(a, b))
        lines += ["", f"Greedy outputs identical between the arms for {same} of {len(a)} requests."]
    ours = next((r for r in rows if r["arm"] == "ours" and r["started"]), None)
    if ours and ours.get("probes"):
        lines += ["", "First request of an adapter (ours): TTFT of its first request against its second, the "
                  "server's split of the first, and the weight file's read time (client, page cache warm).", "",
                  "| adapter | MB | first TTFT s | second TTFT s | resolve s | read+validate s | load s | "
                  "file read s | first / (second + file read) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for p in ours["probes"]:
            s = p["split"]
            ratio = p["first_ttft_s"] / (p["second_ttft_s"] + p["client_read_s"])
            lines.append(f"| {p['adapter']} | {p['bytes'] / 1e6:.1f} | {p['first_ttft_s']:.3f} | "
                         f"{p['second_ttft_s']:.3f} | {s.get('resolve_s', 0):.3f} | {s.get('read_s', 0):.3f} | "
                         f"{s.get('load_s', 0):.3f} | {p['client_read_s']:.3f} | {ratio:.2f} |")
        t = ours["tiers"]
        lines += ["", f"Tiers after the run (ours): source {t['source']['loads']} loads "
                  f"({t['source']['load_s']:.1f} s loading, {t['source']['read_s']:.1f} s reading), host "
                  f"{t['host']['adapters']} adapters / {t['host']['bytes'] / 1e9:.3f} GB of a "
                  f"{(t['host']['budget_bytes'] or 0) / 1e9:.2f} GB budget, {t['host']['drops']} drops, "
                  f"{t['host']['hits']} hits."]
    lines.append("")
    lines.append("Goal (issue 62): an adapter's first request costs at most its file's read time plus 10% on top of "
                 "a resident adapter's TTFT.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", default="ours,stock")
    parser.add_argument("--num-adapters", type=int, default=1000)
    parser.add_argument("--num-requests", type=int, default=240)
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--zipf", type=float, default=1.2)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--probes", type=int, default=8)
    parser.add_argument("--host-gb", type=float, default=1.0)
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    parser.add_argument("--ready-timeout-s", type=float, default=1800.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "eval/results/on_demand/on_demand.jsonl")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    load_avg = list(os.getloadavg())
    model = str(ensure_embedded_model())
    tokenizer = AutoTokenizer.from_pretrained(model)
    source = build_source(model, args.num_adapters, args.seed)
    names = sorted(p.name for p in source.iterdir() if p.is_dir())
    reqs = workload(args, names, tokenizer)
    rows = [run_arm(arm, args, model, source, names, reqs, tokenizer) for arm in args.arms.split(",")]
    setup = {**{k: v for k, v in vars(args).items() if k != "out"}, "out": str(args.out),
             "source_gb": sum((source / n / "adapter_model.safetensors").stat().st_size for n in names) / 1e9,
             "distinct_requested": len({r["lora"] for r in reqs}),
             "command": "python -m eval.bench.on_demand " + " ".join(
                 f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out",))}
    save(args.out, run_record(setup, rows, load_avg), report)


if __name__ == "__main__":
    main()
