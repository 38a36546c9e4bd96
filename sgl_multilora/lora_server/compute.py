"""The LoRA server's maths: one `delta` call's rows, grouped by (adapter, expert), through the segmented LoRA op.

Lives here: `check_delta` (the request against the model and catalog) and `compute_delta`. Not here: residency
(`slots.py` hands in the resident tables) or the wire (`protocol.py`).

Semantics: for each row i with adapter a = names[adapter_index[i]] (rows of index -1 get zeros) and expert
e = expert_ids[i] (-1 for a dense group):
    delta[i, off_j : off_{j+1}] = scaling_a * (x[i] @ A_{a,layer,m_j,e}^T) @ B_{a,layer,m_j,e}^T
for the group's modules m_j in order (`protocol.GROUPS`); a module a does not target contributes zeros. Each
distinct (adapter, expert) of the call is one slot of `triton_kernels.lora_forward` (the host op on a CPU, the Triton
kernels on CUDA), so rows are gathered once per unit and every unit is one shrink and one expand.
"""

from __future__ import annotations

import torch

from sgl_multilora.lora_server.catalog import ServerModel
from sgl_multilora.lora_server.protocol import EXPERT_GROUPS, GROUPS, DeltaRequest, ProtocolError
from sgl_multilora.lora_server.slots import Tables
from sgl_multilora.segments import NO_ADAPTER, SegmentMeta
from sgl_multilora.triton_kernels.ops import LoRAWeights, lora_forward


def group_offsets(model: ServerModel, group: str) -> tuple[int, ...]:
    """Output column offsets of the group's modules (`off[j]` .. `off[j + 1]` is module j)."""
    offsets = [0]
    for module in GROUPS[group]:
        offsets.append(offsets[-1] + model.module_dims(module).out_features)
    return tuple(offsets)


def check_delta(req: DeltaRequest, model: ServerModel, known: set[str] | dict) -> None:
    """Raises ProtocolError naming what the request gets wrong against the model or the catalog (`known` names).
    Pure."""
    unknown = [n for n in req.adapter_names if n not in known]
    if unknown:
        raise ProtocolError(f"unknown adapter(s) {unknown}", "unknown_adapter")
    if not 0 <= req.layer_id < model.shape.num_layers:
        raise ProtocolError(f"layer {req.layer_id} is outside the model's {model.shape.num_layers} layers",
                            "bad_layer")
    modules = GROUPS[req.group]
    if req.group in EXPERT_GROUPS:
        if not model.num_experts:
            raise ProtocolError(f"group {req.group!r} needs a model with fused experts; this one has none",
                                "unknown_group")
        rows = req.expert_ids.shape[0]
        if rows and (int(req.expert_ids.min()) < 0 or int(req.expert_ids.max()) >= model.num_experts):
            raise ProtocolError(f"expert ids must lie in [0, {model.num_experts}), got "
                                f"[{int(req.expert_ids.min())}, {int(req.expert_ids.max())}]", "bad_expert")
    elif any(m not in model.shape.modules for m in modules):
        raise ProtocolError(f"group {req.group!r} needs modules {list(modules)}; the model has "
                            f"{sorted(model.shape.modules)}", "unknown_group")
    width = model.module_dims(modules[0]).in_features
    if req.x.shape[1] != width:
        raise ProtocolError(f"group {req.group!r} takes rows of {width} features, got {req.x.shape[1]}", "bad_shape")


def compute_delta(req: DeltaRequest, model: ServerModel, tables: dict[str, Tables], scalings: dict[str, float],
                  device: torch.device | str = "cpu", impl: str = "auto") -> torch.Tensor:
    """The delta (rows, out_total) in the request's dtype, on the CPU. `tables[name]` are the resident tables of every
    adapter the request names (valid while pinned), `scalings[name]` its PEFT scaling. Does not modify its inputs;
    assumes `check_delta` passed."""
    offsets = group_offsets(model, req.group)
    rows = req.x.shape[0]
    out = torch.zeros(rows, offsets[-1], dtype=torch.float32, device=device)
    index = req.adapter_index.to(torch.int64)
    expert = req.expert_ids.to(torch.int64) if req.expert_ids is not None else torch.full_like(index, -1)
    active = index >= 0
    if rows == 0 or not bool(active.any()):
        return out.to(req.x.dtype).cpu()
    # one slot per distinct (adapter, expert) among the active rows; the key packs both into one int64
    num_e = max(model.num_experts, 1)
    keys = torch.where(active, index * (num_e + 1) + (expert + 1), -1)
    units, inverse = torch.unique(keys[active], return_inverse=True)
    a_list, b_list, scales = [], [], []
    for key in units.tolist():
        a_idx, e = divmod(key, num_e + 1)
        name = req.adapter_names[a_idx]
        ab = tables[name].get((req.layer_id, req.group, e - 1))
        a_list.append(ab[0] if ab is not None else None)
        b_list.append(ab[1] if ab is not None else None)
        scales.append(scalings[name])
    if all(a is None for a in a_list):  # no row's adapter targets this group at this layer
        return out.to(req.x.dtype).cpu()
    token_slot = torch.full((rows,), NO_ADAPTER, dtype=torch.int32)
    token_slot[active] = inverse.to(torch.int32)
    weights = LoRAWeights.from_list(a_list, b_list, scales, offsets)
    meta = SegmentMeta.build(token_slot.to(device), len(units))
    x = req.x.to(device=device, dtype=torch.float32)
    lora_forward(x, out, meta, weights, impl=impl)
    return out.to(req.x.dtype).cpu()
