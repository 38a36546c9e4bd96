"""The plugin's state in one SGLang process, behind the module's only global (created once, never replaced).

Owners: `adapters` (the process's `AdapterRegistry`: ids, specs, identities, host weights), `lora` (our LoRA layers
on the transformers model path, when they run here), `lora_backend` (`--lora-backend multilora` under SGLang's
layers) and `memory` (the scheduler's `LiveMemory`: adapter residency
in the unified pool, when it is on) and `scheduler` (the multi-queue scheduler, with `--multilora-scheduler
multiqueue`). The cache seam's owner is the scheduler's
`MultiLoRARadixCache`, reached through the scheduler (`Scheduler.tree_cache`). Hooks translate SGLang's objects and
ask these owners; they never import another hook module's private state.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from sgl_multilora.adapter_registry import AdapterRegistry

if TYPE_CHECKING:
    from sgl_multilora.patches.lora_transformers import TransformersLoRA
    from sgl_multilora.patches.live_scheduler import LiveScheduler
    from sgl_multilora.patches.lora_backend import MultiLoRABackend
    from sgl_multilora.patches.unified_memory import LiveMemory


class ProcessState:
    def __init__(self) -> None:
        self.adapters = AdapterRegistry()
        self.lora: TransformersLoRA | None = None
        self.memory: LiveMemory | None = None
        self.scheduler: LiveScheduler | None = None
        # `--lora-backend multilora`'s backend object in this process (SGLang's LoRA layers on our kernels).
        self.lora_backend: MultiLoRABackend | None = None
        self.registered = False
        # The requests of the ForwardBatch being built on this thread (set just before SGLang builds it): SGLang's
        # ForwardBatch carries only the new tokens, while an aLoRA's activation start may lie in the cached prefix.
        self.building = threading.local()


_STATE = ProcessState()


def process_state() -> ProcessState:
    return _STATE
