"""The unified pool under SGLang's own LoRA layers: `--lora-backend multilora` with `--radix-cache-backend multilora`.

SGLang's LoRA layers (`QKVParallelLinearWithLoRA`, ...) read per-slot stacked buffers that its `LoRAMemoryPool`
sizes for `--max-loras-per-batch` adapters of `--max-lora-rank` and fills from each adapter's host copy. With the
pool on, those buffers are never allocated: each layer is handed a placeholder of the shape it expects (one element,
expanded: no memory), SGLang's slot copies are skipped, and `MultiLoRABackend` reads each batch slot's adapter in
place from the KV slots that adapter holds (`LiveMemory.weights`). SGLang keeps what it does well: which adapter
sits in which batch slot, and its per-batch cap.
```
  SGLang layer (layer l, "qkv_proj") --placeholder data_ptr--> PoolModule(l, "qkv_proj", offsets, ...)
  batch slot s --memory_pool.uid_to_buffer_id--> lora_id --registry--> identity --LiveMemory.weights--> views
  views[(l, "qkv_proj")] = (A: (3 r, in), B: (q + k + v out, r))  inside k_buffer[l] / v_buffer[l] rows of its slots
```
Host copies: once SGLang has loaded and normalised an adapter (fused per module as its layers read them, sliced for
this tensor-parallel rank), that form becomes the registry's host copy and SGLang's own tensors are freed
(`host_memory.py`), so each adapter is held once on the host. The pool sizes and places it like any adapter
(`slot_layout.py`).
Refused with a clear error at start-up: MoE LoRA in SGLang's layers (its fused-MoE LoRA buffers; on the
`--model-impl transformers` CPU path our `MultiLoRAExperts` computes expert LoRA instead, and the pool holds each
expert's A / B like any projection's), embedding / lm_head LoRA (the backend refuses it),
a KV pool the unified allocator cannot take over, a KV dtype other than the LoRA weights' dtype.
"""

from __future__ import annotations

import logging

import torch

from sgl_multilora.adapters import AdapterSpec, LoadedAdapter
from sgl_multilora.patches import flags, host_memory
from sgl_multilora.patches.lora_backend import PoolModule
from sgl_multilora.patches.state import process_state

logger = logging.getLogger(__name__)


def on() -> bool:
    """The pool holds the adapters of SGLang's layers: the unified pool is requested, SGLang's layers compute (not
    the transformers path's) and they compute with `--lora-backend multilora`."""
    state = process_state()
    return flags.unified_memory_requested() and state.lora is None and state.lora_backend is not None


def allocate_placeholders(pool, base_model) -> None:
    """Instead of `LoRAMemoryPool.init_buffers`: every (module, layer) buffer becomes a placeholder of SGLang's
    shape, each on a storage of its own (so its data_ptr names it), none holding memory."""
    pool.base_model = base_model
    pool._num_experts_local = pool._get_num_local_experts(base_model)
    if pool._has_moe_module(base_model):
        raise RuntimeError("sgl_multilora: the unified pool does not hold the MoE LoRA weights of SGLang's own "
                           "LoRA layers (its fused-MoE LoRA buffers); pass --multilora-stock-baseline memory "
                           "(SGLang's slot buffers) for this model")
    device = next(base_model.parameters()).device
    for module in sorted(pool.target_modules):
        for buffers, shape_of in ((pool.A_buffer, pool.get_lora_A_shape), (pool.B_buffer, pool.get_lora_B_shape)):
            buffers[module] = [
                torch.zeros(1, dtype=pool.dtype, device=device).expand(
                    *shape_of(module, base_model, pool.max_lora_rank, layer))
                for layer in range(pool.num_layer)
            ]
    logger.info("sgl_multilora: SGLang's LoRA slot buffers are placeholders; adapter weights live in the KV pool")


def pool_modules(manager) -> list[PoolModule]:
    """The modules SGLang's layers compute LoRA for, each with its placeholders and output slices."""
    from sglang.srt.lora.utils import LoRAType, get_target_module_name

    pool = manager.memory_pool
    out = []
    for layer, modules in enumerate(manager.lora_modules):
        for name, module in modules.items():
            target = get_target_module_name(name, pool.target_modules)
            a = pool.get_tensor(target_module=target, layer_id=layer, lora_type=LoRAType.LORA_A)
            b = pool.get_tensor(target_module=target, layer_id=layer, lora_type=LoRAType.LORA_B)
            offsets = tuple(int(o) for o in (getattr(module, "lora_offsets", None) or (0, b.shape[-2])))
            if a.shape[1] != (len(offsets) - 1) * pool.max_lora_rank or offsets[-1] != b.shape[1]:
                raise RuntimeError(f"layer {layer} {target}: placeholders {tuple(a.shape)} / {tuple(b.shape)} do "
                                   f"not match output slices {offsets} at rank {pool.max_lora_rank}")
            out.append(PoolModule(layer, target, a.data_ptr(), b.data_ptr(), int(a.shape[-1]), offsets,
                                  pool.max_lora_rank, a.dtype, a.device))
    return out


