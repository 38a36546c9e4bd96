"""LoRA on SGLang's `--model-impl transformers` path, where SGLang's own LoRA layers match no module.

SGLang's LoRA manager normalises adapter targets to fused names (`qkv_proj`, `gate_up_proj`) while a Hugging Face
model keeps separate `q_proj` / `k_proj` / `v_proj` / `gate_proj` / `up_proj`; and the modules whose names do match
(`o_proj`, `down_proj`) would get wrappers that return SGLang's `(output, bias)` tuples into HF code. So on that path
the manager keeps everything it does well (the adapter registry, `/load_lora_adapter`, batch admission) and this
module takes over the layers: each decoder projection is wrapped in a `MultiLoRALinear`, adapter weights are loaded
and validated by `sgl_multilora.adapters`, and every step's per-token layout is built by `SegmentMeta`.
"""

from __future__ import annotations

import logging
import os
import re

import msgspec

import torch
from torch import nn

from sgl_multilora.adapters import (
    AdapterError,
    ModelShape,
    ModuleDims,
    find_invocation_start,
    load_adapter,
    read_spec,
    resolve_under_root,
)
from sgl_multilora.patches import flags, host_memory, lora_pool_layers, lora_remote, remote_deltas
from sgl_multilora.patches import lora_experts
from sgl_multilora.patches.lora_linear import LoRAStep, MultiLoRALinear
from sgl_multilora.patches.state import process_state
from sgl_multilora.pool import ExceedsPoolError

logger = logging.getLogger(__name__)

# Per-layer projections of HF decoder models that LoRA adapters target.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

class TransformersLoRA:
    """Our LoRA layers on the transformers path (one LoRAManager per scheduler process): wrapped layers, the
    current step. Adapter weights are the process's `AdapterRegistry`'s; `adapters` is a read-only view of them."""

    def __init__(self, manager, shape: ModelShape, layers: list[MultiLoRALinear]):
        self.manager = manager
        self.shape = shape
        self.layers = layers
        self.registry = process_state().adapters
        self.adapters = self.registry.loaded_view()  # lora_id -> weights
        self.step = LoRAStep()
        if lora_remote.address() is not None:  # a LoRA server computes every delta; no weights here
            self.step.remote = remote_deltas.RemoteStep(shape)
        for layer in layers:
            layer.step = self.step

    def load(self, lora_ref) -> None:
        """Validates and loads `lora_ref`'s adapter; raises AdapterError naming the problem."""
        if lora_remote.is_remote(lora_ref.lora_path) and self.step.remote is not None:
            self.registry.stage(lora_ref.lora_id, lora_remote.load_remote(lora_ref.lora_name, self.shape)[0])
            return
        adapter = load_adapter(lora_ref.lora_path, self.shape, name=lora_ref.lora_name,
                               max_weights_bytes=flags.current().max_adapter_bytes)
        dtype = self.layers[0].base_dtype if self.layers else torch.float32
        # With the unified pool this is the host copy (slots hold the serving copy); otherwise the serving copy.
        device = "cpu" if flags.unified_memory_requested() else self.manager.device
        adapter.weights = {k: (a.to(device, dtype), b.to(device, dtype)) for k, (a, b) in adapter.weights.items()}
        self.registry.stage(lora_ref.lora_id, adapter)

    def prepare(self, forward_batch) -> None:
        """Refills the step layout (one `SegmentMeta`) that every wrapped layer reads."""
        lora_ids = list(forward_batch.lora_ids or [])
        if forward_batch.forward_mode.is_extend():
            new_token_lens = list(forward_batch.extend_seq_lens_cpu)
        else:
            new_token_lens = [1] * len(lora_ids)
        keys = [uid if uid in self.adapters else None for uid in lora_ids]
        for uid, key in zip(lora_ids, keys):
            if uid is not None and key is None:
                raise RuntimeError(f"LoRA adapter id {uid} is in the batch but not loaded")
        starts = self._lora_starts(forward_batch, keys)
        remote = self.step.remote
        self.step.prepare(keys, new_token_lens, starts, self.adapters if remote else self._step_weights(keys),
                          num_slots=self.manager.max_loras_per_batch, device=self.manager.device)
        if remote is not None:
            remote.prepare(self.step.meta, [self.adapters[k].spec for k in self.step.meta.keys])

    def _step_weights(self, keys: list[str | None]):
        """id -> the weights the step computes with: with the unified pool, views of the adapters' slots (each
        must be resident: admission made it so); otherwise the registry's own tensors."""
        memory = process_state().memory
        if memory is None:
            return self.adapters
        weights = {}
        for key in keys:
            if key is None or key in weights:
                continue
            resident = memory.weights(self.registry.identity(key) or self.adapters[key].spec.identity)
            if resident is None:
                raise RuntimeError(f"LoRA adapter id {key} is in the batch but its weights are not resident")
            weights[key] = resident
        return weights

    def _lora_starts(self, forward_batch, keys: list[str | None]) -> list[int] | None:
        """Per request, the first new token the adapter applies to: 0 for a standard LoRA; for an aLoRA, its
        activation start k (start of the last invocation sequence in the prompt) minus the cached prefix length."""
        alora = [k is not None and self.adapters[k].spec.is_alora for k in keys]
        if not any(alora):
            return None
        reqs = getattr(process_state().building, "reqs", None)
        if reqs is None or len(reqs) != len(keys):
            raise RuntimeError("aLoRA request in a batch whose requests are unknown (ForwardBatch.init_new hook off?)")
        extend = forward_batch.forward_mode.is_extend()
        prefix_lens = forward_batch.extend_prefix_lens_cpu if extend else None
        starts = []
        for i, (key, is_alora) in enumerate(zip(keys, alora)):
            if not is_alora:
                starts.append(0)
                continue
            k = find_invocation_start(reqs[i].origin_input_ids, self.adapters[key].spec.alora_invocation_tokens)
            if k is None:  # no invocation sequence: the adapter never activates (as in PEFT)
                starts.append(1 << 62)
            else:
                starts.append(k - prefix_lens[i] if extend else 0)
        return starts


