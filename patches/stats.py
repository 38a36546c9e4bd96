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
    return result


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
        if all(s is None for s in per_rank):
            return {"enabled": False, "reason": "the server runs without --radix-cache-backend multilora"}
        return {"enabled": True, "schedulers": per_rank}

    _routes_added = True
    return None
