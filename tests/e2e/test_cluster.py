"""End to end: two plugin workers behind SGLang's router `smg` with our LoRA-aware placement in front
(`sgl_multilora.gateway.launch.Cluster(policy="lora_aware")`: gateway/app.py + smg's consistent_hashing policy).

Through the cluster, `/generate` with and without `lora_path` returns the greedy tokens a worker returns directly;
requests of one (adapter, prefix) land on one worker, distinct prompts reach both, and the gateway's choice is the
worker that answers (smg honours its routing header). The OpenAI API with `model="<served>:<adapter>"` answers as
the worker does, where smg alone answers 404 (it routes by the `model` field to workers registered under that id,
and an adapter is no registered id): that limitation is pinned here so a change in smg shows. The cluster view
lists placements and every worker's memory. Stopping the cluster leaves no process.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import tempfile
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import requests

from tests.conftest import LORA_SERVER_ARGS, REPO
from tests.e2e.served import wait_idle
from tests.oracle import assert_matches, logprob_fields

pytest.importorskip("smg", reason="the router `smg` is not installed (requirements/cpu.lock pins it)")

pytestmark = pytest.mark.e2e

MAX_NEW_TOKENS = 6
# The workers run with an API key, as a production cluster does: the router, the gateway and every worker want it.
API_KEY = "e2e-cluster-api-key"
http = requests.Session()  # what a client of the cluster uses: the key on every request
http.headers["Authorization"] = f"Bearer {API_KEY}"


@pytest.fixture(scope="module")
def cluster(model_path):
    from sgl_multilora.gateway.launch import Cluster
    from sgl_multilora.server import cpu_server_args

    worker_args = ["--model-path", model_path, *cpu_server_args(max_total_tokens=4096), *LORA_SERVER_ARGS,
                   "--radix-cache-backend", "multilora", "--api-key", API_KEY]
    handle = Cluster(2, worker_args, policy="lora_aware", log_dir=REPO / ".pytest_cache" / "e2e_cluster")
    with handle:
        yield handle


def generate(url: str, ids: list[int], lora: str | None) -> tuple[list[int], str | None]:
    body = {"input_ids": ids, "lora_path": lora,
            "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
    res = http.post(url + "/generate", json=body, timeout=300)
    assert res.status_code == 200, res.text
    return res.json()["output_ids"], res.headers.get("x-smg-routed-worker-id")


def migrate(cluster, **body) -> requests.Response:
    """`POST /cluster/migrate`: it moves other clients' requests, so it wants the admin key."""
    return http.post(cluster.url + "/cluster/migrate", json=body, headers=cluster.admin_headers, timeout=60)


def chat(url: str, model: str) -> requests.Response:
    return http.post(url + "/v1/chat/completions", timeout=300, json={
        "model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": MAX_NEW_TOKENS, "temperature": 0})


def test_generate_through_cluster_equals_worker(cluster, manifest, tokenizer):
    prompts = {e["name"]: tokenizer(e["example_input_text"], add_special_tokens=False)["input_ids"]
               for e in manifest if e["kind"] == "lora"}
    direct = {}
    for lora in [None, "caps", "json"]:
        ids = prompts[lora or "caps"]
        direct[lora], _ = generate(cluster.worker_urls[0], ids, lora)
        workers = set()
        for _ in range(2):
            tokens, worker = generate(cluster.url, ids, lora)
            assert tokens == direct[lora], f"adapter {lora}: cluster {tokens} != worker {direct[lora]}"
            workers.add(worker.rstrip("/"))
        assert len(workers) == 1, f"one (adapter, prefix) went to several workers: {workers}"
    assert direct[None] != direct["caps"], "caps changed nothing on its own prompt: lora_path was not applied"


