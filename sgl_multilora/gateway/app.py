"""LoRA-aware placement in front of smg: the smallest layer that smg 1.13.0 needs to route by adapter.

Lives here: `python -m sgl_multilora.gateway.app`, an HTTP front that clients use exactly as one SGLang server.
For each generation request it reads the adapter (`lora_path` of `/generate`, or OpenAI's `model="<base>:<adapter>"`)
and the prompt's start, asks `Placement` (cluster/placement.py) for a worker, and forwards the request unchanged to
smg with smg's own routing header `X-SMG-Target-Worker` (smg runs `--policy consistent_hashing`, the policy that
honours it). smg does the rest: connections, health, retries, streaming. Every other path goes to smg as is.
`GET /cluster/stats` is the cluster view: placements, routed counts, moves by kind, workers down, and each worker's
KV and adapter memory from its `/multilora/stats`. Not here: starting processes (launch.py).

Single-prompt native `/generate` requests (no input logprobs), OpenAI `/v1/completions` requests of one prompt
and plain `/v1/chat/completions` requests (openai_view.py says which; they run as the native requests their
worker's OpenAI route would run, a chat's built by the worker itself, and their client gets OpenAI's objects) are
carried: the gateway streams them from the worker and can move them
mid-generation, when asked (`POST /cluster/migrate {"rid": ..., "to": worker}`) or when their worker
fails, by token transfer + recompute; their clients see one stream (carry.py has the protocol). A worker whose
`/health` stops answering is taken out of routing. `/abort_request` for a carried request reaches the worker that
runs it now.

Why a layer at all (smg 1.13.0, checked live): its policies key on prompt text only (`lora_path` is not part of
cache_aware's tree, so it promises affinity across adapters that the workers cannot honour); an OpenAI request
naming `<base>:<adapter>` is answered 404 `model_not_found` (adapters are not model ids, and a worker takes one
model id only); workers report no adapter residency. Its header routing is the extension point that fits, so the
decision is ours and the transport smg's. OpenAI requests naming an adapter are passed to smg as the base model
with SGLang's `lora_path` field, which the workers honour.

Keys, as a worker started with them has them (SGLang's convention): with the workers' `--api-key` (the launcher
passes it in `SGL_MULTILORA_API_KEY`) every route but `/health*`, `/ready*` and `/metrics*` wants it as
`Authorization: Bearer <key>` (401 otherwise) and the gateway presents it on its own calls to smg and the workers;
`/cluster/migrate`, which moves other clients' requests, wants the workers' admin key when there is one.

`X-SMG-Target-Worker` is an index into smg's own worker order, which is not `--worker-urls`' order and differs
between `/generate` (no model named) and the OpenAI routes (the served model's workers): the gateway learns both at
start (one probe per index, reading smg's `x-smg-routed-worker-id` answer header) and again whenever an answer comes
from another worker than the one asked for.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import time
from collections import Counter

import aiohttp
from aiohttp import web

from sgl_multilora.cluster.balance import LiveBalancer
from sgl_multilora.gateway.carry import ROUTED_HEADER, CarriedRequest, carriable
from sgl_multilora.gateway.launch import ADMIN_KEY_ENV, API_KEY_ENV, bearer
from sgl_multilora.gateway.moves import (
    INITIAL_LINK_BYTES_PER_S,
    MIGRATION_KINDS,
    MovesMixin,
    worker_memory,
)
from sgl_multilora.gateway.openai_view import ChatView, CompletionView, ServingSettings, completion_as_native
from sgl_multilora.cluster.placement import NoWorkerError, Placement

logger = logging.getLogger("sgl_multilora.gateway.app")
CHAT_NATIVE_ROUTE = "/multilora/chat/native"  # patches/chat_native.py (the gateway imports no SGLang)
GENERATION_PATHS = ("/generate", "/v1/chat/completions", "/v1/completions")
OPEN_PATHS = ("/health", "/ready", "/metrics")  # probes: open whatever keys are set, as on SGLang's servers
ADMIN_PATHS = ("/cluster/migrate",)
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "content-encoding"}


def adapter_and_prompt(path: str, body: dict) -> tuple[str | None, str, dict]:
    """(adapter or None, the prompt's text for affinity, the body to forward)."""
    if path == "/generate":
        lora = body.get("lora_path")
        lora = lora[0] if isinstance(lora, list) and lora else lora
        text = body.get("text")
        if isinstance(text, list):
            text = text[0] if text else ""
        if text is None:
            ids = body.get("input_ids") or []
            ids = ids[0] if ids and isinstance(ids[0], list) else ids
            text = " ".join(map(str, ids[:128]))
        return (lora or None), str(text), body
    model = str(body.get("model") or "")
    adapter = None
    if ":" in model:  # SGLang's "<base>:<adapter>"; smg knows only the base model id
        base, adapter = model.split(":", 1)
        body = {**body, "model": base, "lora_path": adapter}
    elif body.get("lora_path"):
        adapter = body["lora_path"]
    if path == "/v1/chat/completions":
        prompt = "\n".join(str(m.get("content", "")) for m in body.get("messages") or [] if isinstance(m, dict))
    else:
        prompt = body.get("prompt") or ""
        prompt = prompt[0] if isinstance(prompt, list) and prompt else prompt
    return adapter, str(prompt), body


class Gateway(MovesMixin):
    def __init__(self, router_url: str, worker_urls: list[str], placement: Placement, *, migration: str = "auto",
                 admin_key: str | None = None, api_key: str | None = None, balancer: LiveBalancer | None = None,
                 balance_epoch_s: float = 0.4) -> None:
        if migration not in MIGRATION_KINDS:
            raise ValueError(f"migration must be one of {', '.join(MIGRATION_KINDS)}, got {migration!r}")
        self.router_url, self.worker_urls, self.placement = router_url.rstrip("/"), worker_urls, placement
        self.in_flight = [0] * len(worker_urls)
        self.smg_index: dict[str, list[int]] = {}  # route kind -> our worker -> smg's index
        self.served_model: str | None = None
        self.session: aiohttp.ClientSession | None = None
        self.relearned = 0
        self.incremental = False  # the workers stream deltas (--incremental-streaming-output)
        self.serving = ServingSettings()  # what the workers' OpenAI route reads from their arguments
        self.carried: dict[str, CarriedRequest] = {}  # rid -> a single-prompt /generate request in flight
        self.migrations: dict[str, int] = {"kv": 0, "recompute": 0, "failover": 0}
        self.migration, self.admin_key, self.api_key = migration, admin_key, api_key
        self.link_bytes_per_s = INITIAL_LINK_BYTES_PER_S  # measured over KV transfers
        self.memory_reads: dict[int, tuple[float, asyncio.Future]] = {}  # worker -> its last /multilora/stats read
        self.clock = time.monotonic
        self.kv_moves = {"tokens": 0, "bytes": 0, "seconds": 0.0, "failed": 0, "pulled": 0, "relayed": 0}
        self.balancer, self.balance_epoch_s = balancer, balance_epoch_s
        self.balanced_moves = 0
        self._balancing: asyncio.Task | None = None
        self.down_events = 0
        self._relearning: asyncio.Task | None = None
        self.chat_carried = 0  # chat completions carried (movable)
        self.chat_passed: Counter[str] = Counter()  # chat completions passed to smg, by the worker's reason

    async def start(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                                             headers=bearer(self.api_key))
        await self.learn_order()
        await self.learn_alora()
        async with self.session.get(self.worker_urls[0] + "/get_server_info") as r:
            info = await r.json() if r.status == 200 else {}
        self.incremental = bool(info.get("incremental_streaming_output"))
        self.serving = ServingSettings.from_server_info(info)
        self._watching = asyncio.create_task(self.watch_down())
        self._balancing = (asyncio.create_task(self.balance_epochs(self.balance_epoch_s))
                           if self.balancer is not None else None)

    async def stop(self, app: web.Application) -> None:
        self._watching.cancel()
        if self._balancing is not None:
            self._balancing.cancel()
        await self.session.close()

    async def learn_order(self) -> None:
        """smg's index of each worker, per kind of route (smg orders the workers of a named model apart from the
        unnamed workers `/generate` goes to): one one-token request per index, reading who answered."""
        async with self.session.get(self.worker_urls[0] + "/v1/models") as r:
            self.served_model = (await r.json())["data"][0]["id"]
        probes = {"native": ("/generate", {"text": "ping", "sampling_params": {"max_new_tokens": 1}}),
                  "openai": ("/v1/completions", {"model": self.served_model, "prompt": "ping", "max_tokens": 1})}
        for kind, (path, body) in probes.items():
            found: list[int | None] = [None] * len(self.worker_urls)
            for index in range(len(self.worker_urls) - len(self.placement.down)):
                async with self.session.post(self.router_url + path, json=body,
                                             headers={"X-SMG-Target-Worker": str(index)}) as r:
                    await r.read()
                    url = r.headers.get(ROUTED_HEADER, "").rstrip("/")
                if url in self.worker_urls:
                    found[self.worker_urls.index(url)] = index
            missing = [w for w, i in enumerate(found) if i is None and w not in self.placement.down]
            if missing:
                raise RuntimeError(f"smg at {self.router_url} did not route {path} to every worker by index: {found}")
            self.smg_index[kind] = [-1 if i is None else i for i in found]

    async def learn_alora(self) -> None:
        names: set[str] = set()
        for url in self.worker_urls:
            async with self.session.get(url + "/multilora/stats") as r:
                stats = await r.json() if r.status == 200 else {}
            for memory in stats.get("memory") or []:
                names |= set(((memory or {}).get("adapters") or {}).get("alora") or [])
        self.placement.set_alora(sorted(names))

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        worker = None
        if request.method == "POST" and request.path == "/abort_request":
            try:
                carried = self.carried.get(str(json.loads(raw or b"{}").get("rid")))
            except (ValueError, AttributeError):
                carried = None
            if carried is not None:  # its worker knows it under the rid of its current segment
                await carried.client_abort()
                return web.Response(status=200)
        if request.method == "POST" and request.path in GENERATION_PATHS:
            try:
                body = json.loads(raw or b"{}")
            except ValueError:
                body = None
            if isinstance(body, dict):
                client_model = body.get("model")  # a single server answers with the model named, adapter and all
                adapter, prompt, body = adapter_and_prompt(request.path, body)
                try:
                    worker = self.placement.route(adapter, prompt, self.in_flight)
                except NoWorkerError as e:
                    return web.json_response({"error": {"message": str(e), "code": 503}}, status=503)
                if request.path == "/generate" and carriable(body):
                    return await self._carry(request, body, adapter, prompt, worker)
                if request.path == "/v1/completions":
                    native = completion_as_native(body, self.serving)
                    if native is not None:
                        view = CompletionView({**body, "model": client_model}, self.serving, self.incremental)
                        return await self._carry(request, native, adapter, prompt, worker, view)
                if request.path == "/v1/chat/completions":
                    native = await self.chat_as_native(body, worker, request.headers.get("Authorization"))
                    if native is not None:
                        view = ChatView({**body, "model": client_model}, self.serving, self.incremental)
                        return await self._carry(request, native, adapter, prompt, worker, view)
                raw = json.dumps(body).encode()
                kind = "native" if request.path == "/generate" else "openai"
                headers["X-SMG-Target-Worker"] = str(self.smg_index[kind][worker])
                headers["Content-Type"] = "application/json"
                self.in_flight[worker] += 1
        try:
            return await self._forward(request, raw, headers, worker)
        finally:
            if worker is not None:
                self.in_flight[worker] -= 1

    async def chat_as_native(self, body: dict, worker: int, authorization: str | None = None) -> dict | None:
        """The native body `worker`'s own chat route would run for `body` (patches/chat_native.py), or None when the
        worker says the request cannot be carried, or cannot say: it then goes to smg as before. The client's
        `Authorization` goes along, as it does to smg (workers started with `--api-key` want it)."""
        headers = {"Authorization": authorization} if authorization else None
        try:
            async with self.session.post(self.worker_urls[worker] + CHAT_NATIVE_ROUTE, json=body, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=60)) as r:
                answer = await r.json() if r.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        native = answer.get("native") if isinstance(answer, dict) else None
        if isinstance(native, dict) and carriable(native):
            self.chat_carried += 1
            return native
        self.chat_passed[str(answer.get("reason") if isinstance(answer, dict) else None)] += 1
        return None

    async def _forward(self, request, raw: bytes, headers: dict, worker: int | None) -> web.StreamResponse:
        async with self.session.request(request.method, self.router_url + request.path_qs, data=raw,
                                        headers=headers) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            if worker is not None:
                self.check_answered(worker, upstream.headers)
        return response

    async def cluster_stats(self, request: web.Request) -> web.Response:
        async def worker_view(i: int, url: str) -> dict:
            view = {"url": url, "smg_index": {k: v[i] for k, v in self.smg_index.items()},
                    "in_flight": self.in_flight[i]}
            try:
                async with self.session.get(url + "/multilora/stats",
                                            timeout=aiohttp.ClientTimeout(total=10)) as r:
                    stats = await r.json()
                memory = (stats.get("memory") or [None])[0] or {}
                view["kv"] = {k: memory.get(k) for k in ("total", "free", "cache_evictable", "cache_protected",
                                                         "running", "waiting")}
                view["adapters"] = {k: (memory.get("adapters") or {}).get(k) for k in ("loaded", "total")}
                if memory.get("unified_pool"):
                    view["unified_pool"] = memory["unified_pool"].get("bytes")
                trees = stats.get("schedulers") or []
                if trees and trees[0]:
                    view["tree"] = {k: trees[0].get(k) for k in ("num_kv_nodes", "total_len", "num_evicted_tokens",
                                                                 "hit_tokens")}
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                view["error"] = str(e) or type(e).__name__
            return view

        workers = await asyncio.gather(*(worker_view(i, u) for i, u in enumerate(self.worker_urls)))
        return web.json_response({"router": self.router_url, "placement": self.placement.view(),
                                  "relearned_order": self.relearned, "carried": len(self.carried),
                                  "migrations": self.migrations, "down": sorted(self.placement.down),
                                  "balancer": (None if self.balancer is None
                                               else {**self.balancer.view(), "moves_started": self.balanced_moves}),
                                  "kv_transfer": {**self.kv_moves, "policy": self.migration,
                                                  "enabled": bool(self.admin_key),
                                                  "link_bytes_per_s": round(self.link_bytes_per_s)},
                                  "chat": {"carried": self.chat_carried, "passed": dict(self.chat_passed)},
                                  "down_events": self.down_events, "workers": list(workers)})