def _is_transformers_model(model: nn.Module) -> bool:
    return any(cls.__name__ == "TransformersBase" for cls in type(model).__mro__)


def _state(manager) -> TransformersLoRA | None:
    """Our LoRA layers if they serve `manager` (None where SGLang's own layers compute)."""
    lora = process_state().lora
    return lora if lora is not None and lora.manager is manager else None


def _wrap_projections(model: nn.Module) -> tuple[ModelShape, list[MultiLoRALinear]]:
    dims: dict[str, ModuleDims] = {}
    wrapped: list[MultiLoRALinear] = []
    num_layers = 0
    for name, module in list(model.named_modules()):
        short = name.rsplit(".", 1)[-1]
        m = _LAYER.search(name)
        if short not in PROJECTIONS or m is None or isinstance(module, MultiLoRALinear):
            continue
        layer_id = int(m.group(1))
        lora_layer = MultiLoRALinear(module, layer_id=layer_id, module_name=short)
        parent = model.get_submodule(name.rsplit(".", 1)[0])
        setattr(parent, short, lora_layer)
        wrapped.append(lora_layer)
        dims[short] = ModuleDims(lora_layer.in_features, lora_layer.out_features)
        num_layers = max(num_layers, layer_id + 1)
    return ModelShape(num_layers=num_layers, modules=dims), wrapped


# ---- hooks (see hook_table.py) -------------------------------------------------------------------------------


def init_lora_modules(original, self):
    if flags.current().lora_compute == "sglang" or not _is_transformers_model(self.base_model):
        return original(self)
    self.lora_modules = [{} for _ in range(self.base_hf_config.num_hidden_layers)]
    self.embed_tokens_module = None
    self.lm_head_module = None
    shape, layers = _wrap_projections(self.base_model)
    shape = ModelShape(shape.num_layers, shape.modules, max_rank=self.max_lora_rank)
    shape, experts = lora_experts.wrap_experts(self.base_model, shape)  # MoE expert LoRA (HF's experts module)
    if process_state().lora is not None:
        raise RuntimeError("sgl_multilora: a second LoRA manager in one process is not supported on the "
                           "--model-impl transformers path")
    state = TransformersLoRA(self, shape, layers)
    lora_experts.attach(experts, state.step, remote_deltas.expert_source(state.step))
    process_state().lora = state
    logger.info(
        "sgl_multilora: LoRA on the transformers model path: %d projections wrapped (%s)",
        len(layers), ", ".join(sorted(shape.modules)),
    )
    # Adapters given at start-up were registered before the model shape was known: validate and load them now.
    for lora_id, lora_ref in list(self.lora_refs.items()):
        try:
            state.load(lora_ref)
        except AdapterError as e:
            raise RuntimeError(str(e)) from None
        process_state().adapters.add(lora_id, process_state().adapters.loaded(lora_id).spec)  # the bytes loaded
        host_memory.drop_sglang_weights(self, lora_id)
    host_memory.release()


