"""The gateway's part in moving requests between workers: which workers are up, where a moving request goes, how
its KV goes with it, and `POST /cluster/migrate`. Lives here: `MovesMixin` (mixed into `Gateway`) and
`worker_memory` (the figures the gateway reads from a worker's `/multilora/stats`). Not here: a request's own stream
and its moves (carry.py), routing (cluster/placement.py), the cost model (cluster/cost.py).

Per move, KV transfer or token transfer + recompute (MELL section V): the core `MigrationCostModel` plans the move
with what was measured live: the source's KV bytes per token, the destination's prefill seconds per token (its
unified pool measures them), and the channel's bytes per second over earlier transfers (export, HTTP, import). A KV
transfer exports the request's cached KV from the source's tree (`POST /multilora/kv/export`, after the abort put
it there) and imports it into the destination's (`POST /multilora/kv/import`); the continued request then matches
it as a cached prefix, and whatever did not arrive is recomputed. Both routes are admin routes: the gateway uses the
workers' admin key (`SGL_MULTILORA_WORKER_ADMIN_KEY`, set by the launcher); without one every move recomputes.
A worker's figures are read once per `STATS_TTL_S` at most (moves planned together, as a balancer epoch's, share
one read), and afresh after the worker went down or came back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import aiohttp
from aiohttp import web

from sgl_multilora.gateway.carry import HEALTH_TIMEOUT_S, ROUTED_HEADER, CarriedRequest
from sgl_multilora.cluster.cost import MigrationCostModel
from sgl_multilora.gateway.launch import bearer
from sgl_multilora.gateway.openai_view import CompletionView
from sgl_multilora.cluster.placement import NoWorkerError
from sgl_multilora.cluster.records import Move

logger = logging.getLogger("sgl_multilora.gateway.app")
MIGRATION_KINDS = ("auto", "kv", "recompute")
INITIAL_LINK_BYTES_PER_S = 200e6
"""The channel's speed until a transfer was measured (then an exponential average of measured ones)."""
LINK_EMA = 0.3
TRANSFER_TIMEOUT_S = 120.0
STATS_TTL_S = 1.0
"""How long the figures read from a worker's `/multilora/stats` serve the moves planned after the read."""


@dataclasses.dataclass(frozen=True)
class WorkerMemory:
    """A worker's figures from its `/multilora/stats`; None where it reports none."""

    kv_tokens: int | None = None  # KV token slots (its --max-total-tokens): what `--balancer mell` packs
    kv_bytes_per_token: int | None = None  # K and V bytes of one token slot over all layers: a KV transfer's size
    recompute_s_per_token: float | None = None  # prefill seconds per token its unified pool measured: a recompute's


def worker_memory(stats) -> WorkerMemory:
    """The figures of a `/multilora/stats` answer (patches/stats.py): the `memory` view of its first scheduler
    (`kv_accounting`, with `unified_pool` when the worker runs one). A figure that is missing, not a number or not
    positive (no memory view, a pool without per-layer K/V buffers, nothing measured yet) is None."""
    memory = ((stats.get("memory") if isinstance(stats, dict) else None) or [None])[0]
    memory = memory if isinstance(memory, dict) else {}
    pool = memory.get("unified_pool")
    pool = pool if isinstance(pool, dict) else {}

    def positive(value, kind):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return kind(value) if number and value > 0 else None

    return WorkerMemory(kv_tokens=positive(memory.get("total"), int),
                        kv_bytes_per_token=positive(memory.get("kv_bytes_per_token"), int),
                        recompute_s_per_token=positive(pool.get("recompute_s_per_token"), float))


def _transferred(answer: dict, size: int, how: str) -> dict:
    """A transfer's result from the destination's import answer."""
    imported = int(answer.get("imported") or 0)
    return {"tokens": imported + int(answer.get("cached") or 0), "imported": imported, "bytes": size, "how": how,
            "reason": answer.get("reason")}


