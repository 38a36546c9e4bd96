"""Personal agent: long multi-turn sessions (ELORA's Taskmaster scenario, its longest conversations).

Each session serves one task scene (one adapter, Zipf popularity) and opens with that scene's instructions, a long
prefix shared by every session of the scene. It then runs `min_turns`..`max_turns` turns (uniform): each turn adds a
short observation/user message and generates a short action, after a short tool latency. The history therefore grows
long while each turn's fresh part stays small, which is what makes history-KV reuse pay off.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from eval.workloads.base import Workload, draw_len, poisson_arrivals, rank_adapters, zipf_probs
from eval.workloads.records import Request, history_of


@dataclass(frozen=True)
class AgentParams:
    num_sessions: int = 50
    num_adapters: int = 20
    ranks: tuple[int, ...] = (32, 64)
    zipf_s: float = 1.2
    session_rate: float = 0.2  # new sessions per second (Poisson)
    min_turns: int = 8
    max_turns: int = 20
    scene_tokens: int = 512  # instructions shared by all sessions of one adapter
    mean_new_tokens: float = 40.0  # observation / user message per turn
    mean_output_tokens: float = 60.0  # the agent's action per turn
    tool_time_s: float = 2.0  # mean exponential gap between turns


def generate(p: AgentParams, seed: int) -> Workload:
    if not 1 <= p.min_turns <= p.max_turns:
        raise ValueError(f"need 1 <= min_turns <= max_turns, got {p.min_turns}, {p.max_turns}")
    rng = np.random.default_rng(seed)
    adapters = rank_adapters(p.num_adapters, p.ranks)
    probs = zipf_probs(p.num_adapters, p.zipf_s)
    requests: list[Request] = []
    for s, start in enumerate(poisson_arrivals(rng, p.num_sessions, p.session_rate)):
        adapter = adapters[int(rng.choice(p.num_adapters, p=probs))].name
        num_turns = int(rng.integers(p.min_turns, p.max_turns + 1))
        t, parent = float(start), None
        for turn in range(num_turns):
            req = Request(
                rid=f"agent{s}-t{turn}",
                arrival_s=t,
                session=f"agent{s}",
                turn=turn,
                adapter=adapter,
                **history_of(parent),
                new_tokens=draw_len(rng, p.mean_new_tokens) + (p.scene_tokens if turn == 0 else 0),
                output_tokens=draw_len(rng, p.mean_output_tokens),
                shared_prefix=f"scene:{adapter}" if p.scene_tokens else None,
                shared_prefix_tokens=p.scene_tokens,
                tags={"kind": "lora"},
            )
            requests.append(req)
            parent = req
            t += float(rng.exponential(p.tool_time_s))
    requests.sort(key=lambda r: (r.arrival_s, r.rid))
    return Workload("agent", seed, asdict(p), adapters, tuple(requests))