def test_every_front_wants_the_api_key_and_the_gateway_presents_it(cluster, tokenizer):
    """Workers started with `--api-key`: the gateway, smg and each worker answer 401 without it (probes stay open);
    the gateway's own calls carry it (its view reads every worker's memory); moving a request wants the admin key."""
    ids = tokenizer("Keys guard the cluster.", add_special_tokens=False)["input_ids"]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
    for url in (cluster.url, cluster.router_url, *cluster.worker_urls):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            assert requests.post(url + "/generate", json=body, headers=headers, timeout=60).status_code == 401, url
    for path in ("/cluster/stats", "/v1/models"):
        assert requests.get(cluster.url + path, timeout=60).status_code == 401, path
    assert requests.post(cluster.url + "/v1/chat/completions", timeout=60, json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}]}).status_code == 401
    assert requests.get(cluster.url + "/health", timeout=60).status_code == 200
    # the API key does not move requests: /cluster/migrate wants the admin key (an unknown rid then gets 404)
    assert http.post(cluster.url + "/cluster/migrate", json={"rid": "nobody"}, timeout=60).status_code == 401
    assert migrate(cluster, rid="nobody").status_code == 404
    assert http.post(cluster.url + "/generate", json=body, timeout=300).status_code == 200
    view = http.get(cluster.url + "/cluster/stats", timeout=60).json()
    assert all("error" not in w and w["kv"]["total"] for w in view["workers"]), view["workers"]


def test_distinct_prompts_spread_and_land_where_placed(cluster, tokenizer):
    routed = set()
    for i in range(12):
        ids = tokenizer(f"Question {i}: name a city in country number {i}.", add_special_tokens=False)["input_ids"]
        _, worker = generate(cluster.url, ids, None)
        routed.add(worker.rstrip("/"))
    assert routed == set(cluster.worker_urls), f"12 distinct base prompts all went to {routed}"
    view = http.get(cluster.url + "/cluster/stats", timeout=60).json()
    placement = view["placement"]
    assert set(placement["workers_of"]) >= {"caps", "json"}
    assert sum(placement["routed"].values()) >= 12 + 6
    assert view["relearned_order"] == 0, "smg answered from another worker than the gateway chose"
    for worker in view["workers"]:
        assert worker["kv"]["total"] == 4096 and worker["adapters"]["loaded"] >= 5, worker
    assert sorted(placement["alora"]) == sorted(["check_caps", "rate_length"])


def test_openai_api_through_cluster(cluster):
    served = http.get(cluster.worker_urls[0] + "/v1/models", timeout=60).json()["data"][0]["id"]
    for model in (served, f"{served}:caps"):
        direct, routed = chat(cluster.worker_urls[0], model), chat(cluster.url, model)
        assert direct.status_code == routed.status_code == 200, routed.text
        assert routed.json()["choices"][0]["message"] == direct.json()["choices"][0]["message"], model
    assert chat(cluster.url, served).json()["choices"][0]["message"] != \
        chat(cluster.url, f"{served}:caps").json()["choices"][0]["message"], "the adapter was dropped"
    adapter = chat(cluster.router_url, f"{served}:caps")  # smg alone
    assert adapter.status_code == 404 and "model_not_found" in adapter.text, adapter.text


def sse(response: requests.Response) -> Iterator[dict]:
    """The chunks of a streamed `/generate` answer, until [DONE]."""
    for line in response.iter_lines():
        if line.startswith(b"data:"):
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            yield json.loads(data)


def assert_one_stream(chunks: list[dict], num_tokens: int) -> dict:
    """Every chunk extends the one before (no gap, no repeated token); the last holds all the tokens."""
    assert chunks and all("error" not in c for c in chunks), chunks[-1:]
    for before, after in itertools.pairwise(chunks):
        n = len(before["output_ids"])
        assert after["output_ids"][:n] == before["output_ids"], (before["output_ids"], after["output_ids"])
        assert after["text"].startswith(before["text"]), (before["text"], after["text"])
    assert len(chunks[-1]["output_ids"]) == num_tokens
    return chunks[-1]


