"""End to end: one real CPU SGLang server with the plugin and every bundled adapter; PEFT is the oracle.

For the base model and each adapter, greedy outputs over five prompts equal PEFT's token for token (up to a reported
near tie), sent one by one and all at once (so batches mix adapters); the OpenAI API reaches the same adapters;
`/load_lora_adapter` and `/unload_lora_adapter` keep working; bad input gets a clear 400 and the server goes on.
"""

from __future__ import annotations

import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.oracle import assert_matches

pytestmark = pytest.mark.e2e

MAX_NEW_TOKENS = 20
QUESTIONS = [
    "What is the capital of France?",
    "Name a fruit that is yellow.",
    "What do bees make?",
    "How many legs does a spider have?",
    "What color is the sky on a clear day?",
]


@pytest.fixture(scope="module")
def server(lora_server):
    return lora_server


def chat_ids(tokenizer, question: str, answer: str | None = None, invocation: str | None = None) -> list[int]:
    messages = [{"role": "user", "content": question}]
    if answer is None:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    messages.append({"role": "assistant", "content": answer})
    text = tokenizer.apply_chat_template(messages, tokenize=False) + (invocation or "")
    return tokenizer(text, add_special_tokens=False).input_ids


def generate(server, input_ids: list[int], lora: str | None, max_new_tokens: int = MAX_NEW_TOKENS) -> dict:
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
        "lora_path": lora,
    }
    response = requests.post(server.url + "/generate", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def cases(manifest, tokenizer):
    """(name, adapter dir or None, input ids) for the base model and every bundled adapter, five prompts each."""
    out = []
    for q in QUESTIONS:
        out.append((None, None, chat_ids(tokenizer, q)))
    for entry in manifest:
        for q in QUESTIONS:
            if entry["kind"] == "alora":
                answer = "The answer is " + q.lower().rstrip("?") + "."
                ids = chat_ids(tokenizer, q, answer, entry["invocation_text"])
            else:
                ids = chat_ids(tokenizer, q)
            out.append((entry["name"], entry["path"], ids))
    return out


@pytest.fixture(scope="module")
def expected(cases, oracle):
    return [oracle.greedy(path, ids, MAX_NEW_TOKENS) for _, path, ids in cases]


def test_every_adapter_matches_peft_sequentially(server, cases, expected):
    for (name, _, ids), oracle_out in zip(cases, expected):
        served = generate(server, ids, name)["output_ids"]
        assert_matches(served, oracle_out, f"{name or 'base'} {ids[-8:]}")


def test_mixed_adapter_batches_match_peft(server, cases, expected):
    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        results = list(pool.map(lambda c: generate(server, c[2], c[0]), cases))
    for (name, _, ids), oracle_out, result in zip(cases, expected, results):
        assert_matches(result["output_ids"], oracle_out, f"{name or 'base'} (concurrent)")
    # The batches really mixed requests: the scheduler logged a prefill batch of several sequences.
    new_seqs = [int(n) for n in re.findall(r"Prefill batch, #new-seq: (\d+)", server.log_tail(1_000_000))]
    assert max(new_seqs) > 1, "no prefill batch held more than one request"


def test_adapters_change_the_output(server, cases, expected):
    """Guards the oracle comparison itself: every LoRA adapter answers some prompt unlike the base model."""
    base = {tuple(ids): out.tokens for (name, _, ids), out in zip(cases, expected) if name is None}
    differs: dict[str, bool] = {}
    for (name, _, ids), out in zip(cases, expected):
        if name is not None and tuple(ids) in base:
            differs[name] = differs.get(name, False) or out.tokens != base[tuple(ids)]
    assert differs and all(differs.values()), f"adapters answering exactly as the base model: {differs}"


def test_openai_model_suffix_selects_adapter(server, manifest, tokenizer, oracle):
    entry = next(e for e in manifest if e["kind"] == "lora")
    question = QUESTIONS[0]
    body = {
        "model": f"default:{entry['name']}",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": MAX_NEW_TOKENS,
        "temperature": 0,
    }
    response = requests.post(server.url + "/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["message"]["content"]
    expected = oracle.greedy(entry["path"], chat_ids(tokenizer, question), MAX_NEW_TOKENS)
    expected_text = tokenizer.decode(
        [t for t in expected.tokens if t != tokenizer.eos_token_id], skip_special_tokens=True
    )
    if min(expected.top2_gaps) >= 1e-4:
        assert text.strip() == expected_text.strip()


def _load(server, name: str, path: str) -> requests.Response:
    return requests.post(server.url + "/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=120)


def test_load_and_unload_adapter_at_runtime(server, manifest, tokenizer, oracle):
    entry = next(e for e in manifest if e["kind"] == "lora")
    ids = chat_ids(tokenizer, QUESTIONS[1])
    response = _load(server, "runtime_copy", entry["path"])
    assert response.status_code == 200, response.text
    served = generate(server, ids, "runtime_copy")["output_ids"]
    assert_matches(served, oracle.greedy(entry["path"], ids, MAX_NEW_TOKENS), "runtime-loaded adapter")
    response = requests.post(server.url + "/unload_lora_adapter", json={"lora_name": "runtime_copy"}, timeout=120)
    assert response.status_code == 200, response.text
    assert "runtime_copy" not in response.json().get("loaded_adapters", {}), response.text
    # SGLang re-loads an unloaded adapter it has seen before when a request names it again; its output is unchanged.
    served = generate(server, ids, "runtime_copy")["output_ids"]
    assert_matches(served, oracle.greedy(entry["path"], ids, MAX_NEW_TOKENS), "re-loaded adapter")


def _bad_adapter(tmp_path, manifest, edit) -> str:
    entry = next(e for e in manifest if e["kind"] == "lora")
    bad = tmp_path / "bad"
    shutil.copytree(entry["path"], bad)
    edit(bad)
    return str(bad)


def _set_config(field: str, value):
    def edit(path):
        config = json.loads((path / "adapter_config.json").read_text())
        config[field] = value
        (path / "adapter_config.json").write_text(json.dumps(config))

    return edit


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda p: (p / "adapter_model.safetensors").unlink(), "adapter_model.safetensors is missing"),
        (lambda p: (p / "adapter_config.json").unlink(), "adapter_config.json is missing"),
        (lambda p: (p / "adapter_config.json").write_text("{not json"), "not valid JSON"),
        (_set_config("r", "eight"), "'r' must be a positive integer"),
        (_set_config("r", 64), "exceeds the server's maximum LoRA rank 32"),
        (_set_config("target_modules", ["q_proj", "attn_c_proj"]), "do not exist in the base model"),
    ],
    ids=["no-weights", "no-config", "bad-json", "bad-rank", "rank-too-high", "unknown-module"],
)
def test_bad_adapter_is_refused_and_server_keeps_serving(server, manifest, tmp_path, tokenizer, edit, message):
    path = _bad_adapter(tmp_path, manifest, edit)
    response = _load(server, "bad_adapter", path)
    assert response.status_code == 400, response.text
    assert message in response.text and "bad_adapter" in response.text, response.text
    assert generate(server, chat_ids(tokenizer, QUESTIONS[0]), None, max_new_tokens=4)["output_ids"]


def test_unknown_adapter_name_is_a_400(server, tokenizer):
    response = requests.post(
        server.url + "/generate", json={"input_ids": chat_ids(tokenizer, QUESTIONS[0]), "lora_path": "no_such"},
        timeout=60,
    )
    assert response.status_code == 400 and "no_such" in response.text, response.text
    assert generate(server, chat_ids(tokenizer, QUESTIONS[0]), None, max_new_tokens=4)["output_ids"]
