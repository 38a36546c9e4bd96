"""`make demo`: a real SGLang server on CPU with the plugin, the embedded model and every bundled adapter.
Not here: measurements (eval/live/, eval/bench/).

Sends requests to the base model and to each adapter (the standard LoRAs concurrently, so batches mix adapters),
then a pipeline for each aLoRA check (a base answer, then the check on the same context, which reuses the base
model's KV through the LoRA-aware tree), and prints what each answered with TTFT, decode tokens/s and cached tokens. Stops the server at the end, also on Ctrl-C.
A second, short part does the same for the embedded MoE model: a LoRA server holding the expert adapters of
`assets/moe_adapters/` and one worker that holds none (`--multilora-lora-server`), asked concurrently.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import requests

from sgl_multilora.embedded import ensure_embedded_model
from sgl_multilora.embedded_moe import ensure_embedded_moe_model
from sgl_multilora.server import cpu_server_args, launch

REPO = Path(__file__).resolve().parents[1]
ADAPTERS_DIR = REPO / "assets" / "adapters"
MOE_ADAPTERS_DIR = REPO / "assets" / "moe_adapters"
QUESTIONS = ["What is the capital of France?", "Name three colors of the rainbow."]


@dataclass
class Result:
    adapter: str
    kind: str
    prompt: str
    answer: str
    ttft_s: float
    tokens_per_s: float
    cached_tokens: int
    prompt_tokens: int


def stream_generate(url: str, input_ids: list[int], lora: str | None, max_new_tokens: int) -> dict:
    """Streams one greedy `/generate`; returns the final chunk plus the measured TTFT and end-to-end time."""
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
        "lora_path": lora,
        "stream": True,
    }
    start = time.perf_counter()
    ttft, last = None, None
    with requests.post(url + "/generate", json=body, stream=True, timeout=600) as response:
        if response.status_code != 200:
            raise RuntimeError(f"/generate for {lora or 'base'} failed: {response.status_code} {response.text}")
        for line in response.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - start
            last = json.loads(line[5:])
    last["ttft_s"] = ttft or 0.0
    last["e2e_s"] = time.perf_counter() - start
    return last


def to_result(adapter: str, kind: str, prompt: str, out: dict) -> Result:
    meta = out["meta_info"]
    decode_s = max(out["e2e_s"] - out["ttft_s"], 1e-9)
    num_decode = max(meta["completion_tokens"] - 1, 0)
    return Result(adapter, kind, prompt, out["text"].strip(), out["ttft_s"], num_decode / decode_s,
                  meta.get("cached_tokens", 0), meta["prompt_tokens"])


def chat(tokenizer, question: str, answer: str | None = None) -> list[int]:
    messages = [{"role": "user", "content": question}]
    if answer is None:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    messages.append({"role": "assistant", "content": answer})
    return tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False).input_ids


def run(url: str, tokenizer, manifest: list[dict], max_new_tokens: int) -> list[Result]:
    loras = [e for e in manifest if e["kind"] == "lora"]
    aloras = [e for e in manifest if e["kind"] == "alora"]
    jobs = [(None, "base", q) for q in QUESTIONS] + [(e["name"], "lora", q) for e in loras for q in QUESTIONS]
    print(f"demo: {len(jobs)} requests to the base model and {len(loras)} LoRA adapters, all at once", flush=True)
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        outs = list(pool.map(lambda j: stream_generate(url, chat(tokenizer, j[2]), j[0], max_new_tokens), jobs))
    results = [to_result(name or "base", kind, q, out) for (name, kind, q), out in zip(jobs, outs)]

    base_answers = {r.prompt: r.answer for r in results if r.adapter == "base"}
    for entry in aloras:
        print(f"demo: pipeline for aLoRA {entry['name']}: base answer, then the check on the same context", flush=True)
        for q in QUESTIONS:
            for variant, answer in (("base answer", base_answers[q]), ("in capitals", base_answers[q].upper())):
                ids = chat(tokenizer, q, answer) + tokenizer(entry["invocation_text"], add_special_tokens=False).input_ids
                out = stream_generate(url, ids, entry["name"], 4)
                results.append(to_result(entry["name"], "alora", f"{q} [{variant}]", out))
    return results


def print_table(results: list[Result]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="sgl_multilora demo: one CPU server, base model + bundled adapters", show_lines=True)
    for col in ("adapter", "kind", "prompt", "answer", "TTFT ms", "tok/s", "cached/prompt"):
        table.add_column(col, overflow="fold")
    for r in results:
        table.add_row(r.adapter, r.kind, r.prompt, r.answer[:160], f"{r.ttft_s * 1000:.0f}", f"{r.tokens_per_s:.1f}",
                      f"{r.cached_tokens}/{r.prompt_tokens}")
    Console(width=max(Console().width, 150)).print(table)


def run_moe(url: str, tokenizer, manifest: list[dict], max_new_tokens: int) -> list[Result]:
    """Each expert adapter's example prompt and the base model's answer to the first, all at once."""
    jobs = [(None, manifest[0]["example_prompt"])] + [(e["name"], e["example_prompt"]) for e in manifest]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        outs = list(pool.map(lambda j: stream_generate(url, chat(tokenizer, j[1]), j[0], max_new_tokens), jobs))
    return [to_result(name or "base", "moe lora" if name else "base", q, out) for (name, q), out in zip(jobs, outs)]


def print_moe_table(results: list[Result]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="MoE part: a LoRA server with the expert adapters + one MoE worker holding none")
    for col in ("adapter", "prompt", "answer (first 60 chars)", "TTFT ms"):
        table.add_column(col, overflow="fold")
    for r in results:
        table.add_row(r.adapter, r.prompt, r.answer[:60], f"{r.ttft_s * 1000:.0f}")
    Console(width=max(Console().width, 120)).print(table)


def dense_part(tokenizer, max_new_tokens: int, port: int | None) -> None:
    """The embedded dense model and every bundled adapter on one server."""
    manifest = json.loads((ADAPTERS_DIR / "manifest.json").read_text())
    manifest = manifest["adapters"] if isinstance(manifest, dict) else manifest
    print(f"demo: starting an SGLang server on CPU with {len(manifest)} adapters (about a minute)...", flush=True)
    server = launch(
        ensure_embedded_model(),
        [*cpu_server_args(8192), "--multilora-adapter-dir", str(ADAPTERS_DIR), "--max-loras-per-batch", "8",
         "--radix-cache-backend", "multilora"],
        port=port,
    )
    try:
        print(f"demo: server ready at {server.url} (log: {server.log_path})", flush=True)
        print_table(run(server.url, tokenizer, manifest, max_new_tokens))
    finally:
        server.stop()
        print("demo: server stopped", flush=True)


@contextmanager
def moe_servers(moe_path: Path, address: str, lora_log_path: Path):
    """A LoRA server holding assets/moe_adapters/ on `address` and one MoE worker that holds no adapter weights and
    asks it for every expert delta; yields the worker, stops both on exit. They start side by side: a worker first
    asks the LoRA server's catalog on its first adapter request."""
    from sgl_multilora.lora_server.launch import LoRAServerProcess

    lora_server = LoRAServerProcess(MOE_ADAPTERS_DIR, moe_path, address, lora_log_path)
    with ThreadPoolExecutor(max_workers=1) as pool:
        started = pool.submit(lora_server.start)
        try:
            worker = launch(moe_path, [*cpu_server_args(4096), "--multilora-lora-server", address])
            worker.stop_grace_s = 1.0  # nothing left to drain when the demo stops it
            try:
                started.result()
                yield worker
            finally:
                worker.stop()
        finally:
            wait([started])  # a start still under way would leave its process behind
            lora_server.stop()


