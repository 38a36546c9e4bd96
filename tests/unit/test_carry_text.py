"""The text a moved request's client sees (sgl_multilora/cluster/carry.py): the output of every segment decoded
together by the model's real tokenizer behind a `/detokenize` route, so a character whose bytes a move split comes
out whole, and a stop string that straddles a move ends the request there, cut as a worker cuts it. The moves
themselves run against real workers in tests/e2e/test_cluster.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import aiohttp
from aiohttp import web

from sgl_multilora.cluster.carry import CarriedRequest
from sgl_multilora.server import free_port


def joined(tokenizer, body: dict, done: list[int], seg: list[int], final: bool) -> tuple[dict, bool]:
    """`CarriedRequest._joined` for a request moved after `done`, on a chunk holding `seg` of the new segment."""

    async def detokenize(request: web.Request) -> web.Response:
        data = await request.json()
        return web.json_response({"text": tokenizer.decode(data["tokens"],
                                                           skip_special_tokens=data["skip_special_tokens"])})

    async def run():
        app = web.Application()
        app.router.add_post("/detokenize", detokenize)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        async with aiohttp.ClientSession() as session:
            gw = SimpleNamespace(session=session, worker_urls=[f"http://127.0.0.1:{port}"], incremental=False)
            carried = CarriedRequest(gw, body, 0, None, "prompt")
            carried.prompt_ids, carried.done_ids, carried.seg_ids = [1, 2, 3], done, seg
            carried.migrations = [{"from": 1, "to": 0, "kind": "kv", "at_token": len(done)}]
            carried.done_text = await carried._decoded(done, final=False)
            carried.boundaries = [len(carried.done_text)]
            out = {"text": "", "output_ids": seg, "meta_info": {"finish_reason": {"type": "length"} if final else None}}
            result = await carried._joined(out)
        await runner.cleanup()
        return result

    return asyncio.run(run())


def test_a_character_split_by_a_move_comes_out_whole(tokenizer):
    ids = tokenizer("Deja vu: café au lait ☕ and 😀 twice 😀.", add_special_tokens=False)["input_ids"]
    splits = [k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd")]
    assert splits, "the text has no multi-byte character split across tokens: the test would prove nothing"
    k = splits[0]
    naive = tokenizer.decode(ids[:k]).rstrip("\ufffd") + tokenizer.decode(ids[k:])
    assert naive != tokenizer.decode(ids)  # what joining per segment gave
    out, stopped = joined(tokenizer, {"input_ids": [1]}, ids[:k], ids[k:], final=True)
    assert out["text"] == tokenizer.decode(ids) and out["output_ids"] == ids and not stopped
    running, _ = joined(tokenizer, {"input_ids": [1]}, ids[:k], ids[k:k + 1], final=False)
    assert not running["text"].endswith("\ufffd") and tokenizer.decode(ids).startswith(running["text"])


def test_a_stop_string_across_a_move_ends_the_request_there(tokenizer):
    text = "The quick brown fox jumps over the lazy dog and runs away."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    k = next(k for k in range(len(ids)) if tokenizer.decode(ids[:k]).endswith("brown"))
    body = {"input_ids": [1], "sampling_params": {"stop": ["lazy", "brown fox"]}}
    out, stopped = joined(tokenizer, body, ids[:k], ids[k:], final=False)
    assert stopped and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "brown fox"}
    assert out["text"] == "The quick " and tokenizer.decode(out["output_ids"]).endswith("brown fox")
    assert not tokenizer.decode(out["output_ids"][:-1]).endswith("brown fox")  # no token past the stop
    assert out["meta_info"]["completion_tokens"] == len(out["output_ids"])
    kept, _ = joined(tokenizer, {**body, "sampling_params": {"stop": "brown fox", "no_stop_trim": True}},
                     ids[:k], ids[k:], final=False)
    assert kept["text"] == "The quick brown fox"
    # a stop string wholly after the move is the worker's to find; wholly before it, the first worker's
    later, stopped = joined(tokenizer, {"input_ids": [1], "sampling_params": {"stop": ["lazy", "quick"]}},
                            ids[:k], ids[k:], final=False)
    assert not stopped and later["text"] == tokenizer.decode(ids)
