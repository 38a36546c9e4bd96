"""What the end-to-end tests ask a running server: a greedy generation with the oracle's logprob fields, the
scheduler's memory view (`/multilora/stats`), and waiting until it is idle."""

from __future__ import annotations

import time

import requests

from tests.oracle import logprob_fields


def generate(server, lora: str | None, ids: list[int], max_new_tokens: int) -> dict:
    """Greedy `/generate` of `max_new_tokens` (eos ignored) with the logprobs the oracle compares; asserts HTTP 200."""
    body = {"input_ids": ids, "lora_path": lora, **logprob_fields(),
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    res = requests.post(server.url + "/generate", json=body, timeout=900)
    assert res.status_code == 200, res.text
    return res.json()


def random_ids(tokenizer, n: int, seed: int) -> list[int]:
    """`n` token ids of random vocabulary words (seeded): a prompt no other test shares."""
    import random

    rng = random.Random(seed)
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 3)
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer(" ".join(rng.choices(words, k=n)), add_special_tokens=False).input_ids
    return ids[:n]


def memory(server) -> dict:
    """The (first) scheduler's memory view from `/multilora/stats` (with `server.headers`, when it has them)."""
    res = requests.get(server.url + "/multilora/stats", headers=getattr(server, "headers", None), timeout=60)
    assert res.status_code == 200, res.text
    return res.json()["memory"][0]


def wait_running(server, n: int = 1, timeout_s: float = 60.0) -> None:
    """Returns once the multi-queue scheduler counts `n` running requests or more (admitted: a prefill may still run);
    fails after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while memory(server)["scheduler"]["num_running"] < n:
        assert time.monotonic() < deadline, f"fewer than {n} requests running after {timeout_s} s"
        time.sleep(0.02)


def wait_idle(server, timeout_s: float = 60.0) -> dict:
    """The memory view once nothing runs or waits (or after `timeout_s`, whatever it is then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = memory(server)
        if (m["running"] == 0 and m["waiting"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


def chat_cases(tokenizer, names, adapter_dirs: dict, questions) -> list[tuple]:
    """(adapter name or None, its directory or None, chat-template prompt ids) for every name and question."""
    return [(name, adapter_dirs.get(name), tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False))
            for name in names for q in questions]


def assert_cases_match(oracle, tokenizer, cases, responses, max_new_tokens: int, label: str = "") -> None:
    """Every response equals the oracle's greedy output of its case (tokens and logprobs), and every adapter of the
    cases serves other tokens than the base model (None) on at least one prompt."""
    from tests.oracle import assert_matches, served_from

    oracle.prefetch([(path, ids, max_new_tokens) for _, path, ids in cases], ignore_eos=True)
    served = {}
    for (name, path, ids), response in zip(cases, responses):
        expected = oracle.greedy(path, ids, max_new_tokens, ignore_eos=True)
        assert_matches(response, expected, f"{label}{name or 'base'}: {tokenizer.decode(ids)[-40:]!r}")
        served[(name, tuple(ids))] = served_from(response).tokens
    base_prompts = [tuple(ids) for n, _, ids in cases if n is None]
    for name in {n for n, _, _ in cases if n is not None}:
        assert any(served[(name, ids)] != served[(None, ids)] for ids in base_prompts), (
            f"{name} served the base model's tokens for every prompt")
