"""Heterogeneous sizes: Chameleon's mix of adapter ranks and request lengths.

Chameleon's setup: `num_adapters` adapters split evenly over ranks {8, 16, 32, 64, 128}; each request picks a rank
uniformly, then an adapter within that rank by a power law (Zipf `zipf_s`; the paper gives no exponent); Poisson
arrivals at `rate`; prompt and output lengths are those of the Azure conversation trace (the Splitwise trace Chameleon
uses), bootstrapped with the seed and scaled down by `length_scale` as Chameleon does to fit its testbed. Requests are
tagged "short" or "long" by whether their prompt + output is below `long_threshold_tokens`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from eval.workloads.base import (
    Workload,
    count_capped,
    poisson_arrivals,
    read_azure_trace,
    scale_len,
    zipf_probs,
)
from eval.workloads.records import AdapterInfo, Request


@dataclass(frozen=True)
class HeterogeneousParams:
    num_requests: int = 1000
    num_adapters: int = 100
    ranks: tuple[int, ...] = (8, 16, 32, 64, 128)
    zipf_s: float = 1.0
    rate: float = 8.0  # requests per second (Poisson); Chameleon's medium load is 8 RPS
    length_scale: float = 0.5
    max_prompt_tokens: int = 4096
    max_output_tokens: int = 1024
    long_threshold_tokens: int = 600


def generate(p: HeterogeneousParams, seed: int) -> Workload:
    if p.num_adapters % len(p.ranks):
        raise ValueError(f"num_adapters ({p.num_adapters}) must split evenly over ranks {p.ranks}")
    per_rank = p.num_adapters // len(p.ranks)
    adapters = tuple(
        AdapterInfo(f"r{rank}-{i:03d}", rank) for rank in p.ranks for i in range(per_rank)
    )
    rng = np.random.default_rng(seed)
    rows = read_azure_trace()
    probs = zipf_probs(per_rank, p.zipf_s)
    requests, drawn = [], []
    for i, t in enumerate(poisson_arrivals(rng, p.num_requests, p.rate)):
        rank_index = int(rng.integers(len(p.ranks)))
        adapter = adapters[rank_index * per_rank + int(rng.choice(per_rank, p=probs))]
        row = rows[int(rng.integers(len(rows)))]
        drawn.append(row)
        new = scale_len(row.context_tokens, p.length_scale, p.max_prompt_tokens)
        out = scale_len(row.generated_tokens, p.length_scale, p.max_output_tokens)
        size = "long" if new + out >= p.long_threshold_tokens else "short"
        requests.append(
            Request(
                f"het{i}",
                float(t),
                f"het{i}",
                0,
                adapter.name,
                None,
                0,
                new,
                out,
                tags={"kind": "lora", "size": size, "rank": adapter.rank},
            )
        )
    num_capped = count_capped(
        "heterogeneous", drawn, p.length_scale, p.max_prompt_tokens, p.max_output_tokens
    )
    notes = {"num_capped": num_capped}
    return Workload("heterogeneous", seed, asdict(p), adapters, tuple(requests), notes)
