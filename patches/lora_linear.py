"""`MultiLoRALinear`: a base projection plus the LoRA deltas of every adapter in the step, in one segmented op.

The step's layout (`SegmentMeta`, and the kernels' `TokenLayout` built from it once per step) and adapter weights are
shared by all wrapped layers through one `LoRAStep`, set once per forward by the LoRA manager hook; a layer only
looks up its own (layer, module) weights. The op is `triton_kernels.ops.lora_forward`: the torch reference on a CPU,
the Triton kernels on a GPU (same call, same layout, weights read in place).
"""

from __future__ import annotations

import torch
from torch import nn

from sgl_multilora.adapters import LoadedAdapter
from sgl_multilora.patches import flags
from sgl_multilora.segments import SegmentMeta
from sgl_multilora.triton_kernels.ops import LoRAWeights, TokenLayout, lora_forward


class LoRAStep:
    """The current step's layout and the adapters it may reference. Written by the manager hook, read by layers."""

    __slots__ = ("meta", "adapters", "_layout")

    def __init__(self):
        self.meta: SegmentMeta | None = None
        self.adapters: dict[str, LoadedAdapter] = {}
        self._layout: TokenLayout | None = None

    def set(self, meta: SegmentMeta, adapters: dict[str, LoadedAdapter]) -> None:
        self.meta = meta
        self.adapters = adapters
        self._layout = None

    @property
    def layout(self) -> TokenLayout:
        """The kernels' token layout for this step (weight slot = index of the group in `meta.groups`)."""
        if self._layout is None:
            assert self.meta is not None, "LoRAStep.layout read before set()"
            self._layout = TokenLayout.build(self.meta.token_adapter, max(1, len(self.meta.groups)))
        return self._layout


class MultiLoRALinear(nn.Module):
    """Wraps one projection (`base`: any module mapping (..., in) -> (..., out)) of decoder layer `layer_id`."""

    MAX_CACHED_TABLES = 16  # adapter combinations whose weight tables are kept (cleared all at once beyond)

    def __init__(self, base: nn.Module, *, layer_id: int, module_name: str):
        super().__init__()
        self.base = base
        self.layer_id = layer_id
        self.module_name = module_name
        weight = base.weight
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.base_dtype = weight.dtype
        self.step: LoRAStep | None = None
        self._tables: dict[tuple[int, ...], tuple[tuple[LoadedAdapter, ...], LoRAWeights | None]] = {}

    @property
    def weight(self) -> torch.Tensor:  # HF code sometimes reads `proj.weight.dtype`
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        step = self.step
        if step is None or step.meta is None or not step.meta.has_lora:
            return out
        meta = step.meta
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] != meta.num_tokens:
            raise RuntimeError(
                f"LoRA layout is for {meta.num_tokens} tokens but layer {self.layer_id} {self.module_name} got "
                f"{x2.shape[0]}"
            )
        table = self._table(step)
        if table is not None:
            out2 = out.view(-1, self.out_features)  # in place: `out` is the contiguous base output
            lora_forward(x2, out2, step.layout, table, impl=flags.current().lora_ops)
        return out

    def clear_tables(self) -> None:
        self._tables.clear()

    def _table(self, step: LoRAStep) -> LoRAWeights | None:
        """This layer's weight table for the step's adapters (slot g = group g), or None if none targets it.

        Consecutive steps usually serve the same adapters, so tables are kept per adapter tuple; an entry is used
        only while it was built from the very same `LoadedAdapter` objects (a reload makes new ones)."""
        adapters = tuple(step.adapters[group.key] for group in step.meta.groups)
        cached = self._tables.get(tuple(map(id, adapters)))
        if cached is not None and all(a is b for a, b in zip(cached[0], adapters)):
            return cached[1]
        lora_a, lora_b, scalings = [], [], []
        key = (self.layer_id, self.module_name)
        for adapter in adapters:  # a slot stays empty where the adapter skips this module
            weights = adapter.weights.get(key)
            lora_a.append(None if weights is None else weights[0])
            lora_b.append(None if weights is None else weights[1])
            scalings.append(adapter.spec.scaling)
        table = None
        if any(a is not None for a in lora_a):
            table = LoRAWeights.from_list(lora_a, lora_b, scalings, (0, self.out_features))
        if len(self._tables) >= self.MAX_CACHED_TABLES:
            self._tables.clear()
        self._tables[tuple(map(id, adapters))] = (adapters, table)
        return table
