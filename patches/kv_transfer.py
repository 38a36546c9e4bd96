"""Moving cached KV between servers: `POST /multilora/kv/export` and `POST /multilora/kv/import`.

A request that moves to another worker (the cluster's moves, `sgl_multilora/gateway/carry.py`) can take its KV with
it instead of recomputing it: the source exports the KV its tree holds for the request's tokens, the destination
imports it into its own tree as cached KV, and the request continued there matches it like any cached prefix.

The wire format is one safetensors file (no pickle): tensors `k` and `v` of shape (layers, tokens, heads, head_dim)
in the pool's dtype, and string metadata: the format tag, the served model, the shapes, the namespace (the client's
`extra_key`, `cache_salt`), the adapter's name and content identity, the token ids. An import is refused (HTTP 400,
naming what differs) unless the destination serves the same model with the same KV layout and has an adapter of
the same content identity loaded: KV joins the tree only under the adapter whose weights produced it. Both routes
read or write any tenant's KV, so they are admin routes in SGLang's convention: they answer only on a server
started with `--admin-api-key`, to a caller presenting it (the cluster launcher sets one for its workers).

How it reaches the scheduler: the HTTP process sends SGLang's own `GetInternalStateReq` (the message behind
`/server_info`) with the command in its `rid` (`kv-transfer:` + JSON), and the scheduler's `get_internal_state`
hook runs it in the scheduler loop, between batches, like every other control message. The tensors travel through a
private file (mode 0600, in /dev/shm where it exists) named in the command, never through the typed message. An
import takes slots from the KV allocator (evicting by the tree's policy when short: on the unified pool through the
swapper, so the adapter-before-KV rule holds), writes K and V, and inserts the run; tokens the destination already
caches are not written again. On the unified pool, KV of an adapter joins only while the
adapter is resident (it is made resident if memory allows; otherwise only an aLoRA's base part is imported).
Server to server: an import whose body is JSON `{"from": URL, "export": {...}}` pulls the export from that server
itself, presenting its own admin key there (the cluster's workers share one), so the bytes go worker to worker and
the caller (the cluster's gateway) sends only the request. Single scheduler only (no data parallelism): the command
is fanned out to every rank, and only rank 0 acts.
"""


import asyncio
import json
import logging
import os
import tempfile
import time

import torch

from sgl_multilora.keys import MatchKey

logger = logging.getLogger(__name__)

FORMAT = "sgl-multilora-kv/1"
COMMAND_PREFIX = "kv-transfer:"
EXPORT_ROUTE = "/multilora/kv/export"
IMPORT_ROUTE = "/multilora/kv/import"
TOKENS_HEADER = "X-Multilora-KV-Tokens"
PULL_TIMEOUT_S = 120.0


class TransferError(ValueError):
    """Bad input to an export or import: the message names what was wrong (HTTP 400)."""


# ---- scheduler process ------------------------------------------------------------------------------------------


def scheduler_internal_state(result, self, recv_req, *args, **kwargs):
    """AFTER hook on `Scheduler.get_internal_state`: runs a KV transfer command carried in the request's rid."""
    rid = getattr(recv_req, "rid", None)
    if not isinstance(rid, str) or not rid.startswith(COMMAND_PREFIX):
        return result
    try:
        command = json.loads(rid[len(COMMAND_PREFIX):])
        if getattr(self, "dp_rank", None) not in (None, 0):
            answer = {"ok": True, "skipped": "not rank 0"}
        elif command.get("op") == "export":
            answer = {"ok": True, **export_kv(self, command)}
        elif command.get("op") == "import":
            answer = {"ok": True, **import_kv(self, command)}
        else:
            raise TransferError(f"unknown KV transfer operation {command.get('op')!r}")
    except TransferError as e:
        answer = {"ok": False, "error": str(e)}
    except Exception as e:  # never let a transfer take the scheduler down
        logger.exception("KV transfer failed")
        answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    result.internal_state["multilora_kv"] = answer
    return result


def _cache(scheduler):
    from sgl_multilora.patches.radix_backend import MultiLoRARadixCache

    cache = getattr(scheduler, "tree_cache", None)
    if not isinstance(cache, MultiLoRARadixCache) or cache.disable:
        raise TransferError("KV transfer needs --radix-cache-backend multilora with the prefix cache on")
    kv = cache.token_to_kv_pool_allocator.get_kvcache()
    if not hasattr(kv, "k_buffer") or not hasattr(kv, "v_buffer"):
        raise TransferError(f"KV transfer needs per-layer K and V buffers; this server's pool is "
                            f"{type(kv).__name__}")
    return cache, kv.k_buffer, kv.v_buffer


