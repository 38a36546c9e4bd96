"""Multi-instance KV placement (MELL): online packing of running requests, whose KV grows, onto
instances of fixed KV capacity, with a bounded number of migrations per operation.

Lives here: the engine-agnostic core, plain Python (no torch, no SGLang), driven by a router-side
caller and by the simulator (eval/sim/cluster.py) alike. Not here: starting or stopping instances
and moving requests between them (an engine-side executor runs the returned migrations).
Module map: records (classes, Move, Migration, Placement, BatchResult, errors), cost
(MigrationCostModel: KV transfer vs token transfer + recompute), base (BasePacker: the API, batching),
mell_state (Packing: who sits where), mell_check (the invariants), mell_place (Allocate rules),
mell_repair (repairs), mell (MellPacker), baselines (best-fit, worst-fit, Llumnix-like), registry.
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
