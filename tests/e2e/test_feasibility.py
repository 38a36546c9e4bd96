"""End to end: no request waits forever on a unified pool barely larger than its largest adapter plus a request.

The pool holds 1,150 token slots; the bundled `bullets` adapter (rank 32, every projection) takes 864 of them in the
pool, so a request on it fits only with prompt + new tokens <= 284. Concurrent base, LoRA and aLoRA requests, some
on `bullets` near that edge: every feasible one is answered and equals PEFT's output (tokens and logprobs); one
past the edge is refused with HTTP 400 naming the sizes at once, while the rest are served; one that sets no
`max_new_tokens` has its generation clipped to what fits beside its adapter (an adapter that leaves no room for any
request is refused at load: tests/e2e/test_unified_pool.py). Both admission policies: SGLang's own and the
multi-queue scheduler. The servers run in test mode (`--multilora-check-invariants`, SGLang's strict memory check at
every step).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.conftest import ADAPTERS_DIR, start_server
from tests.e2e.served import memory, random_ids, wait_idle
from tests.oracle import assert_matches, logprob_fields

pytestmark = pytest.mark.e2e

POOL_SLOTS = 1150
NEW_TOKENS = 8


@pytest.fixture(scope="module", params=["stock", "multiqueue"])
def server(request, model_path):
    handle = start_server(model_path, [
        "--enable-lora", "--multilora-adapter-dir", str(ADAPTERS_DIR), "--max-loras-per-batch", "4",
        "--max-lora-rank", "64", "--radix-cache-backend", "multilora", "--chunked-prefill-size", "128",
        "--multilora-check-invariants", "--multilora-scheduler", request.param,
    ], name=f"e2e_feasibility_{request.param}", max_total_tokens=POOL_SLOTS,
        env={"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1"})
    yield handle
    handle.stop()


def post(server, lora: str | None, ids: list[int], max_new_tokens: int | None) -> requests.Response:
    body = {"input_ids": ids, "lora_path": lora, **logprob_fields(),
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    return requests.post(server.url + "/generate", json=body, timeout=900)


def test_every_request_is_answered_or_refused_at_once_and_outputs_match_peft(server, tokenizer, manifest, oracle):
    by_name = {e["name"]: e for e in manifest}
    pool = memory(server)["unified_pool"]
    bullets = pool["adapter_sizes"]["bullets"]["num_slots"]
    assert pool["num_slots"] == POOL_SLOTS and bullets == 864, pool["adapter_sizes"]
    longest = POOL_SLOTS - bullets - 2  # prompt + new tokens beside bullets (SGLang reserves one more slot)
    log = Path(server.log_path).read_text()
    assert f"the largest adapter ('bullets') takes {bullets} slots, the longest request beside it {longest}" in log

    invocation = list(by_name["check_caps"]["invocation_token_ids"])
    work = [  # (label, adapter, prompt ids): every one feasible, one exactly at the edge
        ("base/0", None, random_ids(tokenizer, 160, 1)),
        ("bullets/edge", "bullets", random_ids(tokenizer, longest - NEW_TOKENS, 2)),
        ("json/0", "json", random_ids(tokenizer, 150, 3)),
        ("bullets/1", "bullets", random_ids(tokenizer, 120, 4)),
        ("check_caps/0", "check_caps", random_ids(tokenizer, 110, 6) + invocation),
        ("caps/0", "caps", random_ids(tokenizer, 100, 5)),
    ]
    too_long = random_ids(tokenizer, longest - NEW_TOKENS + 1, 9)  # one token past the edge
    def timed(lora, ids):
        response = post(server, lora, ids, NEW_TOKENS)
        return response, time.monotonic()

    with ThreadPoolExecutor(max_workers=len(work)) as executor:
        futures = [executor.submit(timed, lora, ids) for _, lora, ids in work]
        time.sleep(1.0)  # the feasible ones are queued or running when the infeasible one arrives
        refused, refused_at = timed("bullets", too_long)
        responses, done_at = zip(*(f.result() for f in futures))

    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]["message"] if "error" in refused.json() else refused.text
    for size in (f"'bullets' takes {bullets} token slots", f"the request {longest + 2}",
                 f"({longest - NEW_TOKENS + 1} prompt + {NEW_TOKENS} new + 1 reserved)",
                 f"the pool holds {POOL_SLOTS}", f"prompt + new tokens <= {longest}"):
        assert size in message, message
    # answered by the scheduler's next step, not after a wait in the queue behind the feasible requests
    assert sum(t < refused_at for t in done_at) <= len(work) // 2, "the refusal waited in the queue"

    for (label, _, _), response in zip(work, responses):
        assert response.status_code == 200, (label, response.text)
    oracle.prefetch([(lora and by_name[lora]["path"], ids, NEW_TOKENS) for _, lora, ids in work], ignore_eos=True)
    for (label, lora, ids), response in zip(work, responses):
        expected = oracle.greedy(lora and by_name[lora]["path"], ids, NEW_TOKENS, ignore_eos=True)
        assert_matches(response.json(), expected, f"{label} on a pool near its feasibility edge")

    m = wait_idle(server)
    assert m["running"] == 0 and m["waiting"] == 0, m
    assert m["cache_protected"] == 0 and m["free"] + m["cache_evictable"] == m["total"], m
    gate = m["unified_pool"]["admission"]
    assert gate["stalls"] == 0 and gate["infeasible"] == 0 and gate["hold"] is None, gate


def test_a_request_without_max_new_tokens_generates_what_fits_beside_its_adapter(server, tokenizer):
    pool = memory(server)["unified_pool"]
    bullets = pool["adapter_sizes"]["bullets"]["num_slots"]
    prompt = random_ids(tokenizer, 250, 21)
    fits = POOL_SLOTS - bullets - 2 - len(prompt)
    response = post(server, "bullets", prompt, None)
    assert response.status_code == 200, response.text
    assert response.json()["meta_info"]["completion_tokens"] == fits
    wait_idle(server)
