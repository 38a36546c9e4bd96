"""The LoRA server end to end over real ZMQ sockets (ipc:// in a tmp dir), against PEFT as the oracle.

A tiny random Llama (2 layers, hidden 32) and three PEFT adapters of different ranks and targets, written by peft
with `init_lora_weights=False`. Every delta is compared with PEFT's own module output minus its base layer's output
(the adapters loaded back from the files the server read). After every scenario the server's slot pool passes
`check_invariants` (asked for over the wire, between calls).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import pytest
import torch
import zmq

from sgl_multilora.adapters import read_spec
from sgl_multilora.lora_server import LoRAServerClient, LoRAServerError, LoRAServerUnavailable
from sgl_multilora.lora_server.catalog import Catalog, ServerModel
from sgl_multilora.lora_server.protocol import VERSION, tensor_frame
from sgl_multilora.lora_server.server import LoRAServer
from sgl_multilora.lora_server.slots import SlotPool

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ADAPTERS = {  # name -> (rank, alpha, targets, rslora)
    "a": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
    "b": (16, 8, ["q_proj", "v_proj", "gate_proj", "down_proj"], True),
    "c": (8, 4, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
}
GROUP_MODULES = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
                 "down": ("down_proj",)}


def tiny_llama_config():
    return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2)


def write_adapter(model_cls, config, path: Path, rank: int, alpha: int, targets: list[str], rslora: bool,
                  seed: int, **extra) -> None:
    torch.manual_seed(seed)
    lc = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                         init_lora_weights=False, **extra)
    peft.get_peft_model(model_cls(config), lc).save_pretrained(str(path))
    inner = path / "default"  # older peft versions write into a sub-directory when an adapter name is given
    assert (path / "adapter_config.json").is_file() or inner.is_dir()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(model_dir, adapter_dir, peft oracle model with adapters a, b, c)."""
    root = tmp_path_factory.mktemp("lora_server")
    config = tiny_llama_config()
    model_dir = root / "model"
    config.save_pretrained(str(model_dir))
    adapter_dir = root / "adapters"
    for seed, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        write_adapter(transformers.LlamaForCausalLM, config, adapter_dir / name, rank, alpha, targets, rslora, seed)
    torch.manual_seed(123)
    base = transformers.LlamaForCausalLM(config)
    oracle = peft.PeftModel.from_pretrained(base, str(adapter_dir / "a"), adapter_name="a")
    for name in ("b", "c"):
        oracle.load_adapter(str(adapter_dir / name), adapter_name=name)
    return model_dir, adapter_dir, oracle


def expected_delta(oracle, adapter: str, layer: int, group: str, x: torch.Tensor) -> torch.Tensor:
    """PEFT's output of each module of `group` minus its base layer's, concatenated (zeros where not targeted)."""
    oracle.set_adapter(adapter)
    layer_mod = oracle.base_model.model.model.layers[layer]
    parts = []
    for module in GROUP_MODULES[group]:
        mod = getattr(layer_mod.self_attn if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))
                      else layer_mod.mlp, module)
        with torch.no_grad():
            parts.append(mod(x) - mod.base_layer(x) if hasattr(mod, "base_layer") else torch.zeros(
                x.shape[0], mod.out_features))
    return torch.cat(parts, dim=1)


def start_server(model_dir, adapter_dir, address, max_slots=2, policy="lru") -> LoRAServer:
    model = ServerModel.from_config(model_dir)
    catalog = Catalog.from_dir(adapter_dir, model)
    server = LoRAServer(catalog, SlotPool(catalog, max_slots, policy), address)
    server.start()
    return server


@pytest.fixture
def served(setup, tmp_path, request):
    """(server, client, oracle, address); 3 slots unless the test passes another count (indirect param)."""
    model_dir, adapter_dir, oracle = setup
    address = f"ipc://{tmp_path}/lora.sock"
    server = start_server(model_dir, adapter_dir, address, max_slots=getattr(request, "param", 3))
    client = LoRAServerClient(address, timeout_s=5.0)
    yield server, client, oracle, address
    assert client.stats()["invariants"] == "ok"
    client.close()
    server.stop()
    server.join()
    server.pool.check_invariants()


