"""The cluster launcher's ports (`gateway/launch.py`): every process gets its own, and a front (router, gateway)
whose port a worker took meanwhile starts again on new ones, unless the operator chose it."""

from __future__ import annotations

import itertools

import pytest

from sgl_multilora.gateway import launch
from sgl_multilora.gateway.launch import Cluster, ClusterError


def test_ports_are_distinct_even_when_free_port_repeats_itself(monkeypatch):
    answers = itertools.chain([5000, 5000, 5001, 5000, 5001, 5002, 5003, 5002, 5004], itertools.count(6000))
    monkeypatch.setattr(launch, "free_port", lambda: next(answers))
    c = Cluster(2, ["--model-path", "m"], policy="lora_aware")
    ports = [c.router_port, *c.worker_ports, c.metrics_port, c.gateway_port]
    assert len(set(ports)) == len(ports) == 5, ports


class Handle:
    def __init__(self, log):
        self.log, self.stopped = log, False

    def stop(self):
        self.stopped = True


def starts(cluster, monkeypatch, failures: list[str], fixed=False):
    """Runs `_start_bound` with `_wait` failing with each of `failures` in turn, then succeeding."""
    pending = list(failures)

    def wait(handles, path, what):
        if pending:
            raise ClusterError(pending.pop(0))

    monkeypatch.setattr(cluster, "_wait", wait)
    started, moved = [], []
    cluster._start_bound(lambda: started.append(Handle("")) or started[-1], "/readiness", "router",
                         lambda: moved.append(1), fixed=fixed)
    return started, moved


def test_a_front_whose_port_was_taken_starts_again_on_new_ports(monkeypatch):
    c = Cluster(1, ["--model-path", "m"])
    busy = "router exited during start-up; log:\nFailed to bind the HTTP listener: Address already in use (os error 98)"
    started, moved = starts(c, monkeypatch, [busy])
    assert len(started) == 2 and started[0].stopped and not started[1].stopped and moved == [1]


def test_other_failures_and_the_operators_port_are_not_retried(monkeypatch):
    c = Cluster(1, ["--model-path", "m"])
    with pytest.raises(ClusterError, match="exited with code 1"):
        starts(c, monkeypatch, ["router exited with code 1 during start-up: bad flag"])
    with pytest.raises(ClusterError, match="already in use"):
        starts(c, monkeypatch, ["address already in use"], fixed=True)
    with pytest.raises(ClusterError, match="already in use"):  # at most PORT_TRIES starts
        starts(c, monkeypatch, ["address already in use"] * launch.PORT_TRIES)