def test_request_moved_mid_generation_continues_its_stream(cluster, manifest, tokenizer, oracle):
    caps = next(e for e in manifest if e["name"] == "caps")
    ids = tokenizer(caps["example_input_text"], add_special_tokens=False)["input_ids"]
    n = 64
    body = {"input_ids": ids, "lora_path": "caps", **logprob_fields(),
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    chunks, moved = [], None
    with http.post(cluster.url + "/generate", json={**body, "rid": "move-me", "stream": True}, stream=True,
                       timeout=300) as r:
        assert r.status_code == 200, r.text
        for chunk in sse(r):
            chunks.append(chunk)
            if moved is None and len(chunk["output_ids"]) >= 4:
                moved = migrate(cluster, rid="move-me", kind="recompute")
                assert moved.status_code == 202, moved.text
    final = assert_one_stream(chunks, n)
    src, dst = moved.json()["from"], moved.json()["to"]
    migrations = final["meta_info"]["migrations"]
    assert [(m["from"], m["to"], m["kind"]) for m in migrations] == [(src, dst, "recompute")], migrations
    assert 4 <= migrations[0]["at_token"] < n, migrations  # moved mid-generation, not before or after
    assert final["meta_info"]["completion_tokens"] == n and final["meta_info"]["prompt_tokens"] == len(ids)
    direct = http.post(cluster.worker_urls[src] + "/generate", json=body, timeout=300).json()
    assert final["output_ids"] == direct["output_ids"] and final["text"] == direct["text"]
    assert_matches(final, oracle.greedy(caps["path"], ids, n, ignore_eos=True), "caps moved mid-generation")
    view = http.get(cluster.url + "/cluster/stats", timeout=60).json()
    assert view["migrations"]["recompute"] >= 1 and view["carried"] == 0
    gone = migrate(cluster, rid="move-me")
    assert gone.status_code == 404 and "no running request" in gone.text


@pytest.mark.parametrize("name", ["caps", "check_caps"])  # a LoRA, and an aLoRA (base prefix + adapter suffix)
def test_request_moved_with_its_kv_reuses_it_and_matches_peft(cluster, manifest, tokenizer, oracle, name):
    """A KV move: the source's cached KV of the request is imported at the destination, which computes only what
    did not arrive; the output is a single worker's and PEFT's, and the destination's accounting closes."""
    caps = next(e for e in manifest if e["name"] == name)
    ids = tokenizer("Moving KV: " + caps["example_input_text"], add_special_tokens=False)["input_ids"]
    n = 48
    rid = f"move-kv-{name}"
    body = {"input_ids": ids, "lora_path": name, **logprob_fields(),
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    chunks, moved = [], None
    with http.post(cluster.url + "/generate", json={**body, "rid": rid, "stream": True}, stream=True,
                       timeout=300) as r:
        assert r.status_code == 200, r.text
        for chunk in sse(r):
            chunks.append(chunk)
            if moved is None and len(chunk["output_ids"]) >= 6:
                moved = migrate(cluster, rid=rid, kind="kv")
                assert moved.status_code == 202, moved.text
    final = assert_one_stream(chunks, n)
    src, dst = moved.json()["from"], moved.json()["to"]
    [move] = final["meta_info"]["migrations"]
    assert (move["from"], move["to"], move["kind"]) == (src, dst, "kv"), move
    held = len(ids) + move["at_token"]  # prompt and output at the abort; the last token's KV is not computed yet
    assert held - 1 <= move["kv_tokens"] <= held and move["kv_bytes"] > 0 and move["kv_route"] == "pulled", move
    # the destination computes at least the last token itself; everything before it came from the import
    assert final["meta_info"]["cached_tokens"] >= min(move["kv_tokens"], held - 1), (final["meta_info"], move)
    direct = http.post(cluster.worker_urls[src] + "/generate", json=body, timeout=300).json()
    assert final["output_ids"] == direct["output_ids"] and final["text"] == direct["text"]
    assert_matches(final, oracle.greedy(caps["path"], ids, n, ignore_eos=True), f"{name} moved with its KV")
    view = http.get(cluster.url + "/cluster/stats", timeout=60).json()
    assert view["migrations"]["kv"] >= 1 and view["kv_transfer"]["tokens"] > 0, view["kv_transfer"]
    assert view["kv_transfer"]["pulled"] >= 1 and view["kv_transfer"]["relayed"] == 0, view["kv_transfer"]  # worker to worker
    m = wait_idle(SimpleNamespace(url=cluster.worker_urls[dst], headers=cluster.client_headers))
    slots = m["unified_pool"]["slots"]
    assert m["cache_protected"] == 0 and m["free"] + m["cache_evictable"] == m["total"], m
    assert slots["free"] + slots["adapter"] + slots["kv_cached"] == m["total"], slots
    assert slots["kv_cached"] == m["unified_pool"]["tree_kv_tokens"], m["unified_pool"]


def test_openai_completion_moved_mid_generation_answers_as_the_worker_does(cluster, manifest):
    """An OpenAI /v1/completions request naming an adapter is carried as well: moved with its KV mid-stream, its
    client gets the deltas, finish reason and usage a worker's own /v1/completions gives, without a gap."""
    served = http.get(cluster.worker_urls[0] + "/v1/models", timeout=60).json()["data"][0]["id"]
    caps = next(e for e in manifest if e["name"] == "caps")
    n = 40
    body = {"model": f"{served}:caps", "prompt": "OpenAI move: " + caps["example_input_text"], "max_tokens": n,
            "temperature": 0, "ignore_eos": True}
    direct = http.post(cluster.worker_urls[0] + "/v1/completions", json=body, timeout=300).json()
    with http.post(cluster.worker_urls[0] + "/v1/completions", json={**body, "stream": True}, stream=True,
                       timeout=300) as r:
        direct_chunks = list(sse(r))
    chunks, moved, rid = [], None, "move-openai"
    with http.post(cluster.url + "/v1/completions", stream=True, timeout=300, json={
            **body, "rid": rid, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.text
        for chunk in sse(r):
            chunks.append(chunk)
            if moved is None and len("".join(c["choices"][0]["text"] for c in chunks if c["choices"])) >= 8:
                moved = migrate(cluster, rid=rid, kind="kv")
                assert moved.status_code == 202, moved.text
    assert moved is not None and all("error" not in c for c in chunks), chunks[-1:]
    *content, usage = chunks
    assert "".join(c["choices"][0]["text"] for c in content) == direct["choices"][0]["text"]
    reasons = [c["choices"][0]["finish_reason"] for c in content]
    assert reasons[-1] == direct["choices"][0]["finish_reason"] == "length" and set(reasons[:-1]) == {None}
    assert {c["id"] for c in content} == {usage["id"]} and all(c["object"] == "text_completion" for c in chunks)
    # the usage chunk leaves out what is unset, as the worker's does
    assert usage["choices"] == [] and usage["usage"] == {k: v for k, v in direct["usage"].items() if v is not None}
    assert set(content[0]) == set(direct_chunks[0]) and set(content[0]["choices"][0]) == set(
        direct_chunks[0]["choices"][0]), (content[0], direct_chunks[0])  # the worker's own objects
    view = http.get(cluster.url + "/cluster/stats", timeout=60).json()
    assert view["migrations"]["kv"] >= 1 and view["carried"] == 0
    # not moved, not streamed: the worker's own answer but for its id and time
    routed = http.post(cluster.url + "/v1/completions", json=body, timeout=300).json()
    assert {k: v for k, v in routed.items() if k not in ("id", "created")} == \
        {k: v for k, v in direct.items() if k not in ("id", "created")}
    # served, not carried: what a move could not continue exactly (a penalty counts the output so far)
    penalised = http.post(cluster.url + "/v1/completions", json={**body, "frequency_penalty": 0.5}, timeout=300)
    assert penalised.status_code == 200 and penalised.json()["choices"][0]["text"], penalised.text


def test_chat_completion_moved_mid_generation_answers_as_the_worker_does(cluster):
    """A plain OpenAI chat completion naming an adapter is carried too, its native body built by a worker's own chat
    route (template, tokenizer, defaults): moved with its KV mid-stream, its client gets the role chunk, the content
    deltas, the finish chunk and the usage a worker's own /v1/chat/completions gives, without a gap. A chat request
    the gateway's view could not write (two choices) is served by a worker's chat route, not carried."""
    served = http.get(cluster.worker_urls[0] + "/v1/models", timeout=60).json()["data"][0]["id"]
    n = 40
    body = {"model": f"{served}:caps", "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "system", "content": "You answer briefly."},
                         {"role": "user", "content": "Chat move: name the planets of the solar system."}]}
    before = http.get(cluster.url + "/cluster/stats", timeout=60).json()["chat"]
    direct = http.post(cluster.worker_urls[0] + "/v1/chat/completions", json=body, timeout=300).json()
    with http.post(cluster.worker_urls[0] + "/v1/chat/completions", stream=True, timeout=300,
                       json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        direct_chunks = list(sse(r))
    chunks, moved, rid = [], None, "move-chat"
    with http.post(cluster.url + "/v1/chat/completions", stream=True, timeout=300, json={
            **body, "rid": rid, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.text
        for chunk in sse(r):
            chunks.append(chunk)
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            if moved is None and len(text) >= 8:
                moved = migrate(cluster, rid=rid, kind="kv")
                assert moved.status_code == 202, moved.text
    assert moved is not None and all("error" not in c for c in chunks), chunks[-1:]
    role, *content, finish, usage = chunks
    assert role["choices"][0]["delta"] == direct_chunks[0]["choices"][0]["delta"] == {
        "reasoning_content": None, "role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"]["content"] for c in content) == direct["choices"][0]["message"]["content"]
    assert finish == {**direct_chunks[-2], "id": finish["id"], "created": finish["created"]}  # the worker's own
    assert finish["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"] == direct["usage"]
    assert {c["id"] for c in chunks} == {usage["id"]} and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all(set(c) == set(direct_chunks[1]) and set(c["choices"][0]) == set(direct_chunks[1]["choices"][0])
               for c in content), (content[0], direct_chunks[1])
    view = http.get(cluster.url + "/cluster/stats", timeout=60).json()
    assert view["migrations"]["kv"] >= 1 and view["carried"] == 0
    # not moved, not streamed: the worker's own answer but for its id and time
    routed = http.post(cluster.url + "/v1/chat/completions", json=body, timeout=300).json()
    assert {k: v for k, v in routed.items() if k not in ("id", "created")} == \
        {k: v for k, v in direct.items() if k not in ("id", "created")}
    two = http.post(cluster.url + "/v1/chat/completions", json={**body, "n": 2, "max_tokens": 4}, timeout=300)
    assert two.status_code == 200 and len(two.json()["choices"]) == 2, two.text
    after = http.get(cluster.url + "/cluster/stats", timeout=60).json()["chat"]
    assert after["carried"] - before["carried"] == 2, (before, after)
    assert after["passed"].get("n > 1", 0) - before["passed"].get("n > 1", 0) == 1, (before, after)


def test_bad_input_of_a_carried_request_gets_the_workers_error_and_status(cluster):
    """A prompt longer than the model's context, carried natively or as an OpenAI completion, streamed or not: the
    client gets the status and the error a worker itself answers (OpenAI's error object on the OpenAI route)."""
    too_long = [100] * 9000  # SmolLM2's context is 8,192 tokens
    native = {"input_ids": too_long, "sampling_params": {"max_new_tokens": 4}}
    direct = http.post(cluster.worker_urls[0] + "/generate", json=native, timeout=300)
    routed = http.post(cluster.url + "/generate", json=native, timeout=300)
    assert direct.status_code == routed.status_code == 400, (direct.text, routed.text)
    assert routed.json()["error"]["message"] == direct.json()["error"]["message"]
    assert "context length" in routed.json()["error"]["message"]
    for stream in (False, True):
        body = {"model": http.get(cluster.worker_urls[0] + "/v1/models", timeout=60).json()["data"][0]["id"],
                "prompt": too_long, "max_tokens": 4, "stream": stream}
        direct = http.post(cluster.worker_urls[0] + "/v1/completions", json=body, timeout=300)
        routed = http.post(cluster.url + "/v1/completions", json=body, timeout=300)
        assert direct.status_code == routed.status_code == 400, (stream, direct.text, routed.text)
        assert routed.json() == direct.json(), stream
    assert http.get(cluster.url + "/cluster/stats", timeout=60).json()["carried"] == 0


def test_kv_routes_are_admin_only_and_refuse_what_does_not_fit(cluster, tokenizer):
    """Export and import read and write any tenant's cache: admin key only. An import whose adapter identity is not
    loaded, whose layout differs, or that is not a KV export at all is refused with a message saying so."""
    from safetensors import safe_open
    from safetensors.torch import load, save

    a, b = cluster.worker_urls
    admin = cluster.admin_headers
    ids = tokenizer("Admin routes guard the cache of every tenant.", add_special_tokens=False)["input_ids"]
    generate(a, ids, "json")
    export = {"input_ids": ids, "lora_path": "json"}
    for route, kwargs in (("export", {"json": export}), ("import", {"data": b"x"})):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = requests.post(f"{a}/multilora/kv/{route}", headers=headers, timeout=60, **kwargs)
            assert r.status_code == 401, (route, headers, r.status_code, r.text)
    r = http.post(a + "/multilora/kv/export", json=export, headers=admin, timeout=60)
    assert r.status_code == 200 and int(r.headers["X-Multilora-KV-Tokens"]) == len(ids), (r.status_code, r.text)
    data = r.content
    unknown = http.post(a + "/multilora/kv/export", json={**export, "lora_path": "nope"}, headers=admin,
                            timeout=60)
    assert unknown.status_code == 400 and "'nope' is not loaded" in unknown.text, unknown.text

    def reimport(tensors, **metadata) -> requests.Response:
        with tempfile.NamedTemporaryFile() as f:
            f.write(data)
            f.flush()
            with safe_open(f.name, framework="pt") as g:
                meta = {**g.metadata(), **metadata}
        return http.post(b + "/multilora/kv/import", data=save(tensors, metadata=meta), headers=admin,
                             timeout=60)

    tensors = load(data)
    foreign = reimport(tensors, adapter_identity=json.dumps("0" * 64))
    assert foreign.status_code == 400 and "no adapter with the KV's identity" in foreign.text, foreign.text
    cut = reimport({"k": tensors["k"][1:], "v": tensors["v"][1:]})
    assert cut.status_code == 400 and "differs" not in cut.text and "must be" in cut.text, cut.text
    garbage = http.post(b + "/multilora/kv/import", data=b"not a KV export", headers=admin, timeout=60)
    assert garbage.status_code == 400 and "safetensors" in garbage.text, garbage.text
    ok = http.post(b + "/multilora/kv/import", data=data, headers=admin, timeout=60)
    assert ok.status_code == 200 and ok.json()["imported"] + ok.json()["cached"] == len(ids), ok.text
    again = http.post(b + "/multilora/kv/import", data=data, headers=admin, timeout=60).json()
    assert again["imported"] == 0 and again["cached"] == len(ids), again  # never written twice
    hit = http.post(b + "/generate", timeout=300, json={
        "input_ids": ids, "lora_path": "json", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).json()
    assert hit["meta_info"]["cached_tokens"] == len(ids) - 1, hit["meta_info"]
    # server to server: b pulls a's export itself (with its own admin key); bad sources are named
    pull = {"input_ids": ids, "lora_path": "json"}
    for source, says in (("file:///etc/passwd", "must be a server's http(s) URL"),
                         ("http://127.0.0.1:9", "could not pull the KV export from http://127.0.0.1:9")):
        bad = http.post(b + "/multilora/kv/import", json={"from": source, "export": pull}, headers=admin, timeout=60)
        assert bad.status_code == 400 and says in bad.text, bad.text
    assert http.post(b + "/flush_cache", headers=admin, timeout=60).status_code == 200
    pulled = http.post(b + "/multilora/kv/import", json={"from": a, "export": pull}, headers=admin, timeout=60)
    assert pulled.status_code == 200, pulled.text
    assert pulled.json()["imported"] == len(ids) and pulled.json()["bytes"] == len(data), pulled.json()


def test_mell_balancer_moves_a_growing_request_and_outputs_stay_exact(cluster, tokenizer):
    """`--balancer mell` on a packing capacity of 100 tokens per worker: two 40-token prompts are packed onto one
    worker (MELL fills instances), and as both grow past the capacity together the packer's Update moves one of them
    to another worker mid-generation; both outputs equal a single worker's, and the packing empties when they end."""
    from concurrent.futures import ThreadPoolExecutor

    saved = cluster.gateway_args
    cluster.gateway_args = [*saved, "--balancer", "mell", "--balance-fill", str(100 / 4096)]
    cluster.set_policy("lora_aware")  # a new gateway with the balancer; the workers stay
    try:
        prompts = [tokenizer(f"Balancer story {i}: the lighthouse keeper counted ships until dawn, and",
                             add_special_tokens=False)["input_ids"] for i in range(2)]
        prompts = [(p * 4)[:40] for p in prompts]
        n = 48

        def run(ids, url):
            return http.post(url + "/generate", timeout=300, json={
                "input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}})

        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda ids: run(ids, cluster.url), prompts))
        view = http.get(cluster.url + "/cluster/stats", timeout=60).json()
        balancer = view["balancer"]
        assert balancer["policy"] == "mell" and balancer["capacity_tokens"] == 100, balancer
        moved = [a.json()["meta_info"].get("migrations") for a in answers]
        assert balancer["moves_started"] >= 1 and any(moved), (balancer, moved)
        assert balancer["peak_workers_in_use"] == 2 and balancer["max_unit_moves_per_op"] <= 10, balancer
        for ids, answer in zip(prompts, answers):
            direct = run(ids, cluster.worker_urls[0]).json()
            assert answer.json()["output_ids"] == direct["output_ids"], answer.json()["meta_info"]
        deadline = time.monotonic() + 10  # the last Departs are applied at the next epoch
        while balancer["tracked"] or balancer["instances"]:
            assert time.monotonic() < deadline, balancer
            time.sleep(0.5)
            balancer = http.get(cluster.url + "/cluster/stats", timeout=60).json()["balancer"]
    finally:
        cluster.gateway_args = saved
        cluster.set_policy("lora_aware")


def test_worker_stopped_mid_request_finishes_elsewhere_and_comes_back(cluster):
    n = 64
    body = {"text": "Tell a long story about a lighthouse keeper and the sea.",
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    expected = http.post(cluster.worker_urls[0] + "/generate", json=body, timeout=300).json()
    chunks = []
    with http.post(cluster.url + "/generate", json={**body, "stream": True}, stream=True, timeout=300) as r:
        victim = cluster.worker_urls.index(r.headers["x-smg-routed-worker-id"].rstrip("/"))
        for chunk in sse(r):
            chunks.append(chunk)
            if len(chunks) == 3:
                os.killpg(cluster.workers[victim].process.pid, signal.SIGKILL)
    final = assert_one_stream(chunks, n)
    assert final["output_ids"] == expected["output_ids"] and final["text"] == expected["text"]
    assert [(m["from"], m["kind"]) for m in final["meta_info"]["migrations"]] == [(victim, "failover")]
    view = http.get(cluster.url + "/cluster/stats", timeout=60).json()
    assert view["down"] == [victim] and view["migrations"]["failover"] == 1, view
    survivor = cluster.worker_urls[1 - victim]
    for i in range(3):  # new requests go to the worker that is left
        res = http.post(cluster.url + "/generate", timeout=300, json={
            "text": f"Question {i}: name a river.", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        assert res.status_code == 200 and res.headers["x-smg-routed-worker-id"].rstrip("/") == survivor, res.text

    cluster.restart_worker(victim)  # back: the gateway sees its health and routes to it again
    deadline = time.monotonic() + 120
    while http.get(cluster.url + "/cluster/stats", timeout=60).json()["down"] and time.monotonic() < deadline:
        time.sleep(1.0)
    assert http.get(cluster.url + "/cluster/stats", timeout=60).json()["down"] == []
    routed = set()
    for i in range(12):
        res = http.post(cluster.url + "/generate", timeout=300, json={
            "text": f"Question {i}: name a mountain in country {i}.", "sampling_params": {"max_new_tokens": 2}})
        assert res.status_code == 200, res.text
        routed.add(res.headers["x-smg-routed-worker-id"].rstrip("/"))
    assert routed == set(cluster.worker_urls), f"the restarted worker gets no traffic: {routed}"


def test_stop_leaves_no_process(cluster):
    handles = [*cluster.workers, cluster.router, cluster.gateway]
    groups = [h.process.pid for h in handles]  # each started its own process group
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
    assert not any(h.alive() for h in handles)
