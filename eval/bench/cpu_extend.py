"""CPU extend attention: SGLang's stock path vs sgl_multilora's new-tokens-only path, same run.
Not here: the patch itself (patches/cpu_extend_attention.py).

(a) `op`: one layer's `_run_sdpa_forward_extend` on SmolLM2-135M shapes (9 query heads, 3 KV
    heads, head_dim 64, fp32): 3 new tokens after 512 / 1024 / 2048 cached ones, a chunked-prefill
    step, and cold prefills of the same lengths. Outputs are checked equal before timing; the two
    paths are called in turn and each one's best time is kept (the machine may be shared).
(b) `server` (with --server): a real CPU server (torch_native attention) per mode. First a greedy
    check: a prompt sent cold, again (cache hit), and extended by a few tokens must give the same
    tokens in both modes. Then time to first token (max_new_tokens=1) of a cold 2048-token prompt
    and of that prompt plus 3 tokens (2048 cached).

Results go to eval/results/cpu_extend/cpu_extend.jsonl as JSON lines (setup, device, date, measurements); a
Markdown table is printed. `--quick` runs fewer repeats, lengths and trials.

    .venv/bin/python -m eval.bench.cpu_extend [--quick] [--server] [--threads N]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import sys
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import torch

RESULTS = Path(__file__).resolve().parents[1] / "results" / "cpu_extend" / "cpu_extend.jsonl"
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS = 9, 3, 64, 30  # SmolLM2-135M
MODES = ("stock", "ours")


def device_info() -> dict:
    return {
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1min": os.getloadavg()[0],  # the machine is shared: noise
        "torch": torch.__version__,
    }


def record(setup: dict, measurements: dict) -> dict:
    return {"setup": setup, "device": device_info(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "measurements": measurements}


def op_inputs(prefix_len: int, extend_len: int, seed: int = 0) -> tuple:
    """One request as `forward_extend` passes it, its KV (prefix and new tokens) in the pool."""
    g = torch.Generator().manual_seed(seed)
    seq_len = prefix_len + extend_len
    pool_size = seq_len + 1  # slot 0 is SGLang's padding slot
    req_to_token = torch.zeros(2, seq_len, dtype=torch.int32)
    req_to_token[1] = torch.randperm(seq_len, generator=g).to(torch.int32) + 1
    query = torch.randn(extend_len, NUM_Q_HEADS, HEAD_DIM, generator=g)
    return (query, torch.empty_like(query),
            torch.randn(pool_size, NUM_KV_HEADS, HEAD_DIM, generator=g),
            torch.randn(pool_size, NUM_KV_HEADS, HEAD_DIM, generator=g),
            req_to_token, torch.tensor([1]), torch.tensor([seq_len]), torch.tensor([prefix_len]),
            torch.tensor([extend_len]))


def time_ms(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Wall times (ms) of each function, called in turn `repeats` times after one warm-up round.

    Interleaving spreads the noise of a shared machine over all of them alike.
    """
    samples = {name: [] for name in fns}
    for round_idx in range(repeats + 1):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if round_idx:
                samples[name].append((time.perf_counter() - start) * 1e3)
    return samples


