"""Chatbot: multi-turn conversations, each with one adapter drawn from a Zipf popularity.

Parameters (defaults after the papers): adapter popularity Zipf s = 1.2 (InfiniLoRA/Cannikin's production-calibrated
value), 20 adapters of rank 32/64 (ELORA's Llama3-8B setup), conversations arriving as a Poisson process, a
geometric number of turns, exponential think time between a reply and the next user turn, a system prompt shared by
every conversation. Turn t+1's prompt is turn t's prompt + output + the new user message (ELORA's history KV).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from eval.workloads.base import Workload, draw_len, poisson_arrivals, rank_adapters, zipf_probs
from eval.workloads.records import Request, history_of


@dataclass(frozen=True)
class ChatbotParams:
    num_conversations: int = 200
    num_adapters: int = 20
    ranks: tuple[int, ...] = (32, 64)
    zipf_s: float = 1.2
    conversation_rate: float = 1.0  # new conversations per second (Poisson)
    mean_turns: float = 4.0  # geometric, at least 1
    think_time_s: float = 10.0  # mean exponential gap between a turn's arrival and the next turn's
    mean_new_tokens: float = 120.0  # user message length (geometric)
    mean_output_tokens: float = 130.0  # reply length (Azure conv median output 129)
    system_tokens: int = 64  # shared system prompt at the start of every conversation (0: none)
    first_turn_tokens: int = 0  # a long first message of the conversation's own (a pasted document): long histories


def generate(p: ChatbotParams, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    adapters = rank_adapters(p.num_adapters, p.ranks)
    probs = zipf_probs(p.num_adapters, p.zipf_s)
    starts = poisson_arrivals(rng, p.num_conversations, p.conversation_rate)
    requests: list[Request] = []
    for c, start in enumerate(starts):
        adapter = adapters[int(rng.choice(p.num_adapters, p=probs))].name
        num_turns = draw_len(rng, p.mean_turns)
        t, parent = float(start), None
        for turn in range(num_turns):
            new = draw_len(rng, p.mean_new_tokens) + (p.system_tokens + p.first_turn_tokens if turn == 0 else 0)
            req = Request(
                rid=f"chat{c}-t{turn}",
                arrival_s=t,
                session=f"chat{c}",
                turn=turn,
                adapter=adapter,
                **history_of(parent),
                new_tokens=new,
                output_tokens=draw_len(rng, p.mean_output_tokens),
                shared_prefix="system" if p.system_tokens else None,
                shared_prefix_tokens=p.system_tokens,
                tags={"kind": "lora"},
            )
            requests.append(req)
            parent = req
            t += float(rng.exponential(p.think_time_s))
    requests.sort(key=lambda r: (r.arrival_s, r.rid))
    return Workload("chatbot", seed, asdict(p), adapters, tuple(requests))
