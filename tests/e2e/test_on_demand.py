"""End to end: adapters on demand (`--multilora-adapter-source`, `--multilora-host-adapter-gb`) on a real CPU server
with the unified pool.

The source holds random PEFT adapters of ranks 8-64 on attention and MLP projections, an aLoRA, one adapter in a
Hugging Face hub cache layout, a malformed one, one of a rank above the server's, and 200 more that share one weight
file under configs of their own (one identity each). Nothing is named at start-up. Concurrent first requests for the
same and for different adapters each get PEFT's greedy output (tokens and logprobs), and each adapter is read once;
unknown names, path syntax and bad adapters get HTTP 400 naming the adapter while the server keeps serving; the host
tier's budget drops the least recently used copies and a dropped adapter comes back from its source; changed files
under an old name are served as the new weights; an adapter a user unloads is not quietly reloaded from its old path.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.conftest import start_server
from tests.e2e.served import generate, random_ids
from tests.oracle import assert_matches

pytestmark = pytest.mark.e2e

INVOCATION = "<|im_start|>verify\n"
NEW_TOKENS = 8
DISTINCT = {  # name: (rank, targets, aLoRA)
    "r8_qv": (8, ["q_proj", "v_proj"], False),
    "r16_mlp": (16, ["gate_proj", "up_proj", "down_proj"], False),
    "r64_q": (64, ["q_proj"], False),
    "alora_v": (8, ["q_proj", "k_proj", "v_proj", "o_proj"], True),
}
HUB_NAME = "acme/hub-adapter"
NUM_BULK = 200
HOST_GB = 0.015  # r64_q (8.8 MB) and the small ones, or r16_mlp (12.2 MB) and the small ones, not both


def _save(base, path, rank, targets, alora, invocation, seed):
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False, task_type="CAUSAL_LM",
                        target_modules=targets, alora_invocation_tokens=invocation if alora else None)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "lora_B" in pname:
                p.mul_(0.5)
    model.save_pretrained(str(path))
    return model.unload()


@pytest.fixture(scope="module")
def layout(model_path, tokenizer, tmp_path_factory):
    """src/ (a directory source), hub/ (a hub cache) and refs/ (the oracle's copies, which never change)."""
    import torch
    from transformers import AutoModelForCausalLM

    base_dir = tmp_path_factory.mktemp("on_demand")
    src, hub, refs = base_dir / "src", base_dir / "hub", base_dir / "refs"
    invocation = tokenizer(INVOCATION, add_special_tokens=False).input_ids
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    for i, (name, (rank, targets, alora)) in enumerate(DISTINCT.items()):
        base = _save(base, refs / name, rank, targets, alora, invocation, 700 + i)
    base = _save(base, refs / "r8_qv_v2", 8, ["q_proj", "v_proj"], False, invocation, 799)  # new files, old name
    base = _save(base, refs / "hub", 8, ["k_proj", "o_proj"], False, invocation, 798)
    base = _save(base, refs / "manual", 8, ["q_proj"], False, invocation, 797)
    base = _save(base, refs / "rank128", 128, ["q_proj"], False, invocation, 796)
    for name in DISTINCT:
        shutil.copytree(refs / name, src / name)
    shutil.copytree(refs / "rank128", src / "rank128")
    shutil.copytree(refs / "r8_qv", src / "malformed")
    weights = src / "malformed" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    config = json.loads((refs / "r8_qv" / "adapter_config.json").read_text())
    for i in range(NUM_BULK):  # one weight file, a config (and so an identity) each
        d = src / f"bulk-{i:04d}"
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps({**config, "revision": f"bulk-{i}"}))
        os.link(refs / "r8_qv" / "adapter_model.safetensors", d / "adapter_model.safetensors")
    repo = hub / ("models--" + HUB_NAME.replace("/", "--"))
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(refs / "hub" / f, repo / "blobs" / f)
        (snap / f).symlink_to(repo / "blobs" / f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    return src, hub, refs


@pytest.fixture(scope="module")
def server(model_path, layout):
    src, hub, _ = layout
    handle = start_server(model_path, [
        "--max-lora-rank", "64", "--lora-target-modules", "all", "--max-loras-per-batch", "4",
        "--radix-cache-backend", "multilora", "--multilora-adapter-source", str(src),
        "--multilora-adapter-source", f"hf-cache:{hub}", "--multilora-host-adapter-gb", str(HOST_GB),
        "--multilora-check-invariants",
    ], name="e2e_on_demand", max_total_tokens=6000)
    yield handle
    handle.stop()


def tiers(server) -> dict:
    res = requests.get(server.url + "/multilora/stats", timeout=60)
    assert res.status_code == 200, res.text
    return res.json()["adapter_tiers"]


def post(server, lora, ids) -> requests.Response:
    return requests.post(server.url + "/generate", json={
        "input_ids": ids, "lora_path": lora,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0}}, timeout=300)


def prompt(tokenizer, name, seed):
    ids = random_ids(tokenizer, 40, seed)
    if name == "alora_v":
        ids += tokenizer(INVOCATION, add_special_tokens=False).input_ids
    return ids