def bench_op(cases: list[tuple[int, int]], repeats: int) -> list[dict]:
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from sgl_multilora.patches.cpu_extend_attention import sdpa_forward_extend

    runner = SimpleNamespace(device="cpu", req_to_token_pool=None, token_to_kv_pool=None)
    backend = TorchNativeAttnBackend(runner)
    stock = inspect.unwrap(TorchNativeAttnBackend._run_sdpa_forward_extend)
    impls = {"stock": stock, "ours": sdpa_forward_extend}
    kwargs = dict(scaling=HEAD_DIM**-0.5, enable_gqa=True, causal=True)
    records = []
    for prefix_len, extend_len in cases:
        args = op_inputs(prefix_len, extend_len)
        outs = {mode: fn(backend, *args, **kwargs).clone() for mode, fn in impls.items()}
        torch.testing.assert_close(outs["ours"], outs["stock"], atol=1e-5, rtol=1e-5)
        samples = time_ms({mode: (lambda fn=fn: fn(backend, *args, **kwargs))
                           for mode, fn in impls.items()}, repeats)
        best = {mode: min(v) for mode, v in samples.items()}
        ratios = [a / b for a, b in zip(samples["stock"], samples["ours"])]  # per round: both timed in turn
        records.append(record(
            {"part": "op", "prefix_len": prefix_len, "extend_len": extend_len,
             "num_q_heads": NUM_Q_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
             "dtype": "float32", "repeats": repeats, "statistic": "median (min-max) over rounds; also min"},
            {"per_op_ms": best,
             "per_op_median_ms": {mode: statistics.median(v) for mode, v in samples.items()},
             "per_op_range_ms": {mode: [min(v), max(v)] for mode, v in samples.items()},
             "speedup_per_round": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
             f"x{NUM_LAYERS}_layers_ms": {mode: v * NUM_LAYERS for mode, v in best.items()},
             "speedup": best["stock"] / best["ours"]},
        ))
        print(f"op prefix={prefix_len} extend={extend_len}: "
              + ", ".join(f"{m} {v:.2f} ms" for m, v in best.items()), flush=True)
    return records


def generate(url: str, input_ids: list[int], max_new_tokens: int) -> dict:
    body = {"input_ids": input_ids,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}
    request = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        out = json.loads(response.read())
    out["latency_s"] = time.perf_counter() - start
    return out


def prompt_ids(tokenizer, num_tokens: int, tag: int) -> list[int]:
    """`num_tokens` ids of English text; prompts of distinct tags share only 2 first tokens."""
    text = (f"Report {tag}. " + "The committee met on Tuesday to review the budget for the new "
            "library, the repairs to the bridge, and the schedule of the summer festival. ") * 200
    return tokenizer(text)["input_ids"][:num_tokens]


def greedy_check(url: str, prompt: list[int], suffix: list[int], max_new_tokens: int) -> dict:
    """Cold, cached (prompt again), and extended (prompt + suffix) greedy outputs."""
    outs = {name: generate(url, ids, max_new_tokens)
            for name, ids in (("cold", prompt), ("cached", prompt), ("extended", prompt + suffix))}
    return {name: {"output_ids": o["output_ids"], "cached_tokens": o["meta_info"]["cached_tokens"]}
            for name, o in outs.items()}


def bench_server(model_path: str, prompt_len: int, new_len: int, trials: int) -> list[dict]:
    from transformers import AutoTokenizer

    from sgl_multilora.server import cpu_server_args, launch

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    suffix = tokenizer(" The bridge repairs were approved first, then")["input_ids"]
    check_prompt = prompt_ids(tokenizer, 600, tag=0)
    server_args = cpu_server_args(max_total_tokens=8192)
    checks, records = {}, []
    for mode in MODES:
        stock = ["--multilora-stock-baseline", "extend-attention"] if mode == "stock" else []
        server = launch(model_path, [*server_args, *stock],
                        log_path=f"/tmp/bench_cpu_extend_{mode}.log")
        try:
            generate(server.url, prompt_ids(tokenizer, 64, tag=999), 1)  # warm-up
            checks[mode] = greedy_check(server.url, check_prompt, suffix, max_new_tokens=24)
            cold, cached, cached_tokens = [], [], []
            for trial in range(trials):
                prompt = prompt_ids(tokenizer, prompt_len, tag=trial + 1)
                cold.append(generate(server.url, prompt, 1)["latency_s"] * 1e3)
                hit = generate(server.url, prompt + suffix[:new_len], 1)
                cached.append(hit["latency_s"] * 1e3)
                cached_tokens.append(hit["meta_info"]["cached_tokens"])
        finally:
            server.stop()
        records.append(record(
            {"part": "server", "mode": mode, "model": Path(model_path).name,
             "prompt_len": prompt_len, "new_len": new_len, "trials": trials,
             "max_new_tokens": 1, "statistic": "median", "server_args": server_args},
            {"cold_ttft_ms": statistics.median(cold), "cached_ttft_ms": statistics.median(cached),
             "cold_ttft_samples_ms": cold, "cached_ttft_samples_ms": cached,
             "cached_tokens": cached_tokens},
        ))
        print(f"server {mode}: cold {statistics.median(cold):.0f} ms, "
              f"cached {statistics.median(cached):.0f} ms (cached_tokens {cached_tokens})",
              flush=True)
    assert checks["ours"]["cached"]["cached_tokens"] > 0, "the repeated prompt missed the cache"
    for name in ("cold", "cached", "extended"):
        assert checks["ours"][name]["output_ids"] == checks["stock"][name]["output_ids"], (
            f"greedy outputs differ between modes on the {name} request: {checks}")
    records.append(record({"part": "server-greedy-check", "prompt_len": len(check_prompt),
                           "suffix_len": len(suffix), "max_new_tokens": 24},
                          {"identical_across_modes": True, "requests": checks}))
    return records


