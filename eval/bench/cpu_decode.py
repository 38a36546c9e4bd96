"""CPU decode attention: SGLang's per-request loop vs sgl_multilora's grouped calls (`patches/cpu_decode_attention.py`).

(a) `op`: one decode step's attention over all 30 layers of SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64,
    fp32) for batches of KV lengths drawn from the Azure conversation trace's prompt lengths (`--length-scale` as the
    live benchmarks use it) plus a few fixed ones. Every step gets a new `seq_lens` tensor, as SGLang's decode steps
    do, so ours pays for building its layout once per step. Outputs are checked equal before timing; the two paths
    run in turn each round (the machine may be shared), median (min-max) over rounds. `--pad-rows` also times ours
    with other values of the grouping constant `PAD_ROWS_PER_CALL`.
(b) `server` (with --server): two real CPU servers of one build (the embedded SmolLM2-135M, fp32, no adapters)
    that differ only in `--multilora-stock-baseline decode-attention`. Per round and server (order alternating,
    cache flushed): `--streams` greedy streams of `--tokens` tokens with prompts of mixed lengths sent at once; their
    median time per output token, the wall time, and whether the greedy tokens are equal between the servers.

    .venv/bin/python -m eval.bench.cpu_decode [--rounds 10] [--server] [--out eval/results/cpu_decode/cpu_decode.jsonl]
"""

from __future__ import annotations

import argparse
import inspect
import os
import random
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from eval.bench.results import median_range, run_record, save

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "eval" / "results" / "cpu_decode" / "cpu_decode.jsonl"
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS = 9, 3, 64, 30  # SmolLM2-135M
MODES = ("stock", "ours")


def trace_lengths(n: int, length_scale: float, seed: int) -> list[int]:
    """`n` KV lengths: prompt lengths of the Azure conversation trace times `length_scale`, plus some generated
    tokens (0-63), at least 1."""
    from eval.workloads.base import read_azure_trace

    prompts = [row.context_tokens for row in read_azure_trace()]
    rng = random.Random(seed)
    return [max(1, int(rng.choice(prompts) * length_scale) + rng.randrange(64)) for _ in range(n)]


def step_inputs(seq_lens: list[int], seed: int = 0) -> dict:
    """One decode step's pool and batch, every request's KV at shuffled slots (slot 0 unused)."""
    g = torch.Generator().manual_seed(seed)
    total = sum(seq_lens)
    slots = (torch.randperm(total, generator=g) + 1).split(seq_lens)
    req_to_token = torch.zeros(len(seq_lens), max(seq_lens), dtype=torch.int32)
    for row, s in enumerate(slots):
        req_to_token[row, : len(s)] = s.to(torch.int32)
    return {"query": torch.randn(len(seq_lens), NUM_Q_HEADS, HEAD_DIM, generator=g),
            "k": [torch.randn(total + 1, NUM_KV_HEADS, HEAD_DIM, generator=g) for _ in range(2)],
            "v": [torch.randn(total + 1, NUM_KV_HEADS, HEAD_DIM, generator=g) for _ in range(2)],
            "req_to_token": req_to_token, "req_pool_indices": torch.arange(len(seq_lens)),
            "seq_lens": torch.tensor(seq_lens)}


def run_step(fn, backend, x: dict) -> torch.Tensor:
    """Attention of every layer for one step (layers alternate between two K/V pools: different memory, as the
    layers' caches are); a fresh `seq_lens` tensor, as each of SGLang's steps has."""
    seq_lens = x["seq_lens"].clone()
    out = torch.empty_like(x["query"])
    for layer in range(NUM_LAYERS):
        fn(backend, x["query"], out, x["k"][layer % 2], x["v"][layer % 2], x["req_to_token"], x["req_pool_indices"],
           seq_lens, scaling=HEAD_DIM**-0.5, enable_gqa=True)
    return out


