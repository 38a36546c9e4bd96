"""Adapter registry records: PEFT config parsing, content identity, validation against a model, weight loading.

Lives here: everything we know about one LoRA / aLoRA adapter directory, as plain Python and torch tensors.
Not here: where the weights sit at serving time (the pool) or how they are applied (the LoRA layer / kernels).

Identity. An adapter is known by `identity`, a SHA-256 over its canonical config and its weight bytes, never by the
name a user gave it: loading changed weights under an old name yields a new identity, so KV cached for the old
weights can never be hit again.

MoE expert LoRA. PEFT's `target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]` on a model with
fused experts (transformers 5: `gate_up_proj` [E, 2I, H], `down_proj` [E, H, I], each expert's matrix laid out
(out, in)) wraps each parameter in a `ParamWrapper` whose lora_A is (r E, in) and lora_B (out, r E), and computes
the delta weight of expert e as `scaling * B_e @ A_e` with (PEFT's einsum "o r e, e r i -> e o i", in/out swapped
because the parameter is not `is_transposed`)
    A_e = lora_A.view(E, r, in)[e]        rows e*r .. e*r+r-1           (expert-major)
    B_e = lora_B.view(out, r, E)[:, :, e] columns e, E+e, 2E+e, ...     (expert-minor)
`load_adapter` splits them so: the adapter's weights hold one 2-D unit per (layer, expert module, expert) under
the module name `expert_unit(module, e)` ("experts.gate_up_proj.3"), A_e (r, in) and B_e (out, r), like any
projection's. PEFT nests one wrapper per parameter and the nesting order follows the order the user listed them
in, which the saved config does not keep: a pair of tensors is told apart by its shapes (never ambiguous: that
would need H == I and 2I == H). Experts stored transposed ([E, in, out], `is_transposed`) are not supported.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_WEIGHTS_FILE = "adapter_model.bin"  # PEFT's `safe_serialization=False`; read with torch's weights-only loader
MAX_CONFIG_BYTES = 1 << 20  # a PEFT config is a few KB; anything past this is not one
MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors format's own limit on its JSON header
DEFAULT_MAX_WEIGHTS_BYTES = 4 << 30  # rank-64 adapters on every projection of a 70B model are about 1.7 GB

# `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` -> (3, "q_proj", "A")
_WEIGHT_KEY = re.compile(r"\.layers\.(\d+)\.(?:.*\.)?([A-Za-z0-9_]+)\.lora_([AB])(?:\.default)?\.weight$")
_OUTSIDE_LAYERS = frozenset({"embed_tokens", "lm_head", "wte", "embed_in", "embed_out"})
"""Modules every causal LM has outside its decoder layers (Llama's and GPT-style names), which PEFT can target."""
_LORA_SUFFIX = re.compile(r"\.lora_[AB](?:\.default)?\.weight$")
EXPERT_MODULES = ("experts.gate_up_proj", "experts.down_proj")
"""The fused-experts parameters an adapter's `target_parameters` may name (by their last two path parts)."""
# `...layers.3.mlp.experts.base_layer.lora_A.weight`: PEFT nests one ParamWrapper per targeted parameter
_EXPERT_KEY = re.compile(r"\.layers\.(\d+)\.(?:.*\.)?experts\.(?:base_layer\.)*lora_([AB])(?:\.default)?\.weight$")


def expert_unit(module: str, expert: int) -> str:
    """The module name under which expert `expert`'s LoRA of `module` (one of EXPERT_MODULES) is kept."""
    return f"{module}.{expert}"


def split_expert_unit(name: str) -> tuple[str, int] | None:
    """(module, expert) of an `expert_unit` name; None for a dense projection's name."""
    module, _, expert = name.rpartition(".")
    return (module, int(expert)) if module in EXPERT_MODULES and expert.isdigit() else None


def _dense_key(key: str) -> re.Match | None:
    """`_WEIGHT_KEY`'s match of a dense projection's tensor name (None for an expert tensor or another name)."""
    return None if _EXPERT_KEY.search(key) else _WEIGHT_KEY.search(key)


class AdapterError(ValueError):
    """An adapter that can never be served as given. The message names the adapter and what is wrong."""


@dataclass(frozen=True, slots=True)
class ModuleDims:
    """Input and output width of one projection of the base model (per layer, unsharded)."""

    in_features: int
    out_features: int


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What an adapter is checked against: the base model's layers and projections, and the server's rank limit.
    An MoE model whose fused experts take LoRA adds their count and `expert_modules` (EXPERT_MODULES -> one
    expert's dims)."""

    num_layers: int
    modules: dict[str, ModuleDims]
    max_rank: int | None = None
    num_experts: int = 0
    expert_modules: dict[str, ModuleDims] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """Config-level facts about an adapter (no weights)."""

    name: str
    path: str
    identity: str
    rank: int
    alpha: float
    scaling: float
    target_modules: tuple[str, ...]
    alora_invocation_tokens: tuple[int, ...] | None

    @property
    def is_alora(self) -> bool:
        return self.alora_invocation_tokens is not None


@dataclass(slots=True)
class LoadedAdapter:
    """An adapter's spec and its weights: `weights[(layer_id, module)] = (A: (r, in), B: (out, r))`, fp32, CPU;
    `module` is a projection's name or an `expert_unit` name (one expert of a fused-experts parameter)."""

    spec: AdapterSpec
    weights: dict[tuple[int, str], tuple["torch.Tensor", "torch.Tensor"]]

    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def _fail(name: str, what: str) -> AdapterError:
    return AdapterError(f"LoRA adapter '{name}': {what}")


def resolve_under_root(path: str | os.PathLike, root: str | os.PathLike, name: str,
                       relative_to: str | os.PathLike | None = None) -> Path:
    """`path` (a relative path is taken under `relative_to`, default `root`) with every symlink resolved, if it lies
    inside `root`.

    Raises AdapterError otherwise, with a message that says nothing about `path` (whether it exists, what it is), so
    a caller cannot probe the server's file system. Does not check that the result exists.
    """
    root = Path(os.path.realpath(root))
    candidate = Path(os.path.realpath(Path(relative_to if relative_to is not None else root) / path))
    if candidate != root and root not in candidate.parents:
        raise _fail(name, "the adapter path is outside the directories this server loads adapters from "
                          "(--multilora-adapter-root)")
    return candidate


def _check_size(name: str, file: Path, limit: int, what: str) -> None:
    size = file.stat().st_size
    if size > limit:
        raise _fail(name, f"{file.name} is {size / 2**20:.1f} MiB, above the {limit / 2**20:.0f} MiB {what}")


def read_config(path: str | os.PathLike, name: str | None = None,
                max_weights_bytes: int = DEFAULT_MAX_WEIGHTS_BYTES) -> dict:
    """Reads and checks `adapter_config.json`. Raises AdapterError naming the missing file, malformed field, or a
    file larger than its limit (the config: MAX_CONFIG_BYTES; the weights: `max_weights_bytes`)."""
    path = Path(path)
    name = name or path.name
    if not path.is_dir():
        raise _fail(name, f"adapter directory {str(path)!r} does not exist")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise _fail(name, f"{CONFIG_FILE} is missing in {str(path)!r}")
    weights = weights_file(path)
    if weights is None:
        raise _fail(name, f"{WEIGHTS_FILE} is missing in {str(path)!r} (and there is no {PICKLED_WEIGHTS_FILE})")
    _check_size(name, config_path, MAX_CONFIG_BYTES, "limit for an adapter config")
    _check_size(name, weights, max_weights_bytes, "limit per adapter (--multilora-max-adapter-mb)")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _fail(name, f"{CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise _fail(name, f"{CONFIG_FILE} must hold a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _fail(name, f"peft_type {peft_type!r} is not supported (only LORA)")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise _fail(name, f"'r' must be a positive integer, got {rank!r}")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise _fail(name, f"'lora_alpha' must be a positive number, got {alpha!r}")
    targets = config.get("target_modules")
    experts = _expert_targets(name, config.get("target_parameters"))
    if experts and not targets:  # only the experts: PEFT writes no target_modules (None) then
        config = {**config, "target_modules": list(experts)}
    elif isinstance(targets, str) and targets:
        # PEFT's pattern form (a regex over module paths, or "all-linear" left unresolved): what it matched is
        # exactly what the weight file holds, so the modules are read from there.
        config = {**config, "target_modules": _resolve_pattern(name, path, targets)}
    elif not (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)):
        raise _fail(name, f"'target_modules' must be a non-empty list of module names or a pattern, got {targets!r}")
    elif any("." in t for t in targets):
        # PEFT matches a dotted entry ("self_attn.q_proj") as the end of a module's path: the module is its last part
        config = {**config, "target_modules": sorted({t.rsplit(".", 1)[-1] for t in targets})}
    if experts and targets:
        config = {**config, "target_modules": sorted(set(config["target_modules"]) | set(experts))}
    if config.get("use_dora"):
        raise _fail(name, "DoRA adapters are not supported")
    bias = config.get("bias", "none")
    if bias not in ("none", None):
        raise _fail(name, f"LoRA bias terms ('bias': {bias!r}) are not supported; only 'none'")
    if config.get("modules_to_save"):
        raise _fail(name, f"'modules_to_save' {config['modules_to_save']!r} is not supported (fully trained "
                          f"modules replace the base model's for this adapter only); only lora_A / lora_B weights")
    if config.get("lora_bias"):
        raise _fail(name, "'lora_bias' (a trained bias on lora_B) is not supported; only lora_A / lora_B weights")
    if config.get("trainable_token_indices"):
        raise _fail(name, "'trainable_token_indices' is not supported (trained embedding rows replace the base "
                          "model's for this adapter only); only lora_A / lora_B weights")
    if config.get("layer_replication"):
        raise _fail(name, f"'layer_replication' {config['layer_replication']!r} is not supported (it changes the "
                          "base model's stack of layers)")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise _fail(name, f"per-module '{key}' is not supported")
    invocation = config.get("alora_invocation_tokens")
    if invocation is not None and not (
        isinstance(invocation, list) and invocation and all(isinstance(t, int) and t >= 0 for t in invocation)
    ):
        raise _fail(name, f"'alora_invocation_tokens' must be a non-empty list of token ids, got {invocation!r}")
    return config


def _expert_targets(name: str, params) -> tuple[str, ...]:
    """The EXPERT_MODULES named by a config's `target_parameters` (empty when it has none); raises AdapterError for
    any other parameter."""
    if params in (None, [], ()):
        return ()
    if not (isinstance(params, list) and all(isinstance(p, str) for p in params)):
        raise _fail(name, f"'target_parameters' must be a list of parameter names, got {params!r}")
    found = set()
    for param in params:
        module = ".".join(param.split(".")[-2:])
        if module not in EXPERT_MODULES:
            raise _fail(name, f"target parameter {param!r} is not supported; only the fused experts' "
                              f"{' / '.join(EXPERT_MODULES)}")
        found.add(module)
    return tuple(sorted(found))


def weights_file(path: str | os.PathLike) -> Path | None:
    """The adapter's weight file: `adapter_model.safetensors`, else `adapter_model.bin`, else None."""
    for name in (WEIGHTS_FILE, PICKLED_WEIGHTS_FILE):
        if (Path(path) / name).is_file():
            return Path(path) / name
    return None


def _load_pickled(file: Path, name: str) -> dict:
    """A PyTorch weight file's tensors, through torch's weights-only unpickler (tensors and plain containers only:
    no code runs). Raises AdapterError naming the file when it is not such a file or not a dict of tensors."""
    import pickle

    import torch

    try:
        tensors = torch.load(str(file), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, TypeError) as e:
        raise _fail(name, f"{file.name} is not a readable PyTorch weights file ({str(e).splitlines()[0][:200]})"
                    ) from None
    if not isinstance(tensors, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in tensors.items()):
        raise _fail(name, f"{file.name} must hold a dict of named tensors")
    return tensors


def _weight_keys(path: str | os.PathLike) -> list[str]:
    """The tensor names in `path`'s weight file (a safetensors file: from its header alone, no tensor data); empty
    when the file is not readable (`load_adapter` then says so)."""
    file = weights_file(path)
    if file is not None and file.name == PICKLED_WEIGHTS_FILE:
        try:
            return list(_load_pickled(file, ""))
        except AdapterError:
            return []
    if file is None:
        return []
    try:
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= MAX_SAFETENSORS_HEADER:
                return []
            header = json.loads(f.read(size))
    except (OSError, ValueError):  # also JSONDecodeError, UnicodeDecodeError
        return []
    return [k for k in header if k != "__metadata__"] if isinstance(header, dict) else []


def weight_modules(path: str | os.PathLike) -> tuple[str, ...]:
    """The projection names (sorted) that `path`'s weight file holds per-layer LoRA weights for (expert tensors,
    which only their shapes tell apart, are left out)."""
    return tuple(sorted({m.group(2) for k in _weight_keys(path) if (m := _dense_key(k)) is not None}))


def _resolve_pattern(name: str, path: Path, pattern: str) -> list[str]:
    """PEFT's string `target_modules`: a regex that must match each targeted module's whole path (PEFT's
    `re.fullmatch`), or "all-linear". Returns the module names the weights hold; raises AdapterError when there are
    none, the regex is invalid, or some weight's module is not one the pattern selects."""
    modules, paths = set(), set()
    for key in _weight_keys(path):
        m = _dense_key(key)
        if m is not None:
            modules.add(m.group(2))
            paths.add(_LORA_SUFFIX.sub("", key).removeprefix("base_model.model."))
    if not modules:
        raise _fail(name, f"'target_modules' is the pattern {pattern!r} and the weight file holds no per-layer "
                          f"lora_A / lora_B weights to resolve it")
    if pattern != "all-linear":
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise _fail(name, f"'target_modules' {pattern!r} is not a valid regular expression ({e})") from None
        stray = sorted(p for p in paths if regex.fullmatch(p) is None)
        if stray:
            raise _fail(name, f"'target_modules' pattern {pattern!r} does not select {stray[0]!r}, which "
                              f"the weight file holds LoRA weights for")
    return sorted(modules)


def content_identity(path: str | os.PathLike, config: dict, data: bytes | None = None) -> str:
    """SHA-256 over the canonical config JSON and the weight file's bytes (hex); over `data` when given (the
    file's bytes as already read)."""
    h = hashlib.sha256()
    h.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    h.update(b"\0")
    if data is not None:
        h.update(data)
        return h.hexdigest()
    with open(weights_file(path), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_spec(path: str | os.PathLike, name: str | None = None,
              max_weights_bytes: int = DEFAULT_MAX_WEIGHTS_BYTES, data: bytes | None = None) -> AdapterSpec:
    """Config, identity and scaling of the adapter at `path`. Reads the weight file once (for the hash), or hashes
    `data`, its bytes as already read."""
    path = Path(path)
    name = name or path.name
    config = read_config(path, name, max_weights_bytes)
    rank, alpha = config["r"], float(config.get("lora_alpha", config["r"]))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    invocation = config.get("alora_invocation_tokens")
    return AdapterSpec(
        name=name,
        path=str(path),
        identity=content_identity(path, config, data),
        rank=rank,
        alpha=alpha,
        scaling=scaling,
        target_modules=tuple(sorted(config["target_modules"])),
        alora_invocation_tokens=tuple(invocation) if invocation is not None else None,
    )


def check_against_model(spec: AdapterSpec, shape: ModelShape) -> None:
    """Raises AdapterError if `spec` asks for a rank or target modules the server cannot hold."""
    if shape.max_rank is not None and spec.rank > shape.max_rank:
        raise _fail(
            spec.name,
            f"rank {spec.rank} exceeds the server's maximum LoRA rank {shape.max_rank} (--max-lora-rank)",
        )
    experts = sorted(set(spec.target_modules) & set(EXPERT_MODULES))
    if experts and not set(experts) <= set(shape.expert_modules):
        raise _fail(spec.name, f"it targets the fused experts' {experts}, which take no LoRA on this model (no "
                               f"fused experts, or not run by the plugin's expert LoRA layers)")
    missing = sorted(set(spec.target_modules) - set(shape.modules) - set(EXPERT_MODULES))
    outside = [m for m in missing if m in _OUTSIDE_LAYERS]
    if outside:
        raise _fail(
            spec.name,
            f"LoRA on {outside} is not supported: only the decoder layers' projections "
            f"({sorted(shape.modules)}) take LoRA weights here",
        )
    if missing:
        raise _fail(
            spec.name,
            f"target modules {missing} do not exist in the base model "
            f"(it has {sorted(shape.modules)})",
        )


def load_adapter(path: str | os.PathLike, shape: ModelShape, name: str | None = None,
                 max_weights_bytes: int = DEFAULT_MAX_WEIGHTS_BYTES) -> LoadedAdapter:
    """Reads, validates and loads an adapter's weights (fp32, CPU). Raises AdapterError on any mismatch.

    A safetensors file is read once into memory; its identity is the hash of those bytes and the weights are made
    from them, so what is served is what the identity names even if the file changes meanwhile, and no tensor maps
    the file (a mapped file truncated or rewritten in place under a running server kills it with SIGBUS on the next
    read)."""
    from safetensors import SafetensorError
    from safetensors.torch import load as load_bytes

    name = name or Path(path).name
    read_config(path, name, max_weights_bytes)  # the checks, the size limit among them, before anything is read
    file = weights_file(path)
    data = None
    if file.name != PICKLED_WEIGHTS_FILE:
        with open(file, "rb") as f:
            data = f.read(max_weights_bytes + 1)
        if len(data) > max_weights_bytes:  # grown since its size was checked
            raise _fail(name, f"{file.name} is above the {max_weights_bytes / 2**20:.0f} MiB limit per adapter "
                              "(--multilora-max-adapter-mb)")
    spec = read_spec(path, name, max_weights_bytes, data)
    check_against_model(spec, shape)
    if data is None:
        tensors = _load_pickled(file, spec.name)
    else:
        try:
            tensors = load_bytes(data)  # tensors of their own, not views of `data`
            del data
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:  # malformed header, truncated data, dtype
            raise _fail(spec.name, f"{WEIGHTS_FILE} is not a readable safetensors file ({e})") from None

    halves: dict[tuple[int, str], dict[str, "torch.Tensor"]] = {}
    expert_halves: dict[tuple[int, str], dict[str, "torch.Tensor"]] = {}
    for key, tensor in tensors.items():
        if (e := _EXPERT_KEY.search(key)) is not None:
            _check_tensor(spec.name, key, tensor)
            if int(e.group(1)) >= shape.num_layers:
                raise _fail(spec.name, f"tensor {key!r} is for layer {e.group(1)}; the model has {shape.num_layers}")
            expert_halves.setdefault((int(e.group(1)), key[: e.start(2)]), {})[e.group(2)] = tensor.float()
            continue
        m = _WEIGHT_KEY.search(key)
        if m is None:
            raise _fail(spec.name, f"unexpected tensor {key!r} (only per-layer lora_A / lora_B weights are supported)")
        layer_id, module, half = int(m.group(1)), m.group(2), m.group(3)
        if module not in shape.modules:
            raise _fail(spec.name, f"tensor {key!r} targets module {module!r}, which the base model does not have")
        if layer_id >= shape.num_layers:
            raise _fail(spec.name, f"tensor {key!r} is for layer {layer_id}; the model has {shape.num_layers}")
        _check_tensor(spec.name, key, tensor)
        halves.setdefault((layer_id, module), {})[half] = tensor.float().contiguous()

    weights = {}
    for (layer_id, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise _fail(spec.name, f"layer {layer_id} {module}: lora_A and lora_B must both be present")
        a, b = pair["A"], pair["B"]
        dims = shape.modules[module]
        if tuple(a.shape) != (spec.rank, dims.in_features) or tuple(b.shape) != (dims.out_features, spec.rank):
            raise _fail(
                spec.name,
                f"layer {layer_id} {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not match "
                f"rank {spec.rank} and the module's ({dims.in_features} -> {dims.out_features})",
            )
        weights[(layer_id, module)] = (a, b)
    weights |= _split_experts(spec, shape, expert_halves)
    if not weights:
        raise _fail(spec.name, f"{file.name} holds no LoRA weights")
    return LoadedAdapter(spec=spec, weights=weights)


def _check_tensor(name: str, key: str, tensor: "torch.Tensor") -> None:
    if not tensor.is_floating_point():
        raise _fail(name, f"tensor {key!r} has dtype {tensor.dtype}; LoRA weights are floating point")
    if not bool(tensor.isfinite().all()):
        raise _fail(name, f"tensor {key!r} holds NaN or infinite values")


def _split_experts(spec: AdapterSpec, shape: ModelShape, pairs: dict[tuple[int, str], dict]) -> dict:
    """Per-expert units (see the module docstring) of PEFT's fused-experts tensors, keyed by (layer, wrapper path);
    raises AdapterError for a lone half, shapes that fit no experts parameter at the adapter's rank, or a parameter
    the config does not target."""
    num_e, r = shape.num_experts, spec.rank
    units = {}
    for (layer, prefix), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise _fail(spec.name, f"layer {layer} {prefix!r}: lora_A and lora_B must both be present")
        a, b = pair["A"], pair["B"]
        module = next((m for m, d in shape.expert_modules.items() if tuple(a.shape) == (num_e * r, d.in_features)
                       and tuple(b.shape) == (d.out_features, r * num_e)), None)
        if module is None or module not in spec.target_modules:
            raise _fail(spec.name, f"layer {layer}: expert tensors lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} "
                                   f"match no targeted fused-experts parameter ({num_e} experts, rank {r})")
        a_e, b_e = a.view(num_e, r, -1), b.view(b.shape[0], r, num_e)
        for e in range(num_e):
            units[(layer, expert_unit(module, e))] = (a_e[e].contiguous(), b_e[:, :, e].contiguous())
    return units


def find_invocation_start(token_ids: list[int], invocation: tuple[int, ...]) -> int | None:
    """Start of the last occurrence of `invocation` in `token_ids`, or None if it does not occur (aLoRA's k)."""
    n = len(invocation)
    first = invocation[0]
    for start in range(len(token_ids) - n, -1, -1):
        if token_ids[start] == first and tuple(token_ids[start : start + n]) == invocation:
            return start
    return None