def _layout(k_buffers) -> dict:
    return {"layers": len(k_buffers), "row_shape": list(k_buffers[0].shape[1:]), "dtype": str(k_buffers[0].dtype)}


def _key(cache, command: dict, token_ids: list[int], spec):
    namespace = cache.namespace_for(command.get("extra_key"), command.get("cache_salt"))
    return cache.key_for(namespace, spec, token_ids, command.get("prompt_ids") or token_ids)


def export_kv(scheduler, command: dict) -> dict:
    """Writes the KV the tree holds for the longest cached prefix of `command["input_ids"]` to `command["path"]`.
    Returns {"tokens": n} (0: nothing cached; no file is written then)."""
    from safetensors.torch import save_file

    cache, k_buffers, v_buffers = _cache(scheduler)
    token_ids = [int(t) for t in command["input_ids"]]
    spec = None
    name = command.get("lora_path")
    if name is not None:
        found = cache.adapters.find(name=name)
        if found is None:
            raise TransferError(f"adapter {name!r} is not loaded on this server")
        spec = found[1]
    key = _key(cache, command, token_ids, spec)
    match = cache.tree.match(key, touch=False)
    n = match.prefix_len
    if n == 0:
        return {"tokens": 0}
    rows = torch.tensor(match.kv_values, dtype=torch.int64, device=k_buffers[0].device)
    k = torch.stack([b.index_select(0, rows) for b in k_buffers]).cpu()
    v = torch.stack([b.index_select(0, rows) for b in v_buffers]).cpu()
    metadata = {
        "format": FORMAT, "model": cache.model_id, **{f: json.dumps(x) for f, x in _layout(k_buffers).items()},
        "extra_key": json.dumps(command.get("extra_key")), "cache_salt": json.dumps(command.get("cache_salt")),
        "adapter_name": json.dumps(spec.name if spec else None),
        "adapter_identity": json.dumps(spec.identity if spec else None),
        "input_ids": json.dumps(token_ids[:n]), "prompt_ids": json.dumps(command.get("prompt_ids")),
    }
    save_file({"k": k.contiguous(), "v": v.contiguous()}, command["path"], metadata=metadata)
    return {"tokens": n}