def bench_op(cases: dict[str, list[int]], rounds: int, pad_rows: list[int]) -> list[dict]:
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from sgl_multilora.patches import cpu_decode_attention

    backend = TorchNativeAttnBackend(SimpleNamespace(device="cpu", req_to_token_pool=None, token_to_kv_pool=None))
    stock = inspect.unwrap(TorchNativeAttnBackend._run_sdpa_forward_decode)
    default = cpu_decode_attention.PAD_ROWS_PER_CALL

    def ours_at(rows: int):
        def fn(*args, **kwargs):
            cpu_decode_attention.PAD_ROWS_PER_CALL = rows
            try:
                return cpu_decode_attention.sdpa_forward_decode(*args, **kwargs)
            finally:
                cpu_decode_attention.PAD_ROWS_PER_CALL = default
        return fn

    impls = {"stock": stock, "ours": ours_at(default), **{f"ours-pad{r}": ours_at(r) for r in pad_rows if r != default}}
    rows = []
    for name, seq_lens in cases.items():
        x = step_inputs(seq_lens)
        expected = run_step(stock, backend, x)
        for impl, fn in impls.items():
            torch.testing.assert_close(run_step(fn, backend, x), expected, atol=1e-5, rtol=1e-5)
        samples = {impl: [] for impl in impls}
        for _ in range(rounds + 1):  # the first round warms up
            for impl, fn in impls.items():
                t0 = time.perf_counter()
                run_step(fn, backend, x)
                samples[impl].append((time.perf_counter() - t0) * 1e3)
        samples = {impl: s[1:] for impl, s in samples.items()}
        groups = len(cpu_decode_attention.decode_layout(x["req_to_token"], x["req_pool_indices"], x["seq_lens"],
                                                        None).groups)
        rows.append({"part": "op", "case": name, "batch": len(seq_lens), "kv_tokens": sum(seq_lens),
                     "max_len": max(seq_lens), "groups": groups, "step_ms": samples})
        print(f"op {name}: " + ", ".join(f"{i} {statistics.median(s):.2f} ms" for i, s in samples.items()),
              flush=True)
    return rows


def bench_server(args) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    import requests

    from eval.bench.cpu_lora_op import stream_greedy
    from sgl_multilora.embedded import ensure_embedded_model
    from sgl_multilora.server import cpu_server_args, launch

    model = str(ensure_embedded_model())
    rng = random.Random(1)
    words = "the committee met on tuesday to review the budget for the new library and the bridge".split()
    prompts = [" ".join(rng.choice(words) for _ in range(n))
               for n in trace_lengths(args.streams, args.length_scale, seed=2)]
    log_dir = REPO / ".cache" / "bench_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    servers, out = {}, []
    try:
        for mode in MODES:
            stock = ["--multilora-stock-baseline", "decode-attention"] if mode == "stock" else []
            servers[mode] = launch(model, [*cpu_server_args(max_total_tokens=args.pool_tokens), *stock],
                                   log_path=log_dir / f"cpu_decode_{mode}.log")

        def burst(url: str, tag: str) -> dict:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(prompts)) as pool:
                res = list(pool.map(lambda p: stream_greedy(url, f"{p} ({tag})", None, args.tokens), prompts))
            return {"wall_s": time.perf_counter() - t0,
                    "tpot_s": statistics.median((r["total_s"] - r["ttft_s"]) / (args.tokens - 1) for r in res),
                    "ids": [r["ids"] for r in res]}

        for mode in MODES:
            burst(servers[mode].url, "warm-up")
        for i in range(args.rounds):
            row = {}
            for mode in MODES[i % 2:] + MODES[: i % 2]:
                requests.post(servers[mode].url + "/flush_cache", timeout=60)
                time.sleep(1.0)
                row[mode] = burst(servers[mode].url, f"round {i}")
            row["tokens_equal"] = row["stock"]["ids"] == row["ours"]["ids"]
            for mode in MODES:
                del row[mode]["ids"]
            out.append(row)
            print(f"server round {i}: TPOT " + " / ".join(f"{row[m]['tpot_s'] * 1e3:.1f} ms ({m})" for m in MODES),
                  flush=True)
    finally:
        for handle in servers.values():
            handle.stop()
    return {"part": "server", "streams": args.streams, "tokens": args.tokens,
            "prompt_words": [len(p.split()) for p in prompts], "rounds": out}


