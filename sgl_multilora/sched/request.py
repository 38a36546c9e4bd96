"""The scheduler's request record and its execution-time estimate.

Lives here: `SchedRequest` (what a caller hands the scheduler, plus the fields the scheduler fills
in) and `TimingModel` (T_exec). Not here: queues, quotas or SGLang's `Req`: a hook copies the few
numbers it needs from its own request into a `SchedRequest` and keeps the map back by `rid`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class SchedRequest:
    """One request, as the scheduler sees it. The caller sets the first block; the scheduler owns
    the second and the caller only reads it.

    `adapter` None means the base model. `adapter_tokens` is the adapter's memory expressed in KV
    tokens (adapter bytes / KV bytes per token: about 4 r for Llama-7B with q, k, v, o targets);
    the caller knows the model geometry, the scheduler does not. `max_new_tokens` caps the
    predicted output length. `arrival` is on the caller's clock, the one it passes as `now`
    (arrival rates for the quotas come from it). `cached_len` is how much of the prompt the prefix
    cache held when the request arrived: the prompt tokens it brings to compute (`new_len`) are
    what its size (WRS), its charge and its execution time count; the output predictor keys on the
    whole prompt. A follow-up turn whose history is cached is a small request, not a long one.
    """

    rid: str
    adapter: str | None
    in_len: int
    rank: int = 0
    adapter_tokens: int = 0
    max_new_tokens: int | None = None
    arrival: float = 0.0
    cached_len: int = 0
    # ---- filled in by the scheduler ----
    pred_out_len: int = 0
    wrs: float = 0.0
    cost_tokens: int = 0
    """new_len + pred_out_len + adapter_tokens: what admission charges, fixed at arrival so that
    exactly this much comes back on finish."""
    queue: int = -1
    seq: int = -1
    """Arrival order; FIFO order inside a queue and the re-queue position after a squash."""
    admitted_at: float | None = None
    finished_at: float | None = None
    charges: list[tuple[int, int]] = field(default_factory=list)
    """(queue, tokens) pairs this request holds while it runs: its own queue, and the queues
    whose spare tokens it borrowed in phase 2. Sums to `cost_tokens` while running."""
    num_squashes: int = 0
    num_pushbacks: int = 0
    """Times the engine did not take this request after a batch planned it."""
    resumed: bool = False
    """It ran and was taken back (squashed, or retracted by the engine): its first token is
    out, so no slot squash is made for it (slots.py)."""

    @property
    def new_len(self) -> int:
        """Prompt tokens to compute: the prompt less what was cached at arrival."""
        return self.in_len - self.cached_len

    def __repr__(self) -> str:
        return (f"SchedRequest({self.rid!r}, adapter={self.adapter!r}, in={self.in_len}, "
                f"out~{self.pred_out_len}, cost={self.cost_tokens}, q={self.queue})")


@dataclass(frozen=True)
class TimingModel:
    """T_exec(r) = new_len * prefill_s_per_token + pred_out_len * decode_s_per_token.

    Deliberately simple: one prefill rate and one time between tokens (TBT), both configured (the
    simulator passes its latency model's figures; a live hook can pass measured ones). Used for the
    bypass rule and, before any request of a queue has finished, for the quota's D. The defaults
    are of the order of Llama-7B on an A40 under load (TBT well under the paper's 150 ms SLO).
    """

    prefill_s_per_token: float = 0.0002
    decode_s_per_token: float = 0.03

    def __post_init__(self) -> None:
        if self.prefill_s_per_token < 0 or self.decode_s_per_token < 0:
            raise ValueError(f"timing rates must be >= 0, got {self}")

    def exec_s(self, in_len: int, out_len: int) -> float:
        return in_len * self.prefill_s_per_token + out_len * self.decode_s_per_token

    def request_exec_s(self, r: SchedRequest) -> float:
        return self.exec_s(r.new_len, r.pred_out_len)

    def remaining_s(self, r: SchedRequest, now: float) -> float:
        """Predicted time until a running request finishes; 0 once it has overrun its estimate."""
        start = r.admitted_at if r.admitted_at is not None else now
        return max(0.0, start + self.request_exec_s(r) - now)
