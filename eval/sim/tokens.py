"""Token ids of a workload's requests, so the prefix cache sees real prefix structure.

Lives here: `build_tokens`. A request's prompt is its parent's prompt + output (the history), then its new
tokens; a shared prefix (e.g. a system prompt) is the same ids wherever it appears. Fresh tokens are unique
ids from a counter, so two prompts share a prefix exactly when the workload says they do.
"""

from __future__ import annotations

from eval.workloads.records import Request


Tokens = tuple[int, ...]


def build_tokens(requests: list[Request] | tuple[Request, ...]) -> dict[str, tuple[Tokens, Tokens]]:
    """rid -> (prompt ids, output ids). Raises ValueError naming a request whose parent is unknown or comes
    later, or whose history_tokens is not its parent's prompt + output."""
    out: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    shared: dict[str, tuple[int, ...]] = {}
    counter = 1_000_000

    def fresh(n: int) -> tuple[int, ...]:
        nonlocal counter
        counter += n
        return tuple(range(counter - n, counter))

    for r in sorted(requests, key=lambda r: r.arrival_s):
        if r.parent_rid is not None:
            if r.parent_rid not in out:
                raise ValueError(f"request {r.rid}: parent {r.parent_rid} is unknown or arrives later")
            p_prompt, p_out = out[r.parent_rid]
            history = p_prompt + p_out
            if len(history) != r.history_tokens:
                raise ValueError(f"request {r.rid}: history_tokens {r.history_tokens} != parent's prompt + "
                                 f"output {len(history)}")
            prompt = history + fresh(r.new_tokens)
        else:
            if r.history_tokens:
                raise ValueError(f"request {r.rid} has history_tokens {r.history_tokens} but no parent")
            head: tuple[int, ...] = ()
            if r.shared_prefix is not None and r.shared_prefix_tokens:
                if r.shared_prefix_tokens > r.new_tokens:
                    raise ValueError(f"request {r.rid}: shared prefix longer than its new tokens")
                head = shared.setdefault(r.shared_prefix, fresh(r.shared_prefix_tokens))
                if len(head) != r.shared_prefix_tokens:
                    raise ValueError(f"request {r.rid}: shared prefix {r.shared_prefix} has two lengths")
            prompt = head + fresh(r.new_tokens - len(head))
        out[r.rid] = (prompt, fresh(r.output_tokens))
    return out
