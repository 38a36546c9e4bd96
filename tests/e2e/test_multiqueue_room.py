"""End to end: the multi-queue scheduler's room squash (sgl_multilora/sched/room.py) on a live server with one pool.

The scene, sized from the server's own figures (`/multilora/stats`: the pool's slots and the adapter's) so that each
step can only go one way:
1. R0 runs on adapter Y with a long prompt and a long decode: beside it and Y, the pool's room is short of R1's
   prompt by `MARGIN` slots or more, for R0's whole decode (seconds at this server's decode step);
2. R1 arrives on the base model: without the rule it would wait until R0 ends;
3. once R1 has waited a tenth of the 1 s TTFT SLO, R0 (decoding, the only victim) is retracted, its KV kept in the
   tree as cache, and the next pass admits R1 alone; R1 ends long before R0, which resumes once room allows
   (recomputing what the evictor took of its KV for R1).
Both outputs (tokens and logprobs) equal PEFT's, R0's across its retraction; the scheduler reports one room squash,
one request it retracted and one beneficiary admitted; the pool's and scheduler's invariants hold after every step
(test mode) and no KV of a non-resident adapter is left.
"""

from __future__ import annotations

import threading
import time

import pytest
import requests

from tests.conftest import ADAPTERS_DIR, start_server
from tests.e2e.served import generate, memory, random_ids, wait_idle, wait_running
from tests.oracle import assert_matches

pytestmark = pytest.mark.e2e

POOL_SLOTS = 1200
Y = "caps"
MARGIN = 80  # slots by which each inequality of the scene holds
R1_LEN, R1_NEW = 300, 8
R0_NEW = 60


@pytest.fixture(scope="module")
def server(model_path):
    handle = start_server(model_path, [
        "--lora-paths", f"{Y}={ADAPTERS_DIR / Y}", "--max-loras-per-batch", "4", "--max-lora-rank", "32",
        "--radix-cache-backend", "multilora", "--multilora-scheduler", "multiqueue",
        "--multilora-ttft-slo-s", "1", "--multilora-room-squash-share", "0.1",
        "--multilora-idle-watermark", "0", "--chunked-prefill-size", "256", "--multilora-check-invariants",
    ], name="e2e_multiqueue_room", max_total_tokens=POOL_SLOTS,
        env={"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1"})
    yield handle
    handle.stop()


def test_a_long_decode_is_retracted_for_a_request_the_room_cannot_take_and_outputs_match_peft(server, tokenizer,
                                                                                              oracle):
    pool = memory(server)["unified_pool"]
    total, y_slots = pool["num_slots"], pool["adapter_sizes"][Y]["num_slots"]
    r0_len = total - y_slots - R1_LEN + MARGIN  # R0 and Y leave R1_LEN - MARGIN slots, less what R0 decodes
    r0, r1 = random_ids(tokenizer, r0_len, 30), random_ids(tokenizer, R1_LEN, 31)
    assert r0_len + R0_NEW + y_slots + MARGIN <= total, (total, y_slots)  # R0 alone never needs a retraction
    before = memory(server)["scheduler"]["counts"]

    ends: dict[str, float] = {}
    responses: dict[str, dict] = {}

    def send(key, lora, ids, n):
        responses[key] = generate(server, lora, ids, n)
        ends[key] = time.monotonic()

    threads = {"r0": threading.Thread(target=send, args=("r0", Y, r0, R0_NEW))}
    threads["r0"].start()
    wait_running(server)  # R0 admitted
    threads["r1"] = threading.Thread(target=send, args=("r1", None, r1, R1_NEW))
    threads["r1"].start()
    for t in threads.values():
        t.join()

    m = wait_idle(server)
    s = m["scheduler"]
    counts = {k: s["counts"][k] - before[k] for k in ("room_squashes", "room_squashed", "room_admits")}
    assert counts == {"room_squashes": 1, "room_squashed": 1, "room_admits": 1}, s
    assert ends["r1"] < ends["r0"], ends  # R1 did not wait for R0's decode to end
    assert s["num_queued"] == 0 and s["num_running"] == 0 and s["room_reserved_for"] is None, s
    assert m["unified_pool"]["swapper"]["invalid_kv_slots"] == 0, m["unified_pool"]["swapper"]

    work = {"r0": (str(ADAPTERS_DIR / Y), r0, R0_NEW), "r1": (None, r1, R1_NEW)}
    oracle.prefetch(list(work.values()), ignore_eos=True)
    for key, (path, ids, n) in work.items():
        assert_matches(responses[key], oracle.greedy(path, ids, n, ignore_eos=True), f"{key} (room squash)")
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
