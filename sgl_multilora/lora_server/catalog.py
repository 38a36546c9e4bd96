"""The LoRA server's catalog: the base model's shape and the host copy of every adapter, as LoRA units.

Lives here: `ServerModel` (shape from a HF config.json), `HostAdapter` (one adapter's units on the host) and
`Catalog` (adapters by name; load / unload). Not here: device slots (`slots.py`) or compute (`compute.py`).

A unit is (layer, module, expert) -> (A (r, in), B (out, r)), fp32: expert -1 for a dense projection (module
"q_proj", ...), 0..E-1 for a fused-experts parameter (module "experts.gate_up_proj" / "experts.down_proj").
Adapters are read and validated by `sgl_multilora.adapters` (identity = its content hash), which also splits PEFT
`target_parameters` on Mixtral's fused experts into one `expert_unit` module per expert.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sgl_multilora.adapters import (
    CONFIG_FILE,
    AdapterError,
    AdapterSpec,
    ModelShape,
    ModuleDims,
    load_adapter,
    split_expert_unit,
)

Unit = tuple[int, str, int]  # (layer, module, expert); expert -1 for a dense projection


@dataclass(frozen=True, slots=True)
class ServerModel:
    """The base model as the server sees it: dense projections (`shape`, checked by `adapters.py`) and, for a
    Mixtral-style MoE, the experts' count and per-expert dims of the fused gate_up and down parameters."""

    shape: ModelShape
    num_experts: int = 0
    expert_dims: dict[str, ModuleDims] = field(default_factory=dict)

    def module_dims(self, module: str) -> ModuleDims:
        return self.expert_dims[module] if module in self.expert_dims else self.shape.modules[module]

    @staticmethod
    def from_config(path: str | os.PathLike) -> ServerModel:
        """From a HF `config.json` (a file, or a directory holding one) of a Llama- or Mixtral-style model. Raises
        ValueError naming a missing field."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        cfg = json.loads(path.read_text())
        try:
            hidden, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
            inter = cfg["intermediate_size"]
        except KeyError as e:
            raise ValueError(f"{path}: config.json has no {e.args[0]!r}; cannot derive the model's shape") from None
        head_dim = cfg.get("head_dim") or hidden // heads
        kv = cfg.get("num_key_value_heads") or heads
        modules = {"q_proj": ModuleDims(hidden, heads * head_dim), "k_proj": ModuleDims(hidden, kv * head_dim),
                   "v_proj": ModuleDims(hidden, kv * head_dim), "o_proj": ModuleDims(heads * head_dim, hidden)}
        num_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
        expert_dims = {}
        if num_experts:
            moe_inter = cfg.get("moe_intermediate_size") or inter
            expert_dims = {"experts.gate_up_proj": ModuleDims(hidden, 2 * moe_inter),
                           "experts.down_proj": ModuleDims(moe_inter, hidden)}
        else:
            modules |= {"gate_proj": ModuleDims(hidden, inter), "up_proj": ModuleDims(hidden, inter),
                        "down_proj": ModuleDims(inter, hidden)}
        shape = ModelShape(layers, modules, num_experts=num_experts, expert_modules=dict(expert_dims))
        return ServerModel(shape, num_experts, expert_dims)


@dataclass(slots=True)
class HostAdapter:
    """One adapter's host copy: its spec and units (fp32, CPU). Never modified after construction."""

    spec: AdapterSpec
    units: dict[Unit, tuple[torch.Tensor, torch.Tensor]]
    num_bytes: int

    def info(self) -> dict:
        """What `hello` reports about the adapter (JSON-ready)."""
        layers: dict[int, set[str]] = {}
        experts: set[int] = set()
        for layer, module, expert in self.units:
            layers.setdefault(layer, set()).add(module)
            if expert >= 0:
                experts.add(expert)
        s = self.spec
        return {"identity": s.identity, "rank": s.rank, "alpha": s.alpha, "scaling": s.scaling,
                "modules": {str(k): sorted(v) for k, v in sorted(layers.items())}, "experts": sorted(experts),
                "is_alora": s.is_alora, "invocation_tokens": list(s.alora_invocation_tokens or ()),
                "bytes": self.num_bytes}


def read_host_adapter(path: str | os.PathLike, model: ServerModel, name: str | None = None) -> HostAdapter:
    """Reads, validates and splits an adapter into units. Raises AdapterError naming what is wrong."""
    path = Path(path)
    loaded = load_adapter(path, model.shape, name or path.name)
    units: dict[Unit, tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in loaded.weights.items():
        expert = split_expert_unit(module)
        units[(layer, *expert) if expert else (layer, module, -1)] = ab
    return HostAdapter(loaded.spec, units, loaded.num_bytes())


class Catalog:
    """Adapters by name, host copies. Owned by the server's compute thread (not thread-safe).

    `load` / `unload` mutate; both raise AdapterError (load: unreadable or invalid adapter, or a name in use with
    other weights; unload: unknown name)."""

    def __init__(self, model: ServerModel) -> None:
        self.model = model
        self.adapters: dict[str, HostAdapter] = {}

    @staticmethod
    def from_dir(adapter_dir: str | os.PathLike | None, model: ServerModel) -> Catalog:
        """Every sub-directory holding adapter_config.json, named after it; raises AdapterError on the first bad
        one (a server that silently drops an adapter serves base outputs for it)."""
        catalog = Catalog(model)
        if adapter_dir is not None:
            for sub in sorted(Path(adapter_dir).iterdir()):
                if (sub / CONFIG_FILE).is_file():
                    catalog.load(sub.name, sub)
        return catalog

    def load(self, name: str, path: str | os.PathLike) -> HostAdapter:
        adapter = read_host_adapter(path, self.model, name)
        old = self.adapters.get(name)
        if old is not None and old.spec.identity != adapter.spec.identity:
            raise AdapterError(f"LoRA adapter '{name}': a different adapter is loaded under this name; unload it first")
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise AdapterError(f"LoRA adapter '{name}' is not loaded")
        del self.adapters[name]

    def info(self, names: list[str] | None = None) -> dict:
        """`hello`'s adapters: every one held, or only those of `names` that are held (a worker resolving one name
        asks for it alone, so the reply does not grow with the catalog)."""
        if names is None:
            return {name: a.info() for name, a in sorted(self.adapters.items())}
        return {name: self.adapters[name].info() for name in dict.fromkeys(names) if name in self.adapters}
