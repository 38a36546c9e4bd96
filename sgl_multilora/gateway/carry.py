"""Native `/generate` requests the gateway carries itself, so that they can move between workers mid-generation.

Lives here: `carriable` (which requests can move), `CarriedRequest` (one request's stream, its moves, and what
its client sees) and `IncrementalText` (a moved request's text, decoded a window at a time). Not here: choosing
workers (cluster/placement.py), the HTTP front (app.py), OpenAI's objects (openai_view.py: an OpenAI completion is
carried as its native body, and its view writes what its client sees).

A carried request is one prompt (`text` a string or `input_ids` a flat list of ints) without input logprobs
(`logprob_start_len` >= 0: the prompt of a continuation is another) and nothing whose state spans the output;
output logprobs are joined like the tokens.
Whatever the client asked, the gateway streams it from its worker through smg and keeps what the worker has
produced so far: SGLang's stream repeats the whole output in every chunk (`output_ids` and `text` cumulative; with
`--incremental-streaming-output` each chunk is a delta, also handled).
The client gets the same stream, or the final object if it did not ask for a stream.

A move:
  1. the request is aborted at its worker (`/abort_request` with its rid, sent to that worker), whose tree keeps
     the request's KV as cached KV;
  2. every token the worker produced up to the abort is kept (the abort's last chunk carries them);
  3. the KV goes along when the gateway's cost model picks a KV transfer (moves.py: exported from the source's
     tree, imported into the destination's); otherwise, and when the source failed, it is recomputed;
  4. the destination gets `input_ids = prompt ids + output so far`, the same sampling parameters with
     `max_new_tokens` (and `min_new_tokens`) reduced by the tokens already out, and the same adapter;
  5. the destination's chunks reach the client as continuations: output ids and text appended to what it has,
     `completion_tokens` counted over both segments, `prompt_tokens` its own prompt's.
The client sees one stream without a gap or a repeated token, and `meta_info["migrations"]` lists the moves.
Moves happen when asked (`POST /cluster/migrate`) and when the worker fails mid-request (the connection drops or
smg answers 5xx and the worker's `/health` does not answer): the request then finishes on another worker, or
ends with an error naming the failures after `MAX_FAILOVERS` of them. The prompt's ids come from the destination's
`/tokenize`, the tokenizer SGLang applies to `text`. Greedy decoding gives the tokens one worker gives (tested).
After a move, the client's text is the output of all segments decoded as one, so a character whose bytes a move
split comes out whole: incrementally, as SGLang's detokenizer decodes (`IncrementalText`: per chunk of a moved
request one `/detokenize` call on the worker, over a window of a few tokens before the new ones to the end; the
first move decodes the output before it once), and the whole output decoded together once, for the last chunk. A
stop string the client asked for that straddles a move (neither worker saw it whole) ends the request there, cut as
the worker would cut it. With `--incremental-streaming-output` workers the deltas are passed on per segment, without
that joining.
"""

from __future__ import annotations

import copy
import json
import logging
import uuid
from typing import Protocol

import aiohttp
from aiohttp import web

logger = logging.getLogger("sgl_multilora.gateway.carry")
MAX_FAILOVERS = 3
ROUTED_HEADER = "x-smg-routed-worker-id"  # smg's answer header: the worker that served a request
OUTPUT_LOGPROBS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")
HEALTH_TIMEOUT_S = 5.0
DECODE_CONTEXT = 5
"""Tokens `IncrementalText` keeps in its window, before the new ones, when it moves the window up (SGLang's
detokenizer starts a request's window as many tokens before its output; more than the 3 bytes an incomplete
character can hold back)."""
DECODE_WINDOW = 32
"""`IncrementalText` moves its window up once it spans more tokens than this."""


STATEFUL_PARAMS = ("regex", "json_schema", "ebnf", "structural_tag", "stop_regex", "custom_params")
"""Sampling parameters whose state spans the output (a grammar's position, a regex over the whole text, a custom
processor's): a continuation that re-reads the output as prompt would start them over."""
PENALTY_DEFAULTS = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
"""Penalties count the output's tokens; a continuation counts those before the move as prompt instead."""


