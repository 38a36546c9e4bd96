"""First come, first served: SGLang's default `--schedule-policy fcfs`, and the engine's only order before
admission policies existed (its results are unchanged by their introduction).

Lives here: `FcfsAdmission`. Not here: the pass (engine.py) or the interface (base.py).
"""

from __future__ import annotations

from eval.sim.admission.base import BaseAdmission


class FcfsAdmission(BaseAdmission):
    name = "fcfs"
