"""Replay of a user's trace file: one JSON object per line.

Fields: `arrival_s` (seconds >= 0, non-decreasing), `adapter` (a name or null for the base model), either `prompt`
(literal text) or `prompt_tokens` (a positive count; the driver builds a prompt of about that many tokens), and
`output_tokens` (positive). Optional: `rid` (unique), `session`, `adapter_rank` (default `default_rank`) and
`adapter_kind` ("lora" or "alora"; an aLoRA prompt given as text must end with its invocation). Blank lines and
lines starting with `#` are skipped. Any other problem raises TraceError naming the file and line.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from eval.workloads.base import Workload
from eval.workloads.records import AdapterInfo, Request

KNOWN_FIELDS = {
    "arrival_s",
    "adapter",
    "prompt",
    "prompt_tokens",
    "output_tokens",
    "rid",
    "session",
    "adapter_rank",
    "adapter_kind",
}


class TraceError(ValueError):
    """A malformed trace line; the message starts with `path:line:`."""


@dataclass(frozen=True)
class TraceParams:
    path: str = ""
    default_rank: int = 16


def _positive_int(obj: dict, key: str, where: str) -> int:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TraceError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def parse_line(obj, where: str, default_rank: int) -> tuple[dict, AdapterInfo | None]:
    """Validates one decoded line; returns the Request fields and the adapter it names (if any)."""
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - KNOWN_FIELDS
    if unknown:
        raise TraceError(
            f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(KNOWN_FIELDS)}"
        )
    for key in ("arrival_s", "output_tokens"):
        if key not in obj:
            raise TraceError(f"{where}: missing field {key!r}")
    arrival = obj["arrival_s"]
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or arrival < 0:
        raise TraceError(f"{where}: arrival_s must be a number >= 0, got {arrival!r}")
    if ("prompt" in obj) == ("prompt_tokens" in obj):
        raise TraceError(
            f"{where}: give exactly one of 'prompt' (text) and 'prompt_tokens' (count)"
        )
    prompt = obj.get("prompt")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise TraceError(f"{where}: prompt must be a non-empty string")
    new_tokens = (
        _positive_int(obj, "prompt_tokens", where)
        if prompt is None
        else max(1, len(prompt.split()))
    )
    adapter = obj.get("adapter")
    if adapter is not None and (not isinstance(adapter, str) or not adapter):
        raise TraceError(f"{where}: adapter must be a non-empty string or null, got {adapter!r}")
    info = None
    if adapter is not None:
        kind = obj.get("adapter_kind", "lora")
        if kind not in ("lora", "alora"):
            raise TraceError(f"{where}: adapter_kind must be 'lora' or 'alora', got {kind!r}")
        rank = _positive_int(obj, "adapter_rank", where) if "adapter_rank" in obj else default_rank
        info = AdapterInfo(adapter, rank, kind)
    fields = {
        "arrival_s": float(arrival),
        "adapter": adapter,
        "new_tokens": new_tokens,
        "output_tokens": _positive_int(obj, "output_tokens", where),
        "prompt_text": prompt,
        "rid": obj.get("rid"),
        "session": obj.get("session"),
        "alora_invocation": info is not None and info.kind == "alora",
    }
    return fields, info


def generate(p: TraceParams, seed: int) -> Workload:
    if not p.path:
        raise TraceError("the trace workload needs path=<file.jsonl>")
    path = Path(p.path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    adapters: dict[str, AdapterInfo] = {}
    requests: list[Request] = []
    rids: set[str] = set()
    last = 0.0
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        where = f"{path}:{lineno}"
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e
        fields, info = parse_line(obj, where, p.default_rank)
        if fields["arrival_s"] < last:
            raise TraceError(
                f"{where}: arrival_s {fields['arrival_s']} is earlier than the line before ({last})"
            )
        last = fields["arrival_s"]
        if info is not None:
            if info.name in adapters and adapters[info.name] != info:
                raise TraceError(
                    f"{where}: adapter {info.name!r} was given another rank or kind on an earlier line"
                )
            adapters[info.name] = info
        rid = fields.pop("rid") or f"line{lineno}"
        if rid in rids:
            raise TraceError(f"{where}: duplicate rid {rid!r}")
        rids.add(rid)
        session = fields.pop("session") or rid
        requests.append(
            Request(
                rid=rid,
                session=session,
                turn=0,
                parent_rid=None,
                history_tokens=0,
                tags={"kind": "base" if info is None else info.kind, "line": lineno},
                **fields,
            )
        )
    if not requests:
        raise TraceError(f"{path}: the trace has no requests")
    return Workload("trace", seed, asdict(p), tuple(adapters.values()), tuple(requests))
