"""Batch adapter slots: the engine's cap on distinct adapters per batch, the slot squash and drain.

Lives here: `AdapterSlots` (one batch's view of the cap), `SlotSquash` and `choose_slot_squash`
(pure), `SlotDrain` and `choose_drain_adapter` (pure). Not here: applying a squash
(`MultiQueueScheduler.commit_slot_squash`; the engine retracts the victims), a drain's state
(`MultiQueueScheduler`) or the admission scan that asks for slots (admission.py).

The resource. SGLang runs at most `--max-loras-per-batch` distinct adapters in one batch (the base
model counts as one); a request whose adapter is not among the running ones waits until every
running request of some adapter has finished. Under decode-heavy load that wait is a whole decode,
under fcfs and the plain multi-queue alike (measured: eval/RESULTS.md, multi-queue admission).
Chameleon's engine (S-LoRA) has no
such cap, so the paper has no rule for it; these two apply its ideas to it.

1. Admission counts slots. A request that would need a new slot when none is left is passed over,
   keeping its place, as one whose adapter is loading is: it does not stop its queue, and the plan
   agrees with what the engine will take.
2. Slot squash (Chameleon's squash, for slots instead of adapter memory). When every slot is taken
   and R1, the oldest queued request that needs a new slot (its adapter resident, or made resident
   for it by the squash's one prefetch; no token of it produced yet), would miss its TTFT SLO
   waiting for one, the running requests of one adapter are
   retracted and go back to their arrival positions, and the freed slot is reserved for R1 in the
   next batch (one batch only: a beneficiary that cannot go in then, its cost over the budget or its
   adapter evicted meanwhile, must not hold the slot from everyone else). "Would miss": its wait so
   far plus the predicted time until some running adapter's last request finishes exceeds the SLO,
   or it has already waited `config.slot_squash_share` of the SLO (the prediction was wrong: an
   output-length predictor underestimates long decodes; lower squashes sooner, config.py). The
   victim adapter is the one cheapest to recompute (the prompt and output tokens of its running
   requests), among those whose requests may all still be
   squashed (`max_squashes` each) and whose recompute takes less than the SLO at the timing model's
   prefill rate. Bounds: one squash at a time (none while a reservation is pending), a request
   squashed at most `max_slot_squashes` times, and a retracted request is never R1 (its first token is
   out; its TTFT cannot be saved), so squashes cannot cascade or alternate.
3. Slot drain (SGLang's LoRA drainer, `--lora-drain-wait-threshold`, for the plan). Neither rule
   above serves a request the squash may not fire for (a retracted one resuming, or one whose
   squash finds no victim): while the running adapters keep receiving requests, which need no new
   slot, no slot ever frees for it. When every slot is taken and a queued request that needs a new
   one has waited `config.slot_drain_share` of the SLO for it (since a batch first passed it over),
   the running adapter whose drain adds the least waiting (`choose_drain_adapter`: its predicted
   time to finish, weighed by its queued and arriving requests) takes no new request until its
   last running one finishes; the freed slot is then reserved for that request for one
   batch. One drain at a time, the longest-waiting request first, none while a squash's
   reservation is pending. Nothing is retracted, so a drain costs no recompute; it delays the
   drained adapter's new requests instead. Bound: a request waiting for a slot gets one within
   the threshold plus, for each drain ahead of it and its own, the drained adapter's longest
   remaining decode (finite: every request has its max_new_tokens), unless an adapter retracted
   again by the engine keeps its slot.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from sgl_multilora.sched.config import SchedConfig
from sgl_multilora.sched.request import SchedRequest, TimingModel


@dataclass
class AdapterSlots:
    """One batch's slots: the adapters running (None: the base model) and the cap. `reserved`: the
    rid a squash freed a slot for; until it takes one, every other request that needs a new slot
    finds one fewer."""

    running: set[str | None]
    cap: int
    reserved: str | None = None
    draining: frozenset[str | None] = frozenset()
    """Adapters being drained: their requests get no slot, even while the adapter runs."""
    drain_for: str | None = None
    """The rid the drain is for: once it takes a slot, the drain is over."""
    in_batch: set[str | None] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.cap < 1:
            raise ValueError(f"an adapter slot cap must be >= 1, got {self.cap}")
        self.in_batch = set(self.running)

    def has_slot(self, r: SchedRequest) -> bool:
        if r.adapter in self.draining:
            return False
        if r.adapter in self.in_batch:
            return True
        held = self.reserved is not None and self.reserved != r.rid
        return self.cap - len(self.in_batch) - held > 0

    def take(self, r: SchedRequest) -> None:
        self.in_batch.add(r.adapter)
        if r.rid == self.reserved:
            self.reserved = None
        if r.rid == self.drain_for:
            self.draining, self.drain_for = frozenset(), None


@dataclass(frozen=True)
class SlotSquash:
    adapter: str | None
    """The adapter whose running requests go (None: the base model)."""
    victims: tuple[SchedRequest, ...]
    """Every running request of `adapter`: retract each in the engine, then `commit_slot_squash`."""
    beneficiary: SchedRequest
    """R1: queued; the freed slot is reserved for it."""
    wait_s: float
    """Predicted time until a slot would have freed without the squash."""


@dataclass(frozen=True)
class SlotDrain:
    adapter: str | None
    """The running adapter that takes no new request until its last one finishes (None: the base
    model)."""
    beneficiary: str
    """The queued rid the freed slot is reserved for."""
    started_at: float
    finish_s: float
    """Predicted time from `started_at` until the adapter's running requests finish (inf: some of
    them unknown to the scheduler)."""


def choose_drain_adapter(running: Mapping[str | None, Sequence[SchedRequest | None]], now: float,
                         timing: TimingModel, waiting: Mapping[str | None, int] | None = None,
                         rates: Mapping[str | None, float] | None = None,
                         exclude: Collection[str | None] = ()) -> tuple[str | None, float] | None:
    """The running adapter to drain, with its predicted time to finish (its last running request's
    end): the one whose drain adds the least waiting, in request-seconds. Draining adapter A for
    `finish` seconds holds up the request it is for and A's `waiting` queued requests for up to
    `finish` each, and A's requests arriving meanwhile (at A's recent arrival rate, `rates`, per
    second) for half of it on average: cost = finish (1 + waiting) + rate finish^2 / 2. So an idle
    adapter goes before a busy one that would finish a little sooner (draining the busy one keeps
    its new requests from their first token for its whole drain). Ties: sooner, fewer running
    requests, name. An adapter with a request the scheduler does not know (None) predicts inf and
    goes last. None when every running adapter is in `exclude`. Pure."""
    waiting, rates = waiting or {}, rates or {}
    best = None
    for adapter, reqs in running.items():
        if adapter in exclude:
            continue
        finish = math.inf if any(r is None for r in reqs) else max(
            (timing.remaining_s(r, now) for r in reqs), default=0.0)
        cost = math.inf if math.isinf(finish) else (
            finish * (1 + waiting.get(adapter, 0)) + rates.get(adapter, 0.0) * finish * finish / 2)
        key = (cost, finish, len(reqs), "" if adapter is None else adapter)
        if best is None or key < best[0]:
            best = (key, adapter)
    return None if best is None else (best[1], best[0][1])


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
