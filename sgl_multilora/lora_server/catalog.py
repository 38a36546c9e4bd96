"""The LoRA server's catalog: the base model's shape and the host copy of every adapter, as LoRA units.

Lives here: `ServerModel` (shape from a HF config.json), `HostAdapter` (one adapter's units on the host) and
`Catalog` (adapters by name; load / unload). Not here: device slots (`slots.py`) or compute (`compute.py`).

A unit is (layer, module, expert) -> (A (r, in), B (out, r)), fp32: expert -1 for a dense projection (module
"q_proj", ...), 0..E-1 for a fused-experts parameter (module "experts.gate_up_proj" / "experts.down_proj").
Adapters are read and validated by `sgl_multilora.adapters` (identity = its content hash). PEFT `target_parameters`
on Mixtral's fused experts are split there into `expert_unit` modules when that version of `adapters.py` does so
(`adapters_split_experts()`); with an older one this module reads those weights itself (`_read_with_experts`): PEFT
stores lora_A as (E * r, in), expert-major, and lora_B as (out, r * E), expert-minor. Both readers give the same
units (a test compares them); the fallback goes once `adapters.py`'s expert support has settled.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sgl_multilora.adapters import (
    CONFIG_FILE,
    AdapterError,
    AdapterSpec,
    ModelShape,
    ModuleDims,
    content_identity,
    load_adapter,
    read_spec,
    weights_file,
)

Unit = tuple[int, str, int]  # (layer, module, expert); expert -1 for a dense projection
EXPERT_MODULES = ("experts.gate_up_proj", "experts.down_proj")
# `...layers.3.mlp.experts.base_layer.lora_A.weight` (PEFT nests one wrapper per targeted parameter)
USE_OWN_EXPERT_READER = False  # tests set it to compare the two readers


def adapters_split_experts() -> bool:
    """Whether `sgl_multilora.adapters` reads fused-experts LoRA itself (`split_expert_unit`, and `ModelShape`
    carrying the experts)."""
    import sgl_multilora.adapters as ad

    return hasattr(ad, "split_expert_unit") and "expert_modules" in getattr(ModelShape, "__dataclass_fields__", {})


_EXPERT_KEY = re.compile(r"\.layers\.(\d+)\.mlp\.experts\.(?:base_layer\.)*lora_([AB])(?:\.default)?\.weight$")


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
        if expert_dims and adapters_split_experts():
            shape = ModelShape(layers, modules, num_experts=num_experts, expert_modules=dict(expert_dims))
        else:
            shape = ModelShape(layers, modules)
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
    name = name or path.name
    try:
        raw = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        raw = {}
    split = adapters_split_experts() and not USE_OWN_EXPERT_READER
    if isinstance(raw, dict) and raw.get("target_parameters") and not split:
        return _read_with_experts(path, model, name, raw)
    loaded = load_adapter(path, model.shape, name)
    units: dict[Unit, tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in loaded.weights.items():
        expert = _split_unit(module) if split else None
        units[(layer, *expert) if expert else (layer, module, -1)] = ab
    return HostAdapter(loaded.spec, units, loaded.num_bytes())


def _split_unit(module: str) -> tuple[str, int] | None:
    from sgl_multilora.adapters import split_expert_unit

    return split_expert_unit(module)


def _read_with_experts(path: Path, model: ServerModel, name: str, config: dict) -> HostAdapter:
    """An adapter with PEFT `target_parameters` on the fused experts (and perhaps dense targets too). The dense part
    goes through `adapters.load_adapter` (config checks included) on a copy of the adapter without the expert tensors;
    the expert tensors are split here. Identity: `adapters.content_identity` over the real config and file."""
    import tempfile

    from safetensors.torch import load as load_bytes
    from safetensors.torch import save_file

    if not model.num_experts:
        raise AdapterError(f"LoRA adapter '{name}': it targets parameters {config['target_parameters']}, but the "
                           "base model has no fused experts")
    file = weights_file(path)
    if file is None or file.name != "adapter_model.safetensors":
        raise AdapterError(f"LoRA adapter '{name}': expert adapters must come as adapter_model.safetensors")
    data = file.read_bytes()
    tensors = load_bytes(data)
    expert_tensors = {k: v for k, v in tensors.items() if _EXPERT_KEY.search(k)}
    dense = {k: v for k, v in tensors.items() if k not in expert_tensors}
    # the dense part, checked as a dense adapter; a placeholder target when there is none keeps read_config's checks
    dense_config = {k: v for k, v in config.items() if k != "target_parameters"}
    dense_config["target_modules"] = dense_config.get("target_modules") or ["q_proj"]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / CONFIG_FILE).write_text(json.dumps(dense_config))
        if dense:
            save_file(dense, str(Path(tmp) / "adapter_model.safetensors"))
            loaded = load_adapter(tmp, model.shape, name)
            dense_units, base = loaded.weights, loaded.spec
        else:
            save_file({}, str(Path(tmp) / "adapter_model.safetensors"))
            dense_units, base = {}, read_spec(tmp, name)
    if not expert_tensors:
        raise AdapterError(f"LoRA adapter '{name}': target_parameters {config['target_parameters']} hold no weights")
    targets = tuple(sorted({m for _, m in dense_units}))
    spec = AdapterSpec(name, str(path), content_identity(path, config, data), base.rank, base.alpha, base.scaling,
                       targets, base.alora_invocation_tokens)
    units: dict[Unit, tuple[torch.Tensor, torch.Tensor]] = {
        (layer, module, -1): ab for (layer, module), ab in dense_units.items()}
    units |= _expert_units(name, expert_tensors, model, spec.rank)
    num_bytes = sum(a.numel() * 4 + b.numel() * 4 for a, b in units.values())
    return HostAdapter(spec, units, num_bytes)


def _expert_units(name: str, tensors: dict[str, torch.Tensor], model: ServerModel, rank: int) -> dict:
    """Per-expert units from PEFT's fused-experts tensors; each (A, B) pair is told apart by its shape."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _EXPERT_KEY.search(key)
        layer, half = int(m.group(1)), m.group(2)
        prefix = key[: m.start(2)]  # one wrapper's A and B share everything up to "lora_"
        pairs.setdefault((layer, prefix), {})[half] = t
    num_e = model.num_experts
    units = {}
    for (layer, prefix), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"} or layer >= model.shape.num_layers:
            raise AdapterError(f"LoRA adapter '{name}': bad expert tensors under {prefix!r} (layer {layer})")
        a, b = pair["A"].float(), pair["B"].float()
        module = next((mod for mod, d in model.expert_dims.items()
                       if tuple(a.shape) == (num_e * rank, d.in_features)
                       and tuple(b.shape) == (d.out_features, rank * num_e)), None)
        if module is None:
            raise AdapterError(f"LoRA adapter '{name}': expert tensors {tuple(a.shape)} / {tuple(b.shape)} at layer "
                               f"{layer} match neither fused experts parameter of the base model at rank {rank}")
        if not (bool(a.isfinite().all()) and bool(b.isfinite().all())):
            raise AdapterError(f"LoRA adapter '{name}': expert tensors at layer {layer} hold NaN or inf")
        a_e = a.view(num_e, rank, -1)  # A rows are expert-major: (E, r, in)
        b_e = b.view(b.shape[0], rank, num_e)  # B columns are expert-minor: (out, r, E)
        for e in range(num_e):
            units[(layer, module, e)] = (a_e[e].contiguous(), b_e[:, :, e].contiguous())
    return units


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

    def info(self) -> dict:
        return {name: a.info() for name, a in sorted(self.adapters.items())}
