"""`MultiLoRALinear`: a base projection plus the LoRA deltas of every adapter in the step, one op.

The step's layout (one `SegmentMeta`, refilled once per step) and adapters are shared by all wrapped
layers through one `LoRAStep`, prepared once per forward by the LoRA manager hook; a layer only
looks up its own (layer, module) weights. The op is `triton_kernels.ops.lora_forward`: the torch
reference on a CPU, the Triton kernels on a GPU (same call, same layout, weights read in place). Not
here: reading SGLang's batch (`lora_transformers.py`).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import torch
from torch import nn

from sgl_multilora.adapters import LoadedAdapter
from sgl_multilora.patches import flags
from sgl_multilora.segments import SegmentMeta
from sgl_multilora.triton_kernels.ops import LoRAWeights, lora_forward


class LoRAStep:
    """The current step's layout and the adapters its slots serve. Prepared by the manager hook,
    read by the layers."""

    __slots__ = ("adapters", "meta", "remote")

    def __init__(self):
        self.meta: SegmentMeta | None = None  # made on the first step, then refilled (or grown)
        self.adapters: Mapping[str, LoadedAdapter] = {}
        self.remote = None  # a `remote_deltas.RemoteStep` where a LoRA server computes the deltas

    def prepare(
        self,
        keys: Sequence[Hashable | None],
        new_token_lens: Sequence[int],
        lora_starts: Sequence[int] | None,
        adapters: Mapping[str, LoadedAdapter],
        *,
        num_slots: int,
        device: torch.device | str,
    ) -> None:
        """Refills the layout for the step about to run (see `SegmentMeta.prepare_requests`);
        `adapters` maps every key in the step to its weights. `num_slots` (the most adapters in one
        step) and `device` are read on the first call only."""
        if self.meta is None:
            self.meta = SegmentMeta.make(0, max(1, num_slots), device)
        self.meta.reserve(int(sum(new_token_lens)))
        self.meta.prepare_requests(keys, new_token_lens, lora_starts)
        self.adapters = adapters


class MultiLoRALinear(nn.Module):
    """Wraps one projection (`base`: any module mapping (..., in) -> (..., out)) of decoder layer
    `layer_id`."""

    # adapter combinations whose weight tables are kept (cleared all at once beyond)
    MAX_CACHED_TABLES = 16

    def __init__(self, base: nn.Module, *, layer_id: int, module_name: str):
        super().__init__()
        self.base = base
        self.layer_id = layer_id
        self.module_name = module_name
        weight = base.weight
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.base_dtype = weight.dtype
        self.step: LoRAStep | None = None
        self._tables: dict[tuple[int, ...], tuple[tuple[LoadedAdapter, ...], LoRAWeights | None]]
        self._tables = {}

    @property
    def weight(self) -> torch.Tensor:  # HF code sometimes reads `proj.weight.dtype`
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        step = self.step
        meta = None if step is None else step.meta
        if meta is None or not meta.keys:  # no adapter token in this step
            return self.base(x)
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] != meta.num_tokens:
            raise RuntimeError(
                f"LoRA layout is for {meta.num_tokens} tokens but layer {self.layer_id} "
                f"{self.module_name} got {x2.shape[0]}"
            )
        if step.remote is not None:  # sent before the base GEMM, so that the round trip overlaps it
            call = step.remote.submit(self.layer_id, self.module_name, x2)
            out = self.base(x)
            if call is not None:
                step.remote.add_into(call, self.module_name, out.view(-1, self.out_features))
            return out
        out = self.base(x)
        table = self._table(step)
        if table is not None:
            out2 = out.view(-1, self.out_features)  # in place: `out` is the contiguous base output
            lora_forward(x2, out2, meta, table, impl=flags.current().lora_ops)
        return out

    def clear_tables(self) -> None:
        self._tables.clear()

    def _table(self, step: LoRAStep) -> LoRAWeights | None:
        """This layer's weight table for the step's adapters (slot s serves `meta.keys[s]`; the
        layout's other slots are empty), or None if none of them targets this module.

        Consecutive steps usually serve the same adapters, so tables are kept per adapter tuple; an
        entry is used only while it was built from the very same `LoadedAdapter` objects (a reload
        makes new ones)."""
        adapters = tuple(step.adapters[key] for key in step.meta.keys)
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
            empty = step.meta.num_slots - len(adapters)  # the ops take one weight entry per slot
            table = LoRAWeights.from_list(lora_a + [None] * empty, lora_b + [None] * empty,
                                          scalings + [0.0] * empty, (0, self.out_features))
        if len(self._tables) >= self.MAX_CACHED_TABLES:
            self._tables.clear()
        self._tables[tuple(map(id, adapters))] = (adapters, table)
        return table
