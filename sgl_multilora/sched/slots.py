"""Batch adapter slots: one batch's view of the engine's cap on distinct adapters per batch.

Lives here: `AdapterSlots`. Not here: the admission scan that asks for slots (admission.py) or the
slot squash that frees one for a request about to miss its SLO (rules/slot_squash.py).

The resource. SGLang runs at most `--max-loras-per-batch` distinct adapters in one batch (the base
model counts as one); a request whose adapter is not among the running ones waits until every
running request of some adapter has finished. Chameleon's engine (S-LoRA) has no such cap, so the
paper has no rule for it. Admission counts slots: a request that would need a new slot when none
is left is passed over, keeping its place, as one whose adapter is loading is; it does not stop
its queue, and the plan agrees with what the engine will take.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sgl_multilora.sched.request import SchedRequest


@dataclass
class AdapterSlots:
    """One batch's slots: the adapters running (None: the base model) and the cap. `reserved`: the
    rid a squash freed a slot for; until it takes one, every other request that needs a new slot
    finds one fewer."""

    running: set[str | None]
    cap: int
    reserved: str | None = None
    in_batch: set[str | None] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.cap < 1:
            raise ValueError(f"an adapter slot cap must be >= 1, got {self.cap}")
        self.in_batch = set(self.running)

    def has_slot(self, r: SchedRequest) -> bool:
        if r.adapter in self.in_batch:
            return True
        held = self.reserved is not None and self.reserved != r.rid
        return self.cap - len(self.in_batch) - held > 0

    def closed_to_new(self) -> bool:
        """Whether no request but the reserved one can have a new slot now: `has_slot(r)` is then True only for r
        whose adapter is in the batch, or r the reserved request. Changes only through `take`."""
        return self.cap - len(self.in_batch) - (self.reserved is not None) <= 0

    def take(self, r: SchedRequest) -> None:
        self.in_batch.add(r.adapter)
        if r.rid == self.reserved:
            self.reserved = None
