"""The LoRA server process: a ROUTER socket in front of the catalog, the slot pool and the delta compute.

Lives here: `LoRAServer` (sockets, threads, request dispatch, stats). Not here: the wire format (`protocol.py`),
residency (`slots.py`), maths (`compute.py`), the CLI (`__main__.py`).

One serving thread owns the ROUTER socket, the catalog, the slots and the compute:

    clients (DEALER) ──> [libzmq I/O thread] ──> ROUTER ── serving thread: recv → compute → send
                     <── [libzmq I/O thread] <──

libzmq's own I/O thread (C, outside the GIL) receives the next clients' requests and sends earlier replies while the
serving thread computes, so receiving client c+1 and sending to client c-1 overlap computing for client c
(InfiniLoRA's recv ‖ compute ‖ send pipeline) without a hop between Python threads (a Python I/O thread with two
inproc hops made an empty round trip 1.7x as long). Requests are computed one at a time, in arrival order, with no
batching across clients. A malformed request, an unknown adapter or a failing computation
gets an error reply (`{"ok": false, "error", "code"}`) and the server keeps serving.
"""

from __future__ import annotations

import logging
import threading
import time

import orjson
import torch
import zmq

from sgl_multilora.adapters import AdapterError
from sgl_multilora.lora_server.catalog import Catalog
from sgl_multilora.lora_server.compute import check_delta, compute_delta, group_offsets
from sgl_multilora.lora_server.protocol import (
    DTYPE_NAMES,
    GROUPS,
    ProtocolError,
    decode_delta,
    decode_header,
    error_header,
    reply_header,
    tensor_frame,
)
from sgl_multilora.lora_server.slots import NoFreeSlot, SlotPool

logger = logging.getLogger(__name__)
_POLL_MS = 50
IN_USE_TTL_S = 10.0
"""How long a worker's declared adapters (its last `residency` call's `active`, or its last delta call's adapters)
count as in use when it says nothing more: a worker that died stops holding slots after this."""


