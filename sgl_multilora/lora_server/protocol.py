"""The LoRA server's wire format: one ZMQ multipart message per request and per reply.

Lives here: header encoding (orjson), tensor frames (zero-copy both ways), the projection groups, and the error type
a bad message raises. Not here: sockets (`server.py`, `client.py`) or any LoRA maths.

Message layout (a client is a DEALER, the server a ROUTER that prepends the client's identity frame):

    request  = [ header | frame_1 | ... | frame_k ]          reply = [ header | frame_1 | ... ]
    header   = UTF-8 JSON object, always {"v": VERSION, "op": str, "id": int, ...}
    frame_i  = the raw bytes of one C-contiguous tensor; its dtype and shape are in the header

    op        request header (+ frames)                              reply header (+ frames)
    hello     {} or {"names": [..]} (only those adapters)            {"adapters": {name: info}, "groups": {...},
                                                                      "num_layers", "num_experts", "max_slots"}
    delta     {"layer": int, "group": str, "adapters": [names],      {"rows", "out", "dtype"}
               "rows": n, "in": h, "dtype": "float32"|"bfloat16"|   + delta (n, out) in the request's dtype;
               "float16", "experts": bool}                           a module the row's adapter does not target,
              + x (n, h) + adapter_index int32 (n,)                   and rows of adapter index -1, are zeros
              [+ expert_ids int32 (n,) when "experts"]
    residency {}                                                     {"resident": [..], "free_slots", "loading": [..],
                                                                      "pinned": {name: pins}}
    prefetch  {"names": [..]}                                        {"queued": [..]}
    load      {"name": str, "path": str}                             {"adapter": info}
    unload    {"name": str}                                          {"unloaded": str}
    stats     {}                                                     {"calls", "rows", "hits", "misses", ...}
    any error                                                        {"ok": false, "error": message, "code": str}

    Every reply echoes "v", "op" and "id" and carries "ok". Example, a decode step of 3 rows (2 adapters) asking for
    layer 5's qkv: header {"v": 1, "op": "delta", "id": 42, "layer": 5, "group": "qkv", "adapters": ["a", "b"],
    "rows": 3, "in": 2048, "dtype": "bfloat16", "experts": false}, frames x (3 x 2048 x 2 bytes) and
    adapter_index [0, 1, 0] (int32); the reply carries the (3, q_out + k_out + v_out) delta.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson
import torch

VERSION = 1
MAX_HEADER_BYTES = 1 << 16  # a header names at most a few hundred adapters; anything past this is not one

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

DENSE_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
"""A dense model's fused projection groups: the delta's columns are the modules' outputs in this order."""
EXPERT_GROUPS: dict[str, tuple[str, ...]] = {
    "experts.gate_up": ("experts.gate_up_proj",),
    "experts.down": ("experts.down_proj",),
}
"""Mixtral-style fused experts: one module each, computed per (adapter, expert) unit."""
GROUPS = {**DENSE_GROUPS, **EXPERT_GROUPS}
GROUP_OF = {module: group for group, modules in GROUPS.items() for module in modules}

OPS = ("hello", "delta", "residency", "prefetch", "load", "unload", "stats")


class ProtocolError(ValueError):
    """A message the server cannot act on. `code` is a short machine-readable reason, the message says what was
    wrong in words (it is sent back to the client as is)."""

    def __init__(self, message: str, code: str = "bad_request") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class DeltaRequest:
    """A decoded `delta` request. Tensors are views of the received frames (valid while the frames are)."""

    layer_id: int
    group: str
    adapter_names: tuple[str, ...]
    x: torch.Tensor  # (rows, in), float32 / bfloat16 / float16
    adapter_index: torch.Tensor  # int32 (rows,), -1 or an index into adapter_names
    expert_ids: torch.Tensor | None  # int32 (rows,) for expert groups, else None
    identities: tuple[str, ...] | None = None  # the content identity the caller serves each adapter as


def encode_header(header: dict) -> bytes:
    return orjson.dumps(header)