def test_hello_lists_the_catalog(served, setup):
    _, client, _, _ = served
    cat = client.catalog()
    assert sorted(cat["adapters"]) == ["a", "b", "c"]
    b = cat["adapters"]["b"]
    assert b["identity"] == read_spec(setup[1] / "b").identity
    assert (b["rank"], b["scaling"], b["is_alora"]) == (16, 8 / 16 ** 0.5, False)
    assert b["modules"]["0"] == ["down_proj", "gate_proj", "q_proj", "v_proj"]
    assert cat["groups"]["qkv"]["offsets"] == [0, 32, 48, 64] and cat["num_layers"] == 2
    one = client.catalog(["b", "zzz", "b"])  # a worker resolving a name asks for it alone; unknown names are absent
    assert one["adapters"] == {"b": b} and one["groups"] == cat["groups"]
    assert client.catalog([])["adapters"] == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_equals_peft_for_every_group(served, dtype):
    """Rows of a, b, c and base rows (-1) interleaved in one call; every group of both layers."""
    _, client, oracle, _ = served
    torch.manual_seed(0)
    names = ["c", "a", "b"]  # c is index 0: the index is into this call's list, not the catalog
    index = torch.tensor([1, 2, -1, 0, 1, 2, 2, 0], dtype=torch.int32)
    for layer in (0, 1):
        for group, modules in GROUP_MODULES.items():
            width = 48 if group == "down" else 32
            x = torch.randn(len(index), width)
            delta = client.submit_delta(layer, group, x.to(dtype), index, names).result()
            assert delta.dtype == dtype
            for row, i in enumerate(index.tolist()):
                want = (torch.zeros(1, delta.shape[1]) if i < 0 else
                        expected_delta(oracle, names[i], layer, group, x.to(dtype).float()[row:row + 1]))
                tol = 1e-5 if dtype == torch.float32 else 2e-2
                torch.testing.assert_close(delta[row:row + 1].float(), want, atol=tol, rtol=tol)
    stats = client.stats()
    assert stats["delta_calls"] == 8 and stats["errors"] == 0


