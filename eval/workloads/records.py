"""The request record every workload produces and every consumer (live driver, simulator, reports) reads.
Not here: generating workloads (the other modules of eval/workloads/) or sending them.

A workload is a list of `Request`s sorted by `arrival_s`, plus the `AdapterInfo`s it names. Prefix structure is
explicit: a request's prompt is its parent request's prompt and output (the history; none for a session's first
request) followed by `new_tokens` fresh tokens; the simulator turns that into token ids, the live driver into text.
A conversation chains each turn to the previous one; an aLoRA pipeline hangs its checks and the base continuation
all on the base answer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class AdapterInfo:
    """An adapter a workload uses. `kind` is "lora" or "alora"; `rank` drives weight size and LoRA cost."""

    name: str
    rank: int
    kind: str = "lora"
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class Request:
    """One request of a workload.

    rid: unique id. arrival_s: seconds from the workload's start. session: requests of one session share history
    (a conversation, an agent session, an aLoRA pipeline); turn: 0, 1, ... within it. adapter: an AdapterInfo name,
    or None for the base model. parent_rid: the request whose prompt + output open this prompt (None: no history);
    history_tokens: that length (parent.prompt_tokens + parent.output_tokens, 0 without a parent); new_tokens:
    fresh prompt tokens after that; output_tokens: tokens to generate. A parent always arrives earlier. shared_prefix: an id of a prefix shared across sessions (e.g. a system prompt)
    of shared_prefix_tokens tokens at the very start of the history (or of new tokens for a first turn), or None.
    prompt_text: the literal prompt for replayed user traces that carry text, else None.
    alora_invocation: for an aLoRA request, True when the prompt ends with the adapter's invocation sequence
    (the activation start k is then history_tokens + new_tokens - len(invocation)).
    """

    rid: str
    arrival_s: float
    session: str
    turn: int
    adapter: str | None
    parent_rid: str | None
    history_tokens: int
    new_tokens: int
    output_tokens: int
    shared_prefix: str | None = None
    shared_prefix_tokens: int = 0
    prompt_text: str | None = None
    alora_invocation: bool = False
    tags: dict = field(default_factory=dict, compare=False)

    @property
    def prompt_tokens(self) -> int:
        return self.history_tokens + self.new_tokens

    def to_json(self) -> dict:
        return asdict(self)


def history_of(parent: Request | None) -> dict:
    """`parent_rid` and `history_tokens` of a request whose prompt opens with `parent`'s prompt and output."""
    if parent is None:
        return {"parent_rid": None, "history_tokens": 0}
    return {"parent_rid": parent.rid, "history_tokens": parent.prompt_tokens + parent.output_tokens}


@dataclass
class RequestResult:
    """What one request measured, live or simulated: one JSON line per request in a results file.

    experiment: the experiment's name; arm: which server or simulated system ("ours", "stock", "ours:elora", ...).
    Times in seconds from the workload's start (arrival_s, first_token_s, finish_s) or durations (ttft_s, tpot_s:
    mean inter-token time after the first token, e2e_s). cached_tokens: prompt tokens served from the prefix cache.
    error: None, or the error message (the request then has no timings). extra: arm-specific details (hit kind,
    adapter load time, ...).
    """

    experiment: str
    arm: str
    rid: str
    adapter: str | None
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    error: str | None = None
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)
