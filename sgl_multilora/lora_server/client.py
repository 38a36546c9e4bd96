"""The worker's side of the LoRA server: `LoRAServerClient`, one DEALER socket, requests matched to replies by id.

Lives here: the client, `Pending` (a delta in flight) and the errors a caller sees. Not here: anything of SGLang
(the worker hook wraps this) or the wire format itself (`protocol.py`).

Contract: `submit_delta` sends and returns at once, so the caller computes its base GEMM while the server works;
`Pending.result()` waits. A reply that matches no waiting request (one that timed out, or sent to a server that
restarted since) is dropped. When a wait times out the socket is replaced: its queued requests and late replies go
with it, every request still waiting fails with `LoRAServerUnavailable`, and the next call connects afresh, so a
restarted server is used again without recreating the client. Safe for use from several threads (one lock around
the socket); meant for one scheduler thread.
"""

from __future__ import annotations

import threading
import time
from itertools import count

import orjson
import torch
import zmq

from sgl_multilora.lora_server.protocol import (
    DTYPES,
    VERSION,
    encode_delta,
    encode_header,
    frame_tensor,
)

_SLICE_S = 0.05  # a waiter releases the socket lock this often, so other threads can send meanwhile


class LoRAServerUnavailable(ConnectionError):
    """No reply from the LoRA server at `address` within the client's timeout (server down, restarting or stuck)."""

    def __init__(self, address: str, what: str = "") -> None:
        super().__init__(f"LoRA server at {address} did not answer{' ' + what if what else ''}")
        self.address = address