def _read(path: str) -> tuple[dict, torch.Tensor, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            if metadata.get("format") != FORMAT:
                raise TransferError(f"not a KV export of format {FORMAT} (format {metadata.get('format')!r})")
            if set(f.keys()) != {"k", "v"}:
                raise TransferError(f"a KV export holds tensors k and v, this one {sorted(f.keys())}")
            k, v = f.get_tensor("k"), f.get_tensor("v")
        meta = {key: (value if key in ("format", "model") else json.loads(value)) for key, value in metadata.items()}
    except SafetensorError as e:
        raise TransferError(f"the body is not a readable safetensors file ({e})") from None
    except (json.JSONDecodeError, TypeError) as e:
        raise TransferError(f"malformed KV export metadata ({e})") from None
    return meta, k, v


def import_kv(scheduler, command: dict) -> dict:
    """Inserts the KV of the file at `command["path"]` into the tree as cached KV. Returns {"tokens": KV tokens the
    file holds, "imported": tokens written, "cached": tokens the tree held already, "reason": why fewer}."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cache, k_buffers, v_buffers = _cache(scheduler)
    meta, k, v = _read(command["path"])
    if meta.get("model") != cache.model_id:
        raise TransferError(f"the KV is of model {meta.get('model')!r}; this server serves {cache.model_id!r}")
    here = _layout(k_buffers)
    there = {f: meta.get(f) for f in here}
    if there != here:
        raise TransferError(f"the KV layout {there} differs from this server's {here}")
    token_ids = meta.get("input_ids")
    if not isinstance(token_ids, list) or not all(isinstance(t, int) for t in token_ids):
        raise TransferError("the KV export's input_ids must be a list of token ids")
    n = len(token_ids)
    expected = (here["layers"], n, *here["row_shape"])
    if tuple(k.shape) != expected or tuple(v.shape) != expected or str(k.dtype) != here["dtype"]:
        raise TransferError(f"k and v must be {here['dtype']} of shape {expected}; got {tuple(k.shape)} "
                            f"{tuple(v.shape)} {k.dtype}")
    spec = None
    identity = meta.get("adapter_identity")
    if identity is not None:
        found = cache.adapters.find(identity=identity)
        if found is None:
            raise TransferError(f"no adapter with the KV's identity {identity} ({meta.get('adapter_name')!r}) is "
                                f"loaded on this server")
        spec = found[1]
    key = _key(cache, meta, token_ids, spec)
    reason = None
    if key.adapter is not None and cache.memory is not None \
            and not cache.memory.ensure_resident(key.adapter.identity, None):
        n, reason = key.alora_start or 0, "adapter not resident"  # only an aLoRA's base part may join
        key = _key(cache, meta, token_ids[:n], None)
    n = n // cache.page_size * cache.page_size
    if key.alora_start is not None and n <= key.alora_start:  # nothing of the adapter's own part is left
        key = _key(cache, meta, token_ids[:n], None)
    else:
        key = MatchKey(key.namespace, key.adapter, token_ids[:n], key.alora_start)
    tree = cache.tree
    match = tree.match(key, touch=False)
    start = match.prefix_len
    if start >= n:
        return {"tokens": len(token_ids), "imported": 0, "cached": start, "reason": reason}
    need = n - start
    allocator = cache.token_to_kv_pool_allocator
    began = time.perf_counter()
    tree.lock(match.last_node)  # making room never evicts the prefix this run hangs below
    # nor the adapter the run depends on: with no KV of its own yet, nothing else holds it, and it was evicted for
    # the room its own KV needed (a 2,058-token move then found "adapter not resident")
    pinned = key.adapter.identity if key.adapter is not None and cache.memory is not None else None
    if pinned is not None:
        cache.memory.residency.acquire(pinned)
    try:
        slots = allocator.alloc(need)
        if slots is None:
            cache.evict(EvictParams(num_tokens=need))
            slots = allocator.alloc(need)
        if slots is None:
            return {"tokens": len(token_ids), "imported": 0, "cached": start, "reason": "no free KV memory"}
        rows = slots.to(device=k_buffers[0].device, dtype=torch.int64)
        for layer in range(len(k_buffers)):
            k_buffers[layer].index_copy_(0, rows, k[layer, start:n].to(k_buffers[layer].device))
            v_buffers[layer].index_copy_(0, rows, v[layer, start:n].to(v_buffers[layer].device))
        new = rows.tolist()
        result = tree.insert(key, match.kv_values + new)
        assert result.prefix_len == start, (result.prefix_len, start)
        if cache.memory is not None:
            allocator.mark_cached(new)
    finally:
        tree.unlock(match.last_node)
        if pinned is not None:
            cache.memory.residency.release(pinned)
    logger.info("imported %d tokens of KV (%d cached already) in %.3f s", need, start, time.perf_counter() - began)
    return {"tokens": len(token_ids), "imported": need, "cached": start, "reason": reason}


# ---- HTTP process -----------------------------------------------------------------------------------------------


def _spool_file() -> str:
    """A new private (0600) file for the tensors between the HTTP and scheduler processes, RAM-backed where
    possible; the route that made it removes it."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    fd, path = tempfile.mkstemp(prefix="sgl-multilora-kv-", suffix=".safetensors", dir=base)
    os.close(fd)
    return path


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:  # the private file `_spool_file` made
        f.write(data)


async def _pull(source, export, admin_key: str) -> bytes | None:
    """The KV export `source` (a server's base URL) answers for `export`, fetched from it directly; None when it
    caches nothing for those tokens. Raises TransferError naming what failed."""
    import aiohttp

    if not isinstance(source, str) or not source.startswith(("http://", "https://")):
        raise TransferError(f"'from' must be a server's http(s) URL, got {source!r}")
    if not isinstance(export, dict):
        raise TransferError("'export' must be the export's JSON body: {\"input_ids\": [...], \"lora_path\": ...}")
    url = source.rstrip("/") + EXPORT_ROUTE
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PULL_TIMEOUT_S)) as session:
            async with session.post(url, json=export, headers={"Authorization": f"Bearer {admin_key}"}) as r:
                if r.status == 204:
                    return None
                if r.status != 200:
                    raise TransferError(f"the export at {source} answered HTTP {r.status}: {(await r.text())[:300]}")
                return await r.read()
    except (aiohttp.ClientError, TimeoutError) as e:
        raise TransferError(f"could not pull the KV export from {source} ({type(e).__name__}: {e})") from None


