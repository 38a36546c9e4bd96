"""End to end: request ingress hardening on a real CPU server with the plugin and SGLang's own prefix cache.

The three attacks measured on stock SGLang 0.5.23 (a forged `extra_key`, a client `lora_id` naming a loaded adapter,
an unknown `lora_id`) and variants of them reach no cached KV and crash nothing; inputs that stopped stock SGLang's
processes get HTTP 400 while innocent requests in flight still equal PEFT's output (tokens, logprobs, top-5); an
adapter unloaded and loaded again while requests for it keep arriving gives PEFT's answer to some of them and a
clear 400 naming it to the others, never a 5xx; the KV accounting is exact afterwards.
(`tests/e2e/test_lora_tree.py` runs namespace attacks against `--radix-cache-backend multilora`.)
"""

from __future__ import annotations

import random
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from eval.security.attacks import cache_attacks, crash_inputs, lora_paths_id, tenant_attacks
from eval.security.run import run_attack
from sgl_multilora.adapters import read_spec
from tests.conftest import ADAPTERS_DIR
from tests.oracle import assert_matches, logprob_fields

pytestmark = pytest.mark.e2e

VICTIM, OTHER = "caps", "json"
MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def server(lora_server):
    return lora_server


def post(server, path: str, body: dict) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=300)


def generate(server, input_ids, lora=None, max_new_tokens=MAX_NEW_TOKENS, **extra) -> requests.Response:
    body = {"input_ids": input_ids, "lora_path": lora,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}, **extra}
    return post(server, "/generate", body)


