"""Cross-namespace cache attacks and crash inputs against a live SGLang server, and the report comparing servers.

A victim request (an adapter, or a tenant's `cache_salt`) caches a long prompt; each attack then sends the same prompt
with crafted namespace fields and reads `meta_info.cached_tokens`: any cached token is KV computed for the victim's
namespace, read by a request outside it. Crash inputs are single requests that stopped stock SGLang 0.5.23's server
processes; malformed inputs are requests it mishandled (an internal error, a dead server, or extra entries silently
ignored). The same catalogue drives the e2e tests (`tests/e2e/test_ingress.py`) and this report.

Usage (starts its own CPU servers with the embedded model and the bundled adapters; a few minutes):
    .venv/bin/python -m eval.attacks [--out eval/results/ingress_attacks.jsonl]
Arms: `stock` = `--multilora-ingress stock` (SGLang 0.5.23's request handling and prefix cache; the plugin keeps only
its CPU LoRA compute, without which LoRA does not run on this CPU path), `ours` = `--multilora-ingress strict` with
SGLang's prefix cache, `ours+tree` = strict ingress and `--radix-cache-backend multilora`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import signal
import string
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import requests

ADAPTERS_DIR = Path(__file__).resolve().parents[1] / "assets" / "adapters"
ENCODED_PREFIX = "mlora1:"  # the namespace encoding of `--multilora-ingress strict` (patches/ingress.py)


@dataclass(frozen=True)
class Attack:
    """One attack request: `fields` are added to a /generate body that repeats the victim's prompt."""

    name: str
    fields: dict = field(default_factory=dict)


def lora_paths_id(name: str, path: str) -> str:
    """The internal id SGLang 0.5.23 gives a `--lora-paths name=path` adapter (`LoRARef.deterministic_id`):
    computable by anyone who knows the name and path."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"{name}\0{path}").hex


def cache_attacks(victim_id: str, victim_identity: str | None, other_adapter: str, *, num_random: int = 12,
                  seed: int = 0) -> list[Attack]:
    """Attacks on an adapter victim whose internal id is `victim_id` (and content identity `victim_identity`)."""
    attacks = [
        Attack("extra_key = victim's lora id", {"extra_key": victim_id}),
        Attack("lora_id field = victim's lora id", {"lora_id": victim_id}),
        Attack("lora id split across extra_key / cache_salt", {"extra_key": victim_id[:16], "cache_salt": victim_id[16:]}),
        Attack("cache_salt = victim's lora id", {"cache_salt": victim_id}),
        Attack("extra_key + cache_salt = victim's lora id", {"extra_key": victim_id, "cache_salt": victim_id}),
        Attack("other adapter, extra_key = victim's lora id", {"lora_path": other_adapter, "extra_key": victim_id}),
        Attack("extra_key = strict encoding of the victim's id", {"extra_key": f'{ENCODED_PREFIX}[null,"{victim_id}"]'}),
    ]
    if victim_identity:
        attacks += [
            Attack("extra_key = victim's content identity", {"extra_key": victim_identity}),
            Attack("extra_key = strict encoding of the victim's identity",
                   {"extra_key": f'{ENCODED_PREFIX}[null,"{victim_identity}"]'}),
        ]
    rng = random.Random(seed)
    pieces = [victim_id, victim_id[: rng.randrange(1, 32)], victim_id[rng.randrange(1, 32):], "|", "\0", '"', "\\",
              ENCODED_PREFIX, "null", "[", "]", ",", "é", "🔑", "".join(rng.choices(string.printable, k=8))]
    for i in range(num_random):
        extra = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 4)))
        body = {"extra_key": extra}
        if rng.random() < 0.5:
            body["cache_salt"] = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 3)))
        if rng.random() < 0.3:
            body["lora_path"] = other_adapter
        attacks.append(Attack(f"random namespace #{i}", body))
    return attacks


def tenant_attacks(victim_salt: str) -> list[Attack]:
    """Attacks on a tenant whose base-model requests carry `cache_salt = victim_salt`."""
    return [
        Attack("extra_key = victim tenant's salt", {"extra_key": victim_salt}),
        Attack("salt split across extra_key / cache_salt",
               {"extra_key": victim_salt[:4], "cache_salt": victim_salt[4:]}),
        Attack("salt prefix as cache_salt", {"cache_salt": victim_salt[:-1]}),
    ]


def crash_inputs(vocab_size: int) -> list[Attack]:
    """Single requests that stopped every process of a stock SGLang 0.5.23 CPU server."""
    return [
        Attack("unknown lora_id", {"lora_id": uuid.uuid4().hex}),
        Attack("token id outside the vocabulary", {"input_ids": [1, 2, vocab_size + 7]}),
        Attack("negative token id", {"input_ids": [1, -3, 2]}),
        Attack("empty text prompt", {"text": ""}),
        Attack("top_logprobs_num above the vocabulary size",
               {"return_logprob": True, "top_logprobs_num": 10 * vocab_size}),
    ]


def malformed_inputs(adapter: str) -> list[Attack]:
    """`lora_path` lists that do not give one adapter per prompt. Stock SGLang 0.5.23 answers a shorter list with HTTP
    500, ignores the extra entries of a longer one, and a list sent with a single prompt stops its server; none gets
    a 400 naming the problem."""
    return [
        Attack("lora_path list shorter than the batch", {"text": ["a", "b"], "lora_path": [adapter]}),
        Attack("lora_path list longer than the batch", {"text": ["a", "b"], "lora_path": [adapter] * 3}),
        Attack("lora_path list for a single prompt", {"text": "a", "lora_path": [adapter]}),
    ]


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


# ---- report ----------------------------------------------------------------------------------------------------

ARMS = {
    "stock": ["--multilora-ingress", "stock"],
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ", ".join(ARMS))
    parser.add_argument("--out", type=Path, default=Path("eval/results/ingress_attacks.jsonl"))
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
        f"# Ingress attacks, {datetime.date.today().isoformat()}\n\n`.venv/bin/python -m eval.attacks`; "
        "cells: cached prompt tokens an attack read, or the HTTP status it got.\n\n" + table + "\n")
    print(table)


if __name__ == "__main__":
    main()
