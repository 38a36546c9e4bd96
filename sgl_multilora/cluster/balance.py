"""MELL's KV packing driving a live cluster: `LiveBalancer`, the gateway's `--balancer mell`.

Lives here: the binding of the packer's instances to running workers, and the queue of the packer's operations
(Allocate when a request arrives, Update as its KV grows, Depart when it ends) applied once per epoch, the paper's
operation batching. Not here: the packing rules (mell.py, the core packer the simulator runs too), executing a move
(sgl_multilora/gateway/carry.py; KV transfer or recompute per move is the gateway's measured choice, moves.py).
Plain Python (no HTTP, no SGLang): the gateway drives it and imports it, never the other way.

How the packer's world maps onto a fixed set of workers. The packer opens and closes instances as its packing needs;
here an instance it opens is bound to a worker no instance holds (the one with the fewest requests in flight), and
the worker is free again once the packer closes the instance. Workers without an instance are the ones an elastic
deployment would stop: `workers_in_use` over time is the live counterpart of the simulator's instance count. When
the packer wants more instances than there are workers, the new instance shares the worker holding the fewest
packed tokens and `overcommitted` counts it (KV may then overflow there, as it would under any policy). A request
is packed by its KV tokens (prompt + output so far), against each worker's KV capacity times `fill`; requests the
gateway does not carry (batches, input logprobs, chats with tools, ...: gateway/openai_view.py) are not seen, so
`fill` leaves them room. Only carried requests move; a move the packer plans for a request that has ended or is
already moving is dropped (the packing is then ahead of the cluster until the request departs).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

from sgl_multilora.cluster.base import BasePacker
from sgl_multilora.cluster.records import ItemTooLarge, Migration

logger = logging.getLogger("sgl_multilora.gateway.app")
UPDATE_EVERY_TOKENS = 16
"""A request's Update is queued once its KV grew by this many tokens since the last one (bounds the ops per epoch)."""


class LiveBalancer:
    def __init__(self, packer: BasePacker, num_workers: int, *, update_every: int = UPDATE_EVERY_TOKENS) -> None:
        self.packer = packer
        self.update_every = update_every
        self.num_workers = num_workers
        self.worker_of: dict[int, int] = {}  # packer instance -> worker
        self.down: set[int] = set()
        self.sizes: dict[Hashable, int] = {}  # tracked request -> KV tokens last given to the packer
        self._updates: dict[Hashable, int] = {}
        self._departs: list[Hashable] = []
        self.num_ops = 0
        self.num_planned_moves = 0
        self.num_dropped_moves = 0
        self.overcommitted = 0
        self.untracked = 0  # requests larger than one worker's capacity: placed by the gateway's placement
        self.peak_workers_in_use = 0

    # ---- instances <-> workers ------------------------------------------------------------------------------

    def _bind(self, in_flight: list[int]) -> None:
        """Binds every instance the packer has to a worker; frees the workers of instances it closed."""
        live = self.packer.instances()
        for instance in [i for i in self.worker_of if i not in live]:
            del self.worker_of[instance]
        for instance in sorted(i for i in live if i not in self.worker_of):
            taken = set(self.worker_of.values())
            free = [w for w in range(self.num_workers) if w not in taken and w not in self.down]
            if free:
                self.worker_of[instance] = min(free, key=lambda w: (in_flight[w], w))
                continue
            up = [w for w in range(self.num_workers) if w not in self.down] or list(range(self.num_workers))
            packed = {w: sum(live.get(i, 0) for i, x in self.worker_of.items() if x == w) for w in up}
            self.worker_of[instance] = min(up, key=lambda w: (packed[w], in_flight[w], w))
            self.overcommitted += 1
        self.peak_workers_in_use = max(self.peak_workers_in_use, self.workers_in_use)

    @property
    def workers_in_use(self) -> int:
        return len(set(self.worker_of.values()))

    def set_down(self, worker: int, down: bool = True) -> None:
        """A worker that is down holds no instance: its instances move to other workers at the next binding."""
        if down:
            self.down.add(worker)
            for instance in [i for i, w in self.worker_of.items() if w == worker]:
                del self.worker_of[instance]
        else:
            self.down.discard(worker)

    # ---- operations -----------------------------------------------------------------------------------------

    def allocate(self, rid: Hashable, kv_tokens: int, in_flight: list[int]) -> tuple[int | None, list[tuple]]:
        """A new request: (its worker, or None when it is larger than one worker and not tracked; the moves the
        allocation caused as (rid, from worker, to worker))."""
        try:
            placed = self.packer.allocate(rid, max(1, kv_tokens))
        except ItemTooLarge:
            self.untracked += 1
            return None, []
        self.num_ops += 1
        self.sizes[rid] = max(1, kv_tokens)
        return self._finish(placed.migrations, in_flight, placed.instance)

    def grew(self, rid: Hashable, kv_tokens: int) -> None:
        """The request holds `kv_tokens` now: an Update is queued when it grew enough."""
        last = self.sizes.get(rid)
        if last is not None and kv_tokens - last >= self.update_every:
            self.sizes[rid] = kv_tokens
            self._updates[rid] = min(kv_tokens, self.packer.capacity)

    def ended(self, rid: Hashable) -> None:
        if rid in self.sizes:
            del self.sizes[rid]
            self._updates.pop(rid, None)
            self._departs.append(rid)

    def epoch(self, in_flight: list[int]) -> list[tuple]:
        """Applies the queued Departs and Updates as one batch; returns the moves as (rid, from worker, to
        worker)."""
        if not self._departs and not self._updates:
            return []
        departs, updates = self._departs, self._updates
        self._departs, self._updates = [], {}
        result = self.packer.apply_batch(departs=departs, updates=updates)
        self.num_ops += result.num_ops
        return self._finish(result.migrations, in_flight)[1]

    def _finish(self, migrations: tuple[Migration, ...] | list[Migration], in_flight: list[int],
                instance: int | None = None) -> tuple[int | None, list[tuple]]:
        before = dict(self.worker_of)
        self._bind(in_flight)
        moves = []
        for m in migrations:
            src, dst = before.get(m.src, self.worker_of.get(m.src)), self.worker_of.get(m.dst)
            self.num_planned_moves += 1
            if src is None or dst is None or src == dst:
                continue  # two instances on one worker (overcommitted): nothing to move
            moves.append((m.rid, src, dst))
        return (self.worker_of.get(instance) if instance is not None else None), moves

    def dropped(self) -> None:
        self.num_dropped_moves += 1

    def view(self) -> dict:
        live = self.packer.instances()
        return {"policy": self.packer.name, "capacity_tokens": self.packer.capacity,
                "workers_in_use": self.workers_in_use, "peak_workers_in_use": self.peak_workers_in_use,
                "instances": {str(i): {"worker": self.worker_of.get(i), "kv_tokens": t} for i, t in live.items()},
                "tracked": len(self.sizes), "operations": self.num_ops, "planned_moves": self.num_planned_moves,
                "dropped_moves": self.num_dropped_moves, "overcommitted": self.overcommitted,
                "untracked": self.untracked, "max_unit_moves_per_op": self.packer.op_stats.max_unit_moves,
                "unit_moves_per_op": dict(sorted(self.packer.op_stats.hist.items()))}