class LoRAServer:
    """Serves `catalog` on `listen` (ipc://PATH or tcp://HOST:PORT) with `pool`'s slots.

    `start()` binds (raises zmq.ZMQError when the address is taken) and starts the threads; `stop()` asks them to
    finish (safe from a signal handler or any thread); `join()` waits for them and closes the sockets. The catalog
    and pool are touched only by the compute thread while the server runs: read them in tests only after `join()` or
    through `stats` / `residency` requests.
    """

    def __init__(self, catalog: Catalog, pool: SlotPool, listen: str, impl: str = "auto") -> None:
        self.catalog, self.pool, self.listen, self.impl = catalog, pool, listen, impl
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._in_use: dict[bytes, tuple[frozenset[str], float]] = {}  # client -> (adapters in use, expiry)
        self._client = b""  # the identity of the client whose request is being handled
        self.counters = {"requests": 0, "errors": 0, "delta_calls": 0, "delta_rows": 0, "compute_s": 0.0,
                         "bytes_in": 0, "bytes_out": 0}

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(self.listen)  # created here (errors reach the caller), used only by the serving thread from now
        self._threads = [threading.Thread(target=self._serve, args=(router,), name="lora-serve", daemon=True)]
        for t in self._threads:
            t.start()
        logger.info("LoRA server listening on %s: %d adapters, %d slots, eviction policy %s", self.listen,
                    len(self.catalog.adapters), self.pool.max_slots, self.pool.policy.name)

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout_s: float | None = None) -> None:
        for t in self._threads:
            t.join(timeout_s)
        self._ctx.term()
        logger.info("LoRA server on %s stopped", self.listen)

    def serve_forever(self) -> None:
        """`start()`, then wait until `stop()`, then `join()`."""
        self.start()
        while not self._stop.wait(0.5):
            pass
        self.join()

    # ---- threads ---------------------------------------------------------------------------------

    def _serve(self, router: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if not router.poll(0 if self.pool.loading else _POLL_MS):
                    if self.pool.loading:  # idle: load one queued prefetch between calls
                        self._prefetch_one()
                    continue
                frames = router.recv_multipart(copy=False)  # [identity, header, *tensors]
                router.send_multipart([frames[0], *self.handle(frames[1:], client=frames[0].bytes)], copy=False)
        finally:
            router.close(linger=0)

    def _prefetch_one(self) -> None:
        self.pool.in_use = self.in_use()  # declarations past their TTL no longer protect a slot
        name = self.pool.prefetch_one()
        if name is not None:
            logger.debug("prefetched adapter %s", name)

    # ---- requests --------------------------------------------------------------------------------

    def handle(self, frames: list, client: bytes = b"") -> list:
        """The reply frames for one request's frames (header first) from `client` (its ROUTER identity). Never
        raises: every failure is an error reply. Mutates the catalog, the pool, the in-use table and the counters."""
        self.counters["requests"] += 1
        self.counters["bytes_in"] += sum(len(f) for f in frames)
        header = None
        try:
            if not frames:
                raise ProtocolError("empty message")
            header = decode_header(frames[0].bytes if hasattr(frames[0], "bytes") else frames[0])
            self._client = client
            reply = getattr(self, f"_op_{header['op']}")(header, frames[1:])
        except ProtocolError as e:
            reply = self._error(header, frames, str(e), e.code)
        except AdapterError as e:
            reply = self._error(header, frames, str(e), "adapter")
        except NoFreeSlot as e:
            reply = self._error(header, frames, str(e), "no_slot")
        except Exception as e:  # a bug must not take the server (and every worker) down
            logger.exception("LoRA server: request failed")
            reply = self._error(header, frames, f"internal error: {type(e).__name__}: {e}", "internal")
        self.counters["bytes_out"] += sum(getattr(f, "nbytes", None) or len(f) for f in reply)
        return reply

    def _error(self, header: dict | None, frames: list, message: str, code: str) -> list:
        self.counters["errors"] += 1
        if header is None and frames:  # echo what we can of a header we rejected, so the client can match it
            try:
                raw = orjson.loads(frames[0].bytes if hasattr(frames[0], "bytes") else frames[0])
                header = {"op": raw.get("op"), "id": raw.get("id")} if isinstance(raw, dict) else None
            except orjson.JSONDecodeError:
                header = None
        logger.warning("LoRA server: rejected request (%s): %s", code, message)
        return [error_header(header, message, code)]

    def _op_hello(self, header: dict, frames: list) -> list:
        model = self.catalog.model
        groups = {g: {"modules": list(m), "offsets": list(group_offsets(model, g)),
                      "in": model.module_dims(m[0]).in_features}
                  for g, m in GROUPS.items() if all(x in model.shape.modules or x in model.expert_dims for x in m)}
        names = header.get("names")
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise ProtocolError("hello: 'names' must be a list of adapter names")
        return [reply_header(header, adapters=self.catalog.info(names), groups=groups, num_layers=model.shape.num_layers,
                             num_experts=model.num_experts, max_slots=self.pool.max_slots)]

    def _op_delta(self, header: dict, frames: list) -> list:
        req = decode_delta(header, frames)
        check_delta(req, self.catalog.model, self.catalog.adapters)
        if req.identities is not None:
            stale = [n for n, i in zip(req.adapter_names, req.identities) if self.catalog.adapters[n].spec.identity != i]
            if stale:
                raise ProtocolError(f"adapter(s) {stale} hold other weights now than the caller serves (reloaded "
                                    "under the same name)", "stale_adapter")
        used_idx = torch.unique(req.adapter_index[req.adapter_index >= 0]).tolist()
        used = [req.adapter_names[i] for i in used_idx]
        self._declare(req.adapter_names)
        start = time.perf_counter()
        tables = self.pool.acquire(used)
        try:
            scalings = {n: self.catalog.adapters[n].spec.scaling for n in used}
            delta = compute_delta(req, self.catalog.model, tables, scalings, self.pool.device, self.impl)
        finally:
            self.pool.release(used)
        self.counters["compute_s"] += time.perf_counter() - start
        self.counters["delta_calls"] += 1
        self.counters["delta_rows"] += int(req.x.shape[0])
        return [reply_header(header, rows=int(delta.shape[0]), out=int(delta.shape[1]),
                             dtype=DTYPE_NAMES[delta.dtype]), tensor_frame(delta)]

    def _declare(self, names) -> None:
        self._in_use[self._client] = (frozenset(names), time.monotonic() + IN_USE_TTL_S)
        self.pool.in_use = self.in_use()

    def in_use(self) -> set[str]:
        """Adapters some worker declared in use (its running requests' adapters) within IN_USE_TTL_S."""
        now = time.monotonic()
        for client in [c for c, (_, expiry) in self._in_use.items() if expiry < now]:
            del self._in_use[client]
        return set().union(*(names for names, _ in self._in_use.values()))

    def _op_residency(self, header: dict, frames: list) -> list:
        """`active` (optional): the adapters the calling worker's running requests use; the reply's `in_use` is the
        union over workers, so a worker admits a new adapter only while `len(in_use) < max_slots` (InfiniLoRA's rule:
        resident, or a slot that no running request needs)."""
        active = header.get("active")
        if active is not None:
            if not isinstance(active, list) or not all(isinstance(n, str) for n in active):
                raise ProtocolError("residency header field 'active' must be a list of adapter names")
            self._declare(n for n in active if n in self.catalog.adapters)
        return [reply_header(header, **self.pool.residency(), in_use=sorted(self.in_use()),
                             max_slots=self.pool.max_slots)]

    def _op_prefetch(self, header: dict, frames: list) -> list:
        names = header.get("names")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ProtocolError("prefetch header field 'names' must be a list of adapter names")
        unknown = [n for n in names if n not in self.catalog.adapters]
        if unknown:
            raise ProtocolError(f"unknown adapter(s) {unknown}", "unknown_adapter")
        return [reply_header(header, queued=self.pool.queue_prefetch(names))]

    def _op_load(self, header: dict, frames: list) -> list:
        name, path = header.get("name"), header.get("path")
        if not isinstance(name, str) or not name or not isinstance(path, str):
            raise ProtocolError("load needs string fields 'name' and 'path'")
        adapter = self.catalog.load(name, path)
        self.pool.register(name)
        logger.info("loaded adapter %s from %s (rank %d, %d bytes)", name, path, adapter.spec.rank, adapter.num_bytes)
        return [reply_header(header, adapter=adapter.info())]

    def _op_unload(self, header: dict, frames: list) -> list:
        name = header.get("name")
        if name not in self.catalog.adapters:
            raise ProtocolError(f"unknown adapter {name!r}", "unknown_adapter")
        self.pool.forget(name)
        self.catalog.unload(name)
        logger.info("unloaded adapter %s", name)
        return [reply_header(header, unloaded=name)]

    def _op_stats(self, header: dict, frames: list) -> list:
        """Counters, and the slot pool's `check_invariants` run between calls ("ok" or the failed assertion)."""
        try:
            self.pool.check_invariants(idle=True)
            invariants = "ok"
        except AssertionError as e:
            invariants = str(e)
        return [reply_header(header, **self.counters, **self.pool.counters, resident=self.pool.max_slots -
                             self.pool.free_slots(), free_slots=self.pool.free_slots(),
                             adapters=len(self.catalog.adapters), invariants=invariants)]
