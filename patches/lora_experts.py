"""`MultiLoRAExperts`: an HF fused-experts module plus every step adapter's per-expert LoRA deltas (MoE expert LoRA).

Wraps the `experts` module of an MoE block that runs HF's own code (`moe_cpu.py`: transformers 5 layout, `gate_up_proj`
[E, 2I, H] and `down_proj` [E, H, I], concatenated gate|up). Semantics, per routed (token t, expert e, weight w) row:
    gu  = x_t @ W_gu[e].T + scale_a * (x_t @ A_gu[a, e].T) @ B_gu[a, e].T      (a = t's adapter slot, if any)
    h   = act(gu[:I]) * gu[I:]
    y_t += w * (h @ W_d[e].T + scale_a * (h @ A_d[a, e].T) @ B_d[a, e].T)
which is what PEFT computes with `target_parameters` on the experts (delta W_e = scale B_e @ A_e, merged into the
parameter; `sgl_multilora.adapters` derives A_e, B_e). Rows of different adapters, base rows, and aLoRA rows before
their activation start (slot NO_ADAPTER in the step's `SegmentMeta`, which `MultiLoRALinear` reads too) share one
batch; the latter two get no delta.

The delta seam, `ExpertDeltaSource` (so that a remote LoRA server can compute the deltas, InfiniLoRA style):
    handle = source.submit(layer_id, call, expert_ids, slot_ids, x)   # before the base GEMM of `call`
    delta  = source.result(handle)                                    # after it; added to the base output
  - `call`: "gate_up" (x = the routed hidden states, out = 2I) or "down" (x = act(gate) * up, out = H).
  - `expert_ids`, `slot_ids`: int64 [rows]; rows are sorted by expert (stable in token order); a slot indexes the
    step's `SegmentMeta.keys` (NO_ADAPTER: no delta for that row). `x`: [rows, in], the base dtype.
  - `result` returns a [rows, out] tensor in x's dtype (zero rows where no delta applies), or None when no row gets
    one. A handle is used once, in submit order per layer; `x` must not be modified until `result` returns.
One call per MoE sub-layer and step (all experts' rows together), as InfiniLoRA's one round trip per sub-layer.
`LocalExpertDeltas` computes it in-process from the step's adapters (`LoRAStep.adapters`: the registry's tensors or,
with the unified pool, views of the adapter's pool slots). Not here: reading SGLang's batch (`lora_transformers.py`).
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn
from torch.nn import functional as F

from sgl_multilora.adapters import EXPERT_MODULES, ModelShape, ModuleDims, expert_unit
from sgl_multilora.segments import NO_ADAPTER

CALLS = {"gate_up": "experts.gate_up_proj", "down": "experts.down_proj"}  # call -> the adapters' module name
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
logger = logging.getLogger(__name__)


class ExpertDeltaSource:
    """Interface: computes the experts' LoRA deltas of one step (contract in the module docstring)."""

    def submit(self, layer_id: int, call: str, expert_ids: torch.Tensor, slot_ids: torch.Tensor,
               x: torch.Tensor) -> object:
        raise NotImplementedError

    def result(self, handle: object) -> torch.Tensor | None:
        raise NotImplementedError


class LocalExpertDeltas(ExpertDeltaSource):
    """The deltas computed in this process from `step`'s adapters (a `LoRAStep`, refilled every step); the
    computation runs in `result`. Only valid while `step` describes the batch being computed (a LoRA server's
    worker uses `remote_deltas.RemoteExpertDeltas` instead)."""

    def __init__(self, step):
        self.step = step

    def submit(self, layer_id, call, expert_ids, slot_ids, x):
        assert call in CALLS, f"unknown experts call {call!r} (expected one of {sorted(CALLS)})"
        return layer_id, CALLS[call], expert_ids, slot_ids, x

    def result(self, handle):
        layer_id, module, expert_ids, slot_ids, x = handle
        active = slot_ids != NO_ADAPTER
        if not bool(active.any()):
            return None
        meta, adapters = self.step.meta, self.step.adapters
        pairs = torch.unique(torch.stack([expert_ids[active], slot_ids[active]], dim=1), dim=0).tolist()
        out = None
        for expert, slot in pairs:
            adapter = adapters[meta.keys[slot]]
            weights = adapter.weights.get((layer_id, expert_unit(module, expert)))
            if weights is None:  # the adapter skips this layer or parameter
                continue
            a, b = weights
            rows = ((expert_ids == expert) & (slot_ids == slot)).nonzero().squeeze(1)
            if out is None:
                out = x.new_zeros(x.shape[0], b.shape[0])
            out[rows] = adapter.spec.scaling * ((x[rows] @ a.T) @ b.T)
        return out


