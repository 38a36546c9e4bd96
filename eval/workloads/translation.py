"""Translation: single-turn requests on the Azure conversation trace's real arrival times and lengths, with
adapter popularity that shifts over time.

As in ELORA's translation scenario (language pair -> LoRA, arrivals from a production trace): request i of the
trace (eval/data/azure_conv_2023_first2000.csv, attribution in eval/data/README.md) keeps its arrival time and its
recorded prompt/output lengths (scaled by `length_scale`, capped at `max_*_tokens`), and gets an adapter drawn from
a Zipf(s) popularity whose ranking is reshuffled every `shift_period_s` seconds of trace time (the shifting demand
of ELORA's Fig. 2). `time_scale` > 1 compresses the arrivals (higher rate, same pattern).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from eval.workloads.base import (
    Workload,
    count_capped,
    rank_adapters,
    read_azure_trace,
    scale_len,
    zipf_probs,
)
from eval.workloads.records import Request


@dataclass(frozen=True)
class TranslationParams:
    num_requests: int = 2000
    first_row: int = 0
    num_adapters: int = 50
    ranks: tuple[int, ...] = (32, 64)
    zipf_s: float = 1.2
    shift_period_s: float = 60.0  # trace seconds between popularity reshuffles
    length_scale: float = 1.0
    max_prompt_tokens: int = 8192
    max_output_tokens: int = 2048
    time_scale: float = 1.0  # arrival_s = trace time / time_scale


def popularity_order(
    rng: np.random.Generator, num_adapters: int, num_windows: int
) -> list[np.ndarray]:
    """For each window, a permutation: order[w][k] is the adapter holding popularity rank k in window w."""
    return [rng.permutation(num_adapters) for _ in range(num_windows)]


def generate(p: TranslationParams, seed: int) -> Workload:
    rows = read_azure_trace()[p.first_row : p.first_row + p.num_requests]
    if len(rows) < p.num_requests:
        raise ValueError(
            f"the bundled trace has {len(rows) + p.first_row} rows; asked for rows "
            f"{p.first_row}..{p.first_row + p.num_requests - 1}"
        )
    rng = np.random.default_rng(seed)
    adapters = rank_adapters(p.num_adapters, p.ranks)
    probs = zipf_probs(p.num_adapters, p.zipf_s)
    t0 = rows[0].arrival_s
    num_windows = int((rows[-1].arrival_s - t0) // p.shift_period_s) + 1
    orders = popularity_order(rng, p.num_adapters, num_windows)
    requests = []
    for i, row in enumerate(rows):
        window = int((row.arrival_s - t0) // p.shift_period_s)
        adapter = adapters[int(orders[window][rng.choice(p.num_adapters, p=probs)])].name
        requests.append(
            Request(
                rid=f"tr{i}",
                arrival_s=(row.arrival_s - t0) / p.time_scale,
                session=f"tr{i}",
                turn=0,
                adapter=adapter,
                parent_rid=None,
                history_tokens=0,
                new_tokens=scale_len(row.context_tokens, p.length_scale, p.max_prompt_tokens),
                output_tokens=scale_len(row.generated_tokens, p.length_scale, p.max_output_tokens),
                tags={"kind": "lora", "window": window},
            )
        )
    notes = {
        "popular_adapter_by_window": [adapters[int(o[0])].name for o in orders],
        "num_capped": count_capped(
            "translation", rows, p.length_scale, p.max_prompt_tokens, p.max_output_tokens
        ),
    }
    return Workload("translation", seed, asdict(p), adapters, tuple(requests), notes)
