"""The text a moved request's client sees (sgl_multilora/gateway/carry.py): the output of every segment decoded
together by the model's real tokenizer behind a `/detokenize` route, so a character whose bytes a move split comes
out whole, and a stop string that straddles a move ends the request there, cut as a worker cuts it; per chunk only
a window of a few tokens is decoded (`IncrementalText`), with the same text at every chunk. The moves themselves
run against real workers in tests/e2e/test_cluster.py."""

from __future__ import annotations

import asyncio
import copy
import json
import random
from itertools import pairwise
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from sgl_multilora.gateway.carry import (
    DECODE_CONTEXT,
    DECODE_WINDOW,
    CarriedRequest,
    IncrementalText,
)
from tests.local_app import local_app


def joined(tokenizer, body: dict, done: list[int], seg: list[int], final: bool) -> tuple[dict, bool]:
    """`CarriedRequest._joined` for a request moved after `done`, on a chunk holding `seg` of the new segment."""

    async def detokenize(request: web.Request) -> web.Response:
        data = await request.json()
        return web.json_response({"text": tokenizer.decode(data["tokens"],
                                                           skip_special_tokens=data["skip_special_tokens"])})

    async def run():
        async with local_app(("POST", "/detokenize", detokenize)) as url, aiohttp.ClientSession() as session:
            gw = SimpleNamespace(session=session, worker_urls=[url], incremental=False)
            carried = CarriedRequest(gw, body, 0, None, "prompt")
            carried.prompt_ids, carried.done_ids, carried.seg_ids = [1, 2, 3], done, seg
            carried.migrations = [{"from": 1, "to": 0, "kind": "kv", "at_token": len(done)}]
            carried.done_text = await carried._decoded(done, final=False)
            carried.boundaries = [len(carried.done_text)]
            out = {"text": "", "output_ids": seg, "meta_info": {"finish_reason": {"type": "length"} if final else None}}
            return await carried._joined(out)

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


LONG_TEXT = ("Plain ASCII first: the quick brown fox, 0123456789 and {braces} [brackets].\n"
             "Déjà vu à la crème brûlée, naïve façade, Ångström, Œuvre, ñandú, Straße, Ελληνικά, русский текст.\n"
             "中文的句子在这里，日本語のテキストもあります。한국어 문장도 있습니다.\n"
             "Emoji: 😀 😃 🎉🎉 👩‍💻 🇫🇷 ❤️ 👍🏽 and ☕ between words.\n\n"
             "    indented    spaces\tand\ttabs\n\n\n"
             "Mixed: naïve 中文 😀 end. ") * 4


def stream_moved(tokenizer, ids: list[int], moves: list[int], chunks: list[int]) -> tuple[list[dict], dict, list]:
    """Streams `ids` as a carried request's output through `CarriedRequest.run`: fake workers (smg's `/generate`, the
    workers' `/abort_request` and `/detokenize` on one server) stream each segment in chunks of the sizes `chunks`
    (cycled), and the request is moved to the next worker once each token count in `moves` is out. Returns (every
    chunk the client was given, the final one, the `/detokenize` calls as lists of ids)."""
    prompt = [1, 2, 3]
    detokenized: list[list[int]] = []
    given: list[dict] = []
    holder: dict = {}

    async def detokenize(request: web.Request) -> web.Response:
        data = await request.json()
        detokenized.append(list(data["tokens"]))
        return web.json_response({"text": tokenizer.decode(data["tokens"],
                                                           skip_special_tokens=data["skip_special_tokens"])})

    async def abort(request: web.Request) -> web.Response:
        return web.json_response({})

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        start = len(body["input_ids"]) - len(prompt)
        assert body["input_ids"] == prompt + ids[:start]  # the continuation's prompt: the output so far
        end = next((m for m in moves if m > start), len(ids))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(seg: list[int], reason: dict | None) -> None:
            text = tokenizer.decode(seg) if reason else tokenizer.decode(seg).rstrip("\ufffd")
            chunk = {"text": text, "output_ids": seg, "meta_info": {"finish_reason": reason}}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

        at, k = start, 0
        while at < end:
            at, k = min(end, at + chunks[k % len(chunks)]), k + 1
            await send(ids[start:at], {"type": "length"} if at == len(ids) else None)
        if end < len(ids):  # a move: asked now, answered by the abort's last chunk
            await holder["carried"].ask_move((holder["carried"].worker + 1) % 3)
            await send(ids[start:end], {"type": "abort"})
        await response.write(b"data: [DONE]\n\n")
        return response

    async def ok(*args) -> bool:
        return True

    async def recompute(*args) -> tuple[str, dict]:
        return "recompute", {}

    async def run():
        routes = (("POST", "/detokenize", detokenize), ("POST", "/abort_request", abort),
                  ("POST", "/generate", generate))
        async with local_app(*routes) as url, aiohttp.ClientSession() as session:
            gw = SimpleNamespace(session=session, router_url=url, worker_urls=[url] * 3,
                                 smg_index={"native": [0, 1, 2]}, incremental=False,
                                 check_answered=lambda *a: None, worker_alive=ok, carry_kv=recompute,
                                 count_migration=lambda *a: None, progress=lambda *a: None, admin_headers=dict)
            carried = holder["carried"] = CarriedRequest(
                gw, {"input_ids": prompt, "rid": "r", "sampling_params": {"max_new_tokens": len(ids)}}, 0, None, "")
            emit = carried._emit

            async def record(out: dict, raw: bytes | None = None) -> None:
                given.append(copy.deepcopy(out))
                await emit(out, raw)

            carried._emit = record
            await carried.run(None)
        return given, carried.last, detokenized

    return asyncio.run(run())


