"""End to end: the host tier (`--multilora-host-kv-gb`) on the CPU server.

Six long contexts (base, two LoRAs, an aLoRA) whose KV together is several times the device pool: the first round
computes them and the pool evicts them to the host tier; the second round returns to every context with a new
turn appended, in another order, so each finds its history on the host and gets it copied back instead of
recomputed. Every output equals PEFT's (tokens and logprobs), in concurrent mixed batches. The server runs in test
mode (both tiers' invariants and the pool's accounting after every step, SGLang's strict slot check). Then an
adapter is unloaded while its KV is on the host: its host KV is dropped, nothing else, and the same weights loaded
again serve PEFT's answer.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.conftest import start_server
from tests.e2e.served import generate, wait_idle
from tests.oracle import assert_matches

pytestmark = pytest.mark.e2e

INVOCATION = "<|im_start|>verify\n"
NEW_TOKENS = 8
CONTEXT_WORDS = 150  # about 300 tokens per context
POOL_SLOTS = 1800  # the adapters take a few hundred; the six contexts need ~2,000 tokens of KV
HOST_GB = 0.4  # about 8,700 tokens of KV (46,080 B each)
ADAPTERS = [("lora_a", 8, False), ("lora_b", 16, False), ("alora_v", 8, True)]


@pytest.fixture(scope="module")
def adapters(model_path, tokenizer, tmp_path_factory) -> dict[str, str]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("host_tier_adapters")
    invocation = tokenizer(INVOCATION, add_special_tokens=False).input_ids
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    out = {}
    for i, (name, rank, alora) in enumerate(ADAPTERS):
        torch.manual_seed(300 + i)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False, task_type="CAUSAL_LM",
                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                            alora_invocation_tokens=invocation if alora else None)
        model = get_peft_model(base, config)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    p.mul_(0.5)
        model.save_pretrained(str(root / name))
        base = model.unload()
        out[name] = str(root / name)
    return out


@pytest.fixture(scope="module")
def server(model_path, adapters):
    root = next(iter(adapters.values())).rsplit("/", 1)[0]
    handle = start_server(model_path, [
        "--multilora-adapter-dir", root, "--max-loras-per-batch", "4", "--max-lora-rank", "16",
        "--radix-cache-backend", "multilora", "--multilora-host-kv-gb", str(HOST_GB),
        "--chunked-prefill-size", "256", "--multilora-check-invariants",
    ], name="e2e_host_tier", max_total_tokens=POOL_SLOTS, env={"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1"})
    yield handle
    handle.stop()


def _turn(tokenizer, history: list[dict], alora: bool) -> list[int]:
    if alora:
        ids = tokenizer.apply_chat_template(history, tokenize=True, return_dict=False)
        return ids + tokenizer(INVOCATION, add_special_tokens=False).input_ids
    return tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True, return_dict=False)


def _assert_accounting(m: dict) -> None:
    pool = m["unified_pool"]
    slots = pool["slots"]
    assert slots["kv_running"] == 0 and slots["in_flight"] == 0, slots
    assert slots["free"] + slots["adapter"] + slots["kv_cached"] == pool["num_slots"] == m["total"], slots
    assert slots["kv_cached"] == pool["tree_kv_tokens"], pool
    host = pool["host_tier"]
    assert 0 <= host["used_tokens"] <= host["capacity_tokens"], host


def test_returning_turns_copy_their_history_back_and_match_peft(server, adapters, tokenizer, oracle):
    rng = random.Random(5)
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 3)
    names = [None, None, "lora_a", "lora_b", "lora_a", "alora_v"]
    contexts = []
    for name in names:
        text = " ".join(rng.choices(words, k=CONTEXT_WORDS))
        history = [{"role": "user", "content": f"Here are my notes: {text}"},
                   {"role": "assistant", "content": "Noted."}]
        contexts.append((name, history))

    def first(c):
        name, history = c
        alora = name == "alora_v"
        return name, _turn(tokenizer, history + ([] if alora else [{"role": "user", "content": "Summarise."}]), alora)

    def returning(c):
        name, history = c
        alora = name == "alora_v"
        more = history + [{"role": "user", "content": "Summarise."}, {"role": "assistant", "content": "A list."},
                          {"role": "user", "content": "Which word comes first?"}]
        return name, _turn(tokenizer, more if not alora else more + [{"role": "assistant", "content": "That one."}],
                           alora)

    rounds = [[first(c) for c in contexts], [returning(c) for c in rng.sample(contexts, len(contexts))]]
    responses = []
    with ThreadPoolExecutor(max_workers=2) as executor:
        for work in rounds:
            responses.append(list(executor.map(lambda w: generate(server, w[0], w[1], NEW_TOKENS), work)))
            wait_idle(server)
    oracle.prefetch([(adapters[name] if name else None, ids, NEW_TOKENS) for work in rounds for name, ids in work],
                    ignore_eos=True)
    for work, outs in zip(rounds, responses):
        for (name, ids), response in zip(work, outs):
            expected = oracle.greedy(adapters[name] if name else None, ids, NEW_TOKENS, ignore_eos=True)
            assert_matches(response, expected, f"{name or 'base'} through the host tier")

    m = wait_idle(server)
    host = m["unified_pool"]["host_tier"]
    assert host["spilled_tokens"] > POOL_SLOTS, host  # the first round did not fit the pool
    assert host["load_backs"] >= 3 and host["restored_tokens"] > 3 * 200, host  # returning turns came back by copy
    assert host["copies"] >= 2 * host["load_backs"], host  # K and V: at least one copy each per load-back
    cached = sum(r["meta_info"]["cached_tokens"] for r in responses[1])
    assert cached >= host["restored_tokens"] * 0.9, (cached, host)  # SGLang counts the copied tokens as cached
    assert m["unified_pool"]["swapper"]["invalid_kv_slots"] == 0
    _assert_accounting(m)
    assert m["cache_protected"] == 0 and m["free"] + m["cache_evictable"] == m["total"], m


def test_unloading_an_adapter_drops_its_host_kv(server, adapters, tokenizer, oracle):
    before = wait_idle(server)["unified_pool"]["host_tier"]
    assert before["used_tokens"] > 0, before
    res = requests.post(server.url + "/unload_lora_adapter", json={"lora_name": "lora_b"}, timeout=120)
    assert res.status_code == 200, res.text
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    generate(server, None, ids, NEW_TOKENS)  # a step runs the deferred removal
    after = wait_idle(server)["unified_pool"]["host_tier"]
    assert after["dropped_tokens"] > before["dropped_tokens"], (before, after)
    res = requests.post(server.url + "/load_lora_adapter",
                        json={"lora_name": "lora_b", "lora_path": adapters["lora_b"]}, timeout=120)
    assert res.status_code == 200, res.text
    expected = oracle.greedy(adapters["lora_b"], ids, NEW_TOKENS, ignore_eos=True)
    assert_matches(generate(server, "lora_b", ids, NEW_TOKENS), expected, "lora_b loaded again")
    _assert_accounting(wait_idle(server))
