"""End to end: the LoRA-aware tree under a KV budget several times smaller than the working set.

Concurrent base, standard-LoRA and aLoRA requests over contexts whose KV together is several times the server's
`--max-total-tokens`, sent twice: the tree must evict (and the second round recompute) prefixes while every output
still equals PEFT's (tokens and logprobs), no request fails, and when idle every KV slot is free or cached. The
server runs in test mode: `--multilora-check-invariants` checks the tree after every scheduler step and SGLang's
`SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY` closes the slot accounting at every step; either stops the server on
a violation, which fails every later request here.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.conftest import ADAPTERS_DIR, start_server
from tests.oracle import assert_matches, logprob_fields

pytestmark = pytest.mark.e2e

BUDGET_TOKENS = 640  # --max-total-tokens
CONTEXT_TOKENS = 160  # per context; 6 contexts x 3 requests (base, LoRA, aLoRA) ~ 2.9k prompt tokens
NUM_CONTEXTS = 6
NEW_TOKENS = 8
ADMIN_KEY = "memory-pressure-admin"


@pytest.fixture(scope="module")
def server(model_path):
    handle = start_server(model_path, [
        "--enable-lora", "--multilora-adapter-dir", str(ADAPTERS_DIR), "--max-loras-per-batch", "4",
        "--max-lora-rank", "32", "--radix-cache-backend", "multilora", "--chunked-prefill-size", "96",
        "--multilora-check-invariants", "--multilora-stock-baseline", "memory",  # the KV budget is KV's alone
        "--admin-api-key", ADMIN_KEY,  # the KV transfer routes (the last test)
    ], name="e2e_memory_pressure", max_total_tokens=BUDGET_TOKENS,
        env={"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1"})
    yield handle
    handle.stop()


def contexts(tokenizer) -> list[list[int]]:
    rng = random.Random(7)
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 3)
    out = []
    for _ in range(NUM_CONTEXTS):
        text = " ".join(rng.choices(words, k=CONTEXT_TOKENS))
        ids = tokenizer(text, add_special_tokens=False).input_ids[:CONTEXT_TOKENS]
        out.append(tokenizer.apply_chat_template([{"role": "user", "content": tokenizer.decode(ids)}],
                                                 add_generation_prompt=True, tokenize=True, return_dict=False))
    return out


def cases(tokenizer, manifest) -> list[tuple[str, dict | None, list[int]]]:
    """(label, adapter entry or None, prompt ids): per context a base request, a standard LoRA and an aLoRA check
    of the context (which shares the base request's prefix KV)."""
    by_name = {e["name"]: e for e in manifest}
    loras, aloras = [by_name["caps"], by_name["json"]], [by_name["check_caps"], by_name["rate_length"]]
    out = []
    for i, ctx in enumerate(contexts(tokenizer)):
        out.append((f"base/{i}", None, ctx))
        lora = loras[i % 2]
        out.append((f"{lora['name']}/{i}", lora, ctx))
        alora = aloras[i % 2]
        out.append((f"{alora['name']}/{i}", alora, ctx + list(alora["invocation_token_ids"])))
    return out


def generate(server, entry, ids) -> dict:
    body = {"input_ids": ids, "lora_path": entry and entry["name"], **logprob_fields(),
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
    res = requests.post(server.url + "/generate", json=body, timeout=600)
    assert res.status_code == 200, res.text
    return res.json()


def memory(server) -> dict:
    return requests.get(server.url + "/multilora/stats", timeout=60).json()


def wait_idle(server, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = memory(server)
        m = stats["memory"][0]
        if (m["running"] == 0 and m["waiting"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.5)


def test_outputs_match_peft_while_the_tree_evicts_and_recomputes(server, tokenizer, manifest, oracle):
    work = cases(tokenizer, manifest)
    assert len(work) * CONTEXT_TOKENS > 4 * BUDGET_TOKENS  # the working set is several times the budget
    rounds = []
    with ThreadPoolExecutor(max_workers=4) as pool:
        for _ in range(2):  # the second round finds most of the first round's prefixes evicted
            rounds.append(list(pool.map(lambda c: generate(server, c[1], c[2]), work)))
    oracle.prefetch([(entry and entry["path"], ids, NEW_TOKENS) for _, entry, ids in work], ignore_eos=True)
    for responses in rounds:
        for (label, entry, ids), response in zip(work, responses):
            expected = oracle.greedy(entry and entry["path"], ids, NEW_TOKENS, ignore_eos=True)
            assert_matches(response, expected, f"{label} under memory pressure")
    second_round_cached = sum(r["meta_info"]["cached_tokens"] for r in rounds[1])
    second_round_prompt = sum(r["meta_info"]["prompt_tokens"] for r in rounds[1])
    assert second_round_cached < 0.5 * second_round_prompt, "the second round should have recomputed most prefixes"

    stats = wait_idle(server)
    tree = stats["schedulers"][0]
    assert tree["num_evicted_tokens"] > 2 * BUDGET_TOKENS, tree
    m = stats["memory"][0]
    assert m["running"] == 0 and m["waiting"] == 0, m
    assert m["cache_protected"] == 0 and m["free"] + m["cache_evictable"] == m["total"], m


def test_kv_exported_evicted_and_imported_back_is_reused_exactly(server, tokenizer, manifest, oracle):
    """KV transfer on SGLang's own allocator (`--multilora-stock-baseline memory`) under the small budget: a LoRA's
    and an aLoRA's KV exported, evicted by other work, imported back (the import evicts to make room), then reused
    by the same requests, whose outputs still equal PEFT's; invariants are checked after every step meanwhile."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    work = cases(tokenizer, manifest)
    picked = [c for c in work if c[0] in ("caps/0", "check_caps/0")]
    exports = {}
    for label, entry, ids in picked:
        generate(server, entry, ids)
        r = requests.post(server.url + "/multilora/kv/export", headers=admin, timeout=60,
                          json={"input_ids": ids, "lora_path": entry["name"]})
        assert r.status_code == 200 and int(r.headers["X-Multilora-KV-Tokens"]) == len(ids), (label, r.text[:300])
        exports[label] = r.content
    with ThreadPoolExecutor(max_workers=4) as pool:  # other contexts push the picked ones out of the 640-token budget
        list(pool.map(lambda c: generate(server, c[1], c[2]), work[6:]))
    for label, entry, ids in picked:
        again = requests.post(server.url + "/multilora/kv/export", headers=admin, timeout=60,
                              json={"input_ids": ids, "lora_path": entry["name"]})
        assert again.status_code == 204 or int(again.headers["X-Multilora-KV-Tokens"]) < len(ids), label
        imported = requests.post(server.url + "/multilora/kv/import", data=exports[label], headers=admin, timeout=60)
        assert imported.status_code == 200, imported.text
        answer = imported.json()
        assert answer["imported"] > 0 and answer["imported"] + answer["cached"] == len(ids), (label, answer)
        response = generate(server, entry, ids)
        assert response["meta_info"]["cached_tokens"] == len(ids) - 1, (label, response["meta_info"])
        assert_matches(response, oracle.greedy(entry["path"], ids, NEW_TOKENS, ignore_eos=True), f"{label} imported")
    m = wait_idle(server)["memory"][0]
    assert m["cache_protected"] == 0 and m["free"] + m["cache_evictable"] == m["total"], m