def required_key(path: str, api_key: str | None, admin_key: str | None) -> str | None:
    """The key a request for `path` must present, or None (open): probes are open; the admin paths want the admin
    key, or the API key when there is no admin key; every other path the API key."""
    if path.startswith(OPEN_PATHS):
        return None
    if path in ADMIN_PATHS and admin_key:
        return admin_key
    return api_key


def presents(authorization: str | None, key: str) -> bool:
    """`Authorization: Bearer <key>`, compared in constant time."""
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode())


def auth_middleware(gateway: Gateway):
    @web.middleware
    async def check_key(request: web.Request, handler):
        key = required_key(request.path, gateway.api_key, gateway.admin_key)
        if key is not None and not presents(request.headers.get("Authorization"), key):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check_key


def make_app(gateway: Gateway) -> web.Application:
    app = web.Application(client_max_size=256 * 2**20, middlewares=[auth_middleware(gateway)])
    app.on_startup.append(gateway.start)
    app.on_cleanup.append(gateway.stop)
    app.router.add_get("/cluster/stats", gateway.cluster_stats)
    app.router.add_post("/cluster/migrate", gateway.migrate)
    app.router.add_route("*", "/{tail:.*}", gateway.handle)
    return app


def _kv_capacity(url: str, api_key: str | None = None) -> int:
    """A worker's KV token slots, from its `/multilora/stats` (its `--max-total-tokens`)."""
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(url + "/multilora/stats", headers=bearer(api_key)),
                                timeout=60) as r:
        kv_tokens = worker_memory(json.loads(r.read())).kv_tokens
    if kv_tokens is None:
        raise SystemExit(f"{url}/multilora/stats reports no KV pool size; --balancer mell needs it")
    return kv_tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sgl_multilora.gateway.app", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--router-url", required=True, help="smg, started with --policy consistent_hashing")
    parser.add_argument("--worker-urls", nargs="+", required=True, help="the workers smg routes to")
    parser.add_argument("--replication", type=float, default=1.0,
                        help="replicas per adapter = ceil(request share x workers x this), at least 1")
    parser.add_argument("--cache-threshold", type=float, default=0.3,
                        help="go to the worker holding a request's longest prefix when it covers this share")
    parser.add_argument("--balance-abs", type=int, default=2, help="overloaded: this many more requests in "
                        "flight than the least loaded worker ...")
    parser.add_argument("--balance-rel", type=float, default=1.5, help="... and this many times its count")
    parser.add_argument("--migration", choices=MIGRATION_KINDS, default="auto",
                        help="how a moved request's KV reaches its new worker: auto (per move, the cheaper by the "
                        "measured link and prefill speeds), kv (always transferred), recompute (always recomputed)")
    parser.add_argument("--balancer", choices=("none", "mell"), default="none",
                        help="mell: MELL's KV packing places carried requests and moves them as their KV grows "
                        "(cluster/balance.py); none: placement alone")
    parser.add_argument("--balance-fill", type=float, default=0.8,
                        help="with --balancer mell: the share of a worker's KV slots the packing may fill")
    parser.add_argument("--balance-epoch-s", type=float, default=0.4,
                        help="with --balancer mell: queued Departs and Updates are applied once per epoch")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s")
    placement = Placement(len(args.worker_urls), replication=args.replication, cache_threshold=args.cache_threshold,
                          balance_abs=args.balance_abs, balance_rel=args.balance_rel)
    urls = [u.rstrip("/") for u in args.worker_urls]
    balancer, api_key = None, os.environ.get(API_KEY_ENV) or None
    if args.balancer == "mell":
        from sgl_multilora.cluster.mell import MellPacker

        capacity = min(_kv_capacity(url, api_key) for url in urls)
        balancer = LiveBalancer(MellPacker(max(1, int(capacity * args.balance_fill))), len(urls))
    gateway = Gateway(args.router_url, urls, placement, migration=args.migration,
                      admin_key=os.environ.get(ADMIN_KEY_ENV) or None, api_key=api_key, balancer=balancer,
                      balance_epoch_s=args.balance_epoch_s)
    web.run_app(make_app(gateway), host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
