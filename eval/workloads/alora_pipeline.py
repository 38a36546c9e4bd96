"""aLoRA pipelines: a base-model answer, then aLoRA checks on that answer, then a base continuation.

The pattern of the aLoRA paper's multi-adapter pipelines (generate, judge with activated adapters, continue): the base
turn answers a context of ~`mean_context_tokens`; `checks_per_pipeline` checks (cycling over the aLoRA adapters) each
send the base turn's prompt + answer followed by the adapter's invocation sequence (`invocation_tokens` long) and
generate a short label; the continuation sends the same history plus a follow-up question to the base model. With
aLoRA, every check and the continuation can reuse the base turn's KV. Pipelines arrive as a Poisson process; checks
follow the base answer after `check_delay_s`, the continuation after the checks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from eval.workloads.base import Workload, draw_len, poisson_arrivals
from eval.workloads.records import AdapterInfo, Request


@dataclass(frozen=True)
class AloraPipelineParams:
    num_pipelines: int = 100
    num_aloras: int = 2
    alora_rank: int = 16
    pipeline_rate: float = 0.5  # pipelines per second (Poisson)
    mean_context_tokens: float = 512.0
    mean_answer_tokens: float = 64.0
    checks_per_pipeline: int = 2
    invocation_tokens: int = (
        5  # length of the adapter's invocation sequence (the bundled aLoRAs: 5)
    )
    check_output_tokens: int = 2
    mean_followup_tokens: float = 16.0
    mean_continuation_tokens: float = 64.0
    check_delay_s: float = 0.5


def generate(p: AloraPipelineParams, seed: int) -> Workload:
    if p.num_aloras < 1 or p.checks_per_pipeline < 0:
        raise ValueError("need at least one aLoRA and a non-negative number of checks")
    rng = np.random.default_rng(seed)
    adapters = tuple(
        AdapterInfo(
            f"alora-{i:03d}",
            p.alora_rank,
            kind="alora",
            target_modules=("q_proj", "k_proj", "v_proj"),
        )
        for i in range(p.num_aloras)
    )
    requests: list[Request] = []
    for n, start in enumerate(poisson_arrivals(rng, p.num_pipelines, p.pipeline_rate)):
        session = f"pipe{n}"
        base = Request(
            f"{session}-base",
            float(start),
            session,
            0,
            None,
            None,
            0,
            draw_len(rng, p.mean_context_tokens),
            draw_len(rng, p.mean_answer_tokens),
            tags={"kind": "base", "step": "base answer"},
        )
        history = base.prompt_tokens + base.output_tokens
        requests.append(base)
        for c in range(p.checks_per_pipeline):
            requests.append(
                Request(
                    f"{session}-check{c}",
                    base.arrival_s + p.check_delay_s,
                    session,
                    1 + c,
                    adapters[c % p.num_aloras].name,
                    base.rid,
                    history,
                    p.invocation_tokens,
                    p.check_output_tokens,
                    alora_invocation=True,
                    tags={"kind": "alora", "step": "check"},
                )
            )
        requests.append(
            Request(
                f"{session}-cont",
                base.arrival_s + 2 * p.check_delay_s,
                session,
                1 + p.checks_per_pipeline,
                None,
                base.rid,
                history,
                draw_len(rng, p.mean_followup_tokens),
                draw_len(rng, p.mean_continuation_tokens),
                tags={"kind": "base", "step": "continuation"},
            )
        )
    requests.sort(key=lambda r: (r.arrival_s, r.rid))
    return Workload("alora_pipeline", seed, asdict(p), adapters, tuple(requests))
