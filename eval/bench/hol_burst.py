"""Head-of-line blocking: a burst of long prompts on the highest-rank bundled adapter, then one-line questions on the
lowest-rank one, under three admission policies of one build: `--multilora-scheduler multiqueue` against SGLang's
`--schedule-policy fcfs` and `lpm` (its default).

The scene (issue 66): `--num-long` prompts of `--long-tokens` tokens on `bullets` (rank 32) sent at once, then,
`--gap-s` later, `--num-short` questions of about 12 tokens on `caps` (rank 8); greedy, a few new tokens each.
Every arm: the bundled adapters, `--radix-cache-backend multilora` (the unified pool), the same KV budget and the
CPU server's defaults (chunked prefill included); only the admission policy differs. Per repeat and arm one server:
the scene on it fresh (no request seen, so the multi-queue runs its prior plan), then `--warm-up` small requests on
`caps` (its plan is fitted on them), then the scene again (warm). Arms interleave, their order rotating per repeat.
TTFT is the first streamed chunk's arrival, from the client.

Reported per state and arm: the short requests' median TTFT and each long request's TTFT (median and spread over
repeats); ratios against fcfs per repeat. The goal (issue 66): short median at most 0.4x fcfs's, fresh and warm,
with every long request at most 1.2x fcfs's (the long requests compared by arrival rank: the k-th to get its first
token against fcfs's k-th).

Usage: .venv/bin/python -m eval.bench.hol_burst [--repeats 3] [--arms fcfs,lpm,multiqueue]
           [--out eval/results/hol_burst/hol_burst.jsonl]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
from tqdm import tqdm

from eval.bench.results import median_range, run_record, save
from sgl_multilora.embedded import ensure_embedded_model
from sgl_multilora.server import cpu_server_args, launch

ADAPTERS = Path(__file__).resolve().parents[2] / "assets" / "adapters"
ARMS = {
    "fcfs": ["--schedule-policy", "fcfs"],
    "lpm": [],
    "multiqueue": ["--schedule-policy", "fcfs", "--multilora-scheduler", "multiqueue"],
}
SHORT_TOKENS = 12


def server_args(args) -> list[str]:
    return [*cpu_server_args(max_total_tokens=args.max_total_tokens), "--enable-lora", "--multilora-adapter-dir",
            str(ADAPTERS), "--max-loras-per-batch", "4", "--max-lora-rank", "32", "--radix-cache-backend",
            "multilora"]


def prompts(tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 3)
    return [tokenizer(" ".join(rng.choices(words, k=length)), add_special_tokens=False).input_ids[:length]
            for _ in range(n)]


def ttft(url: str, lora: str, ids: list[int], new_tokens: int) -> float:
    """Seconds from sending to the first streamed chunk (the request then runs to its end)."""
    began, first = time.monotonic(), None
    body = {"input_ids": ids, "lora_path": lora, "stream": True,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}
    with requests.post(url + "/generate", json=body, stream=True, timeout=900) as res:
        res.raise_for_status()
        for line in res.iter_lines():
            if line and first is None:
                first = time.monotonic() - began
    return first


def scene(url: str, longs: list[list[int]], shorts: list[list[int]], gap_s: float, new_tokens: int) -> dict:
    with ThreadPoolExecutor(max_workers=len(longs) + len(shorts)) as ex:
        long_f = [ex.submit(ttft, url, "bullets", ids, new_tokens) for ids in longs]
        time.sleep(gap_s)
        short_f = [ex.submit(ttft, url, "caps", ids, new_tokens) for ids in shorts]
        return {"long_ttft_s": sorted(f.result() for f in long_f), "short_ttft_s": sorted(f.result() for f in short_f)}


def run_arm(arm: str, repeat: int, args, tokenizer, model: str) -> list[dict]:
    log = Path(tempfile.gettempdir()) / f"hol_burst_{arm}_{repeat}.log"
    handle = launch(model, [*server_args(args), *ARMS[arm]], log_path=log)
    handle.stop_grace_s = 0.5
    rows = []
    try:
        seed = 1000 * repeat
        for state in ("fresh", "warm"):
            if state == "warm":
                warm = prompts(tokenizer, args.warm_up, SHORT_TOKENS, seed + 7)
                with ThreadPoolExecutor(max_workers=4) as ex:
                    list(ex.map(lambda ids: ttft(handle.url, "caps", ids, 2), warm))
            longs = prompts(tokenizer, args.num_long, args.long_tokens, seed + (1 if state == "fresh" else 3))
            shorts = prompts(tokenizer, args.num_short, SHORT_TOKENS, seed + (2 if state == "fresh" else 4))
            rows.append({"arm": arm, "repeat": repeat, "state": state,
                         **scene(handle.url, longs, shorts, args.gap_s, args.new_tokens)})
    finally:
        handle.stop()
    return rows


def report(record: dict) -> str:
    rows, setup = record["rows"], record["setup"]
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    lines = [f"# Head-of-line blocking: {setup['num_long']} x {setup['long_tokens']}-token prompts on bullets, then "
             f"{setup['num_short']} one-line questions on caps {setup['gap_s']} s later",
             "", f"{record['date']}, {record['device']['cpu_count']} CPUs, load average "
             f"{record['device']['load_avg_start']} at the start; {setup['repeats']} repeats, arms interleaved. "
             "TTFT in seconds, median (min-max) over repeats; ratios per repeat against fcfs.", ""]
    for state in ("fresh", "warm"):
        lines += [f"## {state}", "", "| arm | short median TTFT | short vs fcfs | long TTFTs (by rank) | worst long vs "
                  "fcfs |", "|---|---|---|---|---|"]
        by = {(r["arm"], r["repeat"]): r for r in rows if r["state"] == state}
        repeats = sorted({r["repeat"] for r in rows})
        for arm in arms:
            own = [by[(arm, k)] for k in repeats if (arm, k) in by]
            short = [statistics.median(r["short_ttft_s"]) for r in own]
            ratios, worst = [], []
            for k in repeats:
                if (arm, k) in by and ("fcfs", k) in by:
                    base = by[("fcfs", k)]
                    ratios.append(statistics.median(by[(arm, k)]["short_ttft_s"]) / statistics.median(
                        base["short_ttft_s"]))
                    worst.append(max(a / b for a, b in zip(by[(arm, k)]["long_ttft_s"], base["long_ttft_s"])))
            longs = ", ".join(median_range([r["long_ttft_s"][i] for r in own], "{:.1f}")
                              for i in range(setup["num_long"]))
            lines.append(f"| {arm} | {median_range(short)} | {median_range(ratios)}x | {longs} | "
                         f"{median_range(worst)}x |")
        lines.append("")
    lines.append("Goal: short median at most 0.4x fcfs's, every long request at most 1.2x fcfs's, fresh and warm.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", default="fcfs,lpm,multiqueue")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-long", type=int, default=6)
    parser.add_argument("--long-tokens", type=int, default=1500)
    parser.add_argument("--num-short", type=int, default=6)
    parser.add_argument("--gap-s", type=float, default=0.5)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--warm-up", type=int, default=40)
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    parser.add_argument("--out", default="eval/results/hol_burst/hol_burst.jsonl")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    model = str(ensure_embedded_model())
    tokenizer = AutoTokenizer.from_pretrained(model)
    arms = args.arms.split(",")
    load_start = list(os.getloadavg())
    rows = []
    runs = [(k, arms[k % len(arms):] + arms[:k % len(arms)]) for k in range(args.repeats)]
    with tqdm(total=args.repeats * len(arms), desc="hol_burst") as bar:
        for k, order in runs:
            for arm in order:
                rows += run_arm(arm, k, args, tokenizer, model)
                bar.update()
    setup = {key: getattr(args, key) for key in ("repeats", "num_long", "long_tokens", "num_short", "gap_s",
                                                   "new_tokens", "warm_up", "max_total_tokens")}
    setup["arms"] = {arm: ARMS[arm] for arm in arms}
    setup["server_args"] = server_args(args)
    save(Path(args.out), run_record(setup, rows, load_start), report)


if __name__ == "__main__":
    main()