class MultiLoRAExperts(nn.Module):
    """Wraps the HF experts module `base` of decoder layer `layer_id`; called as HF's MoE block calls it,
    `(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`. Without adapter tokens in the step
    it is `base` itself. `step` (a `LoRAStep`) and `deltas` (an `ExpertDeltaSource`) are set by the owner."""

    def __init__(self, base: nn.Module, *, layer_id: int):
        super().__init__()
        if getattr(base, "is_transposed", False) or not getattr(base, "is_concatenated", True):
            raise ValueError(f"layer {layer_id}: experts stored transposed or with gate/up interleaved are not "
                             "supported by expert LoRA (only transformers' [E, out, in], gate|up layout)")
        self.base = base
        self.layer_id = layer_id
        self.num_experts = int(base.gate_up_proj.shape[0])
        self.step = None
        self.deltas: ExpertDeltaSource | None = None

    @property
    def gate_up_proj(self) -> torch.Tensor:
        return self.base.gate_up_proj

    @property
    def down_proj(self) -> torch.Tensor:
        return self.base.down_proj

    def dims(self) -> dict[str, ModuleDims]:
        """One expert's (in, out) per fused parameter, as `ModelShape.expert_modules` holds them."""
        _, two_inter, hidden = self.base.gate_up_proj.shape
        return {"experts.gate_up_proj": ModuleDims(int(hidden), int(two_inter)),
                "experts.down_proj": ModuleDims(int(two_inter) // 2, int(hidden))}

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        step = self.step
        meta = None if step is None else step.meta
        if meta is None or not meta.keys or self.deltas is None:  # no adapter token in this step
            return self.base(hidden_states, top_k_index, top_k_weights)
        if hidden_states.shape[0] != meta.num_tokens:
            raise RuntimeError(f"LoRA layout is for {meta.num_tokens} tokens but layer {self.layer_id} experts got "
                               f"{hidden_states.shape[0]}")
        num_k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        order = order[flat[order] < self.num_experts]  # HF marks experts of other ranks with E (none here)
        expert_ids, token_ids = flat[order].long(), order // num_k
        slot_ids = meta.token_slot[: meta.num_tokens].long()[token_ids]
        bounds = [0, *torch.bincount(expert_ids, minlength=self.num_experts).cumsum(0).tolist()]
        x = hidden_states[token_ids]

        gate_up = self._grouped(self.base.gate_up_proj, "gate_up", x, expert_ids, slot_ids, bounds)
        h = self.base.act_fn(gate_up[:, : gate_up.shape[1] // 2]) * gate_up[:, gate_up.shape[1] // 2:]
        y = self._grouped(self.base.down_proj, "down", h, expert_ids, slot_ids, bounds)
        y = y * top_k_weights.reshape(-1)[order, None]
        out = torch.zeros_like(hidden_states)
        out.index_add_(0, token_ids, y.to(out.dtype))
        return out

    def _grouped(self, weight, call, x, expert_ids, slot_ids, bounds) -> torch.Tensor:
        """Base GEMM of each expert over its rows (contiguous: rows are sorted by expert), the delta submitted
        before it and added after it."""
        handle = self.deltas.submit(self.layer_id, call, expert_ids, slot_ids, x)
        out = x.new_empty(x.shape[0], weight.shape[1])
        for expert in range(self.num_experts):
            start, end = bounds[expert], bounds[expert + 1]
            if end > start:
                out[start:end] = F.linear(x[start:end], weight[expert])
        delta = self.deltas.result(handle)
        if delta is not None:
            out += delta
        return out


def wrap_experts(model: nn.Module, shape: ModelShape) -> tuple[ModelShape, list[MultiLoRAExperts]]:
    """Wraps every HF fused-experts module of `model`'s decoder layers in a `MultiLoRAExperts` (in place); returns
    `shape` with the experts' count and dims added (unchanged when there is none) and the wrappers."""
    from sgl_multilora.patches.moe_cpu import is_hf_experts

    wrapped: list[MultiLoRAExperts] = []
    for name, module in list(model.named_modules()):
        m = _LAYER.search(name)
        if name.rsplit(".", 1)[-1] != "experts" or m is None or not is_hf_experts(module):
            continue
        layer = MultiLoRAExperts(module, layer_id=int(m.group(1)))
        setattr(model.get_submodule(name.rsplit(".", 1)[0]), "experts", layer)
        wrapped.append(layer)
    if not wrapped:
        return shape, wrapped
    logger.info("sgl_multilora: expert LoRA on %d MoE layers of %d experts", len(wrapped), wrapped[0].num_experts)
    dims = wrapped[0].dims()
    assert set(dims) == set(EXPERT_MODULES), f"expert modules {sorted(dims)} vs adapters' {EXPERT_MODULES}"
    return ModelShape(shape.num_layers, shape.modules, shape.max_rank, num_experts=wrapped[0].num_experts,
                      expert_modules=dims), wrapped


def attach(experts: list[MultiLoRAExperts], step, source: ExpertDeltaSource | None = None) -> None:
    """Points every wrapper at `step` (the owner's `LoRAStep`) and `source` (default: the in-process deltas over
    `step`; a LoRA server's with `--multilora-lora-server`, `remote_deltas.RemoteExpertDeltas`)."""
    source = source or LocalExpertDeltas(step)
    for layer in experts:
        layer.step, layer.deltas = step, source