def carriable(body: dict) -> bool:
    """One prompt, no input logprobs, no batch, nothing whose state spans the output (STATEFUL_PARAMS, penalties
    other than their defaults, a custom logit processor): the requests a move can continue exactly. The others are
    served the same, through smg, but are not moved."""
    text, ids = body.get("text"), body.get("input_ids")
    one_prompt = (isinstance(text, str) and ids is None) or (
        text is None and isinstance(ids, list) and bool(ids) and all(isinstance(t, int) for t in ids))
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        return False
    start = body.get("logprob_start_len")
    input_logprobs = bool(body.get("return_logprob")) and (isinstance(start, list) or (start is not None
                                                                                      and int(start) >= 0))
    stateful = any(params.get(k) is not None for k in STATEFUL_PARAMS) or body.get("custom_logit_processor") \
        or any(params.get(k) not in (None, v) for k, v in PENALTY_DEFAULTS.items())
    return (one_prompt and int(params.get("n", 1) or 1) == 1
            and not input_logprobs and not stateful
            and not isinstance(body.get("rid"), list)
            and not body.get("input_embeds") and not body.get("image_data") and not body.get("session_params"))


def error_status(error) -> int:
    """The HTTP status of a request that ended with `error` (a stream's error object): its code when that is one."""
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 600 else 500


class ClientView(Protocol):
    """The client's format when it is not the native one (openai_view.CompletionView): native chunks in, the
    client's events and final object out."""

    def stream_chunk(self, out: dict) -> bytes: ...
    def stream_end(self) -> bytes: ...
    def response(self, out: dict) -> dict: ...


class Front(Protocol):
    """What a carried request needs from the gateway that carries it (app.py, moves.py)."""

    session: aiohttp.ClientSession
    router_url: str
    worker_urls: list[str]
    smg_index: dict[str, list[int]]
    incremental: bool

    def check_answered(self, worker: int, headers) -> None: ...
    async def worker_alive(self, worker: int) -> bool: ...
    def pick_other(self, adapter: str | None, prompt: str, exclude: int) -> int | None: ...
    def count_migration(self, kind: str, src: int, dst: int) -> None: ...
    async def carry_kv(self, carried: CarriedRequest, src: int, dst: int) -> tuple[str, dict]: ...


class IncrementalText:
    """The text of a growing output, decoded a window at a time in the manner of SGLang's detokenizer (its
    `DecodeStatus`, with `surr_offset` and `read_offset`).

    A step decodes only the window `ids[surr:]`: `surr` lies a few tokens before the ids the previous step had, so
    the new ones decode in context (a leading space, a character whose bytes span tokens), and the new text is what
    the window's text has past `surr_text`, the text of `ids[surr:read]` decoded alone (the previous step's window,
    or the start it moved up to). An incomplete character at the end (U+FFFD) is held back: it is left out of
    `text` and of `surr_text` alike, so it is not shown, and the next step, whose window still holds its tokens,
    gives it whole once its last bytes arrive. (SGLang keeps its offsets until the character completes; here they
    advance, so that a move which split a character does not make the next step decode the whole output again.) Once
    the window spans more than `DECODE_WINDOW` tokens, `surr` moves up to `DECODE_CONTEXT` tokens before the end,
    whose text is decoded alone (one more call every few dozen tokens), provided the held-back end lies within them.
    Per step the work is the window's, not the output's; the first step, from nothing, decodes all it is given."""

    def __init__(self) -> None:
        self.text = ""  # of ids[:read], without an incomplete end
        self.surr = self.read = 0
        self.surr_text = ""  # of ids[surr:read] decoded alone, without an incomplete end

    async def step(self, ids: list[int], decode) -> str:
        """The text of `ids` (what the previous step had, and more) without a trailing incomplete character;
        `decode(ids)` is the whole text of `ids` (a worker's `/detokenize`)."""
        if len(ids) < self.read:  # not a continuation of the previous step's ids: start over
            self.__init__()
        if len(ids) == self.read:
            return self.text
        window = await decode(ids[self.surr:])
        whole = window.rstrip("\ufffd")
        self.text += whole[len(self.surr_text):]
        self.read, self.surr_text = len(ids), whole
        if self.read - self.surr > DECODE_WINDOW:
            surr = self.read - DECODE_CONTEXT
            context = await decode(ids[surr:])
            if len(context) - len(context.rstrip("\ufffd")) == len(window) - len(whole):  # the same end held back
                self.surr, self.surr_text = surr, context.rstrip("\ufffd")
        return self.text