@pytest.mark.parametrize("chunks", [[1], [3, 1, 7, 2, 1, 5, 4, 1, 1, 9]], ids=["token_by_token", "uneven"])
def test_a_long_moved_stream_is_decoded_a_window_at_a_time(tokenizer, chunks):
    ids = tokenizer(LONG_TEXT, add_special_tokens=False)["input_ids"]
    whole = tokenizer.decode(ids)
    assert whole == LONG_TEXT and len(ids) > 600
    splits = [k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd")]
    moves = [splits[len(splits) // 5], splits[3 * len(splits) // 5]]  # each move splits a character's bytes
    given, last, calls = stream_moved(tokenizer, ids, moves, chunks)
    assert last["output_ids"] == ids and last["text"] == whole
    assert [m["at_token"] for m in last["meta_info"]["migrations"]] == moves
    assert last["meta_info"]["completion_tokens"] == len(ids)
    for out in given[:-1]:  # every chunk: the output so far decoded as one, without an incomplete end
        assert out["text"] == tokenizer.decode(out["output_ids"]).rstrip("\ufffd")
    shown = [out["text"] for out in given]
    assert all(b.startswith(a) for a, b in pairwise(shown))  # the client's text only grows
    assert "".join(b[len(a):] for a, b in pairwise(["", *shown])) == whole
    # /detokenize: the first move decodes the output before it, the last chunk the whole output; in between,
    # per chunk one window of a few tokens (and one more call each time the window moves up)
    after = [out for out in given if len(out["output_ids"]) > moves[0]]
    assert calls[0] == ids[:moves[0]] and calls[-1] == ids
    windows = calls[1:-1]
    assert len(windows) <= len(after) + len(ids) // (DECODE_WINDOW - DECODE_CONTEXT) + len(moves)
    assert max(map(len, windows)) <= DECODE_WINDOW + max(chunks) + 8
    assert sum(map(len, windows)) * 10 < sum(len(out["output_ids"]) for out in after)  # the whole output per chunk


def test_incremental_text_is_the_whole_decode_at_every_step(tokenizer):
    """`IncrementalText` alone, on random chunkings of the long text, of a run of real U+FFFD characters longer than
    its context (held back until a character follows), and of random token ids."""
    rng = random.Random(0)
    runs = ["a" + "\ufffd" * 9 + "😀 b" * 40, LONG_TEXT]
    outputs = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in runs]
    outputs += [[rng.randrange(tokenizer.vocab_size) for _ in range(300)] for _ in range(3)]

    async def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids)

    async def run():
        for ids in outputs:
            text, n = IncrementalText(), 0
            while n < len(ids):
                n = min(len(ids), n + rng.choice([1, 1, 2, 3, 6]))
                assert await text.step(ids[:n], decode) == tokenizer.decode(ids[:n]).rstrip("\ufffd")

    asyncio.run(run())
