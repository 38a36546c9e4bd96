"""A small live run of every workload against one real CPU server (ours, with the bundled adapters).

The six workloads run at once against the same server (a handful of short requests each): the chatbot through the
one-command harness (default 3 repeats) with a second arm whose address answers nothing, the others through the
driver. Checks: every request completes with the planned output length, follow-up turns and aLoRA checks hit the
prefix cache, and the unreachable arm stops the run with its address while the results recorded so far (tagged
with their repeat) stay in the file.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from eval.live import harness
from eval.live.driver import Target, replay
from eval.workloads import create_workload
from sgl_multilora.server import free_port
from tests.conftest import ADAPTERS_DIR

pytestmark = pytest.mark.e2e

SMALL = {
    "translation": {
        "num_requests": 3,
        "num_adapters": 4,
        "length_scale": 0.02,
        "max_prompt_tokens": 48,
        "max_output_tokens": 2,
        "time_scale": 20.0,
    },
    "agent": {
        "num_sessions": 1,
        "num_adapters": 2,
        "min_turns": 2,
        "max_turns": 2,
        "scene_tokens": 16,
        "mean_new_tokens": 8.0,
        "mean_output_tokens": 1.0,
        "tool_time_s": 0.1,
    },
    "alora_pipeline": {
        "num_pipelines": 1,
        "checks_per_pipeline": 2,
        "mean_context_tokens": 24.0,
        "mean_answer_tokens": 4.0,
        "mean_followup_tokens": 6.0,
        "mean_continuation_tokens": 2.0,
        "check_delay_s": 0.1,
    },
    "heterogeneous": {
        "num_requests": 3,
        "num_adapters": 5,
        "length_scale": 0.02,
        "max_prompt_tokens": 48,
        "max_output_tokens": 2,
        "rate": 5.0,
    },
}
SERVED = ("caps", "check_caps")
CHATBOT = [
    "num_conversations=2",
    "num_adapters=3",
    "mean_turns=2",
    "mean_new_tokens=12",
    "mean_output_tokens=2",
    "system_tokens=8",
    "think_time_s=0.1",
    "conversation_rate=5",
]
TRACE = [
    {
        "arrival_s": 0.0,
        "adapter": None,
        "prompt": "What is the capital of France?",
        "output_tokens": 2,
    },
    {"arrival_s": 0.1, "adapter": "caps", "prompt_tokens": 20, "output_tokens": 2},
    {
        "arrival_s": 0.2,
        "adapter": "check_caps",
        "adapter_kind": "alora",
        "output_tokens": 1,
        "prompt": "Paris is the capital of France.<|im_end|>\n<|im_start|>check_caps\n",
    },
]


@pytest.fixture(scope="module")
def adapters_dir(tmp_path_factory):
    """The bundled adapters named in SERVED (links), with their manifest entries: the workloads are mapped onto
    these only, since each adapter's first request on a CPU server costs seconds."""
    root = tmp_path_factory.mktemp("adapters")
    manifest = json.loads((ADAPTERS_DIR / "manifest.json").read_text())
    manifest["adapters"] = [e for e in manifest["adapters"] if e["name"] in SERVED]
    (root / "manifest.json").write_text(json.dumps(manifest))
    for name in SERVED:
        (root / name).symlink_to(ADAPTERS_DIR / name, target_is_directory=True)
    return root


@pytest.fixture(scope="module")
def server(tree_server):
    """The session's `--radix-cache-backend multilora` server (the `ours` arm); it serves every bundled adapter and
    the workloads are mapped onto SERVED only."""
    return tree_server


def write_config(tmp_path, adapters_dir):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps({"adapters_dir": str(adapters_dir), "arms": {"ours": {}, "stock": {}}})
    )
    return path


