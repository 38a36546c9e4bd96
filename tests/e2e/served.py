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
