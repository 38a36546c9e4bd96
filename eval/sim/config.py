"""The simulator's run settings: `SimConfig`, one frozen record that the engine, the systems and the admission
policies read. Not here: the loop that applies them (engine.py) or the policies (admission/).

Its own module so that an admission policy can name the settings without importing the engine that drives it.
"""

from __future__ import annotations

from dataclasses import dataclass

from sgl_multilora.sched import SchedConfig


@dataclass(frozen=True)
class SimConfig:
    """`chunk_tokens`: SGLang's chunked-prefill size (8192 on an 80 GB GPU). `max_running`: cap on running
    requests. `scan_limit`: waiting requests examined per step. `sample_period_s`: memory-sample period.
    `check_every_step`: run every invariant checker after each step (tests). `host_kv_bytes`: size of the host
    KV tier (systems/ours.py; an arm's `:no-host-kv` / `:host-kv=` suffix overrides it)."""

    chunk_tokens: int = 8192
    max_running: int = 256
    scan_limit: int = 512
    sample_period_s: float = 1.0
    check_every_step: bool = False
    pool_bytes: int | None = None  # default: memory.pool_bytes(latency model)
    host_kv_bytes: int | None = None  # host KV tier of the systems with one; None: hostkv.HOST_KV_BYTES, 0: off
    admission: str = "fcfs"  # admission policy: fcfs, lpm or multiqueue (eval/sim/admission/)
    max_loras_per_batch: int | None = None  # SGLang's cap on distinct adapters per batch (base one); None: none
    ttft_slo_s: float = 5.0  # the TTFT SLO the multiqueue scheduler's quotas aim at
    slot_squash_share: float = SchedConfig.slot_squash_share  # multiqueue with a cap: --multilora-slot-squash-share
    max_slot_squashes: int = SchedConfig.max_slot_squashes  # multiqueue with a cap: --multilora-max-slot-squashes
