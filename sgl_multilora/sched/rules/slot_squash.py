"""The slot squash: the running requests of one adapter retracted so that a request about to miss
its TTFT SLO gets an adapter slot (Chameleon's squash, for slots instead of adapter memory).

Lives here: `SlotSquashRule` (R1's choice and the reservation), `SlotSquash` and
`choose_slot_squash` (pure). Not here: the cap itself (slots.py) or the retraction (the engine
retracts the victims, then calls `SlotSquashRule.commit`).

Rule. When every slot is taken and R1, the oldest queued request that needs a new slot (its adapter
resident, or made resident for it by the squash's one prefetch; no token of it produced yet), would
miss its TTFT SLO waiting for one, the running requests of one adapter are retracted and go back
to their arrival positions, and the freed slot is reserved for R1 in the next batch (one batch
only: a beneficiary that cannot go in then, its cost over the budget or its adapter evicted
meanwhile, must not hold the slot from everyone else). "Would miss": its wait so far plus the
predicted time until some running adapter's last request finishes exceeds the SLO, or it has
already waited `config.slot_squash_share` of the SLO (the prediction was wrong: an output-length
predictor underestimates long decodes; lower squashes sooner, config.py). The victim adapter is the
one cheapest to recompute (the prompt and output tokens of its running requests), among those whose
requests may all still be squashed (`max_slot_squashes` each) and whose recompute takes less than
the SLO at the timing model's prefill rate. Bounds: one squash at a time (none while a reservation
is pending), a request squashed at most `max_slot_squashes` times, and a retracted request is never
R1 (its first token is out; its TTFT cannot be saved), so squashes cannot cascade or alternate.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from sgl_multilora.sched.admission import IsResident, RequestPrefetch
from sgl_multilora.sched.config import SchedConfig
from sgl_multilora.sched.request import SchedRequest, TimingModel
from sgl_multilora.sched.rules.base import BatchRule, SchedulerView


@dataclass(frozen=True)
class SlotSquash:
    adapter: str | None
    """The adapter whose running requests go (None: the base model)."""
    victims: tuple[SchedRequest, ...]
    """Every running request of `adapter`: retract each in the engine, then `commit` the squash."""
    beneficiary: SchedRequest
    """R1: queued; the freed slot is reserved for it."""
    wait_s: float
    """Predicted time until a slot would have freed without the squash."""


def slot_free_in_s(running: Mapping[str | None, Sequence[SchedRequest]], now: float,
                   timing: TimingModel) -> float:
    """Predicted time until some running adapter's last request finishes (0 with none running)."""
    return min((max((timing.remaining_s(r, now) for r in reqs), default=0.0)
                for reqs in running.values()), default=0.0)


def choose_slot_squash(r1: SchedRequest,
                       running: Mapping[str | None, Sequence[SchedRequest | None]],
                       now: float, config: SchedConfig,
                       recompute_tokens: Callable[[SchedRequest], int],
                       excluded: Collection[str | None] = ()) -> SlotSquash | None:
    """The squash the rule calls for now for R1, if any (module docstring). `running`: adapter ->
    its running requests, None for one the scheduler does not know (that adapter is not squashed);
    `excluded`: adapters that may not be squashed (one with a chunked prefill in progress). The
    caller has checked that every slot is taken and R1 needs a new one. Modifies nothing."""
    known = {a: [r for r in reqs if r is not None] for a, reqs in running.items()}
    wait = slot_free_in_s(known, now, config.timing)
    age = now - r1.arrival
    slo = config.ttft_slo_s
    if age + wait <= slo and age < config.slot_squash_share * slo:
        return None
    best: tuple[tuple[int, int], str | None, list[SchedRequest]] | None = None
    for adapter, reqs in running.items():
        if adapter in excluded or adapter == r1.adapter or not reqs:
            continue
        if any(r is None or r.num_squashes >= config.max_slot_squashes for r in reqs):
            continue
        cost = sum(recompute_tokens(r) for r in reqs)
        if cost * config.timing.prefill_s_per_token >= slo:
            continue
        key = (cost, len(reqs))
        if best is None or key < best[0]:
            best = (key, adapter, reqs)
    if best is None:
        return None
    return SlotSquash(best[1], tuple(best[2]), r1, wait)


