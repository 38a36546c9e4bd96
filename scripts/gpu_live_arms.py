"""The server side of scripts/gpu_live.py: one arm's flags, its server, its check against the PEFT oracle and its
replay of the fixed trace. Not here: model, adapters and oracle (gpu_live.py)."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from pathlib import Path

ARM_FLAGS = {
    "stock": ["--lora-backend", "triton"],
    "ours": ["--radix-cache-backend", "multilora", "--lora-backend", "multilora"],
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # not embed / lm_head
STOCK_ENV = {"SGLANG_PLUGINS": "no_such_plugin"}  # SGLang's allow-list: a name no plugin has turns ours off


def server_flags(arm: str, adapters: list[dict], dry: bool) -> list[str]:
    from sgl_multilora.server import cpu_server_args

    lora = ["--enable-lora", "--max-lora-rank", str(max(a["rank"] for a in adapters)), "--max-loras-per-batch", "8",
            "--lora-target-modules", *TARGETS, "--lora-paths", *[f"{a['name']}={a['path']}" for a in adapters]]
    if dry:
        return [*cpu_server_args(4096), *lora, *ARM_FLAGS[arm]]
    device = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--dtype", "bfloat16",
              "--mem-fraction-static", "0.7", "--disable-cuda-graph", "--max-running-requests", "64"]
    return [*device, *lora, *ARM_FLAGS[arm]]


def trace(adapters: list[dict], sizes: dict, vocab: int) -> list[dict]:
    """The fixed trace (seed 0): arrival time, adapter by Zipf(s) popularity over adapter order, prompt token ids
    (random, in the vocabulary), output length."""
    rng = random.Random(0)
    weights = [1.0 / (i + 1) ** sizes["zipf"] for i in range(len(adapters))]
    now, requests = 0.0, []
    for _ in range(sizes["requests"]):
        now += rng.expovariate(sizes["rate"])
        length = rng.randint(*sizes["prompt_len"])
        requests.append({"at_s": now, "adapter": rng.choices(adapters, weights)[0]["name"],
                         "input_ids": [rng.randrange(100, vocab) for _ in range(length)]})
    return requests


async def _generate(session, url: str, input_ids: list[int], adapter: str, max_new: int) -> dict:
    body = {"input_ids": input_ids, "lora_path": adapter,
            "sampling_params": {"max_new_tokens": max_new, "min_new_tokens": max_new, "temperature": 0}}
    async with session.post(url + "/generate", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:300]}")
        return await response.json()


async def check(session, url: str, prompts, expected: dict, new_tokens: int) -> dict:
    """Greedy tokens of the server vs PEFT's, per adapter and prompt: exact matches and common prefix lengths."""
    rows = []
    for adapter, per_prompt in expected.items():
        for ids, want in zip(prompts, per_prompt):
            got = (await _generate(session, url, ids, adapter, new_tokens))["output_ids"]
            prefix = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            rows.append({"adapter": adapter, "got": got, "want": want, "prefix": prefix})
    return {"num_exact": sum(r["got"] == r["want"] for r in rows), "num": len(rows), "rows": rows}


async def replay(session, url: str, requests: list[dict], output_len: int) -> dict:
    """Sends each request at its arrival time; latency per request, throughput over the whole replay."""
    start = time.monotonic()

    async def one(request):
        await asyncio.sleep(max(0.0, request["at_s"] - (time.monotonic() - start)))
        sent = time.monotonic()
        try:
            out = await _generate(session, url, request["input_ids"], request["adapter"], output_len)
            return {"latency_s": time.monotonic() - sent, "tokens": len(out["output_ids"]),
                    "cached": out["meta_info"].get("cached_tokens", 0)}
        except Exception as e:
            return {"error": str(e)[:200]}

    results = await asyncio.gather(*(one(r) for r in requests))
    wall = time.monotonic() - start
    ok = [r for r in results if "error" not in r]
    latencies = sorted(r["latency_s"] for r in ok)
    q = (lambda p: latencies[min(len(latencies) - 1, int(p * len(latencies)))]) if latencies else (lambda p: None)
    return {"num": len(results), "num_ok": len(ok), "errors": [r["error"] for r in results if "error" in r][:5],
            "wall_s": round(wall, 2), "output_tokens_per_s": round(sum(r["tokens"] for r in ok) / wall, 1),
            "latency_s": {"p50": q(0.5), "p90": q(0.9), "mean": statistics.fmean(latencies) if latencies else None},
            "cached_tokens": sum(r["cached"] for r in ok)}


async def run_arm(arm: str, model_dir: Path, adapters: list[dict], prompts, expected: dict, sizes: dict, dry: bool,
                  out: Path, timeout_s: float) -> dict:
    """Starts the arm's server, checks it, replays the trace, stops it. Raises on a failed start (its log is in
    `out`); the check and the replay are bounded by `timeout_s` together."""
    import json

    import aiohttp

    from sgl_multilora.server import launch

    flags = server_flags(arm, adapters, dry)
    started = time.monotonic()
    handle = launch(model_dir, flags, env=STOCK_ENV if arm == "stock" else None, log_path=out / f"server_{arm}.log",
                    ready_timeout_s=timeout_s)
    result = {"flags": flags, "start_s": round(time.monotonic() - started, 1)}
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async def body():
                result["check"] = await check(session, handle.url, prompts, expected, sizes["new_tokens"])
                result["replay"] = await replay(session, handle.url, trace(adapters, sizes, vocab),
                                                sizes["output_len"])
            await asyncio.wait_for(body(), timeout_s)
    finally:
        handle.stop(timeout_s=20)
    return result
