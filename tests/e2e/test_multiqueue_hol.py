"""End to end: multi-queue admission lets small requests past a burst of large ones, on a fresh server and once
its plan is fitted on a window of small requests only.

Long prompts on the highest-rank bundled adapter (`bullets`) arrive together; while the first is being prefilled
(in chunks of 128 tokens, so it takes many passes), one-line questions on the lowest-rank one (`caps`) arrive. The
server's own record of each admission pass's requests (`recent_batches` in `/multilora/stats`) must show every
small request admitted in the pass that ends the prefill they arrived behind, before any other long request's
prefill: the plan puts the small ones first, SGLang's pass meets them first, and passes spent on the chunked
prefill promote no queue. Fresh, the prior plan (queues by size against the server's limits) separates them; warm,
the plan fitted once 40 small requests came in (the one-queue fit of a window of small requests only, with the
overflow queue above it, is tests/unit/test_sched_batch.py's).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.conftest import ADAPTERS_DIR, start_server
from tests.e2e.served import memory, random_ids, wait_idle, wait_running

pytestmark = pytest.mark.e2e

NUM_LONG, NUM_SHORT = 3, 4
LONG_TOKENS, SHORT_TOKENS = 800, 10


@pytest.fixture(scope="module")
def server(model_path):
    handle = start_server(model_path, [
        "--enable-lora", "--multilora-adapter-dir", str(ADAPTERS_DIR), "--max-loras-per-batch", "4",
        "--max-lora-rank", "32", "--radix-cache-backend", "multilora", "--multilora-scheduler", "multiqueue",
        "--chunked-prefill-size", "128",
    ], name="e2e_multiqueue_hol", max_total_tokens=12000)
    yield handle
    handle.stop()


def post(server, rid: str, lora: str, ids: list[int], new: int = 2) -> dict:
    body = {"rid": rid, "input_ids": ids, "lora_path": lora,
            "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}}
    res = requests.post(server.url + "/generate", json=body, timeout=900)
    assert res.status_code == 200, res.text
    return res.json()


def burst_then_small(server, tokenizer, tag: str) -> list[list[str]]:
    """The scene; returns the admission passes that admitted any of its requests, in order."""
    seed = 100 * len(tag)  # prompts of their own per scene: nothing the prefix cache holds from the other
    longs = [(f"{tag}-long{i}", random_ids(tokenizer, LONG_TOKENS, seed + i)) for i in range(NUM_LONG)]
    shorts = [(f"{tag}-short{i}", random_ids(tokenizer, SHORT_TOKENS, seed + 50 + i)) for i in range(NUM_SHORT)]
    before = memory(server)["scheduler"]["num_running"]
    with ThreadPoolExecutor(max_workers=NUM_LONG + NUM_SHORT) as executor:
        futures = [executor.submit(post, server, rid, "bullets", ids) for rid, ids in longs]
        wait_running(server, before + 1)  # the first long one is in prefill
        futures += [executor.submit(post, server, rid, "caps", ids) for rid, ids in shorts]
        for f in futures:
            f.result()
    wait_idle(server)
    ours = {rid for rid, _ in longs + shorts}
    return [[rid for rid in batch if rid in ours] for batch in memory(server)["scheduler"]["recent_batches"]
            if ours.intersection(batch)]


def first_pass(passes: list[list[str]], rid: str) -> int:
    return next(i for i, batch in enumerate(passes) if rid in batch)


def assert_small_ones_first(passes: list[list[str]], tag: str) -> None:
    shorts = [f"{tag}-short{i}" for i in range(NUM_SHORT)]
    longs = sorted((f"{tag}-long{i}" for i in range(NUM_LONG)), key=lambda rid: first_pass(passes, rid))
    in_prefill, behind = longs[0], longs[1:]  # the long request prefilling when the small ones arrived
    last_short = max(first_pass(passes, rid) for rid in shorts)
    first_behind = min(first_pass(passes, rid) for rid in behind)
    # every small request is in the first pass with room after the long prefill it arrived behind: no later
    # long request's prefill goes before it (one may start in that same pass with what the small ones left)
    assert last_short <= first_behind, f"a long request went in before a small one: {passes}"
    assert first_pass(passes, in_prefill) < last_short, passes
    last_chunk = max(i for i, batch in enumerate(passes) if in_prefill in batch)
    assert last_short == last_chunk, f"the small requests waited past the prefill they arrived behind: {passes}"


def test_small_requests_pass_a_burst_of_long_ones_fresh_then_after_a_fit(server, tokenizer):
    stats = memory(server)["scheduler"]
    assert stats["counts"]["refreshes"] == 0 and len(stats["queues"]) > 1, stats  # the prior plan, not one FIFO
    assert_small_ones_first(burst_then_small(server, tokenizer, "fresh"), "fresh")

    with ThreadPoolExecutor(max_workers=4) as executor:  # 40 small requests: the window supports a fit
        list(executor.map(lambda i: post(server, f"warm{i}", "caps", random_ids(tokenizer, 12, 1000 + i)),
                          range(40)))
    stats = memory(server)["scheduler"]
    assert stats["counts"]["refreshes"] >= 1, stats
    assert_small_ones_first(burst_then_small(server, tokenizer, "warm"), "warm")