class LoRAServerError(RuntimeError):
    """The server answered with an error: `code` (e.g. "unknown_adapter", "bad_request", "no_slot") and its message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"LoRA server error ({code}): {message}")
        self.code = code


class Pending:
    """A request in flight. `result()` waits for the reply (at most the client's timeout from submission) and
    returns its value once; it raises LoRAServerUnavailable or LoRAServerError."""

    def __init__(self, client: LoRAServerClient, req_id: int, epoch: int, deadline: float, decode) -> None:
        self._client, self._id, self._epoch, self._deadline, self._decode = client, req_id, epoch, deadline, decode

    def result(self):
        header, frames = self._client._wait(self._id, self._epoch, self._deadline)
        if not header.get("ok"):
            raise LoRAServerError(str(header.get("code")), str(header.get("error")))
        return self._decode(header, frames)


def _decode_delta(header: dict, frames: list) -> torch.Tensor:
    return frame_tensor(frames[0], DTYPES[header["dtype"]], (header["rows"], header["out"]), "delta")


class LoRAServerClient:
    """A connection to the LoRA server at `address`. `timeout_s` bounds every wait."""

    def __init__(self, address: str, timeout_s: float = 5.0, context: zmq.Context | None = None) -> None:
        self.address, self.timeout_s = address, timeout_s
        self._ctx = context or zmq.Context.instance()
        self._lock = threading.RLock()
        self._ids = count(1)
        self._epoch = 0
        self._waiting: set[int] = set()
        self._done: dict[int, tuple[dict, list]] = {}
        self._sock: zmq.Socket | None = None

    # ---- calls -----------------------------------------------------------------------------------

    def catalog(self, names: list[str] | None = None) -> dict:
        """The `hello` reply: {"adapters": {name: {identity, rank, alpha, scaling, modules, experts, is_alora,
        invocation_tokens, bytes}}, "groups", "num_layers", "num_experts", "max_slots"}. With `names`, "adapters"
        holds only those of them the server holds (an unknown name is absent, not an error)."""
        return self._call("hello", names=list(names)) if names is not None else self._call("hello")

    def submit_delta(self, layer_id: int, group: str, x: torch.Tensor, adapter_index: torch.Tensor,
                     adapter_names: list[str], expert_ids: torch.Tensor | None = None,
                     identities: list[str] | None = None) -> Pending:
        """Sends a delta request without waiting. x: (rows, in) float32 / bfloat16 / float16, must stay unmodified
        until `result()` returns (it is sent without a copy); adapter_index: int (rows,), -1 or an index into
        adapter_names; expert_ids: int (rows,) for an expert group; identities: optional, the content identity
        served per name (a server holding other weights under a name refuses with code "stale_adapter"). `result()` gives the delta (rows, out_total) in
        x's dtype. Raises ValueError for shapes or dtypes the protocol cannot carry."""
        req_id = next(self._ids)
        frames = encode_delta(req_id, layer_id, group, x, adapter_index, adapter_names, expert_ids, identities)
        return self._submit(req_id, frames, _decode_delta)

    def residency(self, active: list[str] | None = None) -> dict:
        """{"resident": [names in slot order], "free_slots", "loading": [..], "pinned": {..}, "in_use": [..],
        "max_slots", ...}. `active`: declares the adapters this worker's running requests use (counted in `in_use`
        for the server's IN_USE_TTL_S)."""
        return self._call("residency") if active is None else self._call("residency", active=list(active))

    def prefetch(self, names: list[str]) -> list[str]:
        """Asks the server to load `names` into slots out of band; returns the names it queued."""
        return self._call("prefetch", names=list(names))["queued"]

    def load(self, name: str, path: str) -> dict:
        """Loads an adapter into the server's catalog; returns its catalog entry."""
        return self._call("load", name=name, path=path)["adapter"]

    def unload(self, name: str) -> None:
        self._call("unload", name=name)

    def stats(self) -> dict:
        return self._call("stats")

    def close(self) -> None:
        with self._lock:
            self._reset()

    # ---- plumbing --------------------------------------------------------------------------------

    def _call(self, op: str, **fields) -> dict:
        req_id = next(self._ids)
        frames = [encode_header({"v": VERSION, "op": op, "id": req_id, **fields})]
        return self._submit(req_id, frames, lambda header, _frames: header).result()

    def _submit(self, req_id: int, frames: list, decode) -> Pending:
        with self._lock:
            if self._sock is None:
                self._sock = self._ctx.socket(zmq.DEALER)
                self._sock.setsockopt(zmq.LINGER, 0)
                self._sock.connect(self.address)
            deadline = time.monotonic() + self.timeout_s
            try:
                self._sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:  # the send queue is full: the server has not been reading
                self._reset()
                raise LoRAServerUnavailable(self.address, "(send queue full)") from None
            self._waiting.add(req_id)
            return Pending(self, req_id, self._epoch, deadline, decode)

    def _wait(self, req_id: int, epoch: int, deadline: float) -> tuple[dict, list]:
        while True:
            with self._lock:
                if req_id in self._done:
                    self._waiting.discard(req_id)
                    return self._done.pop(req_id)
                if epoch != self._epoch or req_id not in self._waiting:
                    raise LoRAServerUnavailable(self.address, "(the connection was reset while this request waited)")
                left = deadline - time.monotonic()
                if left <= 0:
                    self._reset()
                    raise LoRAServerUnavailable(self.address, f"within {self.timeout_s:g} s")
                if self._sock.poll(int(min(left, _SLICE_S) * 1000) + 1):
                    self._receive()

    def _receive(self) -> None:
        """Reads one reply; files it under its request id if someone waits for it, else drops it (stale)."""
        frames = self._sock.recv_multipart(copy=False)
        try:
            header = orjson.loads(frames[0].bytes)
        except orjson.JSONDecodeError:
            return  # not a reply this client can match to a request: nobody waits for it
        if isinstance(header, dict) and header.get("v") == VERSION and header.get("id") in self._waiting:
            self._done[header["id"]] = (header, frames[1:])

    def _reset(self) -> None:
        """Drops the socket (queued requests, late replies) and fails every waiting request."""
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._epoch += 1
        self._waiting.clear()
        self._done.clear()