def decode_header(frame: bytes | memoryview) -> dict:
    """The header of a request or reply; raises ProtocolError for non-JSON, a non-object, a missing field or a
    version this code does not speak."""
    if len(frame) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header is {len(frame)} bytes, above the {MAX_HEADER_BYTES}-byte limit")
    try:
        header = orjson.loads(frame)
    except orjson.JSONDecodeError as e:
        raise ProtocolError(f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ProtocolError("header must be a JSON object")
    if header.get("v") != VERSION:
        raise ProtocolError(f"protocol version {header.get('v')!r} is not supported (this server speaks "
                            f"{VERSION})", "version")
    if not isinstance(header.get("id"), int):
        raise ProtocolError("header field 'id' must be an integer")
    if header.get("op") not in OPS:
        raise ProtocolError(f"unknown op {header.get('op')!r}; known: {', '.join(OPS)}", "unknown_op")
    return header


def tensor_frame(t: torch.Tensor):
    """A buffer over `t`'s bytes to send with `copy=False` (no copy when `t` is contiguous on the CPU). The caller
    must not modify `t` until ZMQ has sent it (for a reply: never reuse it)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)  # numpy has no bfloat16: the same bytes under an integer type
    return t.reshape(-1).numpy()


def frame_tensor(frame, dtype: torch.dtype, shape: tuple[int, ...], what: str) -> torch.Tensor:
    """A tensor viewing a received frame's bytes (no copy); raises ProtocolError when the size does not match."""
    buf = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
    numel = 1
    for s in shape:
        numel *= s
    expected = numel * torch.empty((), dtype=dtype).element_size()
    if buf.nbytes != expected:
        raise ProtocolError(f"frame '{what}' has {buf.nbytes} bytes; {tuple(shape)} {DTYPE_NAMES.get(dtype, dtype)} "
                            f"needs {expected}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def _field(header: dict, key: str, kind: type, what: str):
    value = header.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ProtocolError(f"delta header field {key!r} must be {what}, got {value!r}")
    return value


def encode_delta(req_id: int, layer_id: int, group: str, x: torch.Tensor, adapter_index: torch.Tensor,
                 adapter_names: list[str], expert_ids: torch.Tensor | None = None,
                 identities: list[str] | None = None) -> list:
    """The frames of a `delta` request. `identities` (optional, one per name): the content identity the caller
    serves each adapter as; the server refuses the call if it now holds other weights under a name. Raises
    ValueError for a dtype or shape the protocol cannot carry."""
    if x.dim() != 2 or x.dtype not in DTYPE_NAMES:
        raise ValueError(f"x must be 2-d float32/bfloat16/float16, got {tuple(x.shape)} {x.dtype}")
    rows = int(x.shape[0])
    if tuple(adapter_index.shape) != (rows,):
        raise ValueError(f"adapter_index must have shape ({rows},), got {tuple(adapter_index.shape)}")
    header = {"v": VERSION, "op": "delta", "id": req_id, "layer": int(layer_id), "group": group,
              "adapters": list(adapter_names), "rows": rows, "in": int(x.shape[1]), "dtype": DTYPE_NAMES[x.dtype],
              "experts": expert_ids is not None}
    if identities is not None:
        if len(identities) != len(adapter_names):
            raise ValueError(f"{len(identities)} identities for {len(adapter_names)} adapter names")
        header["identities"] = list(identities)
    frames = [encode_header(header), tensor_frame(x), tensor_frame(adapter_index.to(torch.int32))]
    if expert_ids is not None:
        if tuple(expert_ids.shape) != (rows,):
            raise ValueError(f"expert_ids must have shape ({rows},), got {tuple(expert_ids.shape)}")
        frames.append(tensor_frame(expert_ids.to(torch.int32)))
    return frames


def decode_delta(header: dict, frames: list) -> DeltaRequest:
    """A `delta` request from its header and tensor frames; raises ProtocolError naming the bad field or frame.
    Checks the message's own consistency only (the adapters and the layer are checked against the catalog later)."""
    layer_id = _field(header, "layer", int, "an integer")
    group = _field(header, "group", str, "a string")
    if group not in GROUPS:
        raise ProtocolError(f"unknown group {group!r}; known: {', '.join(GROUPS)}", "unknown_group")
    names = _field(header, "adapters", list, "a list of adapter names")
    if not all(isinstance(n, str) for n in names):
        raise ProtocolError("delta header field 'adapters' must list adapter names (strings)")
    rows = _field(header, "rows", int, "an integer")
    width = _field(header, "in", int, "an integer")
    dtype = DTYPES.get(header.get("dtype"))
    if dtype is None:
        raise ProtocolError(f"dtype {header.get('dtype')!r} is not supported; use one of {', '.join(DTYPES)}")
    experts = bool(header.get("experts", False))
    if experts != (group in EXPERT_GROUPS):
        raise ProtocolError(f"group {group!r} {'needs' if group in EXPERT_GROUPS else 'takes no'} per-row expert ids")
    if rows < 0 or width <= 0:
        raise ProtocolError(f"bad delta shape rows={rows}, in={width}")
    if len(frames) != (3 if experts else 2):
        raise ProtocolError(f"delta needs {3 if experts else 2} tensor frames (x, adapter_index"
                            f"{', expert_ids' if experts else ''}), got {len(frames)}")
    x = frame_tensor(frames[0], dtype, (rows, width), "x")
    index = frame_tensor(frames[1], torch.int32, (rows,), "adapter_index")
    expert_ids = frame_tensor(frames[2], torch.int32, (rows,), "expert_ids") if experts else None
    if rows and (int(index.min()) < -1 or int(index.max()) >= len(names)):
        raise ProtocolError(f"adapter_index values must lie in [-1, {len(names)}), got "
                            f"[{int(index.min())}, {int(index.max())}]")
    identities = header.get("identities")
    if identities is not None and (not isinstance(identities, list) or len(identities) != len(names)
                                   or not all(isinstance(i, str) for i in identities)):
        raise ProtocolError("delta header field 'identities' must list one identity (string) per adapter name")
    return DeltaRequest(layer_id, group, tuple(names), x, index, expert_ids,
                        tuple(identities) if identities is not None else None)


def reply_header(request: dict, **fields) -> bytes:
    return encode_header({"v": VERSION, "op": request.get("op"), "id": request.get("id"), "ok": True, **fields})


def error_header(request: dict | None, message: str, code: str) -> bytes:
    request = request or {}
    return encode_header({"v": VERSION, "op": request.get("op"), "id": request.get("id"), "ok": False,
                          "error": message, "code": code})