def by_rid(path) -> dict[str, dict]:
    return {r["rid"]: r for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.filterwarnings("ignore:.*trace lengths capped")  # tiny lengths on purpose
def test_every_workload_runs_live(server, adapters_dir, tmp_path, capsys):
    trace_path = tmp_path / "user_trace.jsonl"
    trace_path.write_text("".join(json.dumps(x) + "\n" for x in TRACE))
    workloads = {
        name: create_workload(name, seed=2 if name == "alora_pipeline" else 1, **params)
        for name, params in SMALL.items()
    }
    workloads["trace"] = create_workload("trace", path=str(trace_path))
    workloads["chatbot"] = create_workload("chatbot", seed=3, **dict(p.split("=") for p in CHATBOT))
    served = harness.served_adapters(str(adapters_dir))
    assert [s.name for s in served] == list(SERVED)
    dead = f"http://127.0.0.1:{free_port()}"
    chat_dir = tmp_path / "chatbot"
    chat_args = ["--workload", "chatbot", "--seed", "3", "--arms", "ours,stock"]
    chat_args += ["--url", f"ours={server.url}", "--url", f"stock={dead}"]
    chat_args += ["--out-dir", str(chat_dir), "--timeout-s", "120", "--keep-cache"]  # other workloads share it
    chat_args += [
        "--config",
        str(write_config(tmp_path, adapters_dir)),
        "--served-adapters",
        "caps",
    ]
    chat_args += [x for p in CHATBOT for x in ("--param", p)]
    paths = {name: tmp_path / f"{name}.jsonl" for name in workloads}
    paths["chatbot"] = chat_dir / "results.jsonl"
    with ThreadPoolExecutor(max_workers=len(workloads)) as pool:
        chat = pool.submit(harness.main, chat_args)
        target = [Target("ours", server.url)]
        futures = [
            pool.submit(replay, w, target, paths[name], name, served, 1.0, 120.0)
            for name, w in workloads.items()
            if name != "chatbot"
        ]
        for f in futures:
            f.result()
        assert chat.result() == 1, "the unreachable stock arm makes the harness exit 1"

    assert f"cannot reach the server for arm 'stock' at {dead}" in capsys.readouterr().out
    assert (chat_dir / "report.md").is_file() and (chat_dir / "ttft_vs_rate_chatbot.png").is_file()
    # repeat 0 runs ours, then the dead stock arm stops the run before repeat 1: every record is of repeat 0
    chat_records = by_rid(paths["chatbot"]).values()
    assert {r["extra"]["repeat"] for r in chat_records} == {0}
    assert all(len(r["extra"]["load_avg"]) == 3 for r in chat_records)
    assert "- protocol: 3 repeats" in (chat_dir / "report.md").read_text()
    for name, w in workloads.items():
        results = by_rid(paths[name])
        assert set(results) == {r.rid for r in w.requests}, name
        assert {r["arm"] for r in results.values()} == {"ours"}  # the dead stock arm sent nothing
        for req in w.requests:
            res = results[req.rid]
            assert res["error"] is None, (name, req.rid, res["error"])
            # ignore_eos: exactly the planned output length
            assert res["output_tokens"] == req.output_tokens, (name, req.rid)
            assert 0 < res["ttft_s"] <= res["e2e_s"], (name, req.rid)
            if req.parent_rid is None and req.prompt_text is None and not req.alora_invocation:
                assert res["prompt_tokens"] == req.prompt_tokens, (name, req.rid)  # a token a word
            if req.parent_rid is not None:  # the parent's prompt + output are in the prefix cache
                parent = results[req.parent_rid]
                assert res["cached_tokens"] >= parent["prompt_tokens"] - 1, (name, res, parent)
            if req.alora_invocation:
                assert res["extra"]["served_adapter"] == "check_caps"
            else:
                assert res["extra"]["served_adapter"] in ("caps", None)
            # memory by kind, sampled from /multilora/stats when the request finished
            memory = res["extra"]["memory_bytes"]
            assert set(memory) == {"history KV", "active KV", "adapters"}, memory
            assert min(memory.values()) >= 0 and memory["adapters"] > 0, memory
    assert (chat_dir / "memory_chatbot_ours.png").is_file()