class SlotSquashRule(BatchRule):
    def __init__(self, mq: SchedulerView) -> None:
        super().__init__(mq)
        self._reserved: str | None = None  # the rid the last squash freed a slot for

    @property
    def reserved_for(self) -> str | None:
        """The queued rid a squash reserved a slot for (None: no reservation)."""
        return self._reserved if self._reserved in self.mq.queues else None

    def choose(self, now: float, running_adapters: Mapping[str | None, Collection[str]],
               max_adapters: int, recompute_tokens: Callable[[SchedRequest], int],
               is_resident: IsResident | None = None, excluded: Collection[str | None] = (),
               request_prefetch: RequestPrefetch | None = None) -> SlotSquash | None:
        """The squash to apply now, if any: `running_adapters` maps each adapter the engine runs
        (None: the base model) to its running rids, `max_adapters` is the engine's cap,
        `recompute_tokens(r)` what retracting r costs, `excluded` adapters that may not be
        squashed. None while a slot is free, while an earlier squash's beneficiary is still
        queued, or when no queued request qualifies. R1 is the oldest queued request needing a
        slot whose adapter is resident; with `request_prefetch`, an older one whose adapter is not
        (admission asks for no load while no slot is left for its request) is R1 if the rule fires
        for it and the prefetch makes its adapter resident at once; a load that does not complete
        at once leaves the squash for a later pass. At most one prefetch per call. O(queued +
        running). Modifies nothing but what the prefetch loads."""
        mq = self.mq
        if len(running_adapters) < max_adapters or self._reserved in mq.queues:
            return None
        oldest = resident = None  # the oldest qualifying request; the oldest one already resident
        for q in range(mq.queues.num_queues):
            for r in mq.queues.scan(q):  # arrival order: the first to qualify is the queue's oldest
                if resident is not None and r.seq > resident.seq:
                    break
                if r.resumed or r.adapter in running_adapters:
                    continue
                if oldest is None or r.seq < oldest.seq:
                    oldest = r
                if is_resident is None or r.adapter is None or is_resident(r.adapter):
                    resident = r
                    break
        if oldest is None:
            return None
        running = {a: [mq.running.get(rid) for rid in rids] for a, rids in running_adapters.items()}
        if oldest is not resident and request_prefetch is not None:
            squash = choose_slot_squash(oldest, running, now, mq.config, recompute_tokens, excluded)
            loaded = squash is not None and request_prefetch(oldest.adapter)
            if loaded and is_resident(oldest.adapter):
                return squash
        if resident is None:
            return None
        return choose_slot_squash(resident, running, now, mq.config, recompute_tokens, excluded)

    def commit(self, squash: SlotSquash) -> None:
        """After the engine retracted `squash.victims`: each goes back to its arrival position
        (`requeue(slot_squash=True)`), and the freed slot is reserved for the beneficiary."""
        for r in squash.victims:
            self.mq.requeue(r.rid, slot_squash=True)
        self._reserved = squash.beneficiary.rid
        self.mq.counts["slot_squashes"] += 1

    def left_queues(self, r: SchedRequest) -> None:
        if r.rid == self._reserved:
            self._reserved = None

    def end_batch(self) -> None:
        # the squash freed the slot right before this batch: a beneficiary not admitted in it (its
        # cost over the budget, its adapter evicted meanwhile) would only hold the slot from
        # everyone else; it may be squashed for again
        self._reserved = None

    def check_invariants(self) -> None:
        assert self._reserved is None or self._reserved in self.mq.queues, \
            f"a slot reserved for {self._reserved}, which is not queued"
