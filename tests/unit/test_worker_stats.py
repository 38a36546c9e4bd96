"""What the cluster's gateway reads from a worker's `/multilora/stats` (sgl_multilora/gateway/moves.py,
`worker_memory`): the KV token slots `--balancer mell` packs (app.py, `_kv_capacity`) and the KV bytes per
token and measured prefill seconds per token a move's plan weighs (moves.py, `plan_move`), on answers shaped as
patches/stats.py builds them; and how long a read serves moves."""

from __future__ import annotations

import asyncio
import copy
import io
import json
import urllib.request

import aiohttp
import pytest
from aiohttp import web

from sgl_multilora.cluster.cost import MigrationCostModel
from sgl_multilora.gateway.app import Gateway, _kv_capacity
from sgl_multilora.gateway.moves import STATS_TTL_S, WorkerMemory, worker_memory
from sgl_multilora.cluster.placement import Placement
from sgl_multilora.cluster.records import Move
from tests.local_app import local_app

TREE = {"num_matches": 12, "hits": {"base": 3, "lora": 5}, "hit_tokens": {"base": 96, "lora": 410},
        "num_namespaces": 3, "num_adapter_nodes": 2, "num_kv_nodes": 17, "total_len": 1530, "evictable_len": 1210,
        "protected_len": 320, "num_evicted_runs": 4, "num_evicted_tokens": 388}
MEMORY = {  # patches/stats.py: kv_accounting, with adapter_accounting, the unified pool's and the scheduler's stats
    "kv_bytes_per_token": 18432, "total": 8192, "free": 5310, "cache_evictable": 1210, "cache_protected": 320,
    "running": 3, "waiting": 1,
    "adapters": {"loaded": 2, "weights": {}, "host": {"caps": 1179648, "sql": 2359296}, "slot_buffers": 0,
                 "total": 3538944, "alora": ["uncertainty"]},
    "unified_pool": {"policy": "usage", "slot_bytes": 18432, "num_slots": 8192,
                     "bytes": {"adapter_weights": 3538944, "cached_kv": 22302720, "running_kv": 5898240,
                               "in_flight": 0, "free": 97873920},
                     "slots": {"adapter": 192, "kv_cached": 1210, "kv_running": 320, "in_flight": 0, "free": 5310},
                     "tree_kv_tokens": 1210, "adapters": {"registered": 2, "resident": 2, "loading": 0},
                     "adapter_sizes": {}, "swapper": {}, "skipped_admissions": 0, "starvation_holds": 0,
                     "copy_bytes_per_s": 2.1e9, "recompute_s_per_token": 0.00041, "prefill_tokens": 51200,
                     "host_tier": None},
    "scheduler": {"policy": "fcfs"},
}
STATS = {"enabled": True, "schedulers": [TREE, TREE], "memory": [MEMORY, copy.deepcopy(MEMORY)]}


def test_the_figures_of_a_workers_stats():
    assert worker_memory(STATS) == WorkerMemory(kv_tokens=8192, kv_bytes_per_token=18432,
                                                recompute_s_per_token=0.00041)
    assert worker_memory(json.loads(json.dumps(STATS))) == worker_memory(STATS)  # as it comes over HTTP


def changed(**changes) -> dict:
    """STATS with its first memory view changed: a value set, or the key left out where the value is None."""
    memory = {**MEMORY, **changes}
    return {**STATS, "memory": [{k: v for k, v in memory.items() if v is not None}]}


@pytest.mark.parametrize(("stats", "expected"), [
    (changed(unified_pool=None), WorkerMemory(8192, 18432, None)),  # SGLang's own allocator: nothing measured
    (changed(kv_bytes_per_token=None), WorkerMemory(8192, None, 0.00041)),  # no per-layer K/V buffers: reported None
    (changed(unified_pool={"recompute_s_per_token": 0.0}), WorkerMemory(8192, 18432, None)),  # not measured yet
    (changed(total=0), WorkerMemory(None, 18432, 0.00041)),
    ({"enabled": False, "reason": "the server runs without --radix-cache-backend multilora", "memory": [None]},
     WorkerMemory()),
    ({"enabled": True, "schedulers": [TREE], "memory": []}, WorkerMemory()),
    ({"detail": "Not Found"}, WorkerMemory()),  # a server without the route
    (["not", "a", "dict"], WorkerMemory()),
])
def test_a_figure_a_worker_does_not_report_is_none(stats, expected):
    assert worker_memory(stats) == expected


def test_the_gateways_start_reads_the_kv_slots_from_the_same_figures(monkeypatch):
    answers = {"http://w0/multilora/stats": STATS, "http://w1/multilora/stats": changed(total=None)}
    sent = []

    def urlopen(request, timeout):
        sent.append(request.get_header("Authorization"))
        return io.BytesIO(json.dumps(answers[request.full_url]).encode())

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    assert _kv_capacity("http://w0") == 8192
    assert _kv_capacity("http://w0", api_key="k") == 8192  # workers with --api-key want it
    assert sent == [None, "Bearer k"]
    with pytest.raises(SystemExit, match="no KV pool size"):
        _kv_capacity("http://w1")


def test_moves_share_a_workers_figures_for_a_while(monkeypatch):
    """`plan_move` reads each worker's figures once per STATS_TTL_S (on a fake clock): moves planned together share
    the read, a later one reads again, and so does one after the worker went down; a failed read is not kept."""
    reads = {"w0": 0, "w1": 0}
    answers = {"w0": changed(kv_bytes_per_token=1000), "w1": changed(unified_pool={"recompute_s_per_token": 0.002})}

    async def stats(request: web.Request) -> web.Response:
        worker = request.match_info["worker"]
        reads[worker] += 1
        if answers[worker] is None:
            return web.Response(status=500, text="Internal Server Error")
        return web.json_response(answers[worker])

    async def run():
        async with local_app(("GET", "/{worker}/multilora/stats", stats)) as url:
            await plan_moves(Gateway("http://router", [f"{url}/w0", f"{url}/w1"], Placement(2), admin_key="key"))

    async def plan_moves(gateway: Gateway) -> None:
        now = [100.0]
        gateway.clock = lambda: now[0]
        async with aiohttp.ClientSession() as gateway.session:
            plans = await asyncio.gather(*(gateway.plan_move(f"r{i}", 0, 1, 500) for i in range(3)))
            assert reads == {"w0": 1, "w1": 1}
            model = MigrationCostModel(kv_bytes_per_token=1000, prefill_tokens_per_s=500.0)
            assert plans[0][1]["recompute_s"] == round(model.recompute_seconds(Move("r0", 0, 1, 500)), 4) == 1.0
            now[0] += STATS_TTL_S / 2
            await gateway.plan_move("r3", 1, 0, 500)
            assert reads == {"w0": 1, "w1": 1}
            now[0] += STATS_TTL_S / 2
            await gateway.plan_move("r4", 0, 1, 500)
            assert reads == {"w0": 2, "w1": 2}
            gateway._set_down(1)
            gateway._set_down(1, False)
            await gateway.plan_move("r5", 0, 1, 500)
            assert reads == {"w0": 2, "w1": 3}
            answers["w0"] = None  # its figures are none while it fails, and asked for again at the next move
            gateway._set_down(0)
            assert await gateway._memory(0) == WorkerMemory() and await gateway._memory(0) == WorkerMemory()
            assert reads["w0"] == 4

    asyncio.run(run())
