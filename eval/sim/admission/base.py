"""What every admission policy answers the engine: which waiting requests one admission pass examines, in order.

Lives here: `BaseAdmission`, the interface (and FCFS's behaviour, which the others refine), and `EngineView`,
what a policy may ask of the engine. Not here: the pass itself (engine.py asks the system whether each candidate
fits and stops on its limits), memory or the policies (one file each).

Per step the engine (1) tells the policy about arrivals (`on_arrival`), (2) with requests waiting, lets it retract
running ones (`before_pass`), (3) when it could admit anything at all (a free running slot, less than a chunk of
prefill backlog), asks for `candidates` and walks them in order: a request the system admits starts prefilling, one
waiting for its adapter or a slot is passed over, one lacking KV memory ends the pass; (4) reports the admitted set
(`after_pass`); (5) reports every finished request (`on_finish`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from eval.sim.config import SimConfig
    from eval.sim.latency import LatencyModel
    from eval.sim.systems.base import BaseSystem
    from eval.sim.systems.request import SimRequest


class EngineView(Protocol):
    """What a policy may ask of the engine during `before_pass`, and nothing else (the engine's loop implements it;
    a policy never imports the engine)."""

    def running_by_adapter(self) -> dict[str | None, list[SimRequest]]:
        """The running requests (prefilling and decoding) by adapter name (None: the base model). No mutation."""
        ...

    def generated(self, sr: SimRequest) -> int:
        """Output tokens decoding request `sr` has produced so far. No mutation."""
        ...

    def retract(self, victims: list[SimRequest]) -> None:
        """Takes decoding requests out of the batch (their KV so far cached); they wait again at their arrival
        position. Each victim must be decoding (AssertionError otherwise)."""
        ...


class BaseAdmission:
    """`checks_backlog`: the engine also ends the pass once the prefill backlog reaches a chunk (FCFS and LPM, as
    SGLang's PrefillAdder stops at its chunked-prefill budget); a policy that sizes its own pass says False."""

    name = "base"
    checks_backlog = True

    def __init__(self, system: BaseSystem, lat: LatencyModel, config: SimConfig,
                 requests: list[SimRequest]) -> None:
        self.system, self.lat, self.cfg = system, lat, config

    def on_arrival(self, sr: SimRequest, now: float) -> None:
        """`sr` joined the waiting list (appended at its end)."""

    def before_pass(self, engine: EngineView, now: float) -> None:
        """Before a pass with requests waiting: a policy may retract running requests here
        (`engine.retract`)."""

    def candidates(self, waiting: list[SimRequest], now: float, backlog: int) -> list[SimRequest]:
        """The waiting requests this pass examines, in order (FCFS: all of them, oldest first). May reorder
        `waiting` in place (SGLang sorts its waiting queue in place). `backlog`: prefill tokens admitted but not
        yet computed."""
        return waiting

    def after_pass(self, admitted: set[SimRequest], now: float) -> None:
        """The pass admitted `admitted` (they left the waiting list)."""

    def on_finish(self, sr: SimRequest, now: float) -> None:
        """`sr` produced its last token."""

    def check_invariants(self, waiting: list[SimRequest]) -> None:
        """The policy's state agrees with the engine's waiting list."""