def moe_part(tokenizer, max_new_tokens: int) -> None:
    """The embedded MoE model served by a worker and a LoRA server holding the expert adapters."""
    moe_path = ensure_embedded_moe_model()
    manifest = json.loads((MOE_ADAPTERS_DIR / "manifest.json").read_text())["adapters"]
    print(f"demo: MoE part: a LoRA server with {len(manifest)} expert adapters and one MoE worker...", flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="multilora_demo_") as tmp:
        address = f"ipc://{tmp}/lora.sock"
        with moe_servers(moe_path, address, Path(tmp) / "lora_server.log") as worker:
            print(f"demo: MoE worker at {worker.url} and LoRA server at {address} ready "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
            print_moe_table(run_moe(worker.url, tokenizer, manifest, max_new_tokens))
    print(f"demo: MoE worker and LoRA server stopped ({time.perf_counter() - start:.0f} s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--moe-max-new-tokens", type=int, default=24)
    parser.add_argument("--port", type=int, default=None, help="the dense server's HTTP port")
    parser.add_argument("--parts", default="dense,moe", help="comma-separated: dense, moe")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_embedded_model())  # the MoE model's is the same
    parts = args.parts.split(",")
    if "dense" in parts:
        dense_part(tokenizer, args.max_new_tokens, args.port)
    if "moe" in parts:
        moe_part(tokenizer, args.moe_max_new_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
