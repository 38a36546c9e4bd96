"""Per step, the LoRA deltas a LoRA server computes for this worker (`--multilora-lora-server`).

One call per fused projection group and layer (`GROUPS`), as the paper's one call per MoE sub-layer:

    q_proj ─┐                          o_proj ── "o"      gate_proj ─┐                 down_proj ── "down"
    k_proj ─┼─ "qkv" (outputs q|k|v)                      up_proj  ──┴─ "gate_up" (gate|up)
    v_proj ─┘

The first projection of a group the model calls submits the group's call for its input (only the rows of tokens an
adapter applies to: base tokens and aLoRA tokens before their activation start are never sent) and computes its own
base GEMM while the round trip is in flight; every projection of the group then takes its columns of the one reply.
HF's decoder layers call q/k/v (and gate/up) on one input tensor; a projection whose input is not the tensor its group
was submitted with gets a call of its own, so the values never depend on that assumption. MoE layers make two calls
per layer (`RemoteExpertDeltas`: `experts.gate_up`, `experts.down`, rows tagged by adapter and expert). A call the
server does not answer marks the step `failed` (`lora_remote.after_run_batch` ends its adapter requests).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sgl_multilora.patches.lora_remote import client

# module -> (group, the group's modules in output order)
GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "q_proj": ("qkv", ("q_proj", "k_proj", "v_proj")),
    "k_proj": ("qkv", ("q_proj", "k_proj", "v_proj")),
    "v_proj": ("qkv", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("o", ("o_proj",)),
    "gate_proj": ("gate_up", ("gate_proj", "up_proj")),
    "up_proj": ("gate_up", ("gate_proj", "up_proj")),
    "down_proj": ("down", ("down_proj",)),
}


@dataclass
class _Call:
    x: tuple  # the input the call was submitted for: (data_ptr, shape, version), see `_input_key`
    modules: tuple[str, ...]
    pending: object
    delta: torch.Tensor | None = None


def _input_key(x: torch.Tensor) -> tuple:
    """Which input tensor `x` is: each projection sees a fresh view (`reshape`) of its module's input, so views of
    one tensor share the storage address, shape and version counter (an in-place write in between bumps it)."""
    return x.data_ptr(), tuple(x.shape), x._version


class RemoteStep:
    """One forward's remote LoRA: which rows go, tagged with which adapters, and the calls in flight.

    `prepare` runs once per step (after the step's `SegmentMeta` is refilled); `submit` / `add_into` run per wrapped
    projection. Not thread-safe: one scheduler thread uses it."""

    def __init__(self, shape) -> None:
        self.shape = shape  # ModelShape: output widths of every module
        self.rows: torch.Tensor | None = None  # token rows an adapter applies to
        self.adapter_index: torch.Tensor | None = None  # per sent row: index into `names`
        self.names: list[str] = []
        self.identities: list[str] = []
        self.targeted: set[str] = set()  # modules some adapter of the step targets
        self.failed: str | None = None  # why a call of this step got no delta (its LoRA rows are wrong)
        # since start: calls sent, rows sent, seconds waited for replies after the base GEMM, failed steps
        self.counters = {"calls": 0, "rows": 0, "wait_s": 0.0, "failed_steps": 0}
        self._calls: dict[tuple[int, str], _Call] = {}

    def prepare(self, meta, specs: list[AdapterSpec]) -> None:
        """`specs[s]` serves slot s of `meta` (meta.keys[s])."""
        self._calls.clear()
        self.failed = None
        n = meta.num_tokens
        slots = meta.token_slot[:n]
        rows = torch.nonzero(slots >= 0).flatten()
        self.rows = rows if rows.numel() else None
        self.adapter_index = slots[rows].to(torch.int32) if rows.numel() else None
        self.names = [s.name for s in specs]
        self.identities = [s.identity for s in specs]
        self.targeted = {m for s in specs for m in s.target_modules}

    @property
    def active(self) -> bool:
        return self.rows is not None

    def submit(self, layer_id: int, module: str, x2: torch.Tensor) -> _Call | None:
        """The call serving (`layer_id`, `module`) for input `x2` (rows, in), sent now unless its group's call for
        this very input is already in flight. Does not wait."""
        if self.rows is None or module not in self.targeted or self.failed is not None:
            return None
        group, modules = GROUPS[module]
        key, x_key = (layer_id, group), _input_key(x2)
        call = self._calls.get(key)
        if call is not None and call.x == x_key:
            return call
        if call is not None:  # another input than the group's call: the group again for it, under its own key
            key = (layer_id, module)
            own = self._calls.get(key)
            if own is not None and own.x == x_key:
                return own
        rows = x2.index_select(0, self.rows)  # a copy: the client sends it without one, so it must not change
        try:
            pending = client().submit_delta(layer_id, group, rows, self.adapter_index, self.names,
                                            identities=self.identities)
        except ConnectionError as e:  # LoRAServerUnavailable
            self.failed = str(e)
            return None
        self.counters["calls"] += 1
        self.counters["rows"] += int(rows.shape[0])
        call = _Call(x_key, modules, pending)
        self._calls[key] = call
        return call

    def add_into(self, call: _Call, module: str, out2: torch.Tensor) -> None:
        """Waits for `call` and adds `module`'s columns of its delta into `out2` (rows, out) in place. A call the
        server does not answer (or answers with an error) adds nothing and marks the step `failed`: its requests with
        adapters are then ended (`after_run_batch`), never answered with what the base model computed."""
        from sgl_multilora.lora_server.client import LoRAServerError, LoRAServerUnavailable

        if self.failed is not None:
            return
        if call.delta is None:
            start = time.perf_counter()
            try:
                call.delta = call.pending.result()
            except (LoRAServerUnavailable, LoRAServerError) as e:
                self.failed = str(e)
                return
            finally:
                self.counters["wait_s"] += time.perf_counter() - start
        start = 0
        for m in call.modules:
            width = self.shape.modules[m].out_features
            if m == module:
                out2.index_add_(0, self.rows, call.delta[:, start:start + width].to(out2.dtype))
                return
            start += width
        raise RuntimeError(f"module {module} is not in the LoRA server call's group {call.modules}")


class RemoteExpertDeltas:
    """The experts' LoRA deltas computed by the LoRA server (an `lora_experts.ExpertDeltaSource`): one call per MoE
    sub-layer and step (`experts.gate_up`, `experts.down`), InfiniLoRA's two round trips per MoE layer, carrying only
    the routed rows an adapter applies to, each tagged with its adapter and expert. Failures mark the step as
    `RemoteStep.add_into` does."""

    CALLS = {"gate_up": ("experts.gate_up", "experts.gate_up_proj"), "down": ("experts.down", "experts.down_proj")}

    def __init__(self, remote: RemoteStep) -> None:
        self.remote = remote

    def submit(self, layer_id, call, expert_ids, slot_ids, x):
        rs = self.remote
        group, module = self.CALLS[call]
        if rs.rows is None or module not in rs.targeted or rs.failed is not None:
            return None
        active = torch.nonzero(slot_ids >= 0).flatten()
        if not active.numel():
            return None
        rs.counters["calls"] += 1
        rs.counters["rows"] += int(active.numel())
        try:
            pending = client().submit_delta(layer_id, group, x.index_select(0, active),
                                            slot_ids.index_select(0, active).to(torch.int32), rs.names,
                                            expert_ids=expert_ids.index_select(0, active).to(torch.int32),
                                            identities=rs.identities)
        except ConnectionError as e:  # LoRAServerUnavailable
            rs.failed = str(e)
            return None
        return active, pending, x.shape[0], x.dtype

    def result(self, handle):
        from sgl_multilora.lora_server.client import LoRAServerError, LoRAServerUnavailable

        if handle is None or self.remote.failed is not None:
            return None
        active, pending, num_rows, dtype = handle
        start = time.perf_counter()
        try:
            delta = pending.result()
        except (LoRAServerUnavailable, LoRAServerError) as e:
            self.remote.failed = str(e)
            return None
        finally:
            self.remote.counters["wait_s"] += time.perf_counter() - start
        out = torch.zeros(num_rows, delta.shape[1], dtype=dtype)
        out.index_copy_(0, active, delta.to(dtype))
        return out


def expert_source(step):
    """The experts' delta source where a LoRA server computes them (`step.remote` set), else None."""
    return None if step.remote is None else RemoteExpertDeltas(step.remote)