def report(record: dict) -> str:
    s, d = record["setup"], record["device"]
    lines = [f"# CPU decode attention: SGLang's per-request loop vs grouped calls ({record['date'][:10]})", "",
             f"Machine: {d['cpu_count']} CPUs, load average {d['load_avg_start'][0]:.2f} at the start, "
             f"{d['load_avg_end'][0]:.2f} at the end; torch threads {s['torch_threads']}. Command: "
             f"`.venv/bin/python -m eval.bench.cpu_decode {s['argv']}`.", "",
             f"One decode step's attention, all {NUM_LAYERS} layers of SmolLM2-135M (9 query heads, 3 KV heads, "
             f"head_dim 64, fp32), ms per step, median (min-max) over {s['rounds']} rounds; ratio stock / ours per "
             f"round. Ours builds its layout once per step (included).", ""]
    ops = [r for r in record["rows"] if r["part"] == "op"]
    impls = list(ops[0]["step_ms"]) if ops else []
    lines += ["| batch | requests | KV tokens | longest | groups | " + " | ".join(impls) + " | stock / ours |",
              "|---|---:|---:|---:|---:|" + "---|" * len(impls) + "---|"]
    for r in ops:
        t = r["step_ms"]
        ratio = median_range(a / b for a, b in zip(t["stock"], t["ours"]))
        lines.append(f"| {r['case']} | {r['batch']} | {r['kv_tokens']} | {r['max_len']} | {r['groups']} | "
                     + " | ".join(median_range(t[i]) for i in impls) + f" | {ratio} |")
    server = [r for r in record["rows"] if r["part"] == "server"]
    if server:
        r = server[0]
        rounds = r["rounds"]
        lines += ["", "Live servers (no adapters, `--multilora-stock-baseline decode-attention` / ours): "
                  f"{r['streams']} greedy streams of {r['tokens']} tokens sent at once, prompts of "
                  f"{min(r['prompt_words'])}-{max(r['prompt_words'])} words; {len(rounds)} rounds, servers alternating.", "",
                  "| server | median TPOT ms | burst wall s |", "|---|---|---|"]
        for mode in MODES:
            lines.append(f"| {mode} | {median_range((x[mode]['tpot_s'] * 1e3 for x in rounds), '{:.1f}')} | "
                         f"{median_range(x[mode]['wall_s'] for x in rounds)} |")
        lines += ["", "ours / stock per round: TPOT "
                  + median_range(x["ours"]["tpot_s"] / x["stock"]["tpot_s"] for x in rounds)
                  + ", wall " + median_range(x["ours"]["wall_s"] / x["stock"]["wall_s"] for x in rounds)
                  + f"; greedy tokens equal in {sum(x['tokens_equal'] for x in rounds)} of {len(rounds)} rounds."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--length-scale", type=float, default=0.1, help="scale of the trace's prompt lengths")
    p.add_argument("--pad-rows", default="", help="comma-separated PAD_ROWS_PER_CALL values to time ours with too")
    p.add_argument("--threads", type=int, help="torch threads for the op timings (default: torch's)")
    p.add_argument("--server", action="store_true", help="also measure two live CPU servers")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--pool-tokens", type=int, default=16000)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load = list(os.getloadavg())
    cases = {"8 x 512": [512] * 8, "1 x 2048": [2048]}
    for n in (8, 16, 32, 64):
        cases[f"{n} from the trace"] = trace_lengths(n, args.length_scale, seed=n)
    cases["16 from the trace, x10 lengths"] = trace_lengths(16, args.length_scale * 10, seed=16)
    rows = bench_op(cases, args.rounds, [int(v) for v in args.pad_rows.split(",") if v])
    if args.server:
        rows.append(bench_server(args))
    setup = {"rounds": args.rounds, "length_scale": args.length_scale, "torch_threads": torch.get_num_threads(),
             "argv": " ".join(argv) if argv is not None else " ".join(os.sys.argv[1:])}
    save(args.out, run_record(setup, rows, load), report)


if __name__ == "__main__":
    main()