def test_first_requests_resolve_each_adapter_once_and_match_peft(server, layout, tokenizer, oracle):
    _, _, refs = layout
    names = [*DISTINCT, HUB_NAME, "bulk-0007", "bulk-0123"]
    ref_of = {**{n: refs / n for n in DISTINCT}, HUB_NAME: refs / "hub", "bulk-0007": refs / "r8_qv",
              "bulk-0123": refs / "r8_qv"}
    # two concurrent first requests per adapter, on one prompt (the oracle computes each adapter once)
    jobs = [(name, prompt(tokenizer, name, 40)) for name in names for _ in range(2)] + [(None, prompt(tokenizer, None, 40))]
    before = tiers(server)
    assert before["host"]["adapters"] == 0 and before["source"]["loads"] == 0  # nothing read at start-up
    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda job: generate(server, job[0], job[1], NEW_TOKENS), jobs))
    oracle.prefetch([(str(ref_of[n]) if n else None, ids, NEW_TOKENS) for n, ids in jobs], ignore_eos=True)
    for (name, ids), out in zip(jobs, outs):
        expected = oracle.greedy(str(ref_of[name]) if name else None, ids, NEW_TOKENS, ignore_eos=True)
        assert_matches(out, expected, f"on demand {name}")
        if name in DISTINCT or name == HUB_NAME:  # the random adapter visibly changes the output
            assert expected.tokens != oracle.greedy(None, ids, NEW_TOKENS, ignore_eos=True).tokens, name
    after = tiers(server)
    assert after["source"]["loads"] == len(names), after  # concurrent first requests for one adapter: one read
    assert after["source"]["refused"] == 0 and after["source"]["failed_loads"] == 0, after
    last = after["source"]["last_load"]
    assert {"adapter", "source", "resolve_s", "read_s", "load_s"} <= set(last), last


def test_bad_names_and_bad_adapters_are_refused_by_name_while_the_server_serves(server, tokenizer):
    ids = random_ids(tokenizer, 30, 77)
    with ThreadPoolExecutor(2) as pool:
        ok = pool.submit(generate, server, "r8_qv", random_ids(tokenizer, 60, 78), NEW_TOKENS)
        cases = {
            "nope": "LoRA adapter 'nope' is not loaded and no adapter source holds it",
            "../src/r8_qv": "is not a valid adapter name",
            "/etc/passwd": "is not a valid adapter name",
            "malformed": "malformed",
            "rank128": "rank128",
            "acme/missing": "LoRA adapter 'acme/missing' is not loaded",
        }
        for name, message in cases.items():
            res = post(server, name, ids)
            assert res.status_code == 400 and message in res.text, (name, res.status_code, res.text)
            assert "bulk-" not in res.text and "r64_q" not in res.text  # other adapters' names are not listed
        assert ok.result(timeout=300)["meta_info"]["completion_tokens"] == NEW_TOKENS
    t = tiers(server)
    assert t["source"]["refused"] >= 3 and t["source"]["failed_loads"] >= 1, t
    res = requests.post(server.url + "/v1/completions", json={
        "model": "served:bulk-0042", "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0},
        timeout=300)
    assert res.status_code == 200, res.text


def test_host_budget_drops_least_recent_and_a_dropped_adapter_comes_back(server, layout, tokenizer, oracle):
    _, _, refs = layout
    budget = HOST_GB * 1e9
    for name in ("r64_q", "r16_mlp", "r64_q"):
        generate(server, name, random_ids(tokenizer, 30, 90), 2)
    t = tiers(server)
    assert t["host"]["drops"] >= 1 and t["host"]["bytes"] <= budget, t
    metrics = requests.get(server.url + "/multilora/metrics", timeout=60).text
    assert f"sgl_multilora_host_adapter_drops_total {float(t['host']['drops'])}" in metrics, metrics[-2000:]
    dropped = next(n for n in ("r8_qv", "alora_v", "bulk-0007", "r64_q") if n not in t["host"]["resident"])
    ids = prompt(tokenizer, dropped, 91)
    loads = t["source"]["loads"]
    ref = refs / ("r8_qv" if dropped.startswith("bulk") else dropped)
    assert_matches(generate(server, dropped, ids, NEW_TOKENS), oracle.greedy(str(ref), ids, NEW_TOKENS,
                                                                            ignore_eos=True), f"reloaded {dropped}")
    assert tiers(server)["source"]["loads"] == loads + 1


def test_changed_files_are_new_weights_and_a_user_unload_is_final(server, layout, tokenizer, oracle):
    src, _, refs = layout
    res = requests.post(server.url + "/unload_lora_adapter", json={"lora_name": "r8_qv"}, timeout=300)
    assert res.status_code == 200 or "not loaded" in res.text or "does not exist" in res.text, res.text
    shutil.rmtree(src / "r8_qv")
    shutil.copytree(refs / "r8_qv_v2", src / "r8_qv")
    ids = random_ids(tokenizer, 40, 95)
    served = generate(server, "r8_qv", ids, NEW_TOKENS)
    assert_matches(served, oracle.greedy(str(refs / "r8_qv_v2"), ids, NEW_TOKENS, ignore_eos=True), "changed files")
    assert served["meta_info"]["output_token_logprobs"] != generate(server, "bulk-0011", ids, NEW_TOKENS)[
        "meta_info"]["output_token_logprobs"]  # bulk-* still serve the old weights file

    # loaded by path, outside every source, then unloaded: gone for good, not reloaded from its old path
    res = requests.post(server.url + "/load_lora_adapter", json={"lora_name": "manual",
                                                                 "lora_path": str(refs / "manual")}, timeout=300)
    assert res.status_code == 200, res.text
    assert post(server, "manual", ids).status_code == 200
    res = requests.post(server.url + "/unload_lora_adapter", json={"lora_name": "manual"}, timeout=300)
    assert res.status_code == 200, res.text
    res = post(server, "manual", ids)
    assert res.status_code == 400 and "LoRA adapter 'manual' is not loaded" in res.text, res.text

    shutil.rmtree(src / "r16_mlp")  # removed from the source: served while its copy is held, then refused
    requests.post(server.url + "/unload_lora_adapter", json={"lora_name": "r16_mlp"}, timeout=300)
    res = post(server, "r16_mlp", ids)
    assert res.status_code == 400 and "r16_mlp" in res.text, res.text
    assert generate(server, None, ids, 2)["meta_info"]["completion_tokens"] == 2
