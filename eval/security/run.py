"""Runs the attack catalogue (`eval/security/attacks.py`) against live CPU servers and writes the
stock-vs-ours comparison. Not here: the attacks themselves (data only, shared with the tests).

Each arm starts its own server with the embedded model and the bundled adapters, caches a victim
prompt, sends every attack and records the HTTP status, the cached tokens it read and whether the
server still answers.

Usage (a few minutes):
    .venv/bin/python -m eval.security.run [--out eval/results/ingress_attacks/ingress_attacks.jsonl]
Arms: `stock` = `--multilora-stock-baseline ingress` (SGLang 0.5.23's request handling and prefix cache;
the plugin keeps only its CPU LoRA compute, without which LoRA does not run on this CPU path), `ours` =
strict ingress (the default) with SGLang's prefix cache, `ours+tree` = strict ingress and
`--radix-cache-backend multilora`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import signal
import sys
import uuid
from pathlib import Path

import requests

from eval.security.attacks import (
    Attack,
    cache_attacks,
    crash_inputs,
    lora_paths_id,
    malformed_inputs,
    tenant_attacks,
)

ADAPTERS_DIR = Path(__file__).resolve().parents[2] / "assets" / "adapters"


def generate(url: str, body: dict, timeout: float = 300) -> tuple[int | str, dict | str]:
    """(HTTP status or "connection error", JSON body or error text) of one /generate call."""
    try:
        response = requests.post(url + "/generate", json=body, timeout=timeout)
    except requests.RequestException as e:
        return "connection error", f"{type(e).__name__}: {e}"
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, response.text


def alive(url: str) -> bool:
    try:
        return requests.get(url + "/health", timeout=30).status_code == 200
    except requests.RequestException:
        return False


def cached_tokens(payload) -> int | None:
    if isinstance(payload, dict) and "meta_info" in payload:
        return int(payload["meta_info"].get("cached_tokens", 0))
    return None


def run_attack(url: str, prompt_ids: list[int], attack: Attack, max_new_tokens: int = 2) -> dict:
    """Sends one attack over `prompt_ids`; returns status, cached tokens and whether the server still answers."""
    body = {"sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    if "text" not in attack.fields:
        body["input_ids"] = prompt_ids
    body.update(attack.fields)
    status, payload = generate(url, body)
    error = None
    if status != 200:
        error = payload.get("error", {}).get("message") if isinstance(payload, dict) and "error" in payload else str(
            payload)[:300]
    return {"attack": attack.name, "status": status, "cached_tokens": cached_tokens(payload), "error": error,
            "server_alive": alive(url)}


ARMS = {
    "stock": ["--multilora-stock-baseline", "ingress"],
    "ours": [],
    "ours+tree": ["--radix-cache-backend", "multilora"],
}


def _victim_prompt(tokenizer, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    words = [w for w in tokenizer.get_vocab() if w.isalpha()][:2000]
    text = " ".join(rng.choice(words) for _ in range(length))
    return tokenizer(text, add_special_tokens=False).input_ids[:length]


def run_arm(arm: str, model_path: str, tokenizer, out, args) -> list[dict]:
    from sgl_multilora.server import cpu_server_args, launch

    manifest = json.loads((ADAPTERS_DIR / "manifest.json").read_text())["adapters"]
    names = [e["name"] for e in manifest if e["kind"] == "lora"]
    victim, other = names[0], names[1]
    server_args = [*cpu_server_args(8192), "--multilora-adapter-dir", str(ADAPTERS_DIR), "--max-loras-per-batch",
                   "8", *ARMS[arm]]
    rows = []

    def record(row):
        row.update(arm=arm)
        rows.append(row)
        out.write(json.dumps(row) + "\n")
        out.flush()

    handle = launch(model_path, server_args, log_path=f"/tmp/sgl_multilora_attacks_{arm}.log")
    try:
        victim_id = lora_paths_id(victim, str(ADAPTERS_DIR / victim))
        prompt = _victim_prompt(tokenizer, args.prompt_tokens, args.seed)
        status, payload = generate(handle.url, {"input_ids": prompt, "lora_path": victim,
                                                "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        assert status == 200, payload
        from sgl_multilora.adapters import read_spec

        identity = read_spec(ADAPTERS_DIR / victim, victim).identity
        for attack in cache_attacks(victim_id, identity, other, num_random=args.num_random, seed=args.seed):
            record({"kind": "adapter cache", "prompt_tokens": len(prompt), **run_attack(handle.url, prompt, attack)})
        salt = "tenant-" + uuid.UUID(int=random.Random(args.seed).getrandbits(128)).hex[:12]
        prompt2 = _victim_prompt(tokenizer, args.prompt_tokens, args.seed + 1)
        generate(handle.url, {"input_ids": prompt2, "cache_salt": salt,
                              "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        for attack in tenant_attacks(salt):
            record({"kind": "tenant cache", "prompt_tokens": len(prompt2), **run_attack(handle.url, prompt2, attack)})
        for attack in crash_inputs(len(tokenizer)):
            if not alive(handle.url):  # the previous input stopped it: start a fresh one for the next
                handle.stop()
                handle = launch(model_path, server_args, log_path=f"/tmp/sgl_multilora_attacks_{arm}.log")
            body_prompt = [1, 2, 3]
            record({"kind": "crash input", "prompt_tokens": len(body_prompt),
                    **run_attack(handle.url, body_prompt, attack)})
        for attack in malformed_inputs(victim):
            if not alive(handle.url):
                handle.stop()
                handle = launch(model_path, server_args, log_path=f"/tmp/sgl_multilora_attacks_{arm}.log")
            record({"kind": "malformed input", "prompt_tokens": 0, **run_attack(handle.url, [1, 2, 3], attack)})
    finally:
        handle.stop()
    return rows


CACHE_KINDS = ("adapter cache", "tenant cache")


def summarize(rows: list[dict]) -> str:
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    lines = ["| attack | kind | " + " | ".join(arms) + " |", "|---|---|" + "---|" * len(arms)]
    by = {(r["attack"], r["arm"]): r for r in rows}
    for name, kind in dict.fromkeys((r["attack"], r["kind"]) for r in rows):
        cells = []
        for arm in arms:
            r = by.get((name, arm))
            if r is None:
                cells.append("-")
            elif not r["server_alive"]:
                cells.append(f"**server died** ({r['status']})")
            elif r["status"] != 200:
                cells.append(f"{r['status']}")
            else:
                cells.append(f"{r['cached_tokens']}/{r['prompt_tokens']} cached" if kind in CACHE_KINDS else "200")
        lines.append(f"| {name} | {kind} | " + " | ".join(cells) + " |")
    totals = []
    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm]
        leaked = sum(1 for r in mine if r["kind"] in CACHE_KINDS and (r["cached_tokens"] or 0) > 0)
        died = sum(1 for r in mine if not r["server_alive"])
        internal = sum(1 for r in mine if r["server_alive"] and isinstance(r["status"], int) and r["status"] >= 500)
        totals.append(f"- {arm}: {leaked} of {sum(r['kind'] in CACHE_KINDS for r in mine)} cache attacks read "
                      f"cached KV; {died} requests stopped the server; {internal} got an internal error (5xx)")
    return "\n".join(lines + [""] + totals)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ", ".join(ARMS))
    parser.add_argument("--out", type=Path, default=Path("eval/results/ingress_attacks/ingress_attacks.jsonl"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-tokens", type=int, default=256, help="length of the victims' cached prompts")
    parser.add_argument("--num-random", type=int, default=8, help="random-namespace attacks per arm")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the servers started here
    from transformers import AutoTokenizer

    from sgl_multilora.embedded import ensure_embedded_model

    model_path = str(ensure_embedded_model())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    with open(args.out, "w") as out:
        out.write(json.dumps({"setup": {"date": datetime.date.today().isoformat(), "machine": platform.platform(),
                                        "cpus": os.cpu_count(), "model": "SmolLM2-135M-Instruct (CPU)",
                                        "arms": {a: ARMS[a] for a in args.arms.split(",")}}}) + "\n")
        for arm in args.arms.split(","):
            rows += run_arm(arm, model_path, tokenizer, out, args)
    table = summarize(rows)
    args.out.with_suffix(".md").write_text(
        f"# Ingress attacks, {datetime.date.today().isoformat()}\n\n`.venv/bin/python -m eval.security.run`; "
        "cells: cached prompt tokens an attack read, or the HTTP status it got.\n\n" + table + "\n")
    print(table)


if __name__ == "__main__":
    main()
