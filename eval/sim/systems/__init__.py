"""The simulated systems, chosen by arm name.

- `vllm`: static 20/80 split, LRU in each area (`vllm.py`);
- `slora`: unified adapters + running KV, no history KV (`slora.py`);
- `sglang`: fixed adapter slots, radix cache with LRU (`sglang.py`);
- `ours:<policy>` with policy `lru`, `elora` or `chameleon`, and ELORA's ablations as suffixes
  `ours:elora:no-tree` (WOM), `ours:elora:-lora_count` (WOL), `-cost` (WOC), `-visit` (WOV), `-recency` (WOU),
  `ours:elora:tau=<seconds>` (the time unit of the decay term) and `:no-prefetch` (no idle swap-in);
  suffixes combine (`ours.py`).
"""

from __future__ import annotations

from eval.requests import AdapterInfo
from eval.sim.latency import LatencyModel
from eval.sim.systems.base import BaseSystem
from eval.sim.systems.ours import Ours
from eval.sim.systems.sglang import SglangLike
from eval.sim.systems.slora import SLoraLike
from eval.sim.systems.vllm import VllmLike

BASELINES = {"vllm": VllmLike, "slora": SLoraLike, "sglang": SglangLike}


def create_system(arm: str, adapters: list[AdapterInfo] | tuple[AdapterInfo, ...], lat: LatencyModel,
                  pool_total_bytes: int) -> BaseSystem:
    """Builds the system an arm name describes. Raises ValueError naming a malformed arm."""
    if arm in BASELINES:
        return BASELINES[arm](adapters, lat, pool_total_bytes)
    parts = arm.split(":")
    if parts[0] != "ours" or len(parts) < 2:
        raise ValueError(f"unknown arm {arm!r}; known: {', '.join(BASELINES)}, ours:<policy>[:suffix...]")
    policy, kwargs, dependency, prefetch = parts[1], {}, True, True
    drop = []
    for suffix in parts[2:]:
        if suffix == "no-tree":
            dependency = False
        elif suffix == "no-prefetch":
            prefetch = False
        elif suffix.startswith("-") and policy == "elora":
            drop.append(suffix[1:])
        elif suffix.startswith("tau=") and policy in ("elora", "chameleon"):
            kwargs["tau_s"] = float(suffix[4:])
        else:
            raise ValueError(f"arm {arm!r}: unknown suffix {suffix!r} for policy {policy!r}")
    if drop:
        kwargs["drop"] = drop
    system = Ours(adapters, lat, pool_total_bytes, policy=policy, policy_kwargs=kwargs, dependency=dependency,
                  prefetch=prefetch)
    system.name = arm
    return system
