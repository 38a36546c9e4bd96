"""The simulated systems, chosen by arm name.

- `vllm`: static 20/80 split, LRU in each area (`vllm.py`);
- `slora`: unified adapters + running KV, no history KV (`slora.py`);
- `sglang`: fixed adapter slots, radix cache with LRU (`sglang.py`); `sglang:hicache` adds SGLang's
  hierarchical cache, a host KV tier of the same size as ours (`:host-kv=<GB>` sets it);
- `ours:<policy>` with policy `lru`, `elora` or `chameleon`, and ELORA's ablations as suffixes
  `ours:elora:no-tree` (WOM), `ours:elora:-lora_count` (WOL), `-cost` (WOC), `-visit` (WOV), `-recency` (WOU),
  `ours:elora:tau=<seconds>` (the time unit of the decay term), `:no-prefetch` (no idle swap-in),
  `:no-host-kv` (no host KV tier: evicted KV is dropped, the pre-tier model) and `:host-kv=<GB>` (host KV pool
  size); suffixes combine (`ours.py`).

Host KV tier (`sgl_multilora.host_tier`): ours and its ablations have one, and `sglang:hicache` (stock SGLang with
its hierarchical cache, given the same host budget). ELORA's vLLM baseline is vLLM's GPU prefix cache with LRU in
each area (seed-elora.md 5.4: no host KV tier), S-LoRA keeps no history KV at all, and ELORA ran stock SGLang's
LoRA radix cache without its hierarchical cache (seed-elora.md 7: issue #9144), so those drop evicted KV and
recompute it.
"""

from __future__ import annotations

from eval.sim.hostkv import HOST_KV_BYTES
from eval.sim.latency import LatencyModel
from eval.sim.systems.base import BaseSystem
from eval.sim.systems.ours import Ours
from eval.sim.systems.sglang import SglangLike
from eval.sim.systems.slora import SLoraLike
from eval.sim.systems.vllm import VllmLike
from eval.workloads.records import AdapterInfo

BASELINES = {"vllm": VllmLike, "slora": SLoraLike, "sglang": SglangLike}


def create_system(arm: str, adapters: list[AdapterInfo] | tuple[AdapterInfo, ...], lat: LatencyModel,
                  pool_total_bytes: int, host_kv_bytes: int | None = None) -> BaseSystem:
    """Builds the system an arm name describes. `host_kv_bytes`: host KV pool of the systems that have one
    (None: `hostkv.HOST_KV_BYTES`, 0: off); an arm's `:no-host-kv` / `:host-kv=` suffix wins. Raises ValueError
    naming a malformed arm."""
    if arm in BASELINES:
        return BASELINES[arm](adapters, lat, pool_total_bytes)
    parts = arm.split(":")
    if parts[:2] == ["sglang", "hicache"]:
        for suffix in parts[2:]:
            if not suffix.startswith("host-kv="):
                raise ValueError(f"arm {arm!r}: unknown suffix {suffix!r} for sglang:hicache")
            host_kv_bytes = int(float(suffix[8:]) * 1e9)
        system = SglangLike(adapters, lat, pool_total_bytes,
                            host_kv_bytes=HOST_KV_BYTES if host_kv_bytes is None else host_kv_bytes)
        system.name = arm
        return system
    if parts[0] != "ours" or len(parts) < 2:
        raise ValueError(f"unknown arm {arm!r}; known: {', '.join(BASELINES)}, ours:<policy>[:suffix...]")
    policy, kwargs, dependency, prefetch = parts[1], {}, True, True
    drop = []
    for suffix in parts[2:]:
        if suffix == "no-tree":
            dependency = False
        elif suffix == "no-prefetch":
            prefetch = False
        elif suffix == "no-host-kv":
            host_kv_bytes = 0
        elif suffix.startswith("host-kv="):
            host_kv_bytes = int(float(suffix[8:]) * 1e9)
        elif suffix.startswith("-") and policy == "elora":
            drop.append(suffix[1:])
        elif suffix.startswith("tau=") and policy in ("elora", "chameleon"):
            kwargs["tau_s"] = float(suffix[4:])
        else:
            raise ValueError(f"arm {arm!r}: unknown suffix {suffix!r} for policy {policy!r}")
    if drop:
        kwargs["drop"] = drop
    system = Ours(adapters, lat, pool_total_bytes, policy=policy, policy_kwargs=kwargs, dependency=dependency,
                  prefetch=prefetch, host_kv_bytes=host_kv_bytes)
    system.name = arm
    return system
