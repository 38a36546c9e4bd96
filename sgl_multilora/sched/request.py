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
    out, so no slot squash is made for it (rules/slot_squash.py)."""
    deferred: bool = False
    """A batch planned it behind far smaller requests and put it off to the next one
    (`MultiQueueScheduler.build_batch`); that happens once per request."""
    memory_blocked_since: float | None = None
    """When a batch first found its adapter memory-blocked (it could not be made resident even
    after evicting every idle adapter) since it was last queued by a squash or a retraction; it
    holds the batch `memory_hold_share` of the SLO later (rules/memory_hold.py)."""

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


class MeasuredRates:
    """A live engine's step times turned into `TimingModel` rates.

    Prefill: seconds per token over recent extend steps, weighted by their tokens (exponentially decayed sums of
    seconds and of tokens, each step weighing `weight`). An extend step costs a fixed part (a whole forward pass
    over the model's layers, the sampling, the scheduler's own work) plus a part per token, and on a live server many
    extend steps are small: a prompt of a few tokens, a follow-up turn whose history is cached, a retracted request
    resuming from its kept KV. A mean of per-step ratios charges each small step's fixed part to its few tokens: on
    the 2-core CPU server it read 0.01-0.10 s per token (every small step's fixed part) where the token-weighted rate
    reads about 3 ms, and the slot squash's victim filter (rules/slot_squash.py: recompute within the SLO) then excluded any
    adapter whose running requests held more than a few dozen tokens. The token-weighted rate lets the large steps
    that hold most tokens set it. Decode: seconds per decode step (one token of every running request), the same
    decay. Raises ValueError on a negative time or token count (a caller bug)."""

    def __init__(self, weight: float = 0.2) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.weight = weight
        self._prefill_s = 0.0
        self._prefill_tokens = 0.0
        self._decode_s: float | None = None

    def _decay(self, old: float, new: float, first: bool) -> float:
        return new if first else old + self.weight * (new - old)

    def observe_prefill(self, seconds: float, tokens: int) -> None:
        if seconds < 0 or tokens < 0:
            raise ValueError(f"negative step: {seconds} s, {tokens} tokens")
        if tokens == 0:
            return
        first = self._prefill_tokens == 0
        self._prefill_s = self._decay(self._prefill_s, seconds, first)
        self._prefill_tokens = self._decay(self._prefill_tokens, tokens, first)

    def observe_decode(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"negative step: {seconds} s")
        self._decode_s = self._decay(self._decode_s or 0.0, seconds, self._decode_s is None)

    def rates(self) -> dict[str, float]:
        """The `TimingModel` fields measured so far (absent: nothing of that kind observed yet)."""
        out = {}
        if self._prefill_tokens > 0:
            out["prefill_s_per_token"] = self._prefill_s / self._prefill_tokens
        if self._decode_s is not None:
            out["decode_s_per_token"] = self._decode_s
        return out
