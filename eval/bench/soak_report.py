"""Soak benchmark verdicts and report: pass/fail per criterion from the phase summaries, the
RSS-flat rule, the console line per phase and the Markdown summary. Pure functions of the data.
Not here: running traffic or reading the server (soak.py, soak_traffic.py, soak_churn.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from eval.bench.soak_outcomes import Outcome

MIB = 1024 * 1024
# RSS may grow after warm-up by 5% or 50 MiB, whichever is larger.
# Not zero: a CPU server's resident set drifts with glibc's malloc arenas and torch's CPU allocator,
# which keep freed blocks and grow to the largest batch seen so far; tens of MiB between phases
# say nothing about a leak. Not more: the leaks a soak is for are bigger. The KV pool is
# preallocated (a slot leak shows in the accounting, not in RSS), so RSS catches host-side leaks:
# one kept copy per adapter load is 1.3 to 39 MB here (fp32), at several loads a minute; a few KB
# kept per request is tens of MB over thousands of requests. 5% scales the bound to bigger models
# without letting a slow leak of a small server pass.
RSS_TOLERANCE_FRACTION = 0.05
RSS_TOLERANCE_BYTES = 50 * MIB

# What a soak must have exercised to mean anything: kind -> an outcome it must have had once.
REQUIRED_COVERAGE = {
    "base": Outcome.OK, "lora": Outcome.OK, "alora": Outcome.OK, "churn": Outcome.OK,
    "stream": Outcome.OK, "non-stream": Outcome.OK, "disconnect": Outcome.DISCONNECTED,
    "abort": Outcome.ABORTED, "bad_input": Outcome.REFUSED,
}
REQUIRED_ADMIN = ("load", "unload", "abort")


@dataclass(frozen=True)
class RssVerdict:
    warmup_bytes: int
    final_bytes: int
    max_bytes: int
    tolerance_bytes: int

    @property
    def growth_bytes(self) -> int:
        return self.final_bytes - self.warmup_bytes

    @property
    def ok(self) -> bool:
        return self.growth_bytes <= self.tolerance_bytes


def rss_verdict(rss_by_phase: list[int]) -> RssVerdict:
    """RSS at the end of phase 1 (the warm-up) against the end of the last phase."""
    if not rss_by_phase:
        raise ValueError("rss_verdict needs the RSS of at least one phase")
    warmup = rss_by_phase[0]
    tolerance = max(int(RSS_TOLERANCE_FRACTION * warmup), RSS_TOLERANCE_BYTES)
    return RssVerdict(warmup, rss_by_phase[-1], max(rss_by_phase), tolerance)


@dataclass(frozen=True)
class Criterion:
    name: str
    ok: bool
    detail: str


def _per_phase(name: str, phases: list[dict], failed: Callable[[dict], bool], what: str
               ) -> Criterion:
    bad = [p["phase"] for p in phases if failed(p)]
    if not phases:
        return Criterion(name, False, "no phase ran")
    return Criterion(name, not bad, f"{what} after phases {bad}" if bad
                     else f"held after all {len(phases)} phases")


def coverage_gaps(phases: list[dict]) -> list[str]:
    """Traffic kinds and admin actions that never had their intended outcome during the run."""
    gaps = []
    for kind, outcome in REQUIRED_COVERAGE.items():
        if not any(p["by_kind"].get(kind, {}).get(outcome.value) for p in phases):
            gaps.append(f"{kind} never {outcome.value}")
    for action in REQUIRED_ADMIN:
        if not any(p["admin"].get(action, {}).get(Outcome.OK.value) for p in phases):
            gaps.append(f"{action} never succeeded")
    return gaps


def _adapters_changed(p: dict, baseline: dict) -> bool:
    check = p["check"]
    return (check["adapter_bytes"] != baseline["adapter_bytes"]
            or sorted(check["adapter_names"]) != sorted(baseline["adapter_names"]))


def _rss_criterion(phases: list[dict]) -> Criterion:
    name = "RSS flat after warm-up"
    if len(phases) < 2:
        return Criterion(name, False, "needs at least two phases")
    v = rss_verdict([p["check"]["rss_bytes"] for p in phases])
    return Criterion(name, v.ok, (
        f"{v.growth_bytes / MIB:+.1f} MiB from the end of phase 1 ({v.warmup_bytes / MIB:.1f} "
        f"MiB) to the end ({v.final_bytes / MIB:.1f} MiB; max {v.max_bytes / MIB:.1f} MiB); "
        f"tolerance {v.tolerance_bytes / MIB:.1f} MiB = max({RSS_TOLERANCE_FRACTION:.0%}, "
        f"{RSS_TOLERANCE_BYTES // MIB} MiB)"))


def criteria(phases: list[dict], baseline: dict, stopped_early: str | None = None
             ) -> list[Criterion]:
    """Pass/fail per criterion. `baseline`: {"adapter_bytes", "adapter_names"} before traffic;
    `stopped_early`: why the run ended before its last phase, if it did."""
    num_requests = sum(p["num_requests"] for p in phases)
    num_errors = sum(p["num_errors"] for p in phases)
    gaps = coverage_gaps(phases)
    overlaps = sum(p["in_flight_during_unload"] for p in phases)
    return [
        Criterion("ran every phase", stopped_early is None and bool(phases),
                  stopped_early or f"{len(phases)} phases, {num_requests} requests"),
        Criterion("no failed request or admin call", num_errors == 0,
                  f"{num_errors} failures (5xx, timeout, no connection, unclear 4xx)"
                  if num_errors else f"0 failures in {num_requests} requests"),
        _per_phase("server alive", phases, lambda p: not p["check"]["alive"], "not alive"),
        _per_phase("idle after each phase", phases, lambda p: not p["check"]["idle"],
                   "requests still running or waiting"),
        _per_phase("KV accounting closes (free + evictable == total, protected == 0)", phases,
                   lambda p: not p["check"]["accounting_ok"], "open"),
        _per_phase("adapter memory back to its start", phases,
                   lambda p: _adapters_changed(p, baseline),
                   f"not {baseline['adapter_bytes']} bytes in "
                   f"{len(baseline['adapter_names'])} adapters"),
        _rss_criterion(phases),
        Criterion("every traffic kind exercised", not gaps, "; ".join(gaps) if gaps else
                  f"all; {overlaps} requests in flight during an unload of their adapter"),
    ]


def _mib(num_bytes: int | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / MIB:.1f}"


def _sec(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def progress_line(p: dict, num_phases: int) -> str:
    """One console line per phase: outcomes, RSS, adapter bytes, accounting, idle, alive."""
    c = p["check"]
    counts = " ".join(f"{k} {v}" for k, v in p["outcomes"].items())
    return (f"phase {p['phase']}/{num_phases} ({p['duration_s']:.0f} s): {counts} | RSS "
            f"{_mib(c['rss_bytes'])} MiB | adapters {_mib(c['adapter_bytes'])} MiB | "
            f"accounting {'OK' if c['accounting_ok'] else 'OPEN'} | "
            f"idle {'yes' if c['idle'] else 'NO'} | alive {'yes' if c['alive'] else 'NO'}")


def _phase_row(p: dict) -> str:
    c, mem = p["check"], p["check"]["memory"]
    slots = ", ".join(f"{m['free'] + m['cache_evictable']} / {m['total']}" for m in mem) or "-"
    protected = ", ".join(str(m["cache_protected"]) for m in mem) or "-"
    counts = " | ".join(str(v) for v in p["outcomes"].values())
    latency = p["ok_latency_s"]
    return (f"| {p['phase']} | {p['duration_s']:.0f} | {counts} | {_sec(latency['p50'])} | "
            f"{_sec(latency['p95'])} | {c['idle_wait_s']:.1f} | {slots} | {protected} | "
            f"{_mib(c['rss_bytes'])} | {_mib(c['adapter_bytes'])} |")


def _kind_rows(phases: list[dict]) -> list[str]:
    rows = []
    for key, label in (("by_kind", ""), ("admin", "admin ")):
        for kind in sorted({k for p in phases for k in p[key]}):
            counts = [sum(p[key].get(kind, {}).get(o.value, 0) for p in phases) for o in Outcome]
            rows.append(f"| {label}{kind} | " + " | ".join(map(str, counts)) + " |")
    return rows


def render_markdown(run: dict, phases: list[dict], verdicts: list[Criterion]) -> str:
    """The summary: machine, date, command, the verdict per criterion, per-phase and per-kind
    tables, and every failure reason."""
    failed = [c.name for c in verdicts if not c.ok]
    machine = run["machine"]
    outcome_cols = " | ".join(o.value for o in Outcome)
    lines = [
        "# Soak benchmark", "",
        f"Command: `{run['command']}`", "",
        (f"Date {run['date']}; {machine['nproc']} CPU cores, load average "
         f"{machine['loadavg_start']} at the start and {machine['loadavg_end']} at the end; "
         f"{run['server']}."), "",
        f"**{'PASS' if not failed else 'FAIL'}**: " + (
            f"all {len(verdicts)} criteria held." if not failed
            else f"{len(failed)} of {len(verdicts)} criteria failed: {', '.join(failed)}."), "",
        "| criterion | result | detail |", "|---|---|---|",
        *[f"| {c.name} | {'pass' if c.ok else 'FAIL'} | {c.detail} |" for c in verdicts], "",
        "## Phases", "",
        ("Phase 1 is the warm-up. After each phase's traffic drained: wait until no request "
         "runs or waits, unload leftover adapter copies, then read `/multilora/stats` and the RSS "
         "of the server's process tree (summed over its processes, so pages they share count "
         "once per process: compare phases, not the absolute figure). s: traffic, drain and "
         "check. Latency: end to end, full answers only."), "",
        (f"| phase | s | {outcome_cols} | ok p50 s | ok p95 s | idle wait s "
         "| free + evictable / total | protected | RSS MiB | adapters MiB |"),
        "|---:|---:|" + "---:|" * len(Outcome) + "---:|" * 7,
        *[_phase_row(p) for p in phases], "",
        "## Traffic by kind (all phases)", "",
        f"| kind | {outcome_cols} |", "|---|" + "---:|" * len(Outcome),
        *_kind_rows(phases),
    ]
    reasons: dict[str, int] = {}
    for p in phases:
        for reason, n in p["error_reasons"].items():
            reasons[reason] = reasons.get(reason, 0) + n
    if reasons:
        lines += ["", "## Failures", "", *[f"- {n} x {r}" for r, n in reasons.items()]]
    return "\n".join(lines) + "\n"