def host_copy(manager, lora_id: str, spec: AdapterSpec) -> LoadedAdapter:
    """SGLang's normalised weights of `lora_id` as the pool's host copy: per (layer, target module) A (n r, in) and
    B (out, r), sliced for this rank as SGLang's layers slice them, contiguous on the CPU in the LoRA dtype."""
    from sglang.srt.lora.utils import get_target_module_name

    pool, adapter = manager.memory_pool, manager.loras[lora_id]
    weights = {}
    for layer_id, layer in enumerate(adapter.layers):
        by_target: dict[str, dict[str, torch.Tensor]] = {}
        for name, w in layer.weights.items():
            target = get_target_module_name(name, pool.target_modules)
            by_target.setdefault(target, {})["A" if "lora_A" in name else "B"] = w
        for name, module in manager.lora_modules[layer_id].items():
            target = get_target_module_name(name, pool.target_modules)
            pair = by_target.get(target)
            if pair is None:
                continue
            if set(pair) != {"A", "B"}:
                raise RuntimeError(f"LoRA adapter '{spec.name}': layer {layer_id} {target} has only {sorted(pair)}")
            # A copy of its own: SGLang's tensors may map the adapter file, which may be rewritten while served.
            a = module.slice_lora_a_weights(pair["A"]).to("cpu", pool.dtype, copy=True).contiguous()
            b = module.slice_lora_b_weights(pair["B"]).to("cpu", pool.dtype, copy=True).contiguous()
            weights[(layer_id, target)] = (a, b)
    if not weights:
        raise RuntimeError(f"LoRA adapter '{spec.name}' has no weights for the modules SGLang's layers wrap")
    return LoadedAdapter(spec, weights)


def adopt(manager) -> None:
    """Every adapter SGLang holds that the registry has no host copy of yet gets one (`host_copy`); SGLang's is
    freed. Called once SGLang's layers and pool exist (adapters given at start-up load before them)."""
    registry = process_state().adapters
    for lora_id in list(getattr(manager, "loras", {})):
        spec = registry.spec(lora_id)
        if spec is None or registry.loaded(lora_id) is not None:
            continue
        registry.stage(lora_id, host_copy(manager, lora_id, spec))
        host_memory.drop_sglang_weights(manager, lora_id)
    host_memory.release()


def bind(manager, forward_batch) -> None:
    """The backend's slots for this batch: each slot a request of the batch uses gets its adapter's views (it must
    be resident: admission made it so); the others are empty."""
    backend = manager.lora_backend
    if backend is not process_state().lora_backend or not backend.pool_modules:
        return
    memory, registry = process_state().memory, process_state().adapters
    slots = [None] * manager.max_loras_per_batch
    for uid in set(forward_batch.lora_ids or ()):
        if uid is None:
            continue
        views = memory.weights(registry.identity(uid)) if memory is not None else None
        if views is None:
            raise RuntimeError(f"LoRA adapter id {uid} is in the batch but its weights are not resident in the pool")
        slots[manager.memory_pool.uid_to_buffer_id[uid]] = views
    backend.bind_pool(slots)


def check_memory(memory) -> None:
    """At start-up, once the KV pool exists: with placeholders in SGLang's layers, the unified pool must be there
    and hold the LoRA dtype (RuntimeError naming the fix otherwise)."""
    backend = process_state().lora_backend
    if backend is None or not backend.pool_modules:
        return
    if memory is None:
        raise RuntimeError("sgl_multilora: the unified pool needs page size 1 and an MHA KV pool (SGLang's "
                           "TokenToKVPoolAllocator); pass --page-size 1 or --multilora-stock-baseline memory")
    dtype = next(iter(backend.pool_modules.values())).dtype
    if memory.dtype != dtype:
        raise RuntimeError(f"sgl_multilora: the unified pool holds adapters in the KV cache's dtype ({memory.dtype}) "
                           f"but the LoRA layers compute in {dtype}; pass --kv-cache-dtype auto or "
                           "--multilora-stock-baseline memory")


# ---- hooks (see hook_table.py) -------------------------------------------------------------------------------


def load_to_slot(original, self, *args, **kwargs):
    """AROUND `LoRAMemoryPool.load_lora_weight_to_buffer`: no copy into placeholders (the pool holds the weights)."""
    if on():
        return None
    return original(self, *args, **kwargs)


def clear_slot(original, self, buffer_id):
    """AROUND `LoRAMemoryPool._clear_buffer_slot_for_base`: placeholders hold nothing to clear."""
    if on():
        return None
    return original(self, buffer_id)


def update_lora_info(original, self):
    """AFTER SGLang points its layers at the pool's buffers: the backend learns the placeholders, and the adapters
    loaded so far get their host copies."""
    result = original(self)
    if on() and self.lora_backend is process_state().lora_backend:
        self.lora_backend.use_pool(pool_modules(self))
        adopt(self)
    return result
