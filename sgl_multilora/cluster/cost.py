"""Adaptive request migration (MELL section V): per move, KV transfer or token transfer + recompute,
chosen by a greedy two-bin packing against per-link and per-instance budgets for one epoch.

Lives here: `MigrationCostModel`, its link topology and `plan(moves)`. Not here: which requests move
(the packers) or running the transfers (an engine-side executor).

The paper gives no formulas or values (seed-mell.md 3.2); this is the implementer's model of 3.3:
- communication boundary of link l = bandwidth(l) * epoch_s bytes per epoch. Links: one PCIe budget
  per machine for moves inside it, one NIC budget per source machine for moves leaving it;
- computation boundary of an instance = `recompute_tokens_per_epoch` prefill tokens it co-runs with
  its decodes per epoch (a constant: the paper's dependence on batch size is not modelled);
- greedy first-fit decreasing by KV size, ties by the order given: KV if the link has room, else
  recompute if the destination has room; if neither, the kind with the lower estimated time, flagged
  `over_budget`. The packing already counts the request at its destination, so a move is never
  deferred here; an executor that must defer one keeps it at its source for the epoch.
Deterministic, so every instance computing the plan over the same global move list agrees (the
paper's global consensus).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sgl_multilora.cluster.records import Migration, Move

MachineOf = Callable[[int], int]


@dataclass(frozen=True, slots=True)
class MigrationCostModel:
    kv_bytes_per_token: int = 524_288
    """LLaMA-2-7B in fp16: 2 (K, V) * 32 layers * 4096 hidden * 2 B."""
    intra_bytes_per_s: float = 25e9
    """PCIe 4.0 x16, effective."""
    inter_bytes_per_s: float = 1.25e9
    """10 Gbps between machines (the paper's testbed)."""
    instances_per_machine: int = 8
    epoch_s: float = 0.4
    """The transfer deadline: a move's KV must arrive within one epoch."""
    recompute_tokens_per_epoch: int = 2048
    """Prefill tokens an instance re-computes per epoch without slowing its decodes (assumed)."""
    prefill_tokens_per_s: float = 10_000.0
    """For the time estimate of an over-budget recompute (assumed)."""

    def __post_init__(self) -> None:
        if self.instances_per_machine < 1 or self.epoch_s <= 0:
            raise ValueError("need instances_per_machine >= 1 and epoch_s > 0")

    def machine(self, instance: int) -> int:
        """Default topology: instance ids numbered machine by machine."""
        return instance // self.instances_per_machine

    def link(self, src: int, dst: int, machine_of: MachineOf | None = None) -> tuple[str, int]:
        where = machine_of or self.machine
        if where(src) == where(dst):
            return ("pcie", where(src))
        return ("nic", where(src))

    def link_bytes_per_epoch(self, link: tuple[str, int]) -> float:
        rate = self.intra_bytes_per_s if link[0] == "pcie" else self.inter_bytes_per_s
        return rate * self.epoch_s

    def kv_seconds(self, m: Move, machine_of: MachineOf | None = None) -> float:
        link = self.link(m.src, m.dst, machine_of)
        return m.kv_tokens * self.kv_bytes_per_token / self.link_bytes_per_epoch(link) * self.epoch_s

    def recompute_seconds(self, m: Move) -> float:
        return m.kv_tokens / self.prefill_tokens_per_s

    def plan(self, moves: Sequence[Move], machine_of: MachineOf | None = None) -> list[Migration]:
        """The kind of every move, in the order given. Pure: budgets start full on each call (one
        call = one epoch). `machine_of(instance)` gives the machine an instance runs on (default:
        `machine`)."""
        comm_left: dict[tuple[str, int], float] = {}
        comp_left: dict[int, int] = {}
        kinds: list[tuple[str, bool]] = [("kv", False)] * len(moves)
        order = sorted(range(len(moves)), key=lambda i: (-moves[i].kv_tokens, i))
        for i in order:
            m = moves[i]
            link = self.link(m.src, m.dst, machine_of)
            left = comm_left.setdefault(link, self.link_bytes_per_epoch(link))
            kv_bytes = m.kv_tokens * self.kv_bytes_per_token
            if kv_bytes <= left:
                comm_left[link] = left - kv_bytes
                kinds[i] = ("kv", False)
                continue
            comp = comp_left.setdefault(m.dst, self.recompute_tokens_per_epoch)
            if m.kv_tokens <= comp:
                comp_left[m.dst] = comp - m.kv_tokens
                kinds[i] = ("recompute", False)
                continue
            faster = "kv" if self.kv_seconds(m, machine_of) <= self.recompute_seconds(m) else "recompute"
            kinds[i] = (faster, True)
        return [Migration(m.rid, m.src, m.dst, m.kv_tokens, kind, over)
                for m, (kind, over) in zip(moves, kinds)]
