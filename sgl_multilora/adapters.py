"""Adapter registry records: PEFT config parsing, content identity, validation against a model, weight loading.

Lives here: everything we know about one LoRA / aLoRA adapter directory, as plain Python and torch tensors.
Not here: where the weights sit at serving time (the pool) or how they are applied (the LoRA layer / kernels).

Identity. An adapter is known by `identity`, a SHA-256 over its canonical config and its weight bytes, never by the
name a user gave it: loading changed weights under an old name yields a new identity, so KV cached for the old
weights can never be hit again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
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


class AdapterError(ValueError):
    """An adapter that can never be served as given. The message names the adapter and what is wrong."""


@dataclass(frozen=True, slots=True)
class ModuleDims:
    """Input and output width of one projection of the base model (per layer, unsharded)."""

    in_features: int
    out_features: int


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What an adapter is checked against: the base model's layers and projections, and the server's rank limit."""

    num_layers: int
    modules: dict[str, ModuleDims]
    max_rank: int | None = None


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
    """An adapter's spec and its weights: `weights[(layer_id, module)] = (A: (r, in), B: (out, r))`, fp32, CPU."""

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
    if isinstance(targets, str) and targets:
        # PEFT's pattern form (a regex over module paths, or "all-linear" left unresolved): what it matched is
        # exactly what the weight file holds, so the modules are read from there.
        config = {**config, "target_modules": _resolve_pattern(name, path, targets)}
    elif not (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)):
        raise _fail(name, f"'target_modules' must be a non-empty list of module names or a pattern, got {targets!r}")
    elif any("." in t for t in targets):
        # PEFT matches a dotted entry ("self_attn.q_proj") as the end of a module's path: the module is its last part
        config = {**config, "target_modules": sorted({t.rsplit(".", 1)[-1] for t in targets})}
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
    """The module names (sorted) that `path`'s weight file holds per-layer LoRA weights for."""
    return tuple(sorted({m.group(2) for k in _weight_keys(path) if (m := _WEIGHT_KEY.search(k)) is not None}))


def _resolve_pattern(name: str, path: Path, pattern: str) -> list[str]:
    """PEFT's string `target_modules`: a regex that must match each targeted module's whole path (PEFT's
    `re.fullmatch`), or "all-linear". Returns the module names the weights hold; raises AdapterError when there are
    none, the regex is invalid, or some weight's module is not one the pattern selects."""
    modules, paths = set(), set()
    for key in _weight_keys(path):
        m = _WEIGHT_KEY.search(key)
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
    missing = sorted(set(spec.target_modules) - set(shape.modules))
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
    for key, tensor in tensors.items():
        m = _WEIGHT_KEY.search(key)
        if m is None:
            raise _fail(spec.name, f"unexpected tensor {key!r} (only per-layer lora_A / lora_B weights are supported)")
        layer_id, module, half = int(m.group(1)), m.group(2), m.group(3)
        if module not in shape.modules:
            raise _fail(spec.name, f"tensor {key!r} targets module {module!r}, which the base model does not have")
        if layer_id >= shape.num_layers:
            raise _fail(spec.name, f"tensor {key!r} is for layer {layer_id}; the model has {shape.num_layers}")
        if not tensor.is_floating_point():
            raise _fail(spec.name, f"tensor {key!r} has dtype {tensor.dtype}; LoRA weights are floating point")
        if not bool(tensor.isfinite().all()):
            raise _fail(spec.name, f"tensor {key!r} holds NaN or infinite values")
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
    if not weights:
        raise _fail(spec.name, f"{file.name} holds no LoRA weights")
    return LoadedAdapter(spec=spec, weights=weights)


def find_invocation_start(token_ids: list[int], invocation: tuple[int, ...]) -> int | None:
    """Start of the last occurrence of `invocation` in `token_ids`, or None if it does not occur (aLoRA's k)."""
    n = len(invocation)
    first = invocation[0]
    for start in range(len(token_ids) - n, -1, -1):
        if token_ids[start] == first and tuple(token_ids[start : start + n]) == invocation:
            return start
    return None
