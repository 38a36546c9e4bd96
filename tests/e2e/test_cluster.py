"""End to end: two plugin workers behind SGLang's router `smg` (`sgl_multilora.cluster.Cluster`).

Through the router, `/generate` with and without `lora_path` returns the greedy tokens a worker returns directly,
and round-robin reaches both workers; the OpenAI API reaches the base model. `model="<served>:<adapter>"` is not
routed by smg 1.13 (it routes by the `model` field to workers registered under that id, and an adapter is no
registered id): that limitation is pinned here so a change in smg shows. Stopping the cluster leaves no process.
"""

from __future__ import annotations

import os
import time

import pytest
import requests

from tests.conftest import LORA_SERVER_ARGS, REPO

pytest.importorskip("smg", reason="the router `smg` is not installed (requirements/cpu.lock pins it)")

pytestmark = pytest.mark.e2e

MAX_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def cluster(model_path):
    from sgl_multilora.cluster.launch import Cluster
    from sgl_multilora.server import cpu_server_args

    worker_args = ["--model-path", model_path, *cpu_server_args(max_total_tokens=4096), *LORA_SERVER_ARGS,
                   "--radix-cache-backend", "multilora"]
    handle = Cluster(2, worker_args, policy="round_robin", log_dir=REPO / ".pytest_cache" / "e2e_cluster")
    with handle:
        yield handle


def generate(url: str, ids: list[int], lora: str | None) -> tuple[list[int], str | None]:
    body = {"input_ids": ids, "lora_path": lora,
            "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
    res = requests.post(url + "/generate", json=body, timeout=300)
    assert res.status_code == 200, res.text
    return res.json()["output_ids"], res.headers.get("x-smg-routed-worker-id")


def chat(url: str, model: str) -> requests.Response:
    return requests.post(url + "/v1/chat/completions", timeout=300, json={
        "model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": MAX_NEW_TOKENS, "temperature": 0})


def test_generate_through_router_equals_worker(cluster, manifest, tokenizer):
    prompts = {e["name"]: tokenizer(e["example_input_text"], add_special_tokens=False)["input_ids"]
               for e in manifest if e["kind"] == "lora"}
    routed, direct = set(), {}
    for lora in [None, "caps", "json"]:
        ids = prompts[lora or "caps"]
        direct[lora], _ = generate(cluster.worker_urls[0], ids, lora)
        for _ in range(2):  # round robin: the two requests land on different workers
            tokens, worker = generate(cluster.router_url, ids, lora)
            assert tokens == direct[lora], f"adapter {lora}: router {tokens} != worker {direct[lora]}"
            routed.add(worker.rstrip("/"))
    assert routed == set(cluster.worker_urls)
    assert direct[None] != direct["caps"], "caps changed nothing on its own prompt: lora_path was not applied"


def test_openai_api_through_router(cluster):
    served = requests.get(cluster.worker_urls[0] + "/v1/models", timeout=60).json()["data"][0]["id"]
    direct, routed = chat(cluster.worker_urls[0], served), chat(cluster.router_url, served)
    assert direct.status_code == routed.status_code == 200, routed.text
    assert routed.json()["choices"][0]["message"] == direct.json()["choices"][0]["message"]
    assert chat(cluster.worker_urls[0], f"{served}:caps").status_code == 200
    adapter = chat(cluster.router_url, f"{served}:caps")
    assert adapter.status_code == 404 and "model_not_found" in adapter.text, adapter.text


def test_stop_leaves_no_process(cluster):
    groups = [h.process.pid for h in [*cluster.workers, cluster.router]]  # each started its own process group
    cluster.stop()
    deadline = time.monotonic() + 30
    while True:
        alive = []
        for pgid in groups:
            try:
                os.killpg(pgid, 0)
                alive.append(pgid)
            except ProcessLookupError:
                pass
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not alive, f"process groups still alive after stop: {alive}"
    assert not any(h.alive() for h in [*cluster.workers, cluster.router])
