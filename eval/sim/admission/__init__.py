"""Admission policies of the simulator, chosen by name: which waiting requests each admission pass examines and
in which order (SimConfig.admission).

- `fcfs`: arrival order, SGLang's default (`fcfs.py`; the engine's behaviour before this choice existed);
- `lpm`: SGLang's longest-prefix-match ordering of the waiting queue (`lpm.py`);
- `multiqueue`: the project's `sgl_multilora.sched.MultiQueueScheduler` (Chameleon), driven as the live server
  drives it (`multiqueue.py`).
Not here: the pass itself (engine.py: the system decides whether each candidate fits) or memory (systems/).
"""

from __future__ import annotations

from eval.sim.admission.base import BaseAdmission
from eval.sim.admission.fcfs import FcfsAdmission
from eval.sim.admission.lpm import LpmAdmission
from eval.sim.admission.multiqueue import MultiQueueAdmission

POLICIES: dict[str, type[BaseAdmission]] = {
    "fcfs": FcfsAdmission, "lpm": LpmAdmission, "multiqueue": MultiQueueAdmission,
}


def create_admission(name: str, system, lat, config, requests) -> BaseAdmission:
    """Builds policy `name` for one run. Raises ValueError listing the known names."""
    if name not in POLICIES:
        raise ValueError(f"unknown admission policy {name!r}; known: {', '.join(POLICIES)}")
    return POLICIES[name](system, lat, config, requests)


__all__ = ["POLICIES", "BaseAdmission", "create_admission"]
