"""The CPU serving path's LoRA op (`--multilora-lora-ops cpu`, the default on a CPU) against the torch references it
replaced there (`--multilora-lora-ops torch`), over one whole forward step's projections, same run.

A step is what the server computes for one batch: every decoder projection of the model (SmolLM2-135M: 30 layers x
q, k, v, o, gate, up, down), each a base linear plus the LoRA delta of the step's adapters, on `T` new tokens spread
over `S` adapters (decode: one token per request, requests dealt to adapters round-robin, so rows interleave;
prefill: a few long requests). Adapter ranks cycle through `--ranks` (the bundled adapters' 16 / 32 / 64 by
default), every adapter on every projection. The two ops are called in turn, `--rounds` times per shape; the report
gives each one's median (min-max) step time, the LoRA share over the base linears alone, and the ratio per round.
Results are checked equal (to float32 rounding) before timing.

`--server`: the same comparison in a real CPU server. Two servers of one build with the same flags but
`--multilora-lora-ops` (`cpu` / `torch`), the unified pool, the embedded model and the translation workload's 24
random PEFT adapters (ranks 16 / 32 / 64 on every projection), `--max-loras-per-batch 8`. Each round sends each
server in turn, on a flushed cache, the same burst: `--burst` requests at once on as many adapters as the cap
allows (cycled), each a distinct prompt of about 64 tokens and `--new-tokens` greedy tokens (ignore_eos). The
report gives each arm's burst time and mean TTFT, median (min-max), and the ratio per round; the tokens of the
two arms must be equal.

    .venv/bin/python -m eval.bench.cpu_lora_op [--rounds 7] [--threads 2] [--out eval/results/cpu_lora_op/cpu_lora_op.jsonl]
    .venv/bin/python -m eval.bench.cpu_lora_op --server [--rounds 5] [--out eval/results/cpu_lora_op/cpu_lora_op_server.jsonl]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from eval.bench.results import median_range, run_record, save
from sgl_multilora.segments import SegmentMeta
from sgl_multilora.triton_kernels.ops import LoRAWeights, lora_forward

HIDDEN, INTERMEDIATE, KV, LAYERS = 576, 1536, 192, 30  # SmolLM2-135M
MODULES = {"q_proj": (HIDDEN, HIDDEN), "k_proj": (HIDDEN, KV), "v_proj": (HIDDEN, KV), "o_proj": (HIDDEN, HIDDEN),
           "gate_proj": (HIDDEN, INTERMEDIATE), "up_proj": (HIDDEN, INTERMEDIATE), "down_proj": (INTERMEDIATE, HIDDEN)}
# (label, requests, new tokens per request, adapters)
SHAPES = [("decode", 8, 1, 4), ("decode", 16, 1, 8), ("decode", 32, 1, 8), ("prefill", 4, 64, 4),
          ("prefill", 2, 256, 1)]
IMPLS = ("torch", "cpu")
RESULTS = Path(__file__).resolve().parents[1] / "results" / "cpu_lora_op" / "cpu_lora_op.jsonl"


class Step:
    """One step's inputs, base weights and per-projection weight tables (distinct tensors per layer, as served)."""

    def __init__(self, requests: int, tokens: int, adapters: int, ranks: list[int], max_slots: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.layers = []
        for _ in range(LAYERS):
            layer = []
            for i, o in MODULES.values():
                a = [torch.randn(ranks[s % len(ranks)], i, generator=g) * 0.01 for s in range(adapters)]
                b = [torch.randn(o, ranks[s % len(ranks)], generator=g) * 0.01 for s in range(adapters)]
                empty = max_slots - adapters
                table = LoRAWeights.from_list(a + [None] * empty, b + [None] * empty,
                                              [2.0] * adapters + [0.0] * empty, (0, o))
                layer.append((torch.randn(o, i, generator=g) * 0.02, table))
            self.layers.append(layer)
        self.x = {i: torch.randn(requests * tokens, i, generator=g) for i, _ in MODULES.values()}
        self.meta = SegmentMeta.make(requests * tokens, max_slots, "cpu")
        self.meta.prepare_requests([f"adapter-{r % adapters}" for r in range(requests)], [tokens] * requests)

    def run(self, impl: str | None) -> list[torch.Tensor]:
        """The step's outputs (impl None: the base linears alone)."""
        outs = []
        for layer in self.layers:
            for (base, table), (i, _) in zip(layer, MODULES.values()):
                y = F.linear(self.x[i], base)
                if impl is not None:
                    lora_forward(self.x[i], y, self.meta, table, impl=impl)
                outs.append(y)
        return outs


def measure(args) -> list[dict]:
    rows = []
    for label, requests, tokens, adapters in SHAPES:
        step = Step(requests, tokens, adapters, args.ranks, args.max_slots, seed=requests + adapters)
        ref, got = step.run("torch"), step.run("cpu")
        worst = max(float((r - o).abs().max()) for r, o in zip(ref, got))
        if worst > 1e-4:
            raise SystemExit(f"{label} {requests}x{tokens} on {adapters} adapters: ops differ by {worst:.2e}")
        times = {k: [] for k in ("base", *IMPLS)}
        for _ in range(args.rounds):
            for key in times:  # in turn, every round
                t0 = time.perf_counter()
                step.run(None if key == "base" else key)
                times[key].append(time.perf_counter() - t0)
        row = {"shape": label, "requests": requests, "tokens_per_request": tokens, "adapters": adapters,
               "max_abs_diff": worst, "step_s": times,
               "ratio_cpu_over_torch": [c / t for c, t in zip(times["cpu"], times["torch"])],
               "lora_ratio_cpu_over_torch": [(c - b) / (t - b) for c, t, b in
                                             zip(times["cpu"], times["torch"], times["base"])]}
        rows.append(row)
        print(report_row(row), flush=True)
    return rows


def report_row(row: dict) -> str:
    t = row["step_s"]
    ms = {k: [v * 1e3 for v in vs] for k, vs in t.items()}
    base = statistics.median(ms["base"])
    lora = {k: statistics.median(ms[k]) - base for k in IMPLS}
    return (f"| {row['shape']} | {row['requests']} x {row['tokens_per_request']} | {row['adapters']} | "
            f"{median_range(ms['base'], '{:.1f}')} | {median_range(ms['torch'], '{:.1f}')} | "
            f"{median_range(ms['cpu'], '{:.1f}')} | {lora['torch'] / base:.2f}x / {lora['cpu'] / base:.2f}x | "
            f"{median_range(row['ratio_cpu_over_torch'])} | {median_range(row['lora_ratio_cpu_over_torch'])} |")


def report(record: dict) -> str:
    s, d = record["setup"], record["device"]
    lines = [
        f"# CPU LoRA op vs the torch references, one forward step ({record['date'][:10]})", "",
        f"SmolLM2-135M projections ({LAYERS} layers x {len(MODULES)}), fp32, ranks {s['ranks']} cycled over the "
        f"step's adapters, every adapter on every projection, {s['max_slots']} slots; {s['rounds']} rounds, the "
        f"three arms in turn each round; torch threads {s['threads']}. Machine: {d['cpu_count']} CPUs, load "
        f"average {d['load_avg_start'][0]:.2f} at the start, {d['load_avg_end'][0]:.2f} at the end.", "",
        "| step | requests x new tokens | adapters | base linears ms | + LoRA, torch refs ms | + LoRA, cpu op ms "
        "| LoRA / base (torch / cpu) | step cpu / torch | LoRA part cpu / torch |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [report_row(r) for r in record["rows"]]
    lines += ["", "Times are median (min-max) over rounds; the ratios are per round. The LoRA part is a step's time "
              "less the same round's base linears.", "",
              "`.venv/bin/python -m eval.bench.cpu_lora_op " + s["argv"] + "`"]
    return "\n".join(lines) + "\n"


SERVER_RESULTS = RESULTS.with_name("cpu_lora_op_server.jsonl")
SERVER_ARMS = ("cpu", "torch")


def stream_greedy(url: str, text: str, adapter: str, new_tokens: int) -> dict:
    """One streamed greedy `/generate` request of exactly `new_tokens` tokens: its TTFT and total time (s), its
    output ids."""
    import json

    import requests

    body = {"text": text, "lora_path": adapter, "stream": True,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}
    t0 = time.perf_counter()
    ttft, last = None, None
    with requests.post(url + "/generate", json=body, stream=True, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            last = json.loads(line[5:])
    return {"ttft_s": ttft, "total_s": time.perf_counter() - t0, "ids": last["output_ids"]}


def burst(url: str, prompts: list[str], adapters: list[str], new_tokens: int) -> dict:
    """Sends every prompt at once (prompt i on adapter i mod len), streamed; (wall time, per-request TTFT, tokens)."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda i: stream_greedy(url, prompts[i], adapters[i % len(adapters)], new_tokens),
                                range(len(prompts))))
    return {"wall_s": time.perf_counter() - t0, "ttft_s": [r["ttft_s"] for r in results],
            "tokens": [r["ids"] for r in results]}


def measure_server(args) -> dict:
    import requests

    from eval.live.adapters import CACHE, make_adapters
    from eval.workloads import create_workload
    from sgl_multilora.embedded import ensure_embedded_model
    from sgl_multilora.server import cpu_server_args, launch

    model = str(ensure_embedded_model())
    workload = create_workload("translation", seed=0, num_adapters=24, ranks=(16, 32, 64))
    adapters_dir = make_adapters(model, workload, CACHE / "translation-24-16,32,64")
    names = [a.name for a in workload.adapters][: args.max_loras_per_batch]
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing".split()
    prompts = [" ".join(words[(i + j) % len(words)] for j in range(48)) + f" (request {i})"
               for i in range(args.burst)]
    common = ["--multilora-adapter-dir", str(adapters_dir), "--max-loras-per-batch", str(args.max_loras_per_batch),
              "--max-lora-rank", "64", "--radix-cache-backend", "multilora"]
    log_dir = Path(__file__).resolve().parents[2] / ".cache" / "bench_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    servers, rounds = {}, []
    try:
        for arm in SERVER_ARMS:
            servers[arm] = launch(model, [*cpu_server_args(max_total_tokens=args.pool_tokens), *common,
                                          "--multilora-lora-ops", arm], log_path=log_dir / f"cpu_lora_op_{arm}.log")
        for arm in SERVER_ARMS:  # warm-up: every adapter resident, first-call costs paid
            burst(servers[arm].url, prompts, names, 2)
        for i in range(args.rounds):
            row = {}
            for arm in SERVER_ARMS[i % 2:] + SERVER_ARMS[: i % 2]:
                requests.post(servers[arm].url + "/flush_cache", timeout=60)
                time.sleep(1.0)
                row[arm] = burst(servers[arm].url, prompts, names, args.new_tokens)
            if row["cpu"]["tokens"] != row["torch"]["tokens"]:
                differ = sum(a != b for a, b in zip(row["cpu"]["tokens"], row["torch"]["tokens"]))
                print(f"round {i}: {differ} of {len(prompts)} requests' tokens differ between the arms")
            row["tokens_equal"] = row["cpu"]["tokens"] == row["torch"]["tokens"]
            for arm in SERVER_ARMS:
                del row[arm]["tokens"]
            rounds.append(row)
            print(f"round {i}: burst {row['cpu']['wall_s']:.2f} s (cpu) / {row['torch']['wall_s']:.2f} s (torch)",
                  flush=True)
    finally:
        for handle in servers.values():
            handle.stop()
    return {"burst": args.burst, "new_tokens": args.new_tokens, "adapters": names, "rounds": rounds}


def server_report(record: dict) -> str:
    s, d, r = record["setup"], record["device"], record["rows"]
    rounds = r["rounds"]
    lines = [f"# CPU LoRA op vs the torch references in a live CPU server ({record['date'][:10]})", "",
             f"Two servers of one build, the same flags but `--multilora-lora-ops`: the embedded SmolLM2-135M in fp32, "
             f"the unified pool ({s['pool_tokens']} token slots), `--max-loras-per-batch {s['max_loras_per_batch']}`; "
             f"a burst of {r['burst']} streamed requests at once on {len(r['adapters'])} adapters of ranks 16 / 32 / "
             f"64 (every projection), {r['new_tokens']} greedy tokens each; {len(rounds)} rounds, arms alternating, "
             f"flushed cache. Machine: {d['cpu_count']} CPUs, load average {d['load_avg_start'][0]:.2f} at the "
             f"start, {d['load_avg_end'][0]:.2f} at the end.", "",
             "| arm | burst wall s | mean TTFT s |", "|---|---|---|"]
    for arm in SERVER_ARMS:
        lines.append(f"| `{arm}` | {median_range(x[arm]['wall_s'] for x in rounds)} | "
                     f"{median_range(statistics.fmean(x[arm]['ttft_s']) for x in rounds)} |")
    ttft = [statistics.fmean(x["cpu"]["ttft_s"]) / statistics.fmean(x["torch"]["ttft_s"]) for x in rounds]
    lines += ["", "cpu / torch per round: burst wall time "
              f"{median_range(x['cpu']['wall_s'] / x['torch']['wall_s'] for x in rounds)}, mean TTFT "
              f"{median_range(ttft)}; "
              f"tokens equal between the arms in {sum(x['tokens_equal'] for x in rounds)} of {len(rounds)} rounds.",
              "", "`.venv/bin/python -m eval.bench.cpu_lora_op " + s["argv"] + "`"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[16, 32, 64])
    p.add_argument("--max-slots", type=int, default=8)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--server", action="store_true", help="compare the two ops in live CPU servers")
    p.add_argument("--burst", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--pool-tokens", type=int, default=12000)
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    args = p.parse_args(argv)
    load = list(os.getloadavg())
    argv_text = " ".join(argv) if argv is not None else " ".join(os.sys.argv[1:])
    if args.server:
        rows = measure_server(args)
        setup = {"rounds": args.rounds, "pool_tokens": args.pool_tokens, "argv": argv_text,
                 "max_loras_per_batch": args.max_loras_per_batch, "torch": torch.__version__}
        save(args.out or SERVER_RESULTS, run_record(setup, rows, load), server_report)
        return
    torch.set_num_threads(args.threads)
    rows = measure(args)
    setup = {"ranks": args.ranks, "rounds": args.rounds, "threads": args.threads, "max_slots": args.max_slots,
             "argv": argv_text, "torch": torch.__version__}
    save(args.out or RESULTS, run_record(setup, rows, load), report)


if __name__ == "__main__":
    main()
