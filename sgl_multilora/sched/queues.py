"""The K FIFO queues of waiting requests, and the count of adapters they want.

Lives here: `QueueSet`, the only owner of queued requests (push, pop by rid, re-route). Not here:
who is admitted (multiqueue.py) or which queue a WRS value belongs to (plan.py).

Layout: one `OrderedDict` rid -> request per queue, in arrival (`seq`) order, so the head is O(1),
a scan from the head costs what it reads, and removal by rid (admission out of order, abort) is
O(1). A request returned after a squash or a retraction goes back to its arrival position.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator

from sgl_multilora.sched.request import SchedRequest


class QueueSet:
    def __init__(self, num_queues: int) -> None:
        if num_queues < 1:
            raise ValueError(f"need at least one queue, got {num_queues}")
        self._queues: list[OrderedDict[str, SchedRequest]] = [
            OrderedDict() for _ in range(num_queues)]
        self._by_rid: dict[str, SchedRequest] = {}
        self._wanted: Counter[str] = Counter()

    # ---- queries (modify nothing) ----------------------------------------------------------------

    @property
    def num_queues(self) -> int:
        return len(self._queues)

    def __len__(self) -> int:
        return len(self._by_rid)

    def __contains__(self, rid: str) -> bool:
        return rid in self._by_rid

    def get(self, rid: str) -> SchedRequest | None:
        return self._by_rid.get(rid)

    def len_of(self, q: int) -> int:
        return len(self._queues[q])

    def head(self, q: int) -> SchedRequest | None:
        queue = self._queues[q]
        return next(iter(queue.values())) if queue else None

    def scan(self, q: int) -> Iterator[SchedRequest]:
        """Queue q from the head, FIFO. The caller must not push or pop while iterating."""
        return iter(self._queues[q].values())

    def wanted_adapters(self) -> dict[str, int]:
        """Adapter -> number of queued requests that name it (base-model requests not counted).
        A copy: valid until the next push or pop."""
        return dict(self._wanted)

    # ---- mutations -------------------------------------------------------------------------------

    def push(self, r: SchedRequest, q: int) -> None:
        """Appends `r` to queue q. `r.seq` must exceed every seq already in that queue (arrival
        order); use `push_in_order` otherwise."""
        assert r.rid not in self._by_rid, f"request {r.rid} queued twice"
        r.queue = q
        self._queues[q][r.rid] = r
        self._by_rid[r.rid] = r
        if r.adapter is not None:
            self._wanted[r.adapter] += 1

    def push_in_order(self, r: SchedRequest, q: int) -> None:
        """Inserts `r` at its arrival position in queue q: O(queue length) unless it is the
        youngest. For returns after a squash or retraction, which are rare."""
        queue = self._queues[q]
        tail = next(reversed(queue.values()), None)
        self.push(r, q)
        if tail is not None and tail.seq > r.seq:
            for other in [x for x in queue.values() if x.seq > r.seq]:
                queue.move_to_end(other.rid)

    def pop(self, rid: str) -> SchedRequest | None:
        """Removes a queued request; None if `rid` is not queued here."""
        r = self._by_rid.pop(rid, None)
        if r is None:
            return None
        del self._queues[r.queue][rid]
        if r.adapter is not None:
            self._wanted[r.adapter] -= 1
            if not self._wanted[r.adapter]:
                del self._wanted[r.adapter]
        return r

    def reroute(self, num_queues: int, route: Callable[[SchedRequest], int]) -> None:
        """Rebuilds `num_queues` queues, placing every queued request at `route(r)` in arrival
        order. O(n log n); called once per refresh."""
        everyone = sorted(self._by_rid.values(), key=lambda r: r.seq)
        self._queues = [OrderedDict() for _ in range(num_queues)]
        for r in everyone:
            q = route(r)
            r.queue = q
            self._queues[q][r.rid] = r

    def check_invariants(self) -> None:
        seen = 0
        wanted: Counter[str] = Counter()
        for q, queue in enumerate(self._queues):
            prev = -1
            for rid, r in queue.items():
                assert r.rid == rid and r.queue == q, f"{r} filed under queue {q} as {rid}"
                assert self._by_rid.get(rid) is r, f"{rid} queued but missing from the rid index"
                assert r.seq > prev, f"queue {q} out of arrival order at {rid}"
                assert r.admitted_at is None, f"{rid} queued while marked admitted"
                prev = r.seq
                if r.adapter is not None:
                    wanted[r.adapter] += 1
            seen += len(queue)
        assert seen == len(self._by_rid), "rid index holds requests that are in no queue"
        assert wanted == self._wanted, f"wanted adapters {self._wanted} != queued {wanted}"