class ClientGone(Exception):
    """The client closed its connection: the request ends (its worker sees the upstream connection close)."""


class CarriedRequest:
    """One request's life through the gateway: segments on one worker each, joined for its client."""

    def __init__(self, gateway: Front, body: dict, worker: int, adapter: str | None, prompt: str,
                 view: ClientView | None = None) -> None:
        self.gw, self.adapter, self.prompt = gateway, adapter, prompt
        self.view = view  # the client's format when it is not the native one (an OpenAI completion)
        self.body = body
        self.rid = str(body.get("rid") or uuid.uuid4().hex)
        self.client_stream = bool(body.get("stream"))
        self.worker = worker
        self.upstream_rid = self.rid
        self.prompt_ids: list[int] | None = list(body["input_ids"]) if body.get("input_ids") is not None else None
        self.done_ids: list[int] = []  # output of finished segments
        self.done_text = ""
        self.seg_ids: list[int] = []  # output of the running segment (cumulative)
        self.seg_text = ""
        self.done_lp: dict[str, list] = {k: [] for k in OUTPUT_LOGPROBS}  # output logprobs, as the ids
        self.seg_lp: dict[str, list] = {}
        self.last: dict | None = None  # the last chunk given to the client (or kept for it)
        self.migrations: list[dict] = []
        self.move_to: int | None = None  # asked for, not done yet
        self.move_kind: str | None = None  # "kv" or "recompute" when the move's asker chose; None: the cost model
        self.move_route: str | None = None  # a KV move's route when the asker chose ("pull" or "relay")
        self.client_aborted = False
        self.failures: list[str] = []
        self.response: web.StreamResponse | None = None
        self.request: web.Request | None = None
        self.finish_reason: dict | None = None  # of the running segment's last chunk
        self.answered_by = ""  # smg's header naming the worker that answered the running segment
        self.boundaries: list[int] = []  # where each move cut the text (characters of joined text before it)
        self.decoder = IncrementalText()  # the joined text after a move, over done_ids + seg_ids

    # ---- the loop -------------------------------------------------------------------------------------------------

    async def run(self, request: web.Request) -> web.StreamResponse:
        self.request = request
        try:
            return await self._run()
        except ClientGone:
            logger.info("request %s: the client went away", self.rid)
            return self.response

    async def _run(self) -> web.StreamResponse:
        while True:
            outcome, error = await self._segment()
            if outcome == "error":  # the first segment's 4xx (bad input): the client gets SGLang's answer as is
                return error
            if outcome == "finished":
                break
            self.done_ids += self.seg_ids
            self.done_text += self.seg_text
            for k, v in self.seg_lp.items():
                self.done_lp[k] += v
            self.seg_ids, self.seg_text, self.seg_lp = [], "", {}
            src = self.worker
            if outcome == "failed":
                dst = self._failover_target()
                if dst is None:
                    await self._end_with_error(
                        f"request {self.rid}: its worker failed and no other could continue it "
                        f"({'; '.join(self.failures)})")
                    break
                kind = "failover"
            else:
                dst, self.move_to, kind = self.move_to, None, "recompute"
            left = self._left()
            if left is not None and left <= 0:  # every token was out before the move took effect
                await self._emit(self._final_without_move())
                break
            if self.prompt_ids is None:
                self.prompt_ids = await self.tokenize(dst)
            details: dict = {}
            if kind == "recompute":  # the source is alive: its KV may go along
                kind, details = await self.gw.carry_kv(self, src, dst)
            self.migrations.append({"from": src, "to": dst, "kind": kind, "at_token": len(self.done_ids),
                                    **details})
            if not self.gw.incremental:  # what the client has seen, decoded as one (a move may split a character)
                self.done_text = await self._text(self.done_ids, worker=dst)
                self.boundaries.append(len(self.done_text))
            self.gw.count_migration(kind, src, dst)
            self.worker = dst
            self.finish_reason = None
            self.upstream_rid = f"m{len(self.migrations)}-{self.rid}"
        if self.client_stream and self.response is not None:
            await self.response.write(self.view.stream_end() if self.view is not None else b"data: [DONE]\n\n")
            await self.response.write_eof()
            return self.response
        last = self.last or {}
        error = last.get("error") if isinstance(last, dict) else None
        return web.json_response(self.view.response(last) if self.view is not None else last,
                                 status=error_status(error) if error is not None else 200, headers=self._headers())

    def _headers(self) -> dict:
        return {ROUTED_HEADER: self.answered_by} if self.answered_by else {}

    async def ask_move(self, dst: int, kind: str | None = None, route: str | None = None) -> None:
        """Moves the request to worker `dst` at the next chunk (aborts it where it runs); `kind` "kv" or
        "recompute" overrides the gateway's choice for this move, `route` ("pull", "relay") a KV move's route."""
        self.move_to, self.move_kind, self.move_route = dst, kind, route
        await self._abort_upstream()

    async def client_abort(self) -> None:
        self.client_aborted = True
        await self._abort_upstream()

    # ---- one segment ----------------------------------------------------------------------------------------------

    def _segment_body(self) -> dict:
        body = copy.deepcopy(self.body)
        body["stream"], body["rid"] = True, self.upstream_rid
        if self.migrations:
            body.pop("text", None)
            body["input_ids"] = self.prompt_ids + self.done_ids
            params = body.setdefault("sampling_params", {})
            params["max_new_tokens"] = self._left()
            if params.get("min_new_tokens"):
                params["min_new_tokens"] = max(0, int(params["min_new_tokens"]) - len(self.done_ids))
        return body

    def _left(self) -> int | None:
        """Tokens the request may still produce; None when it set no bound (`max_new_tokens` given as null, as a
        chat completion without `max_tokens` has it: the worker then stops at the context length, which the
        continued request, holding the output so far in its prompt, ends at too)."""
        params = self.body.get("sampling_params") or {}
        if "max_new_tokens" in params and params["max_new_tokens"] is None:
            return None
        return int(params.get("max_new_tokens", 128)) - len(self.done_ids)  # 128: SGLang's default when absent

    async def _segment(self) -> tuple[str, web.Response | None]:
        """'finished', 'moved', 'failed' (the worker is gone), or 'error' with the worker's 4xx answer."""
        headers = {"X-SMG-Target-Worker": str(self.gw.smg_index["native"][self.worker]),
                   "Content-Type": "application/json"}
        try:
            async with self.gw.session.post(self.gw.router_url + "/generate", json=self._segment_body(),
                                            headers=headers) as up:
                if up.status != 200:
                    text = await up.text()
                    if up.status < 500 and not self.migrations and self.last is None:
                        return "error", web.Response(status=up.status, text=text,
                                                     content_type=up.content_type or "application/json")
                    if up.status < 500:
                        await self._end_with_error(f"worker {self.worker} answered {up.status}: {text[:500]}")
                        return "finished", None
                    return await self._failed(f"worker {self.worker}: HTTP {up.status} {text[:200]}"), None
                self.gw.check_answered(self.worker, up.headers)
                self.answered_by = up.headers.get(ROUTED_HEADER, "")
                buffer = b""
                async for piece in up.content.iter_any():
                    buffer += piece
                    while b"\n\n" in buffer:
                        event, buffer = buffer.split(b"\n\n", 1)
                        outcome = await self._on_event(event.strip())
                        if outcome is not None:
                            return outcome, None
        except (TimeoutError, aiohttp.ClientError) as e:
            return await self._failed(f"worker {self.worker}: {type(e).__name__} {e}"), None
        return (await self._failed(f"worker {self.worker}: the stream ended without [DONE]")
                if self.move_to is None else "moved"), None

    async def _on_event(self, event: bytes) -> str | None:
        if not event.startswith(b"data:"):
            return None
        data = event[5:].strip()
        if data == b"[DONE]":
            ours = (self.move_to is not None and not self.client_aborted
                    and (self.finish_reason or {}).get("type") == "abort")
            return "moved" if ours else "finished"
        out = json.loads(data)
        if "error" in out:
            if self.move_to is None and not self.client_aborted and not await self.gw.worker_alive(self.worker):
                self.failures.append(f"worker {self.worker}: {out['error']}")
                return "failed"  # the proxy's word for a worker that went away
            await self._emit(out, data)
            return "finished"
        meta = out.get("meta_info") or {}
        if self.gw.incremental:
            self.seg_ids += out.get("output_ids") or []
            self.seg_text += out.get("text") or ""
            for k in OUTPUT_LOGPROBS:
                if meta.get(k):
                    self.seg_lp.setdefault(k, []).extend(meta[k])
        else:
            self.seg_ids, self.seg_text = out.get("output_ids") or [], out.get("text") or ""
            self.seg_lp = {k: meta[k] for k in OUTPUT_LOGPROBS if meta.get(k) is not None}
        if self.prompt_ids is not None:
            self.gw.progress(self, len(self.prompt_ids) + len(self.done_ids) + len(self.seg_ids))
        reason = meta.get("finish_reason") or {}
        self.finish_reason = reason if isinstance(reason, dict) else {"type": str(reason)}
        if isinstance(reason, dict) and reason.get("type") == "abort" and self.move_to is not None \
                and not self.client_aborted:
            return None  # our own abort: its tokens are kept, the chunk is not the client's
        if self.migrations:
            joined, stopped = await self._joined(out)
            await self._emit(joined)
            if stopped:
                await self._abort_upstream()  # the worker would go on: its stop check never saw the whole string
                return "finished"
        else:
            await self._emit(out, data)  # the worker's chunk as it came
        return None

    async def _joined(self, out: dict) -> tuple[dict, bool]:
        """A chunk of a moved request as its client sees it (in place): output ids and logprobs over every segment,
        the text of all of them decoded together, counts over both. Returns (chunk, stopped): stopped when a stop
        string the client asked for straddles a move (neither worker saw it whole) and ends the request here."""
        meta = out.setdefault("meta_info", {})
        stopped = False
        if not self.gw.incremental:  # deltas need no joining
            ids = self.done_ids + self.seg_ids
            lp = {k: self.done_lp[k] + v for k, v in self.seg_lp.items()}
            final = bool(meta.get("finish_reason"))  # the last chunk: decoded whole, held back nothing
            text = await (self._decoded(ids, final=True) if final else self._text(ids))
            found = self._straddling_stop(text)
            if found is not None:  # cut where the stop string completes, as the worker would have
                stop, at = found
                ids, text = await self._cut_at(ids, at + len(stop))
                trim = (self.body.get("sampling_params") or {}).get("no_stop_trim")
                text = text if trim else text[:at]
                lp = {k: v[:len(ids)] for k, v in lp.items()}
                meta["finish_reason"] = {"type": "stop", "matched": stop}
                stopped = True
            out["output_ids"], out["text"] = ids, text
            meta.update(lp)
        meta["id"] = self.rid
        meta["prompt_tokens"] = len(self.prompt_ids)
        meta["completion_tokens"] = len(out.get("output_ids") or []) if not self.gw.incremental else \
            len(self.done_ids) + len(self.seg_ids)
        meta["migrations"] = self.migrations
        return out, stopped

    async def _decoded(self, ids: list[int], final: bool, worker: int | None = None) -> str:
        """The text of `ids` decoded together by a worker's tokenizer (the running one by default); while the
        request runs, without a trailing incomplete character (the worker's own stream holds those back too)."""
        params = self.body.get("sampling_params") or {}
        url = self.gw.worker_urls[self.worker if worker is None else worker]
        async with self.gw.session.post(url + "/detokenize", json={
                "tokens": ids, "skip_special_tokens": params.get("skip_special_tokens", True)}) as r:
            r.raise_for_status()
            text = (await r.json())["text"]
        return text if final else text.rstrip("\ufffd")

    async def _text(self, ids: list[int], worker: int | None = None) -> str:
        """What `_decoded(ids, final=False)` gives, decoded incrementally (`ids`: the previous call's and more)."""
        return await self.decoder.step(ids, lambda part: self._decoded(part, final=True, worker=worker))

    def _straddling_stop(self, text: str) -> tuple[str, int] | None:
        """(stop string, where it starts) of the first stop string that crosses a move's boundary in `text`."""
        stop = (self.body.get("sampling_params") or {}).get("stop")
        stops = [stop] if isinstance(stop, str) else [x for x in (stop or []) if isinstance(x, str) and x]
        best = None
        for boundary in self.boundaries:
            for s in stops:
                start = max(0, boundary - len(s) + 1)
                at = text.find(s, start, boundary + len(s) - 1)
                if at != -1 and (best is None or at < best[1]):
                    best = (s, at)
        return best

    async def _cut_at(self, ids: list[int], end: int) -> tuple[list[int], str]:
        """The shortest prefix of `ids` whose text reaches `end` characters, and that text."""
        for k in range(max(1, len(self.done_ids)), len(ids) + 1):
            text = await self._decoded(ids[:k], final=True)
            if len(text) >= end:
                return ids[:k], text
        return ids, await self._decoded(ids, final=True)

    async def _emit(self, out: dict, raw: bytes | None = None) -> None:
        """Keeps `out` as the client's latest chunk and streams it to a streaming client (`raw`: its JSON as the
        worker sent it, when unchanged)."""
        self.last = out
        if not self.client_stream:
            return
        if self.response is None and self.view is not None and "error" in out:
            return  # nothing streamed yet: answered as an HTTP error, as the worker's OpenAI route does
        if self.response is None:
            self.response = web.StreamResponse(status=200, headers={
                "Content-Type": "text/event-stream", "Cache-Control": "no-cache", **self._headers()})
            await self.response.prepare(self.request)
        if self.view is not None:
            event = self.view.stream_chunk(out)
        else:
            event = b"data: " + (raw if raw is not None else json.dumps(out).encode()) + b"\n\n"
        try:
            await self.response.write(event)
        except ConnectionResetError as e:  # aiohttp's is also a ClientError: not the worker's failure
            raise ClientGone(str(e)) from e

    # ---- moves and failures ---------------------------------------------------------------------------------------

    async def _abort_upstream(self) -> None:
        url = self.gw.worker_urls[self.worker]
        try:
            async with self.gw.session.post(url + "/abort_request", json={"rid": self.upstream_rid},
                                            headers=self.gw.admin_headers(),  # an admin route in SGLang
                                            timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as r:
                text = await r.text()
                if r.status != 200:
                    logger.warning("abort of %s at %s answered %d: %s", self.upstream_rid, url, r.status, text[:200])
        except (TimeoutError, aiohttp.ClientError) as e:
            logger.warning("abort of %s at %s failed: %s", self.upstream_rid, url, e)

    async def _failed(self, why: str) -> str:
        if self.client_aborted:
            return "finished"
        if self.move_to is not None:
            return "moved"  # the abort closed the stream early
        self.failures.append(why)
        if await self.gw.worker_alive(self.worker):
            # the worker answers its health check: treat as a transient failure of this stream and go elsewhere
            logger.warning("request %s lost its stream (%s); the worker is up, continuing elsewhere", self.rid, why)
        return "failed"

    def _failover_target(self) -> int | None:
        if len(self.failures) > MAX_FAILOVERS:
            return None
        return self.gw.pick_other(self.adapter, self.prompt, exclude=self.worker)

    async def tokenize(self, worker: int) -> list[int]:
        async with self.gw.session.post(self.gw.worker_urls[worker] + "/tokenize",
                                        json={"prompt": self.body["text"]}) as r:
            r.raise_for_status()
            return list((await r.json())["tokens"])

    async def _end_with_error(self, message: str) -> None:
        logger.error(message)
        await self._emit({"error": {"message": message, "type": "server_error", "code": 503, "retryable": True}})

    def _final_without_move(self) -> dict:
        meta = dict((self.last or {}).get("meta_info") or {})
        meta.update(id=self.rid, finish_reason={"type": "length", "length": len(self.done_ids)},
                    completion_tokens=len(self.done_ids), migrations=self.migrations)
        return {"text": self.done_text, "output_ids": self.done_ids, "meta_info": meta}
