"""Longest prefix match: SGLang's `--schedule-policy lpm`, as `SchedulePolicy.calc_priority` in the pinned wheel
(sglang/srt/managers/schedule_policy.py, 0.5.23) does it.

Lives here: `LpmAdmission`. Not here: the pass (engine.py) or the prefix caches (the systems' trees).

Each pass, unless more than `WAITING_QUEUE_PREFIX_MATCH_MAX` (128) requests wait (then SGLang falls back to FCFS
and leaves the queue as it is):
1. every waiting request's prompt is matched against the system's prefix cache (device tree, and the host tier
   where the system has one: SGLang counts every cache level), with touch=False (a pure query; SGLang's match
   records an access, which would reorder our eviction scores);
2. in-batch prefix caching: a request whose cache match is at most 32 tokens is matched against the prompts of
   the earlier such requests of this pass (same adapter: SGLang's extra_key is the LoRA id); one sharing at least
   32 tokens with them is deprioritised to the back (so one of them computes the prefix and the others can reuse
   it), the others are recorded. Sharing >= 32 tokens is sharing the first 32, so a set of 32-token heads stands
   in for SGLang's scratch radix tree exactly;
3. the waiting list is stably sorted in place by descending match length, deprioritised requests last.
With no prefix sharing in a workload, every match is 0 and LPM keeps arrival order: it is FCFS.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from eval.sim.admission.base import BaseAdmission

if TYPE_CHECKING:
    from eval.sim.systems.request import SimRequest

WAITING_QUEUE_PREFIX_MATCH_MAX = 128
IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD = 32
IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD = 32


class LpmAdmission(BaseAdmission):
    name = "lpm"

    def candidates(self, waiting: list[SimRequest], now: float, backlog: int) -> list[SimRequest]:
        if len(waiting) > WAITING_QUEUE_PREFIX_MATCH_MAX:
            return waiting
        head_len = IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD
        heads: set[tuple] = set()
        order: dict[SimRequest, float] = {}
        for sr in waiting:
            matched = self.matched_len(sr)
            order[sr] = -matched
            if matched <= IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD:
                head = (sr.req.adapter, sr.prompt[:head_len])
                if len(sr.prompt) >= head_len and head in heads:
                    order[sr] = float("inf")
                else:
                    heads.add(head)
        waiting.sort(key=order.__getitem__)
        return waiting

    def matched_len(self, sr: SimRequest) -> int:
        """Cached prefix of `sr`'s prompt (all but its last token), device or host. Modifies nothing."""
        system = self.system
        if system.tree is None:
            return 0  # no prefix cache: SGLang turns lpm into fcfs
        key = system.key(sr, sr.prompt[:-1])
        n = system.tree.match(key, touch=False).prefix_len
        if system.host is not None:
            n = max(n, system.host.match(key, touch=False).prefix_len)
        return n
