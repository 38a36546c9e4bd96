"""End to end: a LoRA server (`python -m sgl_multilora.lora_server`) and two CPU workers started with only
`--multilora-lora-server ADDR`, which hold no adapter weights.

The LoRA server holds bundled adapters (a LoRA on attention, one on every projection, an aLoRA) and two random PEFT
adapters no other test uses. Concurrent mixed traffic over both workers (every adapter and the base model, one
prompt each, twice) gets PEFT's greedy output token by token and logprob by logprob; the LoRA server's accounting
closes when idle. A name the LoRA server does not hold gets HTTP 400 naming it and nothing else. With the LoRA server
stopped, an adapter request gets HTTP 503 naming it within the client's timeout while base requests keep their
answers; after a restart on the same address the workers reconnect by themselves and serve adapters again.
"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

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


class LoRAServerProcess:
    def __init__(self, adapter_dir, model_path, address: str, log_path):
        self.args = [sys.executable, "-m", "sgl_multilora.lora_server", "--adapter-dir", str(adapter_dir),
                     "--model-path", str(model_path), "--listen", address, "--max-slots", "4"]
        self.address, self.log_path, self.proc = address, log_path, None

    def start(self) -> None:
        from sgl_multilora.lora_server import LoRAServerClient

        self.proc = subprocess.Popen(self.args, stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT)
        client = LoRAServerClient(self.address, timeout_s=2.0)
        deadline = time.monotonic() + 120
        while True:
            try:
                client.catalog()
                break
            except ConnectionError:
                assert self.proc.poll() is None and time.monotonic() < deadline, self.log_path.read_text()[-3000:]
        client.close()

    def stats(self) -> dict:
        from sgl_multilora.lora_server import LoRAServerClient

        client = LoRAServerClient(self.address, timeout_s=10.0)
        try:
            return client.stats()
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def lora_srv(adapter_dir, model_path, tmp_path_factory):
    address = f"ipc://{tmp_path_factory.mktemp('sock')}/lora.sock"
    server = LoRAServerProcess(adapter_dir, model_path, address, REPO / ".pytest_cache" / "e2e_remote_lora_srv.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def workers(model_path, lora_srv):
    handles = []
    try:
        for i in range(2):
            handles.append(start_server(model_path, ["--multilora-lora-server", lora_srv.address,
                                                     "--max-loras-per-batch", "4"],
                                        name=f"e2e_remote_worker{i}", max_total_tokens=4096))
        yield handles
    finally:
        for h in handles:
            h.stop()


def prompt(tokenizer, name, seed) -> list[int]:
    ids = random_ids(tokenizer, 30, seed)
    if name == "check_caps":
        ids += tokenizer("<|im_start|>check_caps\n", add_special_tokens=False).input_ids
    return ids


def ref_path(adapter_dir, name):
    return None if name is None else str((adapter_dir / name).resolve())


def test_mixed_traffic_over_two_workers_matches_peft(workers, lora_srv, adapter_dir, tokenizer, oracle):
    names = [*BUNDLED, *RANDOM, None]
    jobs = [(name, prompt(tokenizer, name, 300 + i)) for i, name in enumerate(names) for _ in range(2)]
    oracle.prefetch([(ref_path(adapter_dir, n), ids, NEW_TOKENS) for n, ids in jobs], ignore_eos=True)
    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda ij: generate(workers[ij[0] % 2], ij[1][0], ij[1][1], NEW_TOKENS),
                             enumerate(jobs)))
    for (name, ids), out in zip(jobs, outs):
        expected = oracle.greedy(ref_path(adapter_dir, name), ids, NEW_TOKENS, ignore_eos=True)
        assert_matches(out, expected, f"remote LoRA {name}")
        if name in RANDOM:  # the random adapter visibly changes the output
            assert expected.tokens != oracle.greedy(None, ids, NEW_TOKENS, ignore_eos=True).tokens, name
    stats = lora_srv.stats()
    assert stats["invariants"] == "ok", stats
    assert stats["delta_calls"] > 0, stats  # (invariants checked idle: no pin left)


def test_a_name_the_lora_server_does_not_hold_gets_400_naming_only_it(workers, tokenizer):
    res = requests.post(workers[0].url + "/generate", json={
        "input_ids": random_ids(tokenizer, 20, 5), "lora_path": "not-there",
        "sampling_params": {"max_new_tokens": 2, "temperature": 0}}, timeout=120)
    assert res.status_code == 400 and "not-there" in res.text, res.text
    assert not any(name in res.text for name in (*BUNDLED, *RANDOM)), res.text


def test_lora_server_down_gives_503_base_keeps_serving_and_workers_reconnect(workers, lora_srv, adapter_dir,
                                                                              tokenizer, oracle):
    ids = prompt(tokenizer, "caps", 900)
    generate(workers[1], "rnd_r8_qv", ids, 2)  # both adapters registered on this worker
    lora_srv.stop()
    try:
        started = time.monotonic()
        res = requests.post(workers[1].url + "/generate", json={
            "input_ids": ids, "lora_path": "rnd_r8_qv",
            "sampling_params": {"max_new_tokens": 4, "temperature": 0}}, timeout=120)
        assert res.status_code == 503 and lora_srv.address in res.text, (res.status_code, res.text)
        assert time.monotonic() - started < 60
        base = generate(workers[1], None, ids, NEW_TOKENS)
        assert_matches(base, oracle.greedy(None, ids, NEW_TOKENS, ignore_eos=True), "base while down")
    finally:
        lora_srv.start()
    out = generate(workers[1], "rnd_r8_qv", ids, NEW_TOKENS)
    assert_matches(out, oracle.greedy(ref_path(adapter_dir, "rnd_r8_qv"), ids, NEW_TOKENS, ignore_eos=True),
                   "after the LoRA server's restart")
