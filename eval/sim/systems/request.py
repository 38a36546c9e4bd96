"""A request inside the simulator and the answers to "may it run now?".

Lives here: `SimRequest`, `Admit`, the namespace every simulated request uses and the default aLoRA invocation
length. Not here: what a system does with a request (`base.py`) or the event loop (`engine.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from eval.workloads.records import Request
from sgl_multilora.keys import Namespace
from sgl_multilora.tree_nodes import Node

NS = Namespace("llama-3-8b")
ALORA_INVOCATION_TOKENS = 5
"""Default length of an aLoRA invocation sequence (activation start k = prompt length - this), as the bundled
aLoRAs' (eval/workloads/alora_pipeline.py); `simulate(..., alora_invocation_tokens=)` overrides it."""


class Admit(Enum):
    OK = "ok"
    LOADING = "loading"  # its adapter is being copied in (or waits for room to be); others may go first
    NO_SLOT = "no_slot"  # no adapter slot is free (fixed-slot systems); others may go first
    NO_MEMORY = "no_memory"  # not enough KV memory: admission stops here (first come, first served)


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request inside the simulator; times in seconds from the workload's start."""

    req: Request
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    adapter_idx: int  # index in the workload's adapter list; -1 for the base model
    alora_start: int | None = None
    submit_s: float = 0.0  # arrival, or the parent's finish when that is later
    admit_s: float | None = None
    cached: int = 0
    computed: int = 0  # prompt tokens whose KV exists (cached ones included)
    generated: int = 0  # set to len(output) when it finishes (the loop tracks decoding in aggregate)
    first_token_s: float | None = None
    finish_s: float | None = None
    lock_node: Node | None = None
    reserved_slots: int = 0  # KV slots reserved for the tokens it computes (restored ones excluded)
    adapter_was_resident: bool = True
    restored: int = 0  # prompt tokens copied back from the host tier (part of `cached`)
    ready_s: float = 0.0  # prefill may start (KV it reuses still being copied in until then)
    host_lock: Node | None = None  # host-tier run this request will copy back, pinned until admission
    resumed_tokens: int = 0  # output tokens streamed before a retraction (engine.py), since moved into `prompt`
    decode_step: int = 0  # the engine step at which its first token came out of its (last) prefill
    decode_seq: int = -1  # its live entry in the engine's finish heap while decoding, else -1

    @property
    def prompt_tokens(self) -> int:
        """The workload's prompt length (a retracted request's `prompt` also holds what it had streamed)."""
        return len(self.prompt) - self.resumed_tokens

    @property
    def output_tokens(self) -> int:
        """The workload's output length (a retracted request's `output` holds only what is left)."""
        return len(self.output) + self.resumed_tokens
