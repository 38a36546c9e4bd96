"""End to end: the multi-queue scheduler's adapter-memory bypass and its squash, on a live server with one pool.

The scene (Chameleon, 4.4), sized from the server's own figures (`/multilora/stats`: the pool's slots and each
adapter's) so that each step can only go one way:
1. R0 runs on the base model (its prompt holds enough of the pool that a large adapter A cannot fit, even after
   evicting everything idle);
2. R1 arrives on A: memory-blocked; nothing is evicted for it (the cache stays);
3. R2, younger, on resident adapter Y, predicted short (the predictor learned Y's short answers), runs first: a
   bypass, since R1's predicted wait for R0 is longer than R2's predicted run;
4. R2 runs longer than predicted; once R0 finishes, free memory is still short of A but would cover it without R2:
   R2 is squashed (retracted through SGLang's own retraction, re-queued at its arrival position), A comes in, R1
   runs, and R2 runs again later, recomputing what it had.
Every output (R0, R1, R2: tokens and logprobs) equals PEFT's, the scheduler reports one bypass and one squash, and
the pool's and scheduler's invariants hold after every step (test mode).
"""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import requests

from tests.conftest import ADAPTERS_DIR, start_server
from tests.e2e.served import generate, memory, random_ids, wait_idle, wait_running
from tests.oracle import assert_matches

pytestmark = pytest.mark.e2e

POOL_SLOTS = 1200
BIG_RANK = 32  # every projection: about 850 slots of SmolLM2-135M's 46,080-byte KV slot, most of the pool
Y, BIG = "caps", "big"
MARGIN = 80  # slots by which each inequality of the scene holds
R0_NEW, R1_NEW, R2_NEW = 60, 8, 100
Y_TRAIN_NEW = 4


@pytest.fixture(scope="module")
def adapter_dir(model_path, tmp_path_factory):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("squash_adapters")
    shutil.copytree(ADAPTERS_DIR / Y, root / Y)
    torch.manual_seed(7)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = LoraConfig(r=BIG_RANK, lora_alpha=2 * BIG_RANK, init_lora_weights=False, task_type="CAUSAL_LM",
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(base, config)
    with torch.no_grad():  # random weights of a scale that moves greedy outputs without breaking the model
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5)
    model.save_pretrained(str(root / BIG))
    return root


@pytest.fixture(scope="module")
def server(model_path, adapter_dir):
    handle = start_server(model_path, [
        "--multilora-adapter-dir", str(adapter_dir), "--max-loras-per-batch", "4", "--max-lora-rank", "32",
        "--radix-cache-backend", "multilora", "--multilora-scheduler", "multiqueue",
        "--multilora-idle-watermark", "0",  # no idle prefetch: A comes in only on demand
        "--chunked-prefill-size", "256", "--multilora-check-invariants",
    ], name="e2e_multiqueue_squash", max_total_tokens=POOL_SLOTS,
        env={"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1"})
    yield handle
    handle.stop()


def test_a_bypassing_request_is_squashed_for_the_blocked_one_and_outputs_match_peft(server, adapter_dir,
                                                                                     tokenizer, oracle):
    pool = memory(server)["unified_pool"]
    sizes = {name: a["num_slots"] for name, a in pool["adapter_sizes"].items()}
    total, headroom = pool["num_slots"], pool["num_slots"] // 100
    r1 = random_ids(tokenizer, 24, 1)
    need = sizes[BIG] + headroom + len(r1)  # what R1 waits for
    slack = total - need  # room left beside R1: R0 alone, and later R2 alone, must hold more than this
    r0 = random_ids(tokenizer, slack + MARGIN, 0)
    r2 = random_ids(tokenizer, slack + MARGIN - sizes[Y], 2)
    # both running at their peak, with Y resident, fit beside each other (no retraction of SGLang's own)
    peak = len(r0) + R0_NEW + sizes[Y] + len(r2) + R2_NEW
    assert slack > 0 and len(r2) > 0 and peak + MARGIN <= total, (sizes, total, len(r0), len(r2))
    assert total - len(r0) < sizes[BIG]  # R0 running, A cannot fit

    # The predictor learns that Y answers in a few tokens and the base model in R0_NEW (three requests each); Y is
    # resident afterwards.
    train = [(Y, random_ids(tokenizer, 16, 10 + i), Y_TRAIN_NEW) for i in range(3)]
    train += [(None, random_ids(tokenizer, 16, 20 + i), R0_NEW) for i in range(3)]
    threads = [threading.Thread(target=generate, args=(server, *t)) for t in train]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    before = wait_idle(server)
    assert before["scheduler"]["counts"]["finished"] >= len(train), before["scheduler"]

    responses: dict[str, dict] = {}

    def send(key, lora, ids, n):
        responses[key] = generate(server, lora, ids, n)

    threads = {"r0": threading.Thread(target=send, args=("r0", None, r0, R0_NEW))}
    threads["r0"].start()
    wait_running(server)  # R0 admitted
    threads["r1"] = threading.Thread(target=send, args=("r1", BIG, r1, R1_NEW))
    threads["r1"].start()
    time.sleep(0.2)  # R1 queued first
    threads["r2"] = threading.Thread(target=send, args=("r2", Y, r2, R2_NEW))
    threads["r2"].start()
    for t in threads.values():
        t.join()

    m = wait_idle(server)
    s = m["scheduler"]
    counts = s["counts"]
    assert counts["bypasses"] >= 1 and counts["squashes"] == 1 and s["squashed"] == 1, s
    assert s["num_queued"] == 0 and s["num_running"] == 0, s
    swapper = m["unified_pool"]["swapper"]
    assert swapper["invalid_kv_slots"] == 0, swapper

    work = {"r0": (None, r0, R0_NEW), "r1": (BIG, r1, R1_NEW), "r2": (Y, r2, R2_NEW)}
    path = {None: None, BIG: str(adapter_dir / BIG), Y: str(adapter_dir / Y)}
    oracle.prefetch([(path[lora], ids, n) for lora, ids, n in work.values()], ignore_eos=True)
    for key, (lora, ids, n) in work.items():
        expected = oracle.greedy(path[lora], ids, n, ignore_eos=True)
        assert_matches(responses[key], expected, f"{key} on {lora or 'the base model'} (bypass and squash)")
    res = requests.get(server.url + "/health", timeout=30)
    assert res.status_code == 200
