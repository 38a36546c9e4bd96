"""Multi-instance placement and migration planning, pure: MELL's online packing of running requests, whose KV grows,
onto instances of fixed KV capacity with a bounded number of migrations per operation; the baselines; the
KV-vs-recompute cost model; LoRA-aware placement of adapters on workers.

Lives here: the engine-agnostic core, plain Python (no torch, no SGLang, no HTTP), driven by the live gateway and by
the simulator (eval/sim/cluster.py) alike. Not here: processes, HTTP and executing moves (sgl_multilora/gateway/,
which imports this package; only `__main__`, the `python -m sgl_multilora.cluster` command, imports it back).
Module map: records (classes, Move, Migration, Placement, BatchResult, errors), cost
(MigrationCostModel: KV transfer vs token transfer + recompute), base (BasePacker: the API, batching),
mell_state (Packing: who sits where), mell_check (the invariants), mell_place (Allocate rules),
mell_repair (repairs), mell (MellPacker), baselines (best-fit, worst-fit, Llumnix-like), registry,
placement (adapters' replicas and a request's worker), balance (`LiveBalancer`: the packer bound to running workers).
"""

from __future__ import annotations

from sgl_multilora.cluster.base import BasePacker, compress_moves
from sgl_multilora.cluster.baselines import FitPacker, LlumnixLikePacker
from sgl_multilora.cluster.cost import MigrationCostModel
from sgl_multilora.cluster.mell import MellPacker
from sgl_multilora.cluster.records import (
    BatchResult,
    Cls,
    DuplicateRequest,
    ItemTooLarge,
    Migration,
    Move,
    MoveStats,
    Placement,
    UnknownRequest,
    size_class,
)
from sgl_multilora.cluster.registry import PACKERS, create_packer

__all__ = [
    "PACKERS", "BasePacker", "BatchResult", "Cls", "DuplicateRequest", "FitPacker", "ItemTooLarge",
    "LlumnixLikePacker", "MellPacker", "Migration", "MigrationCostModel", "Move", "MoveStats",
    "Placement", "UnknownRequest", "compress_moves", "create_packer", "size_class",
]