def markdown(records: list[dict]) -> str:
    lines = ["| case (op: median (min-max) over rounds, one layer; server: median) | stock | ours | stock / ours "
             "(median, min-max of per-round ratios) |", "|---|---:|---:|---:|"]
    for r in records:
        s, m = r["setup"], r["measurements"]
        if s["part"] == "op":
            name = (f"op, {s['extend_len']} new after {s['prefix_len']} cached" if s["prefix_len"]
                    else f"op, cold prefill {s['extend_len']}")
            if "per_op_range_ms" not in m:  # records written before rounds were kept
                st, ou = m["per_op_ms"]["stock"], m["per_op_ms"]["ours"]
                lines.append(f"| {name} (ms/layer, best) | {st:.2f} | {ou:.2f} | {st / ou:.1f}x |")
                continue
            cell = {mode: f"{m['per_op_median_ms'][mode]:.2f} ({m['per_op_range_ms'][mode][0]:.2f}-"
                          f"{m['per_op_range_ms'][mode][1]:.2f})" for mode in MODES}
            r = m["speedup_per_round"]
            lines.append(f"| {name} (ms/layer) | {cell['stock']} | {cell['ours']} | {r['median']:.1f}x "
                         f"({r['min']:.1f}-{r['max']:.1f}) |")
    server = {r["setup"]["mode"]: r for r in records if r["setup"]["part"] == "server"}
    if len(server) == 2:
        setup = server["ours"]["setup"]
        for key, name in (("cold_ttft_ms", f"cold {setup['prompt_len']}-token prompt"),
                          ("cached_ttft_ms", f"{setup['new_len']} new after the cached prompt")):
            st, ou = (server[mode]["measurements"][key] for mode in MODES)
            lines.append(f"| server TTFT, {name} (ms) | {st:.0f} | {ou:.0f} | {st / ou:.1f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer lengths, repeats and trials")
    parser.add_argument("--server", action="store_true", help="also measure a real CPU server")
    parser.add_argument("--model-path", help="default: the embedded SmolLM2-135M checkpoint")
    parser.add_argument("--threads", type=int, help="torch threads for the op timings (default: "
                        "torch's); on a busy machine 1 avoids waiting on a descheduled thread")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    lengths = (512, 2048) if args.quick else (512, 1024, 2048)
    cases = [(n, 3) for n in lengths] + [(1536, 512)] + [(0, n) for n in lengths]
    records = bench_op(cases, repeats=3 if args.quick else 10)
    if args.server:
        from sgl_multilora.embedded import ensure_embedded_model

        model_path = args.model_path or str(ensure_embedded_model())
        records += bench_server(model_path, prompt_len=2048, new_len=3,
                                trials=1 if args.quick else 3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    text = markdown(records)
    load = records[0]["device"]
    header = (f"# CPU extend attention ({records[0]['date'][:10]})\n\nMachine: {load}. Command: "
              f"`.venv/bin/python -m eval.bench.cpu_extend {' '.join(sys.argv[1:] if argv is None else argv)}`.\n\n")
    args.out.with_suffix(".md").write_text(header + text + "\n")
    print(text)
    print(f"\n{len(records)} records appended to {args.out}")


if __name__ == "__main__":
    main()
