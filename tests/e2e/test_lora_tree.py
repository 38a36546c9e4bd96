"""End to end with `--radix-cache-backend multilora`: aLoRA checks reuse the base model's prefix KV, standard LoRAs
never see another adapter's or the base model's KV, crafted namespaces reach nothing, outputs equal PEFT's (tokens,
logprobs and top-5, MAX_NEW_TOKENS past any EOS), and the tree's sizes count exactly the tokens cached.

The aLoRAs are the two bundled ones (q/k/v) and a random one made here with PEFT on every attention and MLP
projection, loaded at run time."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.conftest import TREE_CHUNK as CHUNK
from tests.oracle import assert_matches, assert_shift_rejected, logprob_fields

pytestmark = pytest.mark.e2e

MAX_NEW_TOKENS = 12  # compared with PEFT (past EOS: an aLoRA's label and EOS come first)
ATTN_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def server(tree_server):
    return tree_server


def post(server, body: dict) -> requests.Response:
    return requests.post(server.url + "/generate", json=body, timeout=300)


def generate(server, input_ids, lora=None, max_new_tokens=2, **extra) -> dict:
    body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
            "lora_path": lora, **extra}
    response = post(server, body)
    assert response.status_code == 200, response.text
    return response.json()


def generate_checked(server, input_ids, lora=None, **extra) -> dict:
    """MAX_NEW_TOKENS greedy tokens past any EOS, with the logprobs the oracle compares."""
    body = {"input_ids": input_ids, "lora_path": lora, **logprob_fields(), **extra,
            "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
    response = post(server, body)
    assert response.status_code == 200, response.text
    return response.json()


def peft(oracle, entry, ids):
    return oracle.greedy(entry and entry["path"], ids, MAX_NEW_TOKENS, ignore_eos=True)


def context(tokenizer, question: str, answer: str) -> list[int]:
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False).input_ids


def invocation_ids(tokenizer, entry) -> list[int]:
    return tokenizer(entry["invocation_text"], add_special_tokens=False).input_ids


def stats(server) -> dict:
    return requests.get(server.url + "/multilora/stats", timeout=60).json()["schedulers"][0]


@pytest.fixture(scope="module")
def random_alora(server, model_path, tokenizer, tmp_path_factory):
    """A random aLoRA (fixed seed, `init_lora_weights=False`) on every projection, invoked by a three-token
    "<|im_start|>verify\n"; loaded at run time and unloaded after the module."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    invocation = "<|im_start|>verify\n"
    path = tmp_path_factory.mktemp("random_alora") / "verify"
    torch.manual_seed(1)
    config = LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, task_type="CAUSAL_LM", target_modules=ATTN_MLP,
                        alora_invocation_tokens=tokenizer(invocation, add_special_tokens=False).input_ids)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    get_peft_model(base, config).save_pretrained(str(path))
    response = post_admin(server, "/load_lora_adapter", {"lora_name": "verify", "lora_path": str(path)})
    assert response.status_code == 200, response.text
    yield {"name": "verify", "kind": "alora", "path": str(path), "invocation_text": invocation}
    post_admin(server, "/unload_lora_adapter", {"lora_name": "verify"})


def post_admin(server, path: str, body: dict) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=120)


@pytest.fixture(scope="module")
def aloras(manifest, random_alora):
    entries = [e for e in manifest if e["kind"] == "alora"]
    assert len(entries) >= 2, "the bundled adapters include at least two aLoRAs"
    return [*entries, random_alora]


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
        out = generate_checked(server, prompt, entry["name"])
        assert out["meta_info"]["cached_tokens"] >= k, (entry["name"], out["meta_info"], k)
        assert_matches(out, peft(oracle, entry, prompt), entry["name"])
        again = generate_checked(server, prompt, entry["name"])  # now its own suffix is cached too
        assert again["meta_info"]["cached_tokens"] == len(prompt) - 1
        assert_matches(again, peft(oracle, entry, prompt), f"{entry['name']} on its cached suffix")
    after = stats(server)
    assert after["hit_tokens"]["alora_base_prefix"] - before["hit_tokens"]["alora_base_prefix"] >= len(aloras) * k
    assert after["hit_tokens"]["alora_suffix"] > before["hit_tokens"]["alora_suffix"]