def test_pipelined_submits_and_two_clients(served):
    """Each client keeps ten calls in flight (submit all, then wait all); two clients at once, in two threads."""
    _, client, oracle, address = served
    second = LoRAServerClient(address, timeout_s=5.0)
    gen = torch.Generator().manual_seed(1)
    work = {}  # client -> (name, inputs, expected): PEFT's oracle switches adapters, so it runs up front
    for c, name in ((client, "a"), (second, "b")):
        xs = [torch.randn(3, 32, generator=gen) for _ in range(10)]
        work[c] = (name, xs, [expected_delta(oracle, name, i % 2, "qkv", x) for i, x in enumerate(xs)])
    failures: list[BaseException] = []

    def run(c: LoRAServerClient) -> None:
        name, xs, want = work[c]
        try:
            index = torch.zeros(3, dtype=torch.int32)
            pending = [c.submit_delta(i % 2, "qkv", x, index, [name]) for i, x in enumerate(xs)]
            for p, w in zip(pending, want):
                torch.testing.assert_close(p.result(), w, atol=1e-5, rtol=1e-5)
        except BaseException as e:  # noqa: BLE001  (reported by the main thread)
            failures.append(e)

    threads = [threading.Thread(target=run, args=(c,)) for c in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    assert sorted(client.residency()["resident"]) == ["a", "b"]
    second.close()


def test_malformed_requests_get_error_replies_and_the_server_keeps_serving(served):
    _, client, oracle, address = served
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(address)

    def ask(*frames) -> dict:
        raw.send_multipart(list(frames))
        assert raw.poll(5000), "no reply to a malformed request"
        return orjson.loads(raw.recv_multipart()[0])

    assert ask(b"\xff not json")["code"] == "bad_request"
    old = ask(orjson.dumps({"v": 99, "op": "hello", "id": 7}))
    assert (old["code"], old["id"], old["ok"]) == ("version", 7, False)
    assert ask(orjson.dumps({"v": VERSION, "op": "nope", "id": 8}))["code"] == "unknown_op"
    assert ask(orjson.dumps({"v": VERSION, "op": "hello", "id": 9, "names": "a"}))["code"] == "bad_request"
    x = torch.zeros(2, 32)
    head = {"v": VERSION, "op": "delta", "id": 9, "layer": 0, "group": "qkv", "adapters": ["zzz"], "rows": 2,
            "in": 32, "dtype": "float32", "experts": False}
    index = tensor_frame(torch.zeros(2, dtype=torch.int32))
    reply = ask(orjson.dumps(head), tensor_frame(x), index)
    assert reply["code"] == "unknown_adapter" and "zzz" in reply["error"]
    assert ask(orjson.dumps({**head, "adapters": ["a"]}), tensor_frame(x[:1]), index)["code"] == "bad_request"
    assert ask(orjson.dumps({**head, "adapters": ["a"], "layer": 5}), tensor_frame(x), index)["code"] == "bad_layer"
    assert ask(orjson.dumps({**head, "adapters": ["a"], "group": "experts.down", "experts": True}),
               tensor_frame(x), index, index)["code"] == "unknown_group"
    raw.close()
    with pytest.raises(LoRAServerError, match="unknown_adapter"):
        client.submit_delta(0, "qkv", x, torch.zeros(2, dtype=torch.int32), ["nope"]).result()
    ok = client.submit_delta(0, "o", x + 1, torch.zeros(2, dtype=torch.int32), ["a"]).result()
    torch.testing.assert_close(ok, expected_delta(oracle, "a", 0, "o", x + 1), atol=1e-5, rtol=1e-5)
    assert client.stats()["errors"] == 9


@pytest.mark.parametrize("served", [2], indirect=True)
def test_eviction_order_over_the_wire_and_prefetch(served):
    """2 slots, LRU: a, b load; c evicts a (least recently used); a again evicts b; prefetch(b) evicts c. A call
    naming three adapters cannot fit two slots: an error reply, no pin left behind."""
    server, client, _, _ = served
    x, one = torch.zeros(1, 32), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(LoRAServerError, match="no_slot"):
        client.submit_delta(0, "qkv", torch.zeros(3, 32), torch.arange(3, dtype=torch.int32), ["a", "b", "c"]).result()
    assert client.stats()["invariants"] == "ok"
    # the failed call left a and b resident (loaded, then unpinned); now b, a, b hit; c evicts a (used before the
    # last b); a evicts b (used before c); prefetch(b) evicts c (used before a)
    for name in ("b", "a", "b", "c", "a"):
        client.submit_delta(0, "qkv", x, one, [name]).result()
    assert client.residency()["resident"] == ["c", "a"]  # slot order: c took a's slot 0, a took b's slot 1
    assert client.prefetch(["b", "a"]) == ["b"]  # a is resident already
    deadline = time.monotonic() + 5
    while "b" not in client.residency()["resident"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.residency()["resident"] == ["b", "a"]
    stats = client.stats()
    # loads: a, b (the failed call), c, a, b (prefetch); evictions: a, b, c; misses: a, b, c (failed), c, a
    assert (stats["loads"], stats["evictions"], stats["hits"], stats["misses"]) == (5, 3, 3, 5)
    with pytest.raises(LoRAServerError, match="unknown_adapter"):
        client.prefetch(["nope"])


def test_load_and_unload_over_the_wire(served, setup):
    _, client, _, _ = served
    info = client.load("a2", str(setup[1] / "a"))
    assert info["identity"] == client.catalog()["adapters"]["a"]["identity"]
    client.submit_delta(0, "qkv", torch.ones(1, 32), torch.zeros(1, dtype=torch.int32), ["a2"]).result()
    client.unload("a2")
    assert "a2" not in client.catalog()["adapters"] and "a2" not in client.residency()["resident"]
    with pytest.raises(LoRAServerError, match="adapter"):
        client.load("bad", str(setup[0]))  # the model dir: no adapter_config.json


def test_unavailable_within_timeout_then_restart_is_used_again(setup, tmp_path):
    model_dir, adapter_dir, oracle = setup
    address = f"ipc://{tmp_path}/restart.sock"
    client = LoRAServerClient(address, timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(LoRAServerUnavailable, match=str(tmp_path)):
        client.catalog()
    assert time.monotonic() - start < 1.5
    x, one = torch.randn(2, 32), torch.zeros(2, dtype=torch.int32)
    server = start_server(model_dir, adapter_dir, address)
    torch.testing.assert_close(client.submit_delta(1, "qkv", x, one, ["a"]).result(),
                               expected_delta(oracle, "a", 1, "qkv", x), atol=1e-5, rtol=1e-5)
    server.stop(), server.join()
    pending = client.submit_delta(1, "qkv", x, one, ["a"])  # sent to a server that is gone
    with pytest.raises(LoRAServerUnavailable):
        pending.result()
    server = start_server(model_dir, adapter_dir, address)  # same address, same client
    try:
        torch.testing.assert_close(client.submit_delta(1, "qkv", x, one, ["c"]).result(),
                                   expected_delta(oracle, "c", 1, "qkv", x), atol=1e-5, rtol=1e-5)
        assert client.stats()["invariants"] == "ok"
    finally:
        client.close()
        server.stop(), server.join()
    server.pool.check_invariants()


def test_a_late_reply_to_a_timed_out_request_is_dropped(tmp_path):
    """A stand-in server (a bare ROUTER) answers request 1 only after the client gave up on it, and before request
    2's reply: the client returns request 2's value, never request 1's."""
    address = f"ipc://{tmp_path}/slow.sock"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(address)
    client = LoRAServerClient(address, timeout_s=0.3)
    try:
        with pytest.raises(LoRAServerUnavailable):
            client.stats()
        first_identity, first = router.recv_multipart()
        client_pending = client._submit(99, [orjson.dumps({"v": VERSION, "op": "stats", "id": 99})],
                                        lambda header, _frames: header)
        assert router.poll(2000)
        identity, second = router.recv_multipart()
        for ident, req, value in ((identity, first, "stale"), (first_identity, first, "stale"),
                                  (identity, second, "fresh")):
            head = orjson.loads(req)
            router.send_multipart([ident, orjson.dumps({"v": VERSION, "op": "stats", "id": head["id"], "ok": True,
                                                        "value": value})])
        assert client_pending.result()["value"] == "fresh"
    finally:
        client.close()
        router.close()


def test_cli_serves_and_stops_on_sigterm(setup, tmp_path):
    model_dir, adapter_dir, _ = setup
    address = f"ipc://{tmp_path}/cli.sock"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-m", "sgl_multilora.lora_server", "--adapter-dir", str(adapter_dir),
                             "--model-path", str(model_dir), "--listen", address, "--max-slots", "2",
                             "--eviction-policy", "elora"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        client = LoRAServerClient(address, timeout_s=30.0)
        assert sorted(client.catalog()["adapters"]) == ["a", "b", "c"]
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert "LoRA server listening on" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