async def _run(command: dict) -> dict:
    from sglang.srt.entrypoints import http_server
    from sglang.srt.managers.io_struct import GetInternalStateReq

    manager = http_server.get_global_state().tokenizer_manager
    manager.auto_create_handle_loop()
    request = GetInternalStateReq(rid=COMMAND_PREFIX + json.dumps(command))
    answers = [r.internal_state.get("multilora_kv") for r in await manager.get_internal_state_communicator(request)]
    answers = [a for a in answers if a is not None and "skipped" not in a]
    if not answers:
        return {"ok": False, "error": "the scheduler did not run the KV transfer (is the plugin loaded?)"}
    return answers[0]


def add_routes(*args, **kwargs):
    """BEFORE hook on `http_server.launch_server` (HTTP process only): the two admin routes. Idempotent."""
    from fastapi import Request
    from fastapi.responses import ORJSONResponse, Response
    from sglang.srt.entrypoints import http_server
    from sglang.srt.utils.auth import AuthLevel, auth_level

    if any(getattr(route, "path", None) == EXPORT_ROUTE for route in http_server.app.routes):
        return

    def error(message: str, status: int = 400):
        return ORJSONResponse({"error": {"message": message}}, status_code=status)

    def admin_missing():
        if not http_server.get_serving().admin_api_key:
            return error("KV export and import read and write any tenant's cache; start the server with "
                         "--admin-api-key to enable them", 403)
        return None

    @http_server.app.post(EXPORT_ROUTE)
    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def multilora_kv_export(request: Request):
        """Body: {"input_ids": [...], "lora_path": name or null, "extra_key", "cache_salt", "prompt_ids"}. Answers
        the KV of the longest cached prefix as a safetensors file (204 when nothing is cached)."""
        if (missing := admin_missing()) is not None:
            return missing
        try:
            body = await request.json()
        except ValueError:
            return error("the body must be JSON: {\"input_ids\": [...], \"lora_path\": ...}")
        ids = body.get("input_ids") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            return error("input_ids must be a non-empty list of token ids")
        path = _spool_file()
        command = {"op": "export", "path": path, "input_ids": ids,
                   **{f: body.get(f) for f in ("lora_path", "extra_key", "cache_salt", "prompt_ids")}}
        try:
            answer = await _run(command)
            if not answer.get("ok"):
                return error(answer.get("error", "KV export failed"))
            if answer["tokens"] == 0:
                return Response(status_code=204, headers={TOKENS_HEADER: "0"})
            data = await asyncio.to_thread(_read_bytes, path)  # never block the server's event loop
            return Response(content=data, media_type="application/octet-stream",
                            headers={TOKENS_HEADER: str(answer["tokens"])})
        finally:
            if os.path.exists(path):
                os.unlink(path)

    @http_server.app.post(IMPORT_ROUTE)
    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def multilora_kv_import(request: Request):
        """Body: a KV export (safetensors), or JSON {"from": a server's URL, "export": an export body} to pull it
        from that server directly (server to server, presenting this server's admin key). Answers {"tokens",
        "imported", "cached", "reason", "bytes"}."""
        if (missing := admin_missing()) is not None:
            return missing
        if request.headers.get("content-type", "").startswith("application/json"):
            try:
                body = await request.json()
                data = await _pull(body.get("from"), body.get("export"), http_server.get_serving().admin_api_key)
            except (ValueError, AttributeError) as e:  # TransferError is a ValueError
                return error(str(e) if isinstance(e, TransferError) else
                             "a pull is JSON: {\"from\": \"http://host:port\", \"export\": {\"input_ids\": ...}}")
            if data is None:
                return {"tokens": 0, "imported": 0, "cached": 0, "reason": "nothing cached at the source", "bytes": 0}
        else:
            data = await request.body()
        if not data:
            return error("the body must be a KV export (a safetensors file from " + EXPORT_ROUTE + ")")
        path = _spool_file()
        try:
            await asyncio.to_thread(_write_bytes, path, data)
            answer = await _run({"op": "import", "path": path})
        finally:
            if os.path.exists(path):
                os.unlink(path)
        if not answer.get("ok"):
            return error(answer.get("error", "KV import failed"))
        return {**{k: answer.get(k) for k in ("tokens", "imported", "cached", "reason")}, "bytes": len(data)}

    return
