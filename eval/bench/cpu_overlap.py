"""SGLang's overlap scheduler on a CPU server: on (SGLang's default; `--multilora-stock-baseline cpu-overlap`) against
off (the plugin's default on a CPU, as `--disable-overlap-schedule`).

The overlap loop runs batch N+1's forward before it processes batch N's results, so that on a GPU the scheduler's
CPU work hides behind the device's. On a CPU the forward runs synchronously in the scheduler's own thread: nothing
overlaps, and each batch's results (a prefill's first token, a decode step's tokens) reach the client one forward
later. The plugin therefore turns it off on a CPU (`--multilora-stock-baseline cpu-overlap` keeps it); this measures
what that saves on two live servers of one build that differ only in that flag: `--radix-cache-backend multilora`, the
embedded SmolLM2-135M in fp32, the multi-queue workload's random PEFT adapters (ranks 8 to 128 on q/k/v/o),
`--max-loras-per-batch 8`.

Each round, each server in turn (order alternating, cache flushed): `alone`, probes one at a time (a ~100-token
prompt, 4 greedy tokens, adapters cycled); `loaded`, the same probes 0.5 s apart while `--background` streams of
`--background-tokens` tokens decode, with the background's time per output token. The report gives each arm's
median (min-max) over rounds of the probes' median TTFT and the background's median TPOT, the ratio off / on per
round, and whether the probes' greedy tokens were equal between the arms.

    .venv/bin/python -m eval.bench.cpu_overlap [--rounds 5] [--out eval/results/cpu_overlap/cpu_overlap.jsonl]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from pathlib import Path

from eval.bench.cpu_lora_op import stream_greedy
from eval.bench.results import median_range, run_record, save

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "eval" / "results" / "cpu_overlap" / "cpu_overlap.jsonl"
ARMS = {"overlap": ["--multilora-stock-baseline", "cpu-overlap"], "no-overlap": []}


def stream(url: str, text: str, adapter: str, new_tokens: int) -> dict:
    """One streamed greedy request: its TTFT, its mean time per output token after the first, its output ids."""
    one = stream_greedy(url, text, adapter, new_tokens)
    return {"ttft_s": one["ttft_s"], "tpot_s": (one["total_s"] - one["ttft_s"]) / max(1, new_tokens - 1),
            "ids": one["ids"]}


def one_round(url: str, adapters: list[str], args, tag: str) -> dict:
    words = "tell me a story about a dragon and a knight who became friends after a long war".split()
    prompt = " ".join(words[j % len(words)] for j in range(90))
    probes = [f"{prompt} ({tag} probe {i})" for i in range(args.probes)]
    alone = [stream(url, p, adapters[i % len(adapters)], 4) for i, p in enumerate(probes)]
    background: list[dict] = []

    def run_background(j: int) -> None:
        background.append(stream(url, f"{prompt} ({tag} background {j})", adapters[(j + 1) % len(adapters)],
                                 args.background_tokens))

    threads = [threading.Thread(target=run_background, args=(j,)) for j in range(args.background)]
    for t in threads:
        t.start()
    time.sleep(2.0)  # the background is decoding
    loaded = []
    for i, p in enumerate(probes):
        loaded.append(stream(url, p + " again", adapters[(i + 3) % len(adapters)], 4))
        time.sleep(0.5)
    for t in threads:
        t.join()
    return {"alone_ttft_s": [x["ttft_s"] for x in alone], "loaded_ttft_s": [x["ttft_s"] for x in loaded],
            "background_tpot_s": [x["tpot_s"] for x in background],
            "ids": [x["ids"] for x in alone + loaded]}


def measure(args) -> dict:
    import requests

    from eval.live.adapters import CACHE, make_adapters
    from eval.workloads import create_workload
    from sgl_multilora.embedded import ensure_embedded_model
    from sgl_multilora.server import cpu_server_args, launch

    model = str(ensure_embedded_model())
    workload = create_workload("heterogeneous", seed=0, num_requests=60, num_adapters=10, rate=1.0,
                               length_scale=0.1, max_output_tokens=64)
    adapters_dir = make_adapters(model, workload, CACHE / "heterogeneous-10")
    adapters = [a.name for a in workload.adapters]
    flags = [f for f in cpu_server_args(max_total_tokens=args.pool_tokens) if f != "--disable-overlap-schedule"]
    common = ["--multilora-adapter-dir", str(adapters_dir), "--max-loras-per-batch", "8",
              "--max-lora-rank", str(max(a.rank for a in workload.adapters)), "--radix-cache-backend", "multilora"]
    log_dir = REPO / ".cache" / "bench_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    servers, rounds, names = {}, [], list(ARMS)
    try:
        for arm, extra in ARMS.items():
            servers[arm] = launch(model, [*flags, *common, *extra], log_path=log_dir / f"cpu_overlap_{arm}.log")
        for arm in names:  # warm-up: first-call costs paid, adapters loaded
            one_round(servers[arm].url, adapters, argparse.Namespace(probes=2, background=2, background_tokens=4),
                      "warm-up")
        for i in range(args.rounds):
            row = {}
            for arm in names[i % 2:] + names[: i % 2]:
                requests.post(servers[arm].url + "/flush_cache", timeout=60)
                time.sleep(1.0)
                row[arm] = one_round(servers[arm].url, adapters, args, f"round {i}")
            row["tokens_equal"] = row["overlap"]["ids"] == row["no-overlap"]["ids"]
            for arm in names:
                del row[arm]["ids"]
            rounds.append(row)
            print(f"round {i}: loaded probe TTFT median "
                  + " / ".join(f"{statistics.median(row[a]['loaded_ttft_s']):.3f} s ({a})" for a in names),
                  flush=True)
    finally:
        for handle in servers.values():
            handle.stop()
    return {"adapters": adapters, "probes": args.probes, "background": args.background,
            "background_tokens": args.background_tokens, "rounds": rounds}


def report(record: dict) -> str:
    s, d, r = record["setup"], record["device"], record["rows"]
    rounds = r["rounds"]
    lines = [f"# SGLang's overlap scheduler on a CPU server: on vs off ({record['date'][:10]})", "",
             f"Two servers of one build (`--radix-cache-backend multilora`), the same flags but "
             f"`--multilora-stock-baseline cpu-overlap` (SGLang's overlap scheduler kept on) in the `overlap` arm: "
             f"the embedded SmolLM2-135M in fp32, {s['pool_tokens']} token slots, {len(r['adapters'])} random PEFT "
             f"adapters (ranks 8 to 128 on q/k/v/o), `--max-loras-per-batch 8`. Per round and arm: {r['probes']} "
             f"probes (~100-token prompt, 4 greedy tokens) one at a time (`alone`), then the same 0.5 s apart while "
             f"{r['background']} streams of {r['background_tokens']} tokens decode (`loaded`). {len(rounds)} rounds, "
             f"arms alternating, flushed cache. Machine: {d['cpu_count']} CPUs, load average "
             f"{d['load_avg_start'][0]:.2f} at the start, {d['load_avg_end'][0]:.2f} at the end.", "",
             "| arm | probe TTFT alone s | probe TTFT loaded s | background TPOT s |", "|---|---|---|---|"]

    def med(row, arm, key):
        return statistics.median(row[arm][key])

    for arm in ARMS:
        lines.append(f"| `{arm}` | " + " | ".join(median_range(med(x, arm, k) for x in rounds)
                                                   for k in ("alone_ttft_s", "loaded_ttft_s", "background_tpot_s"))
                     + " |")
    ratio = {k: median_range(med(x, "no-overlap", k) / med(x, "overlap", k) for x in rounds)
             for k in ("alone_ttft_s", "loaded_ttft_s", "background_tpot_s")}
    lines += ["", f"off / on per round (median of each round's medians): probe TTFT alone {ratio['alone_ttft_s']}, "
              f"loaded {ratio['loaded_ttft_s']}; background TPOT {ratio['background_tpot_s']}; probes' tokens equal "
              f"between the arms in {sum(x['tokens_equal'] for x in rounds)} of {len(rounds)} rounds.", "",
              "`.venv/bin/python -m eval.bench.cpu_overlap " + s["argv"] + "`"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--probes", type=int, default=4)
    p.add_argument("--background", type=int, default=8, help="streams decoding while the loaded probes run")
    p.add_argument("--background-tokens", type=int, default=48)
    p.add_argument("--pool-tokens", type=int, default=12000)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    load = list(os.getloadavg())
    rows = measure(args)
    setup = {"rounds": args.rounds, "pool_tokens": args.pool_tokens,
             "argv": " ".join(argv) if argv is not None else " ".join(os.sys.argv[1:])}
    save(args.out, run_record(setup, rows, load), report)


if __name__ == "__main__":
    main()
