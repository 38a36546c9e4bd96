"""Test mode (`--multilora-check-invariants`): the LoRA-aware tree's invariants checked after every scheduler step.

SGLang's own busy-time check (`SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY=1`) closes the KV slot accounting
(available + evictable + protected + uncached == total) through our cache's `*_size()` answers; this adds the tree's
structure, counters, locks and dependency rule, which SGLang cannot see. Off by default: a check walks every node.
"""

from __future__ import annotations

from sgl_multilora.patches import flags


def process_batch_result(result, self, *args, **kwargs):
    """AFTER hook on `Scheduler.process_batch_result(batch, result)`: raises AssertionError naming the invariant."""
    if flags.current().check_invariants:
        check = getattr(getattr(self, "tree_cache", None), "check_invariants", None)
        if check is not None:
            check()
    return result
