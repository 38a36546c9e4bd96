"""End to end: `--multilora-scheduler multiqueue` orders admissions and never changes the work.

Concurrent base, LoRA and aLoRA requests of very different sizes (short and long prompts, 8 to 24 new tokens) on a
server whose KV pool and adapter ranks make the multi-queue plan matter: every greedy output equals PEFT's (tokens
and logprobs), every request is answered, and when idle the scheduler holds nothing (every admitted request
finished, no queue holds a request, no quota tokens held). Test mode checks the scheduler's and the pool's
invariants after every step.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.conftest import ADAPTERS_DIR, start_server
from tests.e2e.served import wait_idle
from tests.oracle import assert_matches, logprob_fields

pytestmark = pytest.mark.e2e

SLO_S = 20


@pytest.fixture(scope="module")
def server(model_path):
    handle = start_server(model_path, [
        "--multilora-adapter-dir", str(ADAPTERS_DIR), "--max-loras-per-batch", "4", "--max-lora-rank", "32",
        "--radix-cache-backend", "multilora", "--multilora-scheduler", "multiqueue",
        "--chunked-prefill-size", "128", "--multilora-check-invariants",
        # the slot squash after SLO_S / 8 = 2.5 s of waiting, as the default share does at the default SLO of 5 s; the
        # longer SLO keeps victims whose recompute the server's measured prefill rate prices above the SLO rare (a
        # request is not retracted for longer than that: on one core, after the first test, the rate read 90 ms a
        # token, and four 60-token holders were all priced out at an SLO of 5 s)
        "--multilora-ttft-slo-s", str(SLO_S), "--multilora-slot-squash-share", "0.125",
    ], name="e2e_multiqueue", max_total_tokens=4096, env={"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1"})
    yield handle
    handle.stop()


def test_outputs_under_multiqueue_equal_peft_and_nothing_is_held_when_idle(server, tokenizer, manifest, oracle):
    by_name = {e["name"]: e for e in manifest}
    rng = random.Random(5)
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 3)
    work = []
    for i in range(20):
        entry = [None, by_name["caps"], by_name["json"], by_name["bullets"], by_name["check_caps"]][i % 5]
        text = " ".join(rng.choices(words, k=rng.choice([8, 30, 200])))
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        if entry is not None and entry["kind"] == "alora":
            ids = ids + list(entry["invocation_token_ids"])
        work.append((entry, ids, rng.choice([8, 12, 24])))

    def generate(item):
        entry, ids, n = item
        body = {"input_ids": ids, "lora_path": entry and entry["name"], **logprob_fields(),
                "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
        res = requests.post(server.url + "/generate", json=body, timeout=900)
        assert res.status_code == 200, res.text
        return res.json()

    with ThreadPoolExecutor(max_workers=8) as executor:
        responses = list(executor.map(generate, work))
    oracle.prefetch([(entry and entry["path"], ids, n) for entry, ids, n in work], ignore_eos=True)
    for (entry, ids, n), response in zip(work, responses):
        expected = oracle.greedy(entry and entry["path"], ids, n, ignore_eos=True)
        assert_matches(response, expected, f"{entry['name'] if entry else 'base'} under multiqueue")

    s = wait_idle(server)["scheduler"]
    assert s["counts"]["finished"] >= len(work) and s["counts"]["admitted"] >= s["counts"]["finished"], s
    assert s["num_queued"] == 0 and s["num_running"] == 0, s
    assert all(q["held_tokens"] == 0 and q["num_queued"] == 0 for q in s["queues"]), s
    assert s["predictor"]["num_observed"] >= len(work), s["predictor"]


def test_aborts_and_an_unload_while_requests_wait_leave_nothing_behind(server, tokenizer, manifest, oracle):
    """Twelve requests at once (more than a pass admits: some wait in the queues), half of them aborted right away,
    and the adapter some of them name unloaded while they are in flight: every request that was not aborted gets
    PEFT's answer or a clear error, and when idle the multi-queue state and the pool hold nothing; the adapter loads
    again and answers as PEFT."""
    import threading
    import uuid

    entry = next(e for e in manifest if e["name"] == "caps")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Name three rivers of Europe and one sea."}],
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    work = [(f"mq-abort-{uuid.uuid4().hex[:8]}", None if i % 3 else entry["name"]) for i in range(12)]
    results: dict[str, requests.Response] = {}

    def send(rid, lora):
        body = {"rid": rid, "input_ids": ids, "lora_path": lora, **logprob_fields(),
                "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
        results[rid] = requests.post(server.url + "/generate", json=body, timeout=900)

    threads = [threading.Thread(target=send, args=w) for w in work]
    for t in threads:
        t.start()
    aborted = {rid for rid, _ in work[::2]}
    for rid in aborted:
        requests.post(server.url + "/abort_request", json={"rid": rid}, timeout=60)
    unload = requests.post(server.url + "/unload_lora_adapter", json={"lora_name": "caps"}, timeout=300)
    for t in threads:
        t.join()
    assert unload.status_code == 200, unload.text

    answered = 0
    for rid, lora in work:
        res = results[rid]
        if rid in aborted:
            assert res.status_code in (200, 400), res.text  # finished first, or aborted with a clear reason
            continue
        if lora is not None and res.status_code == 400:  # arrived after its adapter was unloaded: named in the error
            assert "caps" in res.text, res.text
            continue
        assert res.status_code == 200, res.text
        expected = oracle.greedy(entry["path"] if lora else None, ids, 24, ignore_eos=True)
        assert_matches(res.json(), expected, f"{lora or 'base'} next to aborts and an unload")
        answered += 1
    assert answered >= 4, "too few requests ran to completion for the test to mean anything"

    s = wait_idle(server)["scheduler"]
    assert s["num_queued"] == 0 and s["num_running"] == 0, s
    assert all(q["held_tokens"] == 0 and q["num_queued"] == 0 for q in s["queues"]), s
    res = requests.post(server.url + "/load_lora_adapter", json={"lora_name": "caps", "lora_path": entry["path"]},
                        timeout=120)
    assert res.status_code == 200, res.text
    body = {"input_ids": ids, "lora_path": "caps", **logprob_fields(),
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    again = requests.post(server.url + "/generate", json=body, timeout=900)
    assert again.status_code == 200, again.text
    assert_matches(again.json(), oracle.greedy(entry["path"], ids, 8, ignore_eos=True), "caps loaded again")


def test_a_request_blocked_by_the_adapter_slot_cap_gets_a_slot_squashed_for_it(server, tokenizer, manifest, oracle):
    """Four long decodes hold the four adapter slots (`--max-loras-per-batch 4`: the base model, caps, json,
    bullets); a short request on a fifth adapter would wait for one of them to finish. Once it has waited an eighth
    of its TTFT SLO (2.5 s), the running requests of the adapter cheapest to recompute are retracted and the slot is its: it is
    answered before the long decodes end, one slot squash is counted, the retracted request resumes (from its KV kept in
    the tree), and every output, the retracted one's included, equals PEFT's."""
    import threading
    import time

    from tests.e2e.served import memory

    by_name = {e["name"]: e for e in manifest}
    before = memory(server)["scheduler"]

    def chat(text):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)

    long_new = 96
    holders = [(None, chat("Tell me a long story about a lighthouse keeper.")),
               (by_name["caps"], chat("Describe a walk along the river in spring.")),
               (by_name["json"], chat("List the planets with one fact each.")),
               (by_name["bullets"], chat("Give advice for a first trip abroad."))]
    short = by_name["check_caps"]
    short_ids = chat("is this text in capital letters? HELLO THERE") + list(short["invocation_token_ids"])
    done: dict[str, tuple[float, dict]] = {}

    def send(key, entry, ids, n):
        body = {"input_ids": ids, "lora_path": entry and entry["name"], **logprob_fields(),
                "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
        res = requests.post(server.url + "/generate", json=body, timeout=900)
        assert res.status_code == 200, res.text
        done[key] = (time.monotonic(), res.json())

    threads = [threading.Thread(target=send, args=(f"long{i}", e, ids, long_new)) for i, (e, ids) in enumerate(holders)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while memory(server)["running"] < len(holders):  # all four decoding: every slot taken
        assert time.monotonic() < deadline and not done, "the four long requests never ran together"
        time.sleep(0.05)
    sent = time.monotonic()
    short_thread = threading.Thread(target=send, args=("short", short, short_ids, 8))
    short_thread.start()
    for t in [*threads, short_thread]:
        t.join()

    after = wait_idle(server)["scheduler"]
    assert after["counts"]["slot_squashes"] - before["counts"]["slot_squashes"] == 1, (after["counts"], after["timing"])
    assert after["slot_squashed"] > before["slot_squashed"] and after["slot_reserved_for"] is None, after
    short_done = done["short"][0]
    assert short_done < min(done[f"long{i}"][0] for i in range(len(holders))), \
        f"the short request ({short_done - sent:.1f} s) waited for a long decode to end"
    # the retracted request's KV stayed in the tree: its resuming prefill found its whole prompt cached (the prompts
    # share only the chat template's system prefix, which is shorter than any of them)
    import re

    log = server.log_tail(2_000_000)
    after_squash = log[log.rindex("for request " + done["short"][1]["meta_info"]["id"]):]
    cached = [int(n) for n in re.findall(r"Prefill batch, .*?#cached-token: (\d+)", after_squash)]
    assert max(cached, default=0) >= min(len(ids) for _, ids in holders), cached
    oracle.prefetch([(e and e["path"], ids, long_new) for e, ids in holders] + [(short["path"], short_ids, 8)],
                    ignore_eos=True)
    for i, (e, ids) in enumerate(holders):
        assert_matches(done[f"long{i}"][1], oracle.greedy(e and e["path"], ids, long_new, ignore_eos=True),
                       f"{e['name'] if e else 'base'} next to a slot squash")
    assert_matches(done["short"][1], oracle.greedy(short["path"], short_ids, 8, ignore_eos=True),
                   "check_caps after its slot squash")
