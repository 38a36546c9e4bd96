"""End to end with `--radix-cache-backend multilora`: aLoRA checks reuse the base model's prefix KV, standard LoRAs
never see another adapter's or the base model's KV, crafted namespaces reach nothing, and outputs equal PEFT's."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.conftest import TREE_CHUNK as CHUNK
from tests.oracle import assert_matches

pytestmark = pytest.mark.e2e

MAX_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def server(tree_server):
    return tree_server


def post(server, body: dict) -> requests.Response:
    return requests.post(server.url + "/generate", json=body, timeout=300)


def generate(server, input_ids, lora=None, max_new_tokens=MAX_NEW_TOKENS, **extra) -> dict:
    body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
            "lora_path": lora, **extra}
    response = post(server, body)
    assert response.status_code == 200, response.text
    return response.json()


def context(tokenizer, question: str, answer: str) -> list[int]:
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False).input_ids


def invocation_ids(tokenizer, entry) -> list[int]:
    return tokenizer(entry["invocation_text"], add_special_tokens=False).input_ids


def stats(server) -> dict:
    return requests.get(server.url + "/multilora/stats", timeout=60).json()["schedulers"][0]


@pytest.fixture(scope="module")
def aloras(manifest):
    entries = [e for e in manifest if e["kind"] == "alora"]
    assert len(entries) >= 2, "the bundled adapters include at least two aLoRAs"
    return entries


@pytest.fixture(scope="module")
def lora(manifest):
    return next(e for e in manifest if e["kind"] == "lora")


def test_alora_check_reuses_the_base_prefix_and_matches_peft(server, tokenizer, oracle, aloras):
    ctx = context(tokenizer, "Describe the city of Lyon in a few sentences.",
                  "Lyon is a large city in France, known for its food, its old town and its two rivers.")
    base = generate(server, ctx, None, max_new_tokens=1)  # the pipeline's base turn puts C in the cache
    assert base["meta_info"]["cached_tokens"] < len(ctx)
    before = stats(server)
    for entry in aloras:
        prompt = ctx + invocation_ids(tokenizer, entry)
        k = len(ctx)  # the invocation starts right after the context
        out = generate(server, prompt, entry["name"])
        assert out["meta_info"]["cached_tokens"] >= k, (entry["name"], out["meta_info"], k)
        assert_matches(out["output_ids"], oracle.greedy(entry["path"], prompt, MAX_NEW_TOKENS), entry["name"])
        again = generate(server, prompt, entry["name"])  # now its own suffix is cached too
        assert again["meta_info"]["cached_tokens"] == len(prompt) - 1
        assert again["output_ids"] == out["output_ids"]
    after = stats(server)
    assert after["hit_tokens"]["alora_base_prefix"] - before["hit_tokens"]["alora_base_prefix"] >= len(aloras) * k
    assert after["hit_tokens"]["alora_suffix"] > before["hit_tokens"]["alora_suffix"]


def test_alora_without_a_cached_prefix_matches_peft(server, tokenizer, oracle, aloras):
    for entry in aloras:
        ctx = context(tokenizer, f"What is special about {entry['name']}?", "NOTHING AT ALL, REALLY.")
        prompt = ctx + invocation_ids(tokenizer, entry)
        out = generate(server, prompt, entry["name"])
        assert out["meta_info"]["cached_tokens"] < len(ctx) - 10  # at most the shared system prompt
        assert_matches(out["output_ids"], oracle.greedy(entry["path"], prompt, MAX_NEW_TOKENS), entry["name"])


def test_two_alora_checks_share_the_prefix_but_not_their_suffixes(server, tokenizer, aloras):
    ctx = context(tokenizer, "Name a planet.", "Mars is a planet.")
    generate(server, ctx, None, max_new_tokens=1)
    first, second = aloras[:2]
    generate(server, ctx + invocation_ids(tokenizer, first), first["name"])
    out = generate(server, ctx + invocation_ids(tokenizer, second), second["name"])
    assert out["meta_info"]["cached_tokens"] == len(ctx)  # the base prefix; none of `first`'s suffix KV


@pytest.mark.parametrize("offset", [-1, 0, 1], ids=["k-before-boundary", "k-at-boundary", "k-after-boundary"])
def test_alora_k_near_a_chunked_prefill_boundary_in_a_mixed_batch(server, tokenizer, oracle, aloras, lora, offset):
    """k just before, at or after a chunked-prefill boundary, in a batch that also holds base, LoRA and another aLoRA
    request with a different k: every request's output equals PEFT's."""
    first, second = aloras[:2]
    # Plain text (no chat template, so nothing is cached): the first aLoRA's k = 2 * CHUNK + offset.
    words = tokenizer(f"Chunk test {offset}: " + "the quick brown fox jumps over the lazy dog " * 40,
                      add_special_tokens=False).input_ids
    requests_ = [
        (first, words[: 2 * CHUNK + offset] + invocation_ids(tokenizer, first)),
        (second, words[: CHUNK + 7] + invocation_ids(tokenizer, second)),
        (None, words[: 2 * CHUNK]),
        (lora, words[: 2 * CHUNK - 5]),
    ]
    with ThreadPoolExecutor(max_workers=len(requests_)) as pool:
        outs = list(pool.map(lambda r: generate(server, r[1], r[0] and r[0]["name"]), requests_))
    for (entry, ids), out in zip(requests_, outs):
        expected = oracle.greedy(entry and entry["path"], ids, MAX_NEW_TOKENS)
        assert_matches(out["output_ids"], expected, f"{entry and entry['name']} chunk={CHUNK} offset={offset}")


def test_standard_lora_never_reads_base_kv(server, tokenizer, lora):
    ctx = context(tokenizer, "Give me a word that rhymes with cat.", "Hat rhymes with cat.")
    generate(server, ctx, None, max_new_tokens=1)
    assert generate(server, ctx, None, max_new_tokens=1)["meta_info"]["cached_tokens"] == len(ctx) - 1
    assert generate(server, ctx, lora["name"], max_new_tokens=1)["meta_info"]["cached_tokens"] == 0


def test_crafted_namespaces_never_reach_an_adapters_kv(server, tokenizer, lora):
    """SGLang issue #24638: stock SGLang keys a LoRA's KV by extra_key + lora_id, a string anyone can build."""
    # Plain text, no chat template: nothing of it is in any base namespace (the template's system prompt would be).
    ids = tokenizer("Tenant A's private notes: the secret number is 41 and only this adapter has seen it.",
                    add_special_tokens=False).input_ids
    generate(server, ids, lora["name"], max_new_tokens=1)
    lora_id = uuid.uuid5(uuid.NAMESPACE_URL, f"{lora['name']}\0{lora['path']}").hex
    assert generate(server, ids, lora["name"], max_new_tokens=1)["meta_info"]["cached_tokens"] == len(ids) - 1
    attempts = [
        {"extra_key": lora_id},
        {"extra_key": lora_id[:16], "cache_salt": lora_id[16:]},
        {"cache_salt": lora_id},
        {"extra_key": "", "cache_salt": ""},
    ]
    for extra in attempts:
        out = generate(server, ids, None, max_new_tokens=1, **extra)
        assert out["meta_info"]["cached_tokens"] == 0, extra
    other = generate(server, ids, lora["name"], max_new_tokens=1, extra_key="tenant-b")
    assert other["meta_info"]["cached_tokens"] == 0  # extra_key narrows the adapter's namespace


def test_alora_request_without_invocation_is_a_400(server, tokenizer, aloras):
    entry = aloras[0]
    ids = context(tokenizer, "Is this in capitals?", "no it is not.")
    response = post(server, {"input_ids": ids, "lora_path": entry["name"],
                             "sampling_params": {"max_new_tokens": 2}})
    assert response.status_code == 400, response.text
    assert entry["name"] in response.text and "invocation sequence" in response.text
    assert generate(server, ids, None, max_new_tokens=1)["output_ids"]  # the server goes on


def test_stats_endpoint_reports_tree(server):
    s = stats(server)
    assert s["num_kv_nodes"] > 0 and s["total_len"] == s["evictable_len"] + s["protected_len"]
    assert set(s["hits"]) == {"base", "same_adapter", "alora_base_prefix", "alora_suffix"}
