"""Soak benchmark, the parts that need no server: outcome classification, the phase summary, the
RSS-flat verdict, the criteria and the Markdown report on synthetic records; the job mix and the
adapter churn with a stand-in tokenizer and client."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

from eval.bench.soak_churn import Churn
from eval.bench.soak_outcomes import (
    AdminRecord,
    Outcome,
    PhaseCheck,
    RequestRecord,
    classify,
    classify_admin,
    summarize_phase,
)
from eval.bench.soak_report import (
    MIB,
    criteria,
    progress_line,
    render_markdown,
    rss_verdict,
)
from eval.bench.soak_traffic import MIX, Adapter, Planner, Prompts, find_adapters

CHURNED = "churn-caps-00003"


def req(kind="base", **fields) -> RequestRecord:
    defaults = {"adapter": None, "stream": False, "rid": "r", "start_s": 0.0, "end_s": 1.0,
                "status": 200, "finish_type": "length"}
    return RequestRecord(kind, **{**defaults, **fields})


@pytest.mark.parametrize("record, outcome", [
    (req(), Outcome.OK),
    (req(stream=True, num_chunks=5, finish_type="stop"), Outcome.OK),
    # load/unload churn: a 400 naming the adapter is allowed, naming something else is not
    (req("churn", refusable=CHURNED, status=400, finish_type=None,
         message=f"Failed to implicitly load LoRA adapter {CHURNED}: gone"), Outcome.REFUSED),
    (req("churn", refusable=CHURNED, status=400, finish_type=None, message="bad request"),
     Outcome.ERROR),
    (req("churn", refusable=CHURNED, stream=True, stream_error_code=400, finish_type=None,
         message=f"not loaded: {CHURNED}"), Outcome.REFUSED),
    (req("churn", refusable=CHURNED, status=500, message=CHURNED), Outcome.ERROR),
    # the same 400 on a request that should have been served is a failure
    (req("lora", adapter="caps", status=400, finish_type=None, message="caps"), Outcome.ERROR),
    # bad inputs must be refused, with the expected words
    (req("bad_input", must_refuse="no-such", status=400, message="never been loaded: no-such"),
     Outcome.REFUSED),
    (req("bad_input", must_refuse="no-such", status=200), Outcome.ERROR),
    (req("bad_input", must_refuse="empty", stream=True, stream_error_code=400, finish_type=None,
         message="The input is empty"), Outcome.REFUSED),
    (req("bad_input", must_refuse="empty", status=422, message="field required"), Outcome.ERROR),
    (req("disconnect", stream=True, disconnected=True, finish_type=None), Outcome.DISCONNECTED),
    (req("abort", abort_sent=True, finish_type="abort"), Outcome.ABORTED),
    (req("abort", abort_sent=True, finish_type="length"), Outcome.OK),  # finished first
    (req("abort", finish_type="abort", finish_message="Aborted"), Outcome.ERROR),  # not by us
    (req(status=None, finish_type=None, exception="ReadTimeout"), Outcome.ERROR),
    (req(status=None, finish_type=None, exception="ConnectionError"), Outcome.ERROR),
    (req(status=503, message="overloaded"), Outcome.ERROR),
    (req(stream=True, finish_type=None, exception="stream ended without [DONE]"), Outcome.ERROR),
    (req(finish_type=None), Outcome.ERROR),
])
def test_classify(record, outcome):
    assert classify(record)[0] is outcome, classify(record)


def test_classify_admin():
    def admin(action, status, message="", exception=None):
        return AdminRecord(action, CHURNED, 0.0, 1.0, status, message, exception)

    assert classify_admin(admin("load", 200))[0] is Outcome.OK
    assert classify_admin(admin("load", 400, f"{CHURNED} already loaded"))[0] is Outcome.REFUSED
    assert classify_admin(admin("unload", 400, "unknown"))[0] is Outcome.ERROR
    assert classify_admin(admin("unload", 500, CHURNED))[0] is Outcome.ERROR
    assert classify_admin(admin("abort", 400, CHURNED))[0] is Outcome.ERROR
    assert classify_admin(admin("load", None, exception="ReadTimeout"))[0] is Outcome.ERROR


def memory(free=3000, evictable=1096, protected=0, running=0) -> dict:
    return {"total": 4096, "free": free, "cache_evictable": evictable,
            "cache_protected": protected, "running": running, "waiting": 0}


def check(rss_mib=3000.0, **mem) -> PhaseCheck:
    return PhaseCheck(idle=True, idle_wait_s=0.5, alive=True, memory=[memory(**mem)],
                      rss_bytes=int(rss_mib * MIB), adapter_bytes=70, adapter_names=["a", "b"])


def full_traffic() -> tuple[list[RequestRecord], list[AdminRecord]]:
    """One request of each kind with its intended outcome, a churn request across an unload."""
    records = [
        req("base"), req("lora", adapter="caps", stream=True),
        req("alora", adapter="check_caps"),
        req("churn", adapter=CHURNED, refusable=CHURNED, start_s=2.0, end_s=6.0),
        req("churn", adapter=CHURNED, refusable=CHURNED, status=400, finish_type=None,
            message=f"not loaded: {CHURNED}", start_s=7.0, end_s=7.1),
        req("disconnect", stream=True, disconnected=True, finish_type=None),
        req("abort", abort_sent=True, finish_type="abort"),
        req("bad_input", must_refuse="empty", status=400, message="input is empty"),
    ]
    admin = [AdminRecord("load", CHURNED, 1.0, 1.5, 200),
             AdminRecord("unload", CHURNED, 5.0, 5.5, 200),
             AdminRecord("abort", "r", 0.3, 0.4, 200)]
    return records, admin


def test_summarize_phase_counts_outcomes_kinds_and_overlaps():
    records, admin = full_traffic()
    records.append(req("lora", adapter="json", status=None, finish_type=None,
                       exception="ReadTimeout", rid="slow"))
    summary = summarize_phase(2, 61.0, records, admin, check())
    assert summary["outcomes"] == {"ok": 4, "refused": 2, "disconnected": 1, "aborted": 1,
                                   "error": 1}
    assert summary["by_kind"]["churn"] == {"ok": 1, "refused": 1}
    assert summary["by_kind"]["stream"] == {"ok": 1, "disconnected": 1}
    assert summary["admin"] == {"abort": {"ok": 1}, "load": {"ok": 1}, "unload": {"ok": 1}}
    assert summary["num_errors"] == 1
    assert summary["error_reasons"] == {"lora: no answer: ReadTimeout": 1}
    assert [f["rid"] for f in summary["failed"]] == ["slow"]
    assert summary["in_flight_during_unload"] == 1  # the churn request from 2.0 s to 6.0 s
    assert summary["ok_latency_s"]["p50"] == pytest.approx(1.0)
    assert summary["check"]["accounting_ok"] is True
    json.dumps(summary)  # a JSON line as it is


@pytest.mark.parametrize("mem, ok", [
    ({}, True),
    ({"free": 2990}, False),  # 10 slots neither free nor cached: leaked
    ({"evictable": 1086, "protected": 10}, False),  # a lock never released
])
def test_accounting_check(mem, ok):
    assert check(**mem).accounting_ok() is ok


def test_rss_verdict_tolerance_is_5_percent_or_50_mib():
    small = rss_verdict([int(400 * MIB), int(460 * MIB), int(440 * MIB)])
    assert small.tolerance_bytes == 50 * MIB and small.growth_bytes == 40 * MIB and small.ok
    assert small.max_bytes == 460 * MIB
    assert not rss_verdict([400 * MIB, 451 * MIB]).ok
    big = rss_verdict([3000 * MIB, 3140 * MIB])
    assert big.tolerance_bytes == 150 * MIB and big.ok
    assert not rss_verdict([3000 * MIB, 3151 * MIB]).ok
    assert rss_verdict([3000 * MIB, 2900 * MIB]).ok  # shrinking is fine
    with pytest.raises(ValueError):
        rss_verdict([])


def phases(rss_mib: list[float], **check_fields) -> list[dict]:
    records, admin = full_traffic()
    return [summarize_phase(i + 1, 60.0, records, admin, check(rss, **check_fields))
            for i, rss in enumerate(rss_mib)]


BASELINE = {"adapter_bytes": 70, "adapter_names": ["a", "b"]}


def verdicts_by_name(ps, **kw) -> dict[str, bool]:
    return {c.name: c.ok for c in criteria(ps, BASELINE, **kw)}


def test_criteria_all_pass_on_a_clean_run():
    assert all(verdicts_by_name(phases([3000, 3010, 3020])).values())


def test_criteria_name_what_failed():
    leaky = phases([3000, 3100, 3200])
    assert not verdicts_by_name(leaky)["RSS flat after warm-up"]
    open_slots = phases([3000, 3000], free=2000)
    assert verdicts_by_name(open_slots) == {
        **verdicts_by_name(phases([3000, 3000])),
        "KV accounting closes (free + evictable == total, protected == 0)": False}
    ps = phases([3000, 3000])
    ps[1]["check"]["adapter_names"] = ["a", "b", CHURNED]
    assert not verdicts_by_name(ps)["adapter memory back to its start"]
    assert not verdicts_by_name(phases([3000]))["RSS flat after warm-up"]  # needs 2 phases
    assert not verdicts_by_name(ps, stopped_early="down after phase 1")["ran every phase"]


def test_coverage_needs_every_kind():
    records, admin = full_traffic()
    no_abort = [r for r in records if r.kind != "abort"]
    ps = [summarize_phase(i, 60.0, no_abort, admin, check()) for i in (1, 2)]
    gaps = next(c for c in criteria(ps, BASELINE) if c.name == "every traffic kind exercised")
    assert not gaps.ok and gaps.detail == "abort never aborted"


def run_info() -> dict:
    return {"command": ".venv/bin/python -m eval.bench.soak --minutes 2", "date": "2026-11-24",
            "machine": {"nproc": 2, "loadavg_start": [1.0, 1.0, 1.0],
                        "loadavg_end": [2.0, 1.5, 1.0]},
            "server": "server started by the benchmark"}


def test_report_states_the_verdict_from_the_data():
    ps = phases([3000, 3010])
    text = render_markdown(run_info(), ps, criteria(ps, BASELINE))
    assert "**PASS**: all 8 criteria held." in text
    assert "--minutes 2" in text and "2 CPU cores" in text and "2026-11-24" in text
    assert "| 2 | 60 | 4 | 2 | 1 | 1 | 0 |" in text  # phase 2's outcomes
    assert "## Failures" not in text

    ps = phases([3000, 3200], free=100)
    ps[0]["error_reasons"] = {"lora: HTTP 500: boom": 2}
    text = render_markdown(run_info(), ps, criteria(ps, BASELINE))
    assert "**FAIL**: 2 of 8 criteria failed: KV accounting closes" in text
    assert "RSS flat after warm-up | FAIL | +200.0 MiB" in text
    assert "- 2 x lora: HTTP 500: boom" in text


def test_progress_line():
    line = progress_line(phases([3000])[0], 10)
    assert line.startswith("phase 1/10 (60 s): ok 4 refused 2 disconnected 1 aborted 1 error 0")
    assert "RSS 3000.0 MiB" in line and "accounting OK" in line and "alive yes" in line


class FakeTokenizer:
    """Chat template and tokenizer stand-in: one id per character."""

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True,
                            return_dict=False):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        text += "<assistant>" if add_generation_prompt else ""
        return [ord(c) for c in text] if tokenize else text

    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[ord(c) for c in text])


def bundled(tmp_path) -> list[Adapter]:
    for name, config in (("caps", {"r": 8}),
                         ("check_caps", {"r": 8, "alora_invocation_tokens": [1, 5875, 79]})):
        (tmp_path / "adapters" / name).mkdir(parents=True)
        (tmp_path / "adapters" / name / "adapter_config.json").write_text(json.dumps(config))
    return find_adapters(tmp_path / "adapters")


def test_planner_covers_every_kind_first_and_builds_valid_jobs(tmp_path):
    adapters = bundled(tmp_path)
    assert [(a.name, a.is_alora) for a in adapters] == [("caps", False), ("check_caps", True)]
    planner = Planner(Prompts(FakeTokenizer()), adapters,
                      lambda: [(CHURNED, adapters[0])], seed=1)
    planner.start_phase()
    first = [planner.next() for _ in MIX]
    assert sorted(j.kind for j in first) == sorted(MIX)
    assert [j.kind for j in first[:2]] == ["bad_input", "abort"]
    jobs = first + [planner.next() for _ in range(300)]
    for job in jobs:
        ids = job.body["input_ids"]
        if job.kind == "alora":  # an aLoRA prompt ends with the adapter's invocation tokens
            assert job.adapter == "check_caps" and ids[-3:] == [1, 5875, 79]
        if job.kind == "churn":
            assert job.adapter == job.refusable == CHURNED
        if job.kind == "disconnect":
            assert job.stream and job.disconnect_after_chunks
        if job.kind == "abort":
            assert job.abort_after_s is not None
    bad = [j for j in jobs if j.kind == "bad_input"]
    assert {j.must_refuse for j in bad} >= {"check_caps", "max_new_tokens", "empty"}
    assert any(j.must_refuse.startswith("no-such-adapter-") for j in bad)
    missing = next(j for j in bad if j.must_refuse == "check_caps")
    assert missing.body["input_ids"][-3:] != [1, 5875, 79]


class FakeClient:
    def __init__(self):
        self.admin: list[AdminRecord] = []

    def post_admin(self, action, name, path, body) -> AdminRecord:
        self.admin.append(AdminRecord(action, name, 0.0, 0.0, 200))
        return self.admin[-1]


def test_churn_cycle_loads_unloads_and_keeps_recent_targets(tmp_path):
    adapters = bundled(tmp_path)
    client = FakeClient()
    workdir = tmp_path / "copies"
    workdir.mkdir()
    churn = Churn(client, adapters, workdir, seed=0, hold_s=(0, 0), grace_s=(0, 0))
    stop = threading.Event()
    churn.cycle(stop)
    churn.cycle(stop)
    names = [a.name for a in client.admin if a.action == "load"]
    assert [a.action for a in client.admin] == ["load", "unload"] * 2
    assert all(n.startswith("churn-") and n[-6:-5] == "-" and n[-5:].isdigit() for n in names)
    assert [n for n, _ in churn.targets()] == names  # none loaded: the last ones unloaded
    assert (workdir / names[0]).exists() and not (workdir / names[1]).exists()  # every other
    churn.cleanup([names[0], "caps"])  # a request loaded names[0] again; "caps" is bundled
    assert [(a.action, a.name) for a in client.admin[4:]] == [("unload", names[0])]
    assert churn.targets() == [] and list(workdir.iterdir()) == []


def test_adapter_state_names_host_copies_when_the_unified_pool_holds_the_weights():
    """With the unified pool `/multilora/stats` lists loaded adapters under `host` (the copies residency loads from)
    and none under `weights`: a churned copy left loaded must still be named, or the phase's cleanup misses it."""
    from eval.bench.soak import adapter_state

    unified = [{"adapters": {"weights": {}, "host": {"caps": 100, "churn-1-caps": 100}, "slot_buffers": 0,
                             "total": 200}}]
    stock = [{"adapters": {"weights": {"caps": 100}, "host": {"caps": 0}, "slot_buffers": 0, "total": 100}}]
    assert adapter_state(unified) == (200, ["caps", "churn-1-caps"])
    assert adapter_state(stock) == (100, ["caps"])
