"""Live driver: replays a workload against running SGLang servers, one arm after the other, and records each request.

Each request is sent at `arrival_s / time_scale` seconds after the arm's start, streaming over `/generate`; a request
with a parent waits for it and sends the parent's prompt text + the parent's actual output text + its fresh text
(eval/workloads/text.py). Recorded per request (eval/workloads/records.py `RequestResult`, one JSON line written as soon as
the request finishes): TTFT, mean inter-token time (TPOT) with the P50/P99 inter-token gaps, end-to-end latency,
the server's prompt / completion / cached token counts, errors, and, where the server has the plugin, its memory by
kind right after the request finished (`memory_bytes`, from `GET /multilora/stats`: `memory_by_kind`). Workload
adapters are mapped onto the adapters the server has (`map_adapters`). Not here: starting servers (eval/live/arms.py) or
summarising results (eval/live/report.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import aiohttp
import numpy as np

from eval.workloads import Workload
from eval.workloads.records import AdapterInfo, Request, RequestResult
from eval.workloads.text import fresh_text


def memory_by_kind(memory: dict) -> dict[str, int] | None:
    """Bytes by kind from one scheduler's `/multilora/stats` `memory` entry, as in ELORA's Fig. 14: `history KV`
    (cached prefixes no request holds: evictable), `active KV` (slots held by running requests), `adapters` (every
    copy of adapter weights). None when the server does not report KV bytes per token."""
    per_token = memory.get("kv_bytes_per_token")
    if not per_token:
        return None
    used = memory["total"] - memory["free"]
    kinds = {
        "history KV": memory["cache_evictable"] * per_token,
        "active KV": (used - memory["cache_evictable"]) * per_token,
    }
    if memory.get("adapters"):
        kinds["adapters"] = memory["adapters"]["total"]
    return kinds


class ServerUnreachable(RuntimeError):
    """A server could not be reached; the message names the arm and the address."""


@dataclass(frozen=True)
class ServedAdapter:
    """An adapter a live server has loaded. invocation_text: an aLoRA's invocation (empty for a LoRA)."""

    name: str
    kind: str = "lora"
    invocation_text: str = ""
    invocation_len: int = 0


@dataclass(frozen=True)
class Target:
    arm: str
    url: str


def served_from_manifest(manifest: dict | list) -> list[ServedAdapter]:
    """The adapters of an assets/adapters/manifest.json (dict with "adapters" or a list)."""
    entries = manifest["adapters"] if isinstance(manifest, dict) else manifest
    return [
        ServedAdapter(
            e["name"],
            e.get("kind", "lora"),
            e.get("invocation_text", ""),
            len(e.get("invocation_token_ids", [])),
        )
        for e in entries
    ]


def map_adapters(
    adapters: tuple[AdapterInfo, ...], served: list[ServedAdapter]
) -> dict[str, ServedAdapter]:
    """Maps each workload adapter onto a served one of the same kind, cycling in name order: with fewer served
    adapters than the workload names, several workload adapters share one (the report states the mapping).
    A name the server has is mapped to itself. Raises ValueError when a kind has no served adapter."""
    by_name = {s.name: s for s in served}
    mapping, counters = {}, {"lora": 0, "alora": 0}
    for info in sorted(adapters, key=lambda a: a.name):
        if info.name in by_name and by_name[info.name].kind == info.kind:
            mapping[info.name] = by_name[info.name]
            continue
        pool = [s for s in served if s.kind == info.kind]
        if not pool:
            raise ValueError(
                f"the workload names {info.kind} adapter {info.name!r} but the server has no "
                f"{info.kind} adapter (served: {[s.name for s in served]})"
            )
        mapping[info.name] = pool[counters[info.kind] % len(pool)]
        counters[info.kind] += 1
    return mapping


