"""How the gateway moves a request's KV (`gateway/moves.py` `transfer_kv`), against fake workers on real HTTP: the
destination pulls the export from the source itself (worker to worker, the gateway sending only the request), and
when that fails the gateway relays the bytes; either way the destination's answer and the byte count are the same.
The real routes run end to end in tests/e2e/test_cluster.py."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from sgl_multilora.gateway.app import Gateway
from sgl_multilora.cluster.placement import Placement
from tests.local_app import local_app

EXPORT = b"K" * 3000 + b"V" * 3000  # stands for a safetensors export
KEY = "admin-key"


def fake_workers(pulls_served: bool, seen: list):
    async def export(request: web.Request) -> web.Response:
        seen.append(("export", request.match_info["w"], request.headers.get("Authorization")))
        return web.Response(body=EXPORT, content_type="application/octet-stream")

    async def import_(request: web.Request) -> web.Response:
        if request.content_type == "application/json":
            body = await request.json()
            seen.append(("pull", request.match_info["w"], body["from"].rsplit("/", 1)[-1]))
            if not pulls_served:
                return web.json_response({"error": {"message": "the body must be a KV export"}}, status=400)
            async with aiohttp.ClientSession() as s, s.post(body["from"] + "/multilora/kv/export",
                                                            json=body["export"]) as r:
                data = await r.read()
        else:
            data = await request.read()
            seen.append(("bytes", request.match_info["w"], len(data)))
        assert data == EXPORT
        return web.json_response({"tokens": 100, "imported": 60, "cached": 40, "reason": None, "bytes": len(data)})

    return (("POST", "/{w}/multilora/kv/export", export), ("POST", "/{w}/multilora/kv/import", import_))


def transfer(pulls_served: bool, route: str = "pull") -> tuple[dict, list, dict]:
    seen: list = []

    async def run():
        async with local_app(*fake_workers(pulls_served, seen)) as url:
            gateway = Gateway("http://router", [f"{url}/w0", f"{url}/w1"], Placement(2), admin_key=KEY)
            async with aiohttp.ClientSession() as gateway.session:
                done = await gateway.transfer_kv(0, 1, {"input_ids": [1, 2, 3], "lora_path": "caps"}, route)
            return done, gateway.kv_moves

    done, moves = asyncio.run(run())
    return done, seen, moves


def test_the_destination_pulls_the_kv_from_the_source():
    done, seen, moves = transfer(pulls_served=True)
    assert seen[0] == ("pull", "w1", "w0") and seen[1][:2] == ("export", "w0") and len(seen) == 2
    assert done["how"] == "pulled" and done["tokens"] == 100 and done["bytes"] == len(EXPORT)
    assert moves["pulled"] == 1 and moves["relayed"] == 0 and moves["tokens"] == 60 and moves["bytes"] == len(EXPORT)


def test_a_failed_pull_is_relayed_through_the_gateway():
    done, seen, moves = transfer(pulls_served=False)
    assert [s[0] for s in seen] == ["pull", "export", "bytes"]
    assert seen[1] == ("export", "w0", f"Bearer {KEY}") and seen[2] == ("bytes", "w1", len(EXPORT))
    assert done["how"] == "relayed" and done["tokens"] == 100 and done["bytes"] == len(EXPORT)
    assert moves["pulled"] == 0 and moves["relayed"] == 1
    assert json.dumps(done)  # the migration record carries it as JSON


def test_a_relay_asked_for_goes_through_the_gateway_at_once():
    done, seen, moves = transfer(pulls_served=True, route="relay")
    assert [s[0] for s in seen] == ["export", "bytes"] and done["how"] == "relayed" and moves["relayed"] == 1
