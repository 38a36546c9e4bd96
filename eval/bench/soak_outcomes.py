"""Soak benchmark records: what one request or admin call saw, its outcome, one phase's summary.
Pure data and functions (no HTTP, no server), so the rules are tested on synthetic records.
Not here: sending traffic (soak_traffic.py) or the pass/fail criteria (soak_report.py).
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from enum import StrEnum


class Outcome(StrEnum):
    OK = "ok"  # a full answer (for an admin call: done)
    REFUSED = "refused"  # a clear 4xx naming what was wrong, where a refusal is allowed
    DISCONNECTED = "disconnected"  # we closed the stream on purpose
    ABORTED = "aborted"  # we sent /abort_request and the answer says it was aborted
    ERROR = "error"  # anything else: 5xx, timeout, no connection, unclear or unexpected 4xx


@dataclass(slots=True)
class RequestRecord:
    """One `/generate` call as the client saw it. Times are seconds since the run started.

    `refusable`: a 400 whose message names this text is an allowed answer (an adapter under
    load/unload churn). `must_refuse`: a bad input; the answer must be a 4xx whose message contains
    this text. `status` None: no HTTP answer at all (`exception` says why)."""

    kind: str
    adapter: str | None
    stream: bool
    rid: str
    start_s: float
    end_s: float = 0.0
    status: int | None = None
    message: str = ""
    finish_type: str | None = None
    finish_message: str = ""
    stream_error_code: int | None = None
    num_chunks: int = 0
    completion_tokens: int = 0
    disconnected: bool = False
    abort_sent: bool = False
    exception: str | None = None
    refusable: str | None = None
    must_refuse: str | None = None


@dataclass(slots=True)
class AdminRecord:
    """One load, unload or abort call. `name`: the adapter, or the rid of an abort."""

    action: str
    name: str
    start_s: float
    end_s: float = 0.0
    status: int | None = None
    message: str = ""
    exception: str | None = None


def _refusal(code: int, message: str, must_contain: str | None) -> tuple[Outcome, str]:
    if 400 <= code < 500 and must_contain and must_contain in message:
        return Outcome.REFUSED, f"{code} naming {must_contain!r}"
    return Outcome.ERROR, f"unexpected {code}: {message[:200]}"


def classify(r: RequestRecord) -> tuple[Outcome, str]:
    """The outcome of one request and a short reason (an ERROR's reason goes into the report)."""
    if r.disconnected:
        return Outcome.DISCONNECTED, "closed by the client"
    if r.status is None:
        return Outcome.ERROR, f"no answer: {r.exception or 'unknown'}"
    if r.status >= 500:
        return Outcome.ERROR, f"HTTP {r.status}: {r.message[:200]}"
    allowed = r.must_refuse or r.refusable
    if r.status != 200:
        return _refusal(r.status, r.message, allowed)
    if r.stream_error_code is not None:  # SGLang reports errors inside a 200 stream
        return _refusal(r.stream_error_code, r.message, allowed)
    if r.must_refuse:
        return Outcome.ERROR, f"bad input accepted (expected a 4xx naming {r.must_refuse!r})"
    if r.exception:
        return Outcome.ERROR, f"broken answer: {r.exception}"
    if r.finish_type == "abort":
        if r.abort_sent:
            return Outcome.ABORTED, "aborted on request"
        if r.refusable:
            return _refusal(400, r.finish_message, r.refusable)
        return Outcome.ERROR, f"aborted by the server: {r.finish_message[:200]}"
    if r.finish_type is None:
        return Outcome.ERROR, "answer without a finish reason"
    return Outcome.OK, f"finished ({r.finish_type})"


def classify_admin(a: AdminRecord) -> tuple[Outcome, str]:
    """A load may find the adapter loaded (SGLang loads a known adapter again when a request names
    it) and an unload may find it gone: a 4xx naming the adapter is fine for both. An abort must
    answer 200."""
    if a.status is None:
        return Outcome.ERROR, f"{a.action}: no answer: {a.exception or 'unknown'}"
    if a.status == 200:
        return Outcome.OK, a.action
    if a.action in ("load", "unload") and 400 <= a.status < 500 and a.name in a.message:
        return Outcome.REFUSED, f"{a.action}: {a.status} naming {a.name!r}"
    return Outcome.ERROR, f"{a.action} {a.name}: HTTP {a.status}: {a.message[:200]}"


def overlaps_unload(records: list[RequestRecord], admin: list[AdminRecord]) -> int:
    """How many requests for an adapter were in flight while an unload of that adapter ran."""
    unloads = [(a.name, a.start_s, a.end_s) for a in admin if a.action == "unload"]
    return sum(
        1 for r in records for name, s, e in unloads
        if r.adapter == name and r.start_s < e and r.end_s > s
    )


def percentile(values: list[float], q: int) -> float | None:
    """The q-th percentile (1..99) by linear interpolation; None without values."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


@dataclass
class PhaseCheck:
    """The server once a phase's traffic drained. `memory`: the `/multilora/stats` memory entries
    (one per scheduler); `rss_bytes`: the server's process tree; `adapter_bytes` and
    `adapter_names`: summed and merged over schedulers."""

    idle: bool
    idle_wait_s: float
    alive: bool
    memory: list[dict] = field(default_factory=list)
    rss_bytes: int = 0
    rss_by_process: dict[str, int] = field(default_factory=dict)
    adapter_bytes: int = 0
    adapter_names: list[str] = field(default_factory=list)

    def accounting_ok(self) -> bool:
        """Every slot free or cached and none locked: no slot or lock leaked (once idle)."""
        return bool(self.memory) and all(
            m["free"] + m["cache_evictable"] == m["total"] and m["cache_protected"] == 0
            for m in self.memory
        )


def _by_outcome(counter: Counter) -> dict[str, int]:
    return {o.value: counter[o] for o in Outcome if counter[o]}


def summarize_phase(
    phase: int,
    duration_s: float,
    records: list[RequestRecord],
    admin: list[AdminRecord],
    check: PhaseCheck,
    max_reasons: int = 10,
    max_failed: int = 20,
) -> dict:
    """One phase as a JSON-ready dict: outcomes overall, by traffic kind and by stream/non-stream,
    admin outcomes, the most frequent failure reasons and the first failed records, latency of
    full answers, the check."""
    outcomes, by_kind, reasons = Counter(), {}, Counter()
    ok_latencies, failed = [], []
    for r in records:
        outcome, reason = classify(r)
        outcomes[outcome] += 1
        for key in (r.kind, "stream" if r.stream else "non-stream"):
            by_kind.setdefault(key, Counter())[outcome] += 1
        if outcome is Outcome.ERROR:
            reasons[f"{r.kind}: {reason}"] += 1
            failed.append(asdict(r))
        elif outcome is Outcome.OK:
            ok_latencies.append(r.end_s - r.start_s)
    admin_outcomes: dict[str, Counter] = {}
    for a in admin:
        outcome, reason = classify_admin(a)
        admin_outcomes.setdefault(a.action, Counter())[outcome] += 1
        if outcome is Outcome.ERROR:
            reasons[f"admin {reason}"] += 1
    failed += [asdict(a) for a in admin if classify_admin(a)[0] is Outcome.ERROR]
    num_admin_errors = sum(c[Outcome.ERROR] for c in admin_outcomes.values())
    return {
        "phase": phase,
        "duration_s": round(duration_s, 1),
        "num_requests": len(records),
        "outcomes": {o.value: outcomes[o] for o in Outcome},
        "by_kind": {k: _by_outcome(c) for k, c in sorted(by_kind.items())},
        "admin": {k: _by_outcome(c) for k, c in sorted(admin_outcomes.items())},
        "num_errors": outcomes[Outcome.ERROR] + num_admin_errors,
        "error_reasons": dict(reasons.most_common(max_reasons)),
        "failed": failed[:max_failed],  # the records themselves, for a reproduction
        "in_flight_during_unload": overlaps_unload(records, admin),
        "ok_latency_s": {"p50": percentile(ok_latencies, 50), "p95": percentile(ok_latencies, 95)},
        "check": {**asdict(check), "accounting_ok": check.accounting_ok()},
    }