def _gap_stats(times: list[float], counts: list[int]) -> tuple[float | None, float | None]:
    """P50 and P99 of the per-token gaps between stream chunks (a chunk of k tokens gives k gaps of dt/k)."""
    gaps = []
    for i in range(1, len(times)):
        k = counts[i] - counts[i - 1]
        if k > 0:
            gaps += [(times[i] - times[i - 1]) / k] * k
    if not gaps:
        return None, None
    return float(np.percentile(gaps, 50)), float(np.percentile(gaps, 99))


class ArmReplay:
    """Replays one workload against one server. Owns the output stream for its results."""

    def __init__(
        self,
        workload: Workload,
        target: Target,
        experiment: str,
        mapping: dict[str, ServedAdapter],
        out: IO[str],
        time_scale: float,
        timeout_s: float,
        on_result: Callable | None,
        tags: dict | None = None,
    ):
        self.workload, self.target, self.experiment = workload, target, experiment
        self.tags = dict(tags or {})
        self.mapping, self.out, self.time_scale = mapping, out, time_scale
        self.timeout_s, self.on_result = timeout_s, on_result
        self.texts: dict[str, asyncio.Future] = {}
        self.results: list[RequestResult] = []
        self.unreachable: str | None = None
        self.rate = workload.offered_rate * time_scale
        self.has_stats = True  # until GET /multilora/stats fails once (a server without the plugin)

    def record(self, result: RequestResult) -> None:
        self.results.append(result)
        self.out.write(json.dumps(result.to_json()) + "\n")
        self.out.flush()
        if self.on_result:
            self.on_result(result)

    def prompt(self, req: Request, history: str) -> tuple[str, str | None]:
        served = self.mapping.get(req.adapter) if req.adapter else None
        inv_text, inv_len = (served.invocation_text, served.invocation_len) if served else ("", 0)
        return history + fresh_text(req, inv_text, inv_len), served.name if served else None

    async def run_one(self, session: aiohttp.ClientSession, req: Request, start: float) -> None:
        done = self.texts[req.rid]
        history = ""
        await asyncio.sleep(max(0.0, start + req.arrival_s / self.time_scale - time.perf_counter()))
        if req.parent_rid is not None:
            history = await self.texts[req.parent_rid]
        sent = time.perf_counter()
        base = RequestResult(
            self.experiment,
            self.target.arm,
            req.rid,
            req.adapter,
            sent - start,
            req.prompt_tokens,
            req.output_tokens,
        )
        base.extra = {
            "kind": req.tags.get("kind"),
            "session": req.session,
            "turn": req.turn,
            "planned_prompt_tokens": req.prompt_tokens,
            "request_rate": self.rate,
            "url": self.target.url,
            **{k: v for k, v in req.tags.items() if k != "kind"},
            **self.tags,
        }
        if history is None or self.unreachable:
            base.error = (
                f"not sent: parent {req.parent_rid} failed"
                if history is None
                else f"not sent: {self.unreachable}"
            )
            done.set_result(None)
            self.record(base)
            return
        text, lora = self.prompt(req, history)
        base.extra["served_adapter"] = lora
        try:
            output = await self.stream(session, req, text, lora, base, sent)
        except (aiohttp.ClientConnectionError, ConnectionError) as e:
            self.unreachable = (
                f"server for arm {self.target.arm} at {self.target.url} is unreachable ({e})"
            )
            base.error, output = self.unreachable, None
        except (TimeoutError, aiohttp.ClientError, RuntimeError, ValueError) as e:
            base.error, output = f"{type(e).__name__}: {e}", None
        done.set_result(None if output is None else text + output)
        if output is not None:
            memory = await self.sample_memory(session)
            if memory is not None:
                base.extra["memory_bytes"] = memory
                base.extra["memory_t_s"] = time.perf_counter() - start
        self.record(base)

    async def sample_memory(self, session: aiohttp.ClientSession) -> dict[str, int] | None:
        if not self.has_stats:
            return None
        try:
            async with session.get(self.target.url + "/multilora/stats") as response:
                stats = await response.json() if response.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, ValueError):
            stats = None
        memory = (stats or {}).get("memory") or [None]
        kinds = memory_by_kind(memory[0]) if memory[0] else None
        if kinds is None:
            self.has_stats = False
        return kinds

    async def stream(self, session, req, text, lora, result: RequestResult, sent: float) -> str:
        body = {
            "text": text,
            "lora_path": lora,
            "stream": True,
            "sampling_params": {
                "max_new_tokens": req.output_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
        times, counts, last = [], [], None
        async with session.post(self.target.url + "/generate", json=body) as response:
            if response.status != 200:
                raise RuntimeError(
                    f"HTTP {response.status} from {self.target.url}: {(await response.text())[:300]}"
                )
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    raise RuntimeError(f"server error: {chunk['error']}")
                times.append(time.perf_counter())
                counts.append(chunk["meta_info"].get("completion_tokens", len(counts) + 1))
                last = chunk
        if last is None:
            raise RuntimeError(f"empty stream from {self.target.url}")
        meta = last["meta_info"]
        result.ttft_s = times[0] - sent
        result.e2e_s = times[-1] - sent
        result.prompt_tokens = meta.get("prompt_tokens", result.prompt_tokens)
        result.output_tokens = meta.get("completion_tokens", result.output_tokens)
        result.cached_tokens = meta.get("cached_tokens", 0)
        if result.output_tokens > 1:
            result.tpot_s = (result.e2e_s - result.ttft_s) / (result.output_tokens - 1)
        result.extra["itl_p50_s"], result.extra["itl_p99_s"] = _gap_stats(times, counts)
        # SGLang streams the cumulative text unless started with --incremental-streaming-output
        return last["text"]

    async def run(self) -> list[RequestResult]:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=10)
        # a fresh connection per request: a pooled keep-alive connection that the server closes as idle just as a
        # request reuses it fails that request with "Server disconnected" before the server sees it (one replay
        # of a multi-queue benchmark run (multiqueue_live_rates_maxrate_seed1_draincost) lost its arm to it: the server logged
        # no such request and kept serving); on localhost a connection costs well under a millisecond
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            loop = asyncio.get_running_loop()
            self.texts = {r.rid: loop.create_future() for r in self.workload.requests}
            start = time.perf_counter()
            await asyncio.gather(*(self.run_one(session, r, start) for r in self.workload.requests))
        return self.results


async def check_reachable(target: Target, timeout_s: float = 10.0) -> None:
    """Raises ServerUnreachable naming the arm and address unless `GET /health` answers 200."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(target.url + "/health") as response,
        ):
            if response.status == 200:
                return
            problem = f"GET /health answered HTTP {response.status}"
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        problem = str(e) or type(e).__name__
    raise ServerUnreachable(
        f"cannot reach the server for arm {target.arm!r} at {target.url}: {problem}"
    )


def replay(
    workload: Workload,
    targets: list[Target],
    out_path: str | Path,
    experiment: str,
    served: list[ServedAdapter],
    time_scale: float = 1.0,
    timeout_s: float = 600.0,
    on_result: Callable[[RequestResult], None] | None = None,
    tags: dict | None = None,
) -> list[RequestResult]:
    """Replays `workload` against each target in turn, appending one JSON line per request to `out_path` as it
    finishes; `tags` (JSON values, e.g. the harness's repeat index) go into every record's `extra`. Raises
    ServerUnreachable (naming the address) when a server cannot be reached before or during its
    arm; every result recorded until then stays in the file. Requests that fail otherwise are recorded with
    their error and the replay goes on."""
    if time_scale <= 0:
        raise ValueError(f"time_scale must be positive, got {time_scale}")
    mapping = map_adapters(workload.adapters, served)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    results: list[RequestResult] = []
    with open(out_path, "a") as out:
        for target in targets:
            asyncio.run(check_reachable(target))
            arm = ArmReplay(
                workload, target, experiment, mapping, out, time_scale, timeout_s, on_result, tags
            )
            results += asyncio.run(arm.run())
            if arm.unreachable:
                raise ServerUnreachable(
                    arm.unreachable + f"; {len(results)} results kept in {out_path}"
                )
    return results
