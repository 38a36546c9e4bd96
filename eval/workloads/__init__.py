"""Workload generators, one module each, chosen by name: `create_workload("chatbot", seed=0, num_adapters=5)`.

Every generator is deterministic for its seed and documents its parameters (defaults follow the papers in
shared/reference/). Workloads are plain `Request` lists (eval/workloads/records.py) that the live driver and the simulator
both consume. Not here: sending requests (eval/live/driver.py) or simulating them (eval/sim/).
"""

from __future__ import annotations

from eval.workloads import agent, alora_pipeline, chatbot, heterogeneous, trace, translation
from eval.workloads.base import Workload, make_params
from eval.workloads.trace import TraceError

WORKLOADS = {
    "chatbot": (chatbot.ChatbotParams, chatbot.generate),
    "translation": (translation.TranslationParams, translation.generate),
    "agent": (agent.AgentParams, agent.generate),
    "alora_pipeline": (alora_pipeline.AloraPipelineParams, alora_pipeline.generate),
    "heterogeneous": (heterogeneous.HeterogeneousParams, heterogeneous.generate),
    "trace": (trace.TraceParams, trace.generate),
}


def create_workload(name: str, seed: int = 0, **params) -> Workload:
    """Generates workload `name`. Raises ValueError for an unknown name (listing the known ones) or parameter."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    cls, generate = WORKLOADS[name]
    workload = generate(make_params(cls, params), seed)
    workload.check_invariants()
    return workload


__all__ = ["WORKLOADS", "TraceError", "Workload", "create_workload"]
