"""`GET /multilora/stats`: the LoRA-aware tree's counters, read from every scheduler over SGLang's own channel.

The HTTP process asks the schedulers with SGLang's `GetInternalStateReq` (the message behind `/server_info`), and
each scheduler adds its tree's `TreeStats` under the key "multilora". No files, no shared globals.
"""

from __future__ import annotations

import dataclasses


def scheduler_internal_state(result, self, *args, **kwargs):
    """AFTER hook on `Scheduler.get_internal_state`."""
    from sgl_multilora.patches.radix_backend import MultiLoRARadixCache

    tree_cache = getattr(self, "tree_cache", None)
    if isinstance(tree_cache, MultiLoRARadixCache):
        result.internal_state["multilora"] = dataclasses.asdict(tree_cache.tree.stats())
    result.internal_state["multilora_memory"] = kv_accounting(self)
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
        "total": int(scheduler.max_total_num_tokens),
        "free": int(allocator.available_size()),
        "cache_evictable": int(tree_cache.evictable_size()),
        "cache_protected": int(tree_cache.protected_size()),
        "running": len(getattr(getattr(scheduler, "running_batch", None), "reqs", []) or []),
        "waiting": len(getattr(scheduler, "waiting_queue", []) or []),
    }


_routes_added = False


def add_routes(*args, **kwargs):
    """BEFORE hook on `http_server.launch_server` (runs in the HTTP process only)."""
    global _routes_added
    if _routes_added:
        return None
    from sglang.srt.entrypoints import http_server

    @http_server.app.get("/multilora/stats")
    async def multilora_stats():
        states = await http_server._global_state.tokenizer_manager.get_internal_state()
        per_rank = [state.get("multilora") for state in states]
        memory = [state.get("multilora_memory") for state in states]
        if all(s is None for s in per_rank):
            return {"enabled": False, "reason": "the server runs without --radix-cache-backend multilora",
                    "memory": memory}
        return {"enabled": True, "schedulers": per_rank, "memory": memory}

    _routes_added = True
    return None