def test_alora_without_a_cached_prefix_matches_peft(server, tokenizer, oracle, aloras):
    served = []
    for entry in aloras:
        ctx = context(tokenizer, f"What is special about {entry['name']}?", "NOTHING AT ALL, REALLY.")
        prompt = ctx + invocation_ids(tokenizer, entry)
        out = generate_checked(server, prompt, entry["name"])
        assert out["meta_info"]["cached_tokens"] < len(ctx) - 10  # at most the shared system prompt
        served.append((entry, prompt, out))
    # PEFT's outputs at the true activation start and one position early and late, each adapter's three in one batch
    oracle.prefetch([(entry["path"], prompt, MAX_NEW_TOKENS, shift) for entry, prompt, _ in served
                     for shift in (0, -1, 1)], ignore_eos=True)
    for entry, prompt, out in served:
        assert_matches(out, peft(oracle, entry, prompt), entry["name"])
        assert_shift_rejected(out, oracle, entry["path"], prompt, MAX_NEW_TOKENS, entry["name"])


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
        outs = list(pool.map(lambda r: generate_checked(server, r[1], r[0] and r[0]["name"]), requests_))
    for (entry, ids), out in zip(requests_, outs):
        assert_matches(out, peft(oracle, entry, ids), f"{entry and entry['name']} chunk={CHUNK} offset={offset}")


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


def wait_idle(server) -> tuple[dict, dict]:
    """(tree stats, KV memory) of the scheduler once no request runs or waits."""
    deadline = time.time() + 60
    while True:
        body = requests.get(server.url + "/multilora/stats", timeout=60).json()
        memory = body["memory"][0]
        if memory["running"] == memory["waiting"] == 0 or time.time() > deadline:
            return body["schedulers"][0], memory
        time.sleep(0.2)


def test_tree_sizes_count_the_cached_tokens(server, tokenizer):
    """The tree's counts equal the tokens cached, counted from the requests and from the KV allocator: after a
    flush, a finished request of n prompt and m generated tokens leaves n + m - 1 tokens (the last token's KV is
    never computed) in two KV nodes (its prompt, cached when its prefill ends, and below it the generated tokens,
    cached when it finishes); a request sharing the first p tokens splits the prompt node there and adds its own two
    nodes with its other tokens (five nodes); when idle nothing is locked and the allocator's used slots are exactly
    the tree's tokens."""
    assert requests.post(server.url + "/flush_cache", timeout=60).status_code == 200
    words = "Tree size test: one two three four five six seven eight nine ten " * 3
    first = tokenizer(words, add_special_tokens=False).input_ids
    p, m = 20, 5
    second = first[:p] + tokenizer(" and then something else entirely", add_special_tokens=False).input_ids
    sizes = []
    for ids in (first, second):
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": m, "temperature": 0, "ignore_eos": True}}
        response = post(server, body)
        assert response.status_code == 200 and len(response.json()["output_ids"]) == m, response.text
        tree, memory = wait_idle(server)
        sizes.append((tree["num_kv_nodes"], tree["total_len"]))
        assert tree["protected_len"] == 0 and tree["evictable_len"] == tree["total_len"], tree
        # used slots: the tree's KV, plus the adapters resident in the unified pool (the tree server's default)
        adapter_slots = memory["unified_pool"]["slots"]["adapter"]
        assert memory["unified_pool"]["slots"]["kv_cached"] == tree["total_len"], (memory, tree)
        assert memory["total"] - memory["free"] == tree["total_len"] + adapter_slots, (memory, tree)
    assert second[:p] == first[:p] and second[p] != first[p]
    assert sizes == [(2, len(first) + m - 1), (5, len(first) + m - 1 + len(second) + m - 1 - p)], sizes
    s = stats(server)
    assert set(s["hits"]) == {"base", "same_adapter", "alora_base_prefix", "alora_suffix"}


def test_prometheus_metrics_carry_the_stats_figures(server, tokenizer):
    """`/multilora/metrics` is `/multilora/stats` in Prometheus' text format (read back with prometheus_client's
    parser): when idle, the same KV slots, pool bytes, tree tokens and reused tokens by kind."""
    from prometheus_client.parser import text_string_to_metric_families

    ids = tokenizer("Metrics test: a prompt for the scrape.", add_special_tokens=False).input_ids
    assert post(server, {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}).status_code == 200
    tree, memory = wait_idle(server)
    res = requests.get(server.url + "/multilora/metrics", timeout=60)
    assert res.status_code == 200 and res.headers["content-type"].startswith("text/plain"), res.text
    got = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "rank"))): s.value
           for family in text_string_to_metric_families(res.text) for s in family.samples
           if s.labels.get("rank") == "0"}
    for state in ("total", "free", "cache_evictable", "cache_protected"):
        assert got[("sgl_multilora_kv_slots", (("state", state),))] == memory[state], state
    pool = memory["unified_pool"]
    for kind, value in pool["bytes"].items():
        assert got[("sgl_multilora_pool_bytes", (("kind", kind),))] == value, kind
    assert sum(v for k, v in got.items() if k[0] == "sgl_multilora_pool_bytes") == pool["num_slots"] * pool["slot_bytes"]
    assert got[("sgl_multilora_tree_tokens", ())] == tree["total_len"]
    for kind, value in tree["hit_tokens"].items():
        assert got[("sgl_multilora_tree_hit_tokens_total", (("kind", kind),))] == value, kind
    assert got[("sgl_multilora_invalid_kv_slots", ())] == 0
