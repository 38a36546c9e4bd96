"""The gateway's part in moving requests between workers: which workers are up, where a moving request goes, and
`POST /cluster/migrate`. Lives here: `MovesMixin` (mixed into `Gateway`). Not here: a request's own stream and its
moves (carry.py), routing (placement.py).
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from aiohttp import web

from sgl_multilora.cluster.carry import HEALTH_TIMEOUT_S, ROUTED_HEADER, CarriedRequest
from sgl_multilora.cluster.placement import NoWorkerError

logger = logging.getLogger("sgl_multilora.cluster.gateway")


class MovesMixin:
    """Needs from the gateway: session, worker_urls, placement, in_flight, carried, migrations, down_events,
    relearned, _relearning and learn_order()."""

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
            self.placement.set_down(worker)
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
                    self.placement.set_down(worker, False)
                    logger.warning("worker %d (%s) is back", worker, self.worker_urls[worker])
                    try:
                        await self.learn_order()
                    except RuntimeError as e:  # smg has not taken it back yet: out again until it does
                        logger.warning("%s", e)
                        self.placement.set_down(worker)

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
        """`POST /cluster/migrate {"rid": ..., "to": worker}`: moves a running request (token transfer +
        recompute); without "to", to the worker placement picks among the others."""
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "the body must be JSON: {\"rid\": ..., \"to\": worker}"}, status=400)
        carried = self.carried.get(str(body.get("rid")))
        if carried is None:
            return web.json_response({"error": f"no running request {body.get('rid')!r} that can move (only "
                                               f"single-prompt /generate requests without logprobs can)"}, status=404)
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
        await carried.ask_move(to)
        return web.json_response({"rid": carried.rid, "from": source, "to": to}, status=202)

    async def _carry(self, request: web.Request, body: dict, adapter: str | None, prompt: str,
                     worker: int) -> web.StreamResponse:
        carried = CarriedRequest(self, body, worker, adapter, prompt)
        if carried.rid in self.carried:
            return web.json_response({"error": f"request id {carried.rid!r} is already in flight"}, status=400)
        self.carried[carried.rid] = carried
        self.in_flight[worker] += 1
        try:
            return await carried.run(request)
        finally:
            self.in_flight[carried.worker] -= 1
            del self.carried[carried.rid]