def _checked_ref(lora_ref):
    """`lora_ref` with its path resolved inside `--multilora-adapter-root` (a relative path is the launcher's, as
    SGLang reads it); the same ref without a root. Raises AdapterError for a path outside the root."""
    root = flags.current().adapter_root
    if root is None:
        return lora_ref
    resolved = resolve_under_root(lora_ref.lora_path, root, lora_ref.lora_name, relative_to=os.getcwd())
    return msgspec.structs.replace(lora_ref, lora_path=str(resolved))


def load_lora_adapter(original, self, lora_ref):
    state = _state(self)
    if lora_remote.is_remote(lora_ref.lora_path) and state is not None and state.step.remote is not None:
        return lora_remote.manager_load(self, lora_ref, state.shape, process_state().adapters)
    try:
        lora_ref = _checked_ref(lora_ref)
        spec = read_spec(lora_ref.lora_path, lora_ref.lora_name, flags.current().max_adapter_bytes)
    except AdapterError as e:
        return self.create_lora_update_result(success=False, error_message=str(e))
    state = _state(self)
    memory = process_state().memory
    if state is not None:  # after start-up: validate against the model before SGLang touches anything
        try:
            state.load(lora_ref)
            spec = process_state().adapters.loaded(lora_ref.lora_id).spec  # the identity of the bytes loaded
            if memory is not None:
                memory.check_fits(process_state().adapters.loaded(lora_ref.lora_id))
        except (AdapterError, ExceedsPoolError) as e:
            process_state().adapters.remove(lora_ref.lora_id)
            return self.create_lora_update_result(success=False, error_message=str(e))
    result = original(self, lora_ref)
    if not result.success:
        process_state().adapters.remove(lora_ref.lora_id)
        return result
    process_state().adapters.add(lora_ref.lora_id, spec)
    if state is not None:
        host_memory.drop_sglang_weights(self, lora_ref.lora_id)
        host_memory.release()
    elif lora_pool_layers.on() and getattr(self, "memory_pool", None) is not None:  # after start-up (see `adopt`)
        try:
            lora_pool_layers.adopt(self)
            if memory is not None:
                memory.check_fits(process_state().adapters.loaded(lora_ref.lora_id))
        except (RuntimeError, ValueError, ExceedsPoolError) as e:
            self._unload_lora_adapter(lora_ref)
            return self.create_lora_update_result(success=False, error_message=str(e))
    loaded = process_state().adapters.loaded(lora_ref.lora_id)
    if memory is not None and loaded is not None:
        memory.register(lora_ref.lora_id, loaded)
    return result


def unload_lora_adapter(original, self, lora_ref):
    identity = process_state().adapters.identity(lora_ref.lora_id)
    result = original(self, lora_ref)
    if result.success:
        process_state().adapters.remove(lora_ref.lora_id)
        if process_state().memory is not None:
            process_state().memory.unregister(lora_ref.lora_id, identity)
        state = _state(self)
        if state is not None:
            for layer in state.layers:  # weight tables would keep the unloaded adapter's tensors alive
                layer.clear_tables()
    return result


def fetch_new_loras(original, self, new_loras, *args, **kwargs):
    if _state(self) is None:
        return original(self, new_loras, *args, **kwargs)
    return None  # our layers read the adapters' own tensors; SGLang's slot buffers are not used on this path


def init_buffers(original, self, base_model):
    """AROUND `LoRAMemoryPool.init_buffers`: where our layers compute (the LoRA manager's `init_lora_modules` ran
    first and set them up), SGLang's slot buffers would never be filled or read (`fetch_new_loras` and
    `prepare_lora_batch` are ours), so none are allocated: `--max-loras-per-batch` x `--max-lora-rank` over every
    target module is memory that nothing uses (with the unified pool, memory outside the pool). The pool object
    stays, with its empty buffer maps, for what SGLang asks of it (`can_support`, its slot bookkeeping)."""
    if process_state().lora is None:
        if lora_pool_layers.on():  # SGLang's layers on our backend, adapters in the unified pool
            return lora_pool_layers.allocate_placeholders(self, base_model)
        return original(self, base_model)
    self.base_model = base_model
    self._num_experts_local = self._get_num_local_experts(base_model)
    return None


def forward_batch_init_new(cls, batch, *args, **kwargs):
    process_state().building.reqs = getattr(batch, "reqs", None)


def prepare_lora_batch(original, self, forward_batch):
    state = _state(self)
    if state is None:
        result = original(self, forward_batch)
        lora_pool_layers.bind(self, forward_batch)
        return result
    state.prepare(forward_batch)
