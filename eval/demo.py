"""`make demo`: a real SGLang server on CPU with the plugin, the embedded model and every bundled adapter.
Not here: measurements (eval/live/, eval/bench/).

Sends requests to the base model and to each adapter (the standard LoRAs concurrently, so batches mix adapters),
then a pipeline for each aLoRA check (a base answer, then the check on the same context, which reuses the base
model's KV through the LoRA-aware tree), and prints what each answered with TTFT, decode tokens/s and cached tokens. Stops the server at the end, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import requests

from sgl_multilora.embedded import ensure_embedded_model
from sgl_multilora.server import cpu_server_args, launch

REPO = Path(__file__).resolve().parents[1]
ADAPTERS_DIR = REPO / "assets" / "adapters"
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--port", type=int, default=None)
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    model_path = ensure_embedded_model()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    manifest = json.loads((ADAPTERS_DIR / "manifest.json").read_text())
    manifest = manifest["adapters"] if isinstance(manifest, dict) else manifest
    print(f"demo: starting an SGLang server on CPU with {len(manifest)} adapters (about a minute)...", flush=True)
    server = launch(
        model_path,
        [*cpu_server_args(8192), "--multilora-adapter-dir", str(ADAPTERS_DIR), "--max-loras-per-batch", "8",
         "--radix-cache-backend", "multilora"],
        port=args.port,
    )
    try:
        print(f"demo: server ready at {server.url} (log: {server.log_path})", flush=True)
        results = run(server.url, tokenizer, manifest, args.max_new_tokens)
        print_table(results)
    finally:
        server.stop()
        print("demo: server stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