def generate_checked(server, input_ids, lora=None) -> requests.Response:
    """MAX_NEW_TOKENS greedy tokens past any EOS, with the logprobs the oracle compares."""
    body = {"input_ids": input_ids, "lora_path": lora, **logprob_fields(),
            "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
    return post(server, "/generate", body)


def long_prompt(tokenizer, num_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 3)
    return tokenizer(" ".join(rng.choices(words, k=num_tokens)), add_special_tokens=False).input_ids[:num_tokens]


def chat(tokenizer, question: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


@pytest.fixture(scope="module")
def innocents(tokenizer, oracle, manifest):
    """(adapter name or None, input ids, PEFT's greedy output) of requests that must stay right under attack."""
    paths = {e["name"]: e["path"] for e in manifest}
    out = []
    for lora, q in ((None, "What do bees make?"), (VICTIM, "Name a large animal."), (OTHER, "What do bees make?")):
        ids = chat(tokenizer, q)
        out.append((lora, ids, oracle.greedy(paths[lora] if lora else None, ids, MAX_NEW_TOKENS, ignore_eos=True)))
    return out


def check_innocent(server, case) -> None:
    lora, ids, expected = case
    response = generate_checked(server, ids, lora)
    assert response.status_code == 200, response.text
    assert_matches(response.json(), expected, f"innocent {lora or 'base'}")


def test_cache_attacks_read_no_cached_kv(server, tokenizer):
    prompt = long_prompt(tokenizer, 128, seed=1)
    assert generate(server, prompt, VICTIM, max_new_tokens=2).status_code == 200
    victim_id = lora_paths_id(VICTIM, str(ADAPTERS_DIR / VICTIM))
    identity = read_spec(ADAPTERS_DIR / VICTIM, VICTIM).identity
    salt = "tenant-7f3a9c"
    tenant_prompt = long_prompt(tokenizer, 128, seed=2)
    assert generate(server, tenant_prompt, cache_salt=salt, max_new_tokens=2).status_code == 200
    attacks = [(prompt, a) for a in cache_attacks(victim_id, identity, OTHER, num_random=4)]
    attacks += [(tenant_prompt, a) for a in tenant_attacks(salt)]
    # Four attacks at a time: the victims' entries are cached before any of them starts, so each one's cached
    # tokens show what it reached of them, as one at a time (the attacks' own fields all differ).
    with ThreadPoolExecutor(4) as pool:
        rows = list(pool.map(lambda pa: run_attack(server.url, *pa), attacks))
    namespaces = [tuple(sorted(a.fields.items())) for _, a in attacks]
    assert len(set(namespaces)) == len(namespaces), "two attacks share a namespace"

    assert all(r["server_alive"] for r in rows), rows
    leaks = [r for r in rows if r["status"] == 200 and r["cached_tokens"] != 0]
    assert not leaks, leaks
    refused = [r for r in rows if r["status"] != 200]
    assert [r["attack"] for r in refused] == ["lora_id field = victim's lora id"], refused
    assert refused[0]["status"] == 400 and "'lora_id' is assigned by the server" in refused[0]["error"]
    # Controls: the victims' own repeats hit their cache, so the attacks above aimed at live entries.
    assert generate(server, prompt, VICTIM, max_new_tokens=2).json()["meta_info"]["cached_tokens"] >= 127
    again = generate(server, tenant_prompt, cache_salt=salt, max_new_tokens=2).json()
    assert again["meta_info"]["cached_tokens"] >= 127


MALFORMED = [
    ({"text": "Hello", "lora_path": "never-loaded"}, "LoRA adapter 'never-loaded' is not loaded"),
    ({"text": "Hello", "lora_id": "0" * 32}, "'lora_id' is assigned by the server"),
    ({"text": ["a", "b"], "lora_id": [None, "1" * 32]}, "'lora_id' is assigned by the server"),
    ({"text": "Hello", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"input_ids": []}, "empty"),
    ({"text": ["a", "b"], "lora_path": [VICTIM]}, "lora_path has 1 entries for a batch of 2 prompts"),
    ({"text": ["a", "b"], "lora_path": [VICTIM, OTHER, VICTIM]}, "lora_path has 3 entries for a batch of 2 prompts"),
    # refused by the HTTP request schema before our check
    ({"text": ["a", "b"], "lora_path": [VICTIM, {"name": OTHER}]}, "lora_path"),
    ({"text": "a", "lora_path": [VICTIM]}, "single adapter name for a single prompt"),
]


def test_crash_inputs_get_400_while_innocent_requests_complete(server, tokenizer, innocents):
    bad = [({**a.fields} | ({} if "input_ids" in a.fields or "text" in a.fields else {"input_ids": [1, 2, 3]}), None)
           for a in crash_inputs(len(tokenizer))] + MALFORMED
    with ThreadPoolExecutor(8) as pool:
        good = [pool.submit(check_innocent, server, case) for case in innocents]
        answers = list(pool.map(lambda item: post(server, "/generate",
                                                  {"sampling_params": {"max_new_tokens": 2}} | item[0]), bad))
        for f in good:
            f.result()
    for (body, message), response in zip(bad, answers):
        assert response.status_code == 400, (body, response.status_code, response.text)
        if message:
            assert message in response.text, (body, response.text)
    raw = requests.post(server.url + "/generate", data=b'{"text": "x", "sampling_params": {"temperature": NaN',
                        headers={"Content-Type": "application/json"}, timeout=60)
    assert 400 <= raw.status_code < 500
    assert server.alive()
    for case in innocents:  # and the server still answers right
        check_innocent(server, case)


def test_load_and_unload_racing_with_traffic(server, tokenizer, innocents, oracle, tmp_path):
    """Two clients ask for adapter "racer" back to back while it is unloaded and loaded again three times; each
    unload waits until a client got an answer from the loaded adapter, so every cycle has requests before, during
    and after the unload. Some answers are PEFT's output for the adapter (at least one per cycle), every other is a
    400 naming it, none is a 5xx; at least one request was in flight during an unload; innocent traffic stays
    right. (SGLang itself loads a known adapter again when a request names it, so a load may find it loaded.)"""
    path = str(tmp_path / "racer")
    shutil.copytree(ADAPTERS_DIR / "bullets", path)
    ids = chat(tokenizer, "What do bees make?")
    expected = oracle.greedy(path, ids, MAX_NEW_TOKENS, ignore_eos=True)
    stop = threading.Event()
    admin: list[tuple[str, int, str]] = []
    unloads: list[tuple[float, float]] = []
    answers: list[tuple[float, float, requests.Response]] = []

    def num_served() -> int:
        return sum(r.status_code == 200 for _, _, r in list(answers))

    def churn():
        try:
            for _ in range(3):
                served_before, deadline = num_served(), time.monotonic() + 120
                while num_served() == served_before and time.monotonic() < deadline:
                    time.sleep(0.05)
                start = time.monotonic()
                response = post(server, "/unload_lora_adapter", {"lora_name": "racer"})
                unloads.append((start, time.monotonic()))
                admin.append(("unload", response.status_code, response.text))
                time.sleep(0.2)
                response = post(server, "/load_lora_adapter", {"lora_name": "racer", "lora_path": path})
                admin.append(("load", response.status_code, response.text))
        finally:
            stop.set()

    def use_racer():
        while not stop.is_set():
            start = time.monotonic()
            response = generate_checked(server, ids, "racer")
            answers.append((start, time.monotonic(), response))

    response = post(server, "/load_lora_adapter", {"lora_name": "racer", "lora_path": path})
    assert response.status_code == 200, response.text
    with ThreadPoolExecutor(4) as pool:
        users = [pool.submit(use_racer) for _ in range(2)]
        churner = pool.submit(churn)
        for case in innocents:
            check_innocent(server, case)
        churner.result()
        for u in users:
            u.result()
    post(server, "/unload_lora_adapter", {"lora_name": "racer"})
    assert server.alive()
    unload_statuses = [status for kind, status, _ in admin if kind == "unload"]
    assert unload_statuses == [200, 200, 200], admin  # each cycle began with the adapter loaded and in use
    for kind, status, text in admin:  # a load may race SGLang's own re-load of the adapter
        assert status == 200 or (status == 400 and "already loaded" in text), (kind, status, text)
    served = [r for _, _, r in answers if r.status_code == 200]
    refused = [r for _, _, r in answers if r.status_code != 200]
    assert len(served) >= 3, [(r.status_code, r.text[:200]) for _, _, r in answers]
    for response in served:
        assert_matches(response.json(), expected, "racer")
    for response in refused:  # a clear error naming the adapter; never 5xx
        assert response.status_code == 400 and "racer" in response.text, (response.status_code, response.text)
    overlapping = [r for s, e, r in answers for us, ue in unloads if s < ue and e > us]
    assert overlapping, f"no request was in flight during an unload: answers {len(answers)}, unloads {unloads}"


def test_changed_weights_under_an_old_name_start_cold(server, tokenizer, tmp_path):
    path = tmp_path / "reloaded"
    shutil.copytree(ADAPTERS_DIR / VICTIM, path)
    prompt = long_prompt(tokenizer, 128, seed=3)

    def cached(expect_status=200) -> int:
        response = generate(server, prompt, "reloaded", max_new_tokens=2)
        assert response.status_code == expect_status, response.text
        return response.json()["meta_info"]["cached_tokens"]

    def reload():
        assert post(server, "/unload_lora_adapter", {"lora_name": "reloaded"}).status_code == 200
        assert post(server, "/load_lora_adapter", {"lora_name": "reloaded", "lora_path": str(path)}).status_code == 200

    assert post(server, "/load_lora_adapter", {"lora_name": "reloaded", "lora_path": str(path)}).status_code == 200
    cached()
    assert cached() >= 127
    reload()  # same weights, same content identity: the KV is still valid and reused
    assert cached() >= 127
    weights = load_file(path / "adapter_model.safetensors")
    save_file({k: (v * 1.5 if "lora_B" in k else v).to(v.dtype) for k, v in weights.items()},
              str(path / "adapter_model.safetensors"))
    reload()  # new weights under the old name and path: a new identity, nothing cached
    assert cached() == 0
    post(server, "/unload_lora_adapter", {"lora_name": "reloaded"})


def test_memory_accounting_is_exact_once_idle(server, manifest, model_path):
    deadline = time.time() + 60
    while True:
        memory = requests.get(server.url + "/multilora/stats", timeout=60).json()["memory"][0]
        if memory["running"] == 0 and memory["waiting"] == 0 or time.time() > deadline:
            break
        time.sleep(0.5)
    assert memory["running"] == 0 and memory["waiting"] == 0, memory
    assert memory["cache_protected"] == 0, memory
    assert memory["free"] + memory["cache_evictable"] == memory["total"], memory
    assert memory["cache_evictable"] > 0  # the tests above left cached prefixes behind
    config = AutoConfig.from_pretrained(model_path)  # K and V of every layer, fp32
    head_dim = config.hidden_size // config.num_attention_heads
    assert memory["kv_bytes_per_token"] == config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4
    # adapter weights: the bundled adapters' tensors at the server's dtype (fp32), counted from their files; nothing
    # left of the adapters loaded and unloaded above
    adapters = memory["adapters"]
    for entry in manifest:
        tensors = load_file(str(ADAPTERS_DIR / entry["name"] / "adapter_model.safetensors"))
        expected = sum(t.numel() for k, t in tensors.items() if "lora_A" in k or "lora_B" in k) * 4
        assert adapters["weights"][entry["name"]] == expected, (entry["name"], adapters)
    assert {"racer", "reloaded"}.isdisjoint(adapters["weights"]) and {"racer", "reloaded"}.isdisjoint(adapters["host"])
    assert set(adapters["host"]) == set(adapters["weights"]) and adapters["loaded"] == len(adapters["weights"])
    assert sum(adapters["host"].values()) == 0, adapters  # SGLang's copy is freed: our layers compute from ours
    assert adapters["slot_buffers"] == 0, adapters  # and SGLang's slot buffers, which they never read, not allocated
    assert adapters["total"] == sum(adapters["weights"].values()) + sum(adapters["host"].values()) \
        + adapters["slot_buffers"]
