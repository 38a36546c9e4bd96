"""Story test: InfiniLoRA's admission rule (`patches/remote_admission.RemoteAdmission`) against a real LoRA server of 2
slots over ZMQ, two workers (two clients, two admissions), adapters a, b, c of `test_lora_server`'s tiny model.

Each step states who asks, what runs there, and the exact answer; the server's residency and its idle invariants
are checked as the story goes."""

from __future__ import annotations

import time

import pytest

from sgl_multilora.lora_server import LoRAServerClient
from sgl_multilora.lora_server import server as server_module
from sgl_multilora.patches.remote_admission import RemoteAdmission
from tests.unit.test_lora_server import setup, start_server  # noqa: F401 (the module fixture)


def settled(client: LoRAServerClient) -> dict:
    """The residency once every queued prefetch has loaded."""
    deadline = time.monotonic() + 10
    while True:
        view = client.residency()
        if not view["loading"] or time.monotonic() > deadline:
            return view
        time.sleep(0.01)


@pytest.fixture
def two_workers(setup, tmp_path):  # noqa: F811
    model_dir, adapter_dir, _ = setup
    address = f"ipc://{tmp_path}/lora.sock"
    server = start_server(model_dir, adapter_dir, address, max_slots=2)
    clients = [LoRAServerClient(address, timeout_s=5.0) for _ in range(2)]
    admissions = []
    for c in clients:
        adm = RemoteAdmission(lambda c=c: c)
        adm.VIEW_TTL_S = 0.0  # every question asks the server: the story is exact, not timing-dependent
        admissions.append(adm)
    yield server, clients, admissions
    assert clients[0].stats()["invariants"] == "ok"
    for c in clients:
        c.close()
    server.stop()
    server.join()


def test_admission_story(two_workers):
    server, (c1, c2), (w1, w2) = two_workers
    # worker 1, nothing running: a and b each take a free slot and are prefetched; c finds both slots claimed
    assert w1.admits("a", set()) is True
    w1.VIEW_TTL_S = 60.0  # the rest of this pass uses one view: its claims count as in use
    assert w1.admits("b", set()) is True
    assert w1.admits("c", set()) is False and w1.waits == 1
    assert sorted(settled(c1)["resident"]) == ["a", "b"]  # prefetched out of band, before any delta call
    w1.VIEW_TTL_S = 0.0
    # worker 1's next pass: a and b run there (declared); a request for a joins, c still waits
    assert w1.admits("a", {"a", "b"}) is True
    assert w1.admits("c", {"a", "b"}) is False and w1.waits == 2
    # worker 2 sees worker 1's adapters in use: c waits there too, a joins (in use, resident)
    assert w2.admits("c", set()) is False and w2.waits == 1
    assert w2.admits("a", set()) is True
    view = c2.residency()
    assert sorted(view["in_use"]) == ["a", "b"] and view["max_slots"] == 2
    # worker 1's b requests finish: b's slot is free for c (b stays resident until c's prefetch evicts it)
    assert w1.admits("a", {"a"}) is True
    assert w2.admits("c", set()) is True
    assert sorted(settled(c2)["resident"]) == ["a", "c"]
    assert w1.waits == 2 and w2.waits == 1


def test_a_silent_worker_stops_holding_slots_after_the_ttl(two_workers, monkeypatch):
    server, (c1, c2), (w1, w2) = two_workers
    monkeypatch.setattr(server_module, "IN_USE_TTL_S", 0.3)
    assert w1.admits("a", {"a", "b"}) is True  # worker 1 declares a and b in use, then dies
    assert w2.admits("c", set()) is False
    time.sleep(0.4)
    assert w2.admits("c", set()) is True  # worker 1 said nothing for longer than the TTL
