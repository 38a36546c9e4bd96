"""`GET /multilora/stats`: the LoRA-aware tree's counters, read from every scheduler over SGLang's own channel.

The HTTP process asks the schedulers with SGLang's `GetInternalStateReq` (the message behind `/server_info`), and
each scheduler adds its tree's `TreeStats` under the key "multilora". No files, no shared globals. The HTTP process
adds its own part: the adapter tiers of `--multilora-adapter-source` / `--multilora-host-adapter-gb`
(`adapter_tiers`, `patches/on_demand.py`; null without either flag), and with `--multilora-lora-server` each
scheduler's side of the LoRA server (`lora_server`: calls, rows, the seconds waited on replies, failures).
"""

from __future__ import annotations

import dataclasses

from sgl_multilora.patches.state import process_state


def scheduler_internal_state(result, self, *args, **kwargs):
    """AFTER hook on `Scheduler.get_internal_state`."""
    from sgl_multilora.patches.radix_backend import MultiLoRARadixCache

    tree_cache = getattr(self, "tree_cache", None)
    if isinstance(tree_cache, MultiLoRARadixCache):
        result.internal_state["multilora"] = dataclasses.asdict(tree_cache.multilora_stats())
    memory = kv_accounting(self)
    if memory is not None:
        memory["adapters"] = adapter_accounting(self)
        if process_state().memory is not None:
            memory["unified_pool"] = process_state().memory.stats()
        if process_state().scheduler is not None:
            memory["scheduler"] = process_state().scheduler.stats()
    result.internal_state["multilora_memory"] = memory
    from sgl_multilora.patches import lora_remote

    result.internal_state["multilora_lora_server"] = lora_remote.stats()
    return result


def kv_accounting(scheduler) -> dict | None:
    """KV token slots of one scheduler: total, free, and held by the prefix cache (evictable / locked).

    When no request is running, `free + cache_evictable == total` and `cache_protected == 0`: every slot is either
    free or cached, none leaked. Token counts, for any `--radix-cache-backend`.
    """
    allocator = getattr(scheduler, "token_to_kv_pool_allocator", None)
    tree_cache = getattr(scheduler, "tree_cache", None)
    if allocator is None or tree_cache is None:
        return None
    return {
        "kv_bytes_per_token": _kv_bytes_per_token(allocator),
        "total": int(scheduler.max_total_num_tokens),
        "free": int(allocator.available_size()),
        "cache_evictable": int(tree_cache.evictable_size()),
        "cache_protected": int(tree_cache.protected_size()),
        "running": len(getattr(getattr(scheduler, "running_batch", None), "reqs", []) or []),
        "waiting": len(getattr(scheduler, "waiting_queue", []) or []),
    }


def _kv_bytes_per_token(allocator) -> int | None:
    """K and V bytes of one token slot over all layers (None for pools without per-layer K/V buffers)."""
    try:
        kvcache = allocator.get_kvcache()
        rows = kvcache.k_buffer[0].shape[0]
        return int(sum(kvcache.get_kv_size_bytes()) // rows)
    except (AttributeError, IndexError, TypeError, AssertionError):
        return None


def _tensor_bytes(obj) -> int:
    import torch

    if isinstance(obj, torch.Tensor):  # an expanded tensor (the pool's placeholders) counts its storage only
        return min(obj.numel() * obj.element_size(), obj.untyped_storage().nbytes())
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def adapter_accounting(scheduler) -> dict | None:
    """Bytes of adapter weights one scheduler holds, per adapter name, by owner:

    - `weights`: per adapter, the copy our layers compute from on the transformers path (empty with the unified
      pool, whose slots hold the serving copies while the registry's copies count as `host`; empty where SGLang's
      layers compute, from `slot_buffers`);
    - `slot_buffers`: the bytes of SGLang's slot buffers as allocated, sized for `--max-loras-per-batch` adapters of
      `--max-lora-rank` whether or not they are filled (0 on the transformers path, which allocates none, and with
      the unified pool under SGLang's layers, whose placeholders hold none);
    - `host`: SGLang's host copy of every loaded adapter (`LoRAManager.loras`), which it keeps for swapping into slots
      (0 on the transformers path: our layers compute from their own copy and SGLang's is freed); with the unified
      pool, the registry's copy (the pool loads adapters from it), which replaces SGLang's;

    After an adapter is unloaded none of its bytes remain.
    """
    runner = getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)
    manager = getattr(runner, "lora_manager", None)
    if manager is None:
        return None
    names = {uid: ref.lora_name for uid, ref in getattr(manager, "lora_refs", {}).items()}
    host = {names.get(uid, uid): sum(_tensor_bytes(layer.weights) for layer in adapter.layers)
            for uid, adapter in getattr(manager, "loras", {}).items()}
    pool = getattr(manager, "memory_pool", None)
    slots = sum(_tensor_bytes(getattr(pool, attr, None)) for attr in
                ("A_buffer", "B_buffer", "embedding_A_buffer", "embedding_B_buffer", "lm_head_A_buffer",
                 "lm_head_B_buffer", "new_embeddings_buffer"))
    weights = {names.get(uid, uid): adapter.num_bytes() for uid, adapter in process_state().adapters.loaded_items()}
    if weights and process_state().memory is not None:  # the registry's copies are the host tier; slots hold the rest
        host = {**{k: v for k, v in host.items() if v}, **weights}
        weights = {}
    registry = process_state().adapters
    alora = sorted(name for uid, name in names.items() if (spec := registry.spec(uid)) is not None and spec.is_alora)
    return {"loaded": len(names), "weights": weights, "host": host, "slot_buffers": slots,
            "total": sum(weights.values()) + sum(host.values()) + slots, "alora": alora}


ROUTE = "/multilora/stats"
METRICS_ROUTE = "/multilora/metrics"  # the same figures in Prometheus' text format (sgl_multilora/metrics.py)


def add_routes(*args, **kwargs):
    """BEFORE hook on `http_server.launch_server` (runs in the HTTP process only). Idempotent."""
    from fastapi.responses import PlainTextResponse
    from sglang.srt.entrypoints import http_server

    from sgl_multilora.metrics import prometheus_text

    if any(getattr(route, "path", None) == ROUTE for route in http_server.app.routes):
        return None

    def adapter_tiers() -> dict | None:
        from sgl_multilora.patches import on_demand

        tm = http_server.get_global_state().tokenizer_manager
        od = on_demand.state(tm)
        return od.snapshot(tm) if od is not None else None

    async def read():
        states = await http_server.get_global_state().tokenizer_manager.get_internal_state()
        remote = [state.get("multilora_lora_server") for state in states]
        return ([state.get("multilora") for state in states], [state.get("multilora_memory") for state in states],
                None if all(r is None for r in remote) else remote)

    @http_server.app.get(METRICS_ROUTE)
    async def multilora_metrics():
        per_rank, memory, _ = await read()
        return PlainTextResponse(prometheus_text(per_rank, memory, adapter_tiers()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @http_server.app.get(ROUTE)
    async def multilora_stats():
        per_rank, memory, remote = await read()
        if all(s is None for s in per_rank):
            return {"enabled": False, "reason": "the server runs without --radix-cache-backend multilora",
                    "memory": memory, "adapter_tiers": adapter_tiers(), "lora_server": remote}
        return {"enabled": True, "schedulers": per_rank, "memory": memory, "adapter_tiers": adapter_tiers(),
                "lora_server": remote}

    return None