class MovesMixin:
    """Needs from the gateway: session, worker_urls, placement, in_flight, carried, migrations, down_events,
    relearned, _relearning, learn_order(), migration (one of MIGRATION_KINDS), link_bytes_per_s, kv_moves,
    admin_key, balancer (a `LiveBalancer` or None), balanced_moves, memory_reads (worker -> (when read, the read)),
    and clock() (monotonic seconds)."""

    # ---- KV or recompute ----------------------------------------------------------------------------------------

    def admin_headers(self) -> dict:
        return bearer(self.admin_key)

    async def _memory(self, worker: int) -> WorkerMemory:
        """The worker's figures from its `/multilora/stats`, as read within the last `STATS_TTL_S` (callers at the
        same time share one read); none when it does not answer, which is not kept: the next caller asks again."""
        now = self.clock()
        read_at, reading = self.memory_reads.get(worker, (now, None))
        if reading is None or now - read_at >= STATS_TTL_S:
            reading = asyncio.ensure_future(self._read_memory(worker))
            self.memory_reads[worker] = (now, reading)
        memory = await asyncio.shield(reading)  # a caller that is cancelled leaves the read to the others
        if memory is None:
            if self.memory_reads.get(worker, (now, None))[1] is reading:
                del self.memory_reads[worker]
            return WorkerMemory()
        return memory

    async def _read_memory(self, worker: int) -> WorkerMemory | None:
        try:
            async with self.session.get(self.worker_urls[worker] + "/multilora/stats",
                                        timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as r:
                return worker_memory(await r.json())
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return None

    async def plan_move(self, rid: str, src: int, dst: int, tokens: int) -> tuple[str, dict]:
        """("kv" or "recompute", the inputs of the choice) for moving a request holding `tokens` tokens."""
        if not self.admin_key:
            return "recompute", {"why": "the workers have no admin key"}
        if self.migration != "auto":
            return self.migration, {"why": f"--migration {self.migration}"}
        source, destination = await asyncio.gather(self._memory(src), self._memory(dst))
        bytes_per_token, s_per_token = source.kv_bytes_per_token, destination.recompute_s_per_token
        default = MigrationCostModel()
        model = MigrationCostModel(
            kv_bytes_per_token=int(bytes_per_token or default.kv_bytes_per_token),
            intra_bytes_per_s=self.link_bytes_per_s, inter_bytes_per_s=self.link_bytes_per_s,
            instances_per_machine=len(self.worker_urls),
            prefill_tokens_per_s=1.0 / s_per_token if s_per_token else default.prefill_tokens_per_s,
            recompute_tokens_per_epoch=int(default.epoch_s / s_per_token) if s_per_token
            else default.recompute_tokens_per_epoch)
        move = Move(rid, src, dst, tokens)
        plan = model.plan([move])[0]
        return plan.kind, {"kv_s": round(model.kv_seconds(move), 4),
                           "recompute_s": round(model.recompute_seconds(move), 4), "over_budget": plan.over_budget}

    async def transfer_kv(self, src: int, dst: int, export: dict, route: str = "pull") -> dict:
        """Moves the KV `src` caches for `export["input_ids"]` into `dst`'s tree: {"tokens": KV tokens the
        destination holds for them now, "bytes", "seconds", "how"} ("error" instead when it failed: the move
        recomputes). The destination pulls it from the source itself (worker to worker); when that fails (a
        worker that cannot reach the other, or pulls not served), the gateway relays it; `route` "relay" relays it
        at once."""
        began = time.perf_counter()
        if route == "pull":
            done = await self._pull_kv(src, dst, export)
            if "error" in done:
                logger.warning("KV pull %d -> %d failed (%s); relaying it through the gateway", src, dst,
                               done["error"])
                done = await self._relay_kv(src, dst, export)
        else:
            done = await self._relay_kv(src, dst, export)
        if "error" in done:
            return done
        seconds, size = time.perf_counter() - began, done["bytes"]
        if size:
            self.link_bytes_per_s += LINK_EMA * (size / max(seconds, 1e-6) - self.link_bytes_per_s)
        self.kv_moves["bytes"] += size
        self.kv_moves["seconds"] += seconds
        self.kv_moves["tokens"] += done["imported"]
        self.kv_moves[done["how"]] += bool(done["tokens"])  # transfers that moved something, by route
        return {**done, "seconds": seconds}

    async def _pull_kv(self, src: int, dst: int, export: dict) -> dict:
        """`dst` fetches the export from `src` itself (`POST /multilora/kv/import {"from", "export"}`)."""
        try:
            async with self.session.post(self.worker_urls[dst] + "/multilora/kv/import",
                                         json={"from": self.worker_urls[src], "export": export},
                                         headers=self.admin_headers(),
                                         timeout=aiohttp.ClientTimeout(total=TRANSFER_TIMEOUT_S)) as r:
                if r.status != 200:
                    return {"error": f"pull by worker {dst}: HTTP {r.status} {(await r.text())[:300]}"}
                answer = await r.json()
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:
            return {"error": f"{type(e).__name__} {e}"}
        return _transferred(answer, int(answer.get("bytes") or 0), "pulled")

    async def _relay_kv(self, src: int, dst: int, export: dict) -> dict:
        """The export streams from `src` through the gateway into `dst`'s import (no copy held here)."""
        timeout = aiohttp.ClientTimeout(total=TRANSFER_TIMEOUT_S)
        try:
            async with self.session.post(self.worker_urls[src] + "/multilora/kv/export", json=export,
                                         headers=self.admin_headers(), timeout=timeout) as r:
                if r.status == 204:
                    return _transferred({"reason": "nothing cached at the source"}, 0, "relayed")
                if r.status != 200:
                    return {"error": f"export at worker {src}: HTTP {r.status} {(await r.text())[:300]}"}
                sent = [0]

                async def relay():
                    async for piece in r.content.iter_chunked(1 << 20):
                        sent[0] += len(piece)
                        yield piece

                async with self.session.post(self.worker_urls[dst] + "/multilora/kv/import", data=relay(),
                                             headers={**self.admin_headers(),
                                                      "Content-Type": "application/octet-stream"},
                                             timeout=timeout) as r2:
                    if r2.status != 200:
                        return {"error": f"import at worker {dst}: HTTP {r2.status} {(await r2.text())[:300]}"}
                    answer = await r2.json()
        except (TimeoutError, aiohttp.ClientError) as e:
            return {"error": f"{type(e).__name__} {e}"}
        return _transferred(answer, sent[0], "relayed")

    async def carry_kv(self, carried: CarriedRequest, src: int, dst: int) -> tuple[str, dict]:
        """The move of a carried request from a live `src`: its KV transferred when the plan says so. Returns
        (kind done, details for the request's migration record)."""
        token_ids = carried.prompt_ids + carried.done_ids
        forced, carried.move_kind = carried.move_kind, None
        route, carried.move_route = carried.move_route or "pull", None
        if forced is not None and (forced == "recompute" or self.admin_key):
            kind, why = forced, {"why": "asked for"}
        else:
            kind, why = await self.plan_move(carried.rid, src, dst, len(token_ids))
        if kind != "kv":
            return "recompute", why
        export = {"input_ids": token_ids, "lora_path": carried.adapter, "prompt_ids": carried.prompt_ids,
                  "extra_key": carried.body.get("extra_key"), "cache_salt": carried.body.get("cache_salt")}
        done = await self.transfer_kv(src, dst, export, route)
        if "error" in done or done["tokens"] == 0:
            logger.warning("request %s: KV transfer %d -> %d gave nothing (%s); recomputing", carried.rid, src, dst,
                           done.get("error") or done.get("reason") or "nothing cached at the source")
            self.kv_moves["failed"] += 1
            return "recompute", {**why, "kv_error": done.get("error") or done.get("reason") or "nothing cached"}
        return "kv", {**why, "kv_tokens": done["tokens"], "kv_bytes": done["bytes"],
                      "kv_seconds": round(done["seconds"], 4), "kv_route": done["how"]}

    async def _healthy(self, worker: int) -> bool:
        try:
            async with self.session.get(self.worker_urls[worker] + "/health",
                                        timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as r:
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def worker_alive(self, worker: int) -> bool:
        """Asks the worker's `/health`; one that does not answer is marked down (nothing is routed to it)."""
        alive = await self._healthy(worker)
        if not alive and worker not in self.placement.down:
            self._set_down(worker)
            self.down_events += 1
            logger.error("worker %d (%s) is down: its requests continue on other workers", worker,
                         self.worker_urls[worker])
        return alive

    async def watch_down(self, interval_s: float = 5.0) -> None:
        """Puts a down worker back into routing once its `/health` answers again (smg's order is relearned)."""
        while True:
            await asyncio.sleep(interval_s)
            for worker in sorted(self.placement.down):
                if await self._healthy(worker):
                    self._set_down(worker, False)
                    logger.warning("worker %d (%s) is back", worker, self.worker_urls[worker])
                    try:
                        await self.learn_order()
                    except RuntimeError as e:  # smg has not taken it back yet: out again until it does
                        logger.warning("%s", e)
                        self._set_down(worker)

    def _set_down(self, worker: int, down: bool = True) -> None:
        self.placement.set_down(worker, down)
        self.memory_reads.pop(worker, None)  # its figures are read afresh (a restarted worker may differ)
        if self.balancer is not None:
            self.balancer.set_down(worker, down)

    # ---- MELL's balancing (--balancer mell) ------------------------------------------------------------------

    async def run_moves(self, moves: list[tuple]) -> None:
        """Starts the balancer's moves (rid, from worker, to worker) of carried requests still where it thinks."""
        for rid, src, dst in moves:
            carried = self.carried.get(rid)
            if carried is None or carried.worker != src or carried.move_to is not None or dst in self.placement.down:
                self.balancer.dropped()
                continue
            self.balanced_moves += 1
            await carried.ask_move(dst)

    async def balance_epochs(self, epoch_s: float) -> None:
        """MELL's operation batching: the queued Departs and Updates are applied every `epoch_s`."""
        while True:
            await asyncio.sleep(epoch_s)
            try:
                await self.run_moves(self.balancer.epoch(self.in_flight))
            except Exception:  # the packer's invariants are checked in tests; never stop balancing on one error
                logger.exception("balancer epoch failed")

    def progress(self, carried: CarriedRequest, kv_tokens: int) -> None:
        if self.balancer is not None:
            self.balancer.grew(carried.rid, kv_tokens)

    def pick_other(self, adapter: str | None, prompt: str, exclude: int) -> int | None:
        """Where a moving request goes: placement's choice among the other workers that are up."""
        try:
            return self.placement.route(adapter, prompt, self.in_flight, exclude=(exclude,), arrival=False)
        except NoWorkerError:
            return None

    def count_migration(self, kind: str, src: int, dst: int) -> None:
        self.migrations[kind] = self.migrations.get(kind, 0) + 1
        self.in_flight[src] -= 1
        self.in_flight[dst] += 1

    def check_answered(self, worker: int, headers) -> None:
        """smg answered from another worker than the one asked for: its order changed; learn it again."""
        answered = headers.get(ROUTED_HEADER, "").rstrip("/")
        if answered and answered != self.worker_urls[worker] and (self._relearning is None or self._relearning.done()):
            self.relearned += 1
            logger.warning("smg answered from %s for worker %s; relearning its worker order", answered,
                           self.worker_urls[worker])
            self._relearning = asyncio.create_task(self.learn_order())

    async def migrate(self, request: web.Request) -> web.Response:
        """`POST /cluster/migrate {"rid": ..., "to": worker, "kind": "kv" | "recompute", "route": "pull" |
        "relay"}`: moves a running request; without "to", to the worker placement picks among the others; without
        "kind", KV transfer or recompute as the cost model says (`plan_move`); a KV transfer goes worker to worker
        ("pull", the default) or through the gateway ("relay")."""
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "the body must be JSON: {\"rid\": ..., \"to\": worker}"}, status=400)
        carried = self.carried.get(str(body.get("rid")))
        if carried is None:
            return web.json_response({"error": f"no running request {body.get('rid')!r} that can move (only "
                                               f"single-prompt /generate requests without logprobs can)"}, status=404)
        kind = body.get("kind")
        if kind not in (None, "kv", "recompute"):
            return web.json_response({"error": f"kind must be \"kv\" or \"recompute\" (or left out: the gateway "
                                               f"picks), got {kind!r}"}, status=400)
        route = body.get("route")
        if route not in (None, "pull", "relay"):
            return web.json_response({"error": f"route must be \"pull\" or \"relay\", got {route!r}"}, status=400)
        to = body.get("to")
        if to is None:
            to = self.pick_other(carried.adapter, carried.prompt, exclude=carried.worker)
        if not isinstance(to, int) or not 0 <= to < len(self.worker_urls) or to in self.placement.down:
            return web.json_response({"error": f"worker {to!r} can not take the request: workers are 0.."
                                               f"{len(self.worker_urls) - 1}, down {sorted(self.placement.down)}"},
                                     status=400)
        if to == carried.worker or carried.move_to is not None:
            return web.json_response({"error": f"request {carried.rid} is on worker {carried.worker} "
                                               f"(moving to {carried.move_to})"}, status=409)
        source = carried.worker
        await carried.ask_move(to, kind, route)
        return web.json_response({"rid": carried.rid, "from": source, "to": to, "kind": kind}, status=202)

    async def _carry(self, request: web.Request, body: dict, adapter: str | None, prompt: str,
                     worker: int, view: CompletionView | None = None) -> web.StreamResponse:
        carried = CarriedRequest(self, body, worker, adapter, prompt, view)
        if carried.rid in self.carried:
            return web.json_response({"error": f"request id {carried.rid!r} is already in flight"}, status=400)
        moves: list[tuple] = []
        if self.balancer is not None:  # MELL places it: Allocate by its prompt's KV tokens
            if carried.prompt_ids is None:
                carried.prompt_ids = await carried.tokenize(worker)
            packed, moves = self.balancer.allocate(carried.rid, len(carried.prompt_ids), self.in_flight)
            if packed is not None and packed not in self.placement.down:
                carried.worker = packed
        self.carried[carried.rid] = carried
        self.in_flight[carried.worker] += 1
        try:
            if moves:
                await self.run_moves(moves)
            return await carried.run(request)
        finally:
            self.in_flight[carried.worker] -= 1
            del self.carried[carried.rid]
            if self.balancer is not None:
                self.balancer.ended(carried.rid)
