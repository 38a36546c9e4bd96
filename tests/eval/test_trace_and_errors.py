"""Bad input gets a clear error: malformed trace lines name their line; an unreachable server names its address."""

from __future__ import annotations

import json

import pytest

from eval.live.driver import ServedAdapter, ServerUnreachable, Target, replay
from eval.workloads import TraceError, create_workload
from sgl_multilora.server import free_port

GOOD = [
    {
        "arrival_s": 0.0,
        "adapter": None,
        "prompt": "What is the capital of France?",
        "output_tokens": 4,
    },
    {
        "arrival_s": 0.5,
        "adapter": "caps",
        "prompt_tokens": 40,
        "output_tokens": 3,
        "adapter_rank": 8,
    },
    {
        "arrival_s": 0.5,
        "adapter": "check_caps",
        "prompt_tokens": 20,
        "output_tokens": 1,
        "adapter_kind": "alora",
        "rid": "judge",
    },
]


def write(tmp_path, lines: list) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return str(path)


def test_trace_replay_reads_every_field(tmp_path):
    w = create_workload("trace", path=write(tmp_path, ["# a comment", *GOOD, ""]))
    assert [r.rid for r in w.requests] == ["line2", "line3", "judge"]
    base, caps, judge = w.requests
    assert (
        base.prompt_text == GOOD[0]["prompt"] and base.adapter is None and base.output_tokens == 4
    )
    assert caps.new_tokens == 40 and caps.prompt_text is None and caps.arrival_s == 0.5
    assert judge.alora_invocation and judge.tags["kind"] == "alora"
    assert {(a.name, a.rank, a.kind) for a in w.adapters} == {
        ("caps", 8, "lora"),
        ("check_caps", 16, "alora"),
    }


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{not json", r"trace.jsonl:3: not valid JSON"),
        (
            {"adapter": None, "prompt_tokens": 4, "output_tokens": 2},
            r"trace.jsonl:3: missing field 'arrival_s'",
        ),
        (
            {
                "arrival_s": 1,
                "adapter": None,
                "prompt": "hi",
                "prompt_tokens": 4,
                "output_tokens": 2,
            },
            r"trace.jsonl:3: give exactly one of 'prompt'",
        ),
        (
            {"arrival_s": 1, "adapter": None, "output_tokens": 2},
            r"trace.jsonl:3: give exactly one of 'prompt'",
        ),
        (
            {"arrival_s": -1, "adapter": None, "prompt_tokens": 4, "output_tokens": 2},
            r"trace.jsonl:3: arrival_s must",
        ),
        (
            {"arrival_s": 0.2, "adapter": None, "prompt_tokens": 4, "output_tokens": 2},
            r"trace.jsonl:3: arrival_s 0.2 is",
        ),
        (
            {"arrival_s": 1, "adapter": None, "prompt_tokens": 0, "output_tokens": 2},
            r"trace.jsonl:3: prompt_tokens must",
        ),
        (
            {"arrival_s": 1, "adapter": 7, "prompt_tokens": 4, "output_tokens": 2},
            r"trace.jsonl:3: adapter must",
        ),
        (
            {"arrival_s": 1, "adapter": "caps", "prompt_tokens": 4, "output_tokens": 2.5},
            r"trace.jsonl:3: output_tokens",
        ),
        (
            {"arrival_s": 1, "adapter": "caps", "prompt_tokens": 4, "output_tokens": 2, "rank": 8},
            r"trace.jsonl:3: unknown field\(s\) \['rank'\]",
        ),
        (
            {
                "arrival_s": 1,
                "adapter": "caps",
                "prompt_tokens": 4,
                "output_tokens": 2,
                "adapter_rank": 16,
            },
            r"trace.jsonl:3: adapter 'caps' was given another rank",
        ),
        ([1, 2], r"trace.jsonl:3: expected a JSON object"),
    ],
)
def test_malformed_trace_line_names_the_line(tmp_path, bad, message):
    with pytest.raises(TraceError, match=message):
        create_workload("trace", path=write(tmp_path, [GOOD[0], GOOD[1], bad]))


def test_missing_or_empty_trace_file(tmp_path):
    with pytest.raises(TraceError, match="no such trace file"):
        create_workload("trace", path=str(tmp_path / "absent.jsonl"))
    with pytest.raises(TraceError, match="has no requests"):
        create_workload("trace", path=write(tmp_path, ["# nothing"]))


def test_unreachable_server_names_its_address(tmp_path):
    w = create_workload("trace", path=write(tmp_path, GOOD[:2]))
    url = f"http://127.0.0.1:{free_port()}"
    out = tmp_path / "results.jsonl"
    with pytest.raises(ServerUnreachable, match=f"arm 'stock' at {url}"):
        replay(w, [Target("stock", url)], out, "trace", [ServedAdapter("caps")], time_scale=1.0)
    assert not out.exists() or out.read_text() == ""


def test_adapter_kinds_the_server_lacks_are_named(tmp_path):
    w = create_workload("trace", path=write(tmp_path, GOOD))
    with pytest.raises(
        ValueError, match="alora adapter 'check_caps' but the server has no alora adapter"
    ):
        replay(
            w,
            [Target("ours", "http://127.0.0.1:1")],
            tmp_path / "r.jsonl",
            "trace",
            [ServedAdapter("caps")],
        )
