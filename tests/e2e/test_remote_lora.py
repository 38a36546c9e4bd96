"""End to end on the dense model: a LoRA server (`python -m sgl_multilora.lora_server`) and a CPU worker started with
only `--multilora-lora-server ADDR`, which holds no adapter weights (two workers of the MoE model share one LoRA
server in `test_remote_moe.py`).

The LoRA server holds bundled adapters (a LoRA on attention, one on every projection, an aLoRA) and two random PEFT
adapters no other test uses; it has fewer slots than adapters, so admission waits for slots. Concurrent mixed traffic
(every adapter and the base model, one prompt each, twice) gets PEFT's greedy output token by token and logprob by
logprob; the LoRA server's accounting closes when idle. A name the LoRA server does not hold gets HTTP 400 naming it and nothing else. With the LoRA server
stopped, an adapter request gets HTTP 503 naming it within the client's timeout while base requests keep their
answers; after a restart on the same address the worker reconnects by itself and serves adapters again.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from sgl_multilora.lora_server.launch import LoRAServerProcess
from tests.conftest import ADAPTERS_DIR, REPO, start_server
from tests.e2e.served import generate, random_ids
from tests.oracle import assert_matches

pytestmark = pytest.mark.e2e

NEW_TOKENS = 8
BUNDLED = ("caps", "bullets", "check_caps")
RANDOM = {"rnd_r8_qv": (8, ["q_proj", "v_proj"]), "rnd_r16_mlp_o": (16, ["o_proj", "gate_proj", "down_proj"])}


@pytest.fixture(scope="module")
def adapter_dir(model_path, tmp_path_factory):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("remote_lora")
    for name in BUNDLED:
        (root / name).symlink_to(ADAPTERS_DIR / name)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    for i, (name, (rank, targets)) in enumerate(RANDOM.items()):
        torch.manual_seed(4100 + i)
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                init_lora_weights=False, task_type="CAUSAL_LM"))
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    p.mul_(0.5)
        model.save_pretrained(str(root / name))
        base = model.unload()
    return root


@pytest.fixture(scope="module")
def lora_srv(adapter_dir, model_path, tmp_path_factory):
    address = f"ipc://{tmp_path_factory.mktemp('sock')}/lora.sock"
    server = LoRAServerProcess(adapter_dir, model_path, address, REPO / ".pytest_cache" / "e2e_remote_lora_srv.log",
                               ["--max-slots", "4"]).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def worker(model_path, lora_srv):
    handle = start_server(model_path, ["--multilora-lora-server", lora_srv.address, "--max-loras-per-batch", "8",
                                       "--radix-cache-backend", "multilora"],
                          name="e2e_remote_worker", max_total_tokens=4096)
    yield handle
    handle.stop()


def prompt(tokenizer, name, seed) -> list[int]:
    ids = random_ids(tokenizer, 30, seed)
    if name == "check_caps":
        ids += tokenizer("<|im_start|>check_caps\n", add_special_tokens=False).input_ids
    return ids


def ref_path(adapter_dir, name):
    return None if name is None else str((adapter_dir / name).resolve())


def test_mixed_traffic_matches_peft(worker, lora_srv, adapter_dir, tokenizer, oracle):
    names = [*BUNDLED, *RANDOM, None]
    jobs = [(name, prompt(tokenizer, name, 300 + i)) for i, name in enumerate(names) for _ in range(2)]
    oracle.prefetch([(ref_path(adapter_dir, n), ids, NEW_TOKENS) for n, ids in jobs], ignore_eos=True)
    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda job: generate(worker, job[0], job[1], NEW_TOKENS), jobs))
    for (name, ids), out in zip(jobs, outs):
        expected = oracle.greedy(ref_path(adapter_dir, name), ids, NEW_TOKENS, ignore_eos=True)
        assert_matches(out, expected, f"remote LoRA {name}")
        if name in RANDOM:  # the random adapter visibly changes the output
            assert expected.tokens != oracle.greedy(None, ids, NEW_TOKENS, ignore_eos=True).tokens, name
    stats = lora_srv.stats()
    assert stats["invariants"] == "ok", stats  # checked idle: no pin left
    assert stats["delta_calls"] > 0 and stats["errors"] == 0, stats
    side = requests.get(worker.url + "/multilora/stats", timeout=60).json()["lora_server"][0]
    assert side["calls"] > 0 and side["failed_steps"] == 0 and side["admission_waits"] > 0, side


def test_a_name_the_lora_server_does_not_hold_gets_400_naming_only_it(worker, tokenizer):
    res = requests.post(worker.url + "/generate", json={
        "input_ids": random_ids(tokenizer, 20, 5), "lora_path": "not-there",
        "sampling_params": {"max_new_tokens": 2, "temperature": 0}}, timeout=120)
    assert res.status_code == 400 and "not-there" in res.text, res.text
    assert not any(name in res.text for name in (*BUNDLED, *RANDOM)), res.text


def test_lora_server_down_gives_503_base_keeps_serving_and_the_worker_reconnects(worker, lora_srv, adapter_dir,
                                                                              tokenizer, oracle):
    ids = prompt(tokenizer, "caps", 900)
    generate(worker, "rnd_r8_qv", ids, 2)  # registered on the worker
    lora_srv.stop()
    try:
        started = time.monotonic()
        res = requests.post(worker.url + "/generate", json={
            "input_ids": ids, "lora_path": "rnd_r8_qv",
            "sampling_params": {"max_new_tokens": 4, "temperature": 0}}, timeout=120)
        assert res.status_code == 503 and lora_srv.address in res.text, (res.status_code, res.text)
        assert time.monotonic() - started < 60
        base = generate(worker, None, ids, NEW_TOKENS)
        assert_matches(base, oracle.greedy(None, ids, NEW_TOKENS, ignore_eos=True), "base while down")
    finally:
        lora_srv.start()
    out = generate(worker, "rnd_r8_qv", ids, NEW_TOKENS)
    assert_matches(out, oracle.greedy(ref_path(adapter_dir, "rnd_r8_qv"), ids, NEW_TOKENS, ignore_eos=True),
                   "after the LoRA server's restart")
