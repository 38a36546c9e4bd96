"""`python -m sgl_multilora.cluster --lora-server-slots`: the LoRA server's slots given, or sized by InfiniLoRA's
planner from the workers' batch and the adapters' popularity (Zipf over the adapter directory, or a request trace),
and passed to the server as --max-slots; every malformed or incomplete request for a plan is refused by name."""

from __future__ import annotations

import json

import pytest

from sgl_multilora import planner
from sgl_multilora.gateway.cli import lora_server_args, parse_args


@pytest.fixture()
def adapter_dir(tmp_path):
    for i in range(64):
        (tmp_path / f"a{i:02d}").mkdir()
        (tmp_path / f"a{i:02d}" / "adapter_config.json").write_text("{}")
    (tmp_path / "not_an_adapter").mkdir()
    return tmp_path


WORKER = ["--model-path", "M", "--max-running-requests", "8"]


def cli(adapter_dir, *own, worker=WORKER):
    return parse_args(["--workers", "3", "--lora-server-adapter-dir", str(adapter_dir), *own, "--", *worker])[0]


def test_zipf_plan_is_the_planners_minimum_for_the_global_batch(adapter_dir):
    args = cli(adapter_dir, "--lora-server-slots", "zipf:1.2", "--lora-server-alpha", "0.9")
    expect = planner.min_cached_adapters(planner.zipf_popularity(64, 1.2), 3 * 8, 0.9)
    assert args.planned["slots"] == expect.min_cached_adapters and args.planned["adapters"] == 64
    assert args.planned["global_batch"] == 24 and args.planned["iar"] >= 0.9
    assert 1 <= args.planned["slots"] < 64  # a skewed popularity needs fewer slots than adapters
    assert lora_server_args(args)[-2:] == ["--max-slots", str(expect.min_cached_adapters)]
    looser = cli(adapter_dir, "--lora-server-slots", "zipf:1.2", "--lora-server-alpha", "0.5")
    assert looser.planned["slots"] <= args.planned["slots"]


def test_trace_plan_and_a_given_count(adapter_dir, tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"adapter": a}) + "\n" for a in ["x"] * 30 + ["y"] * 5 + ["z"] + [None] * 4))
    args = cli(adapter_dir, "--lora-server-slots", f"trace:{trace}", "--lora-server-arg=--eviction-policy",
               "--lora-server-arg=lru")
    p, _ = planner.trace_popularity(trace)
    assert args.planned["slots"] == planner.min_cached_adapters(p, 24, 0.95).min_cached_adapters
    assert args.planned["adapters"] == 3
    assert lora_server_args(args) == ["--eviction-policy", "lru", "--max-slots", str(args.planned["slots"])]
    fixed = cli(adapter_dir, "--lora-server-slots", "12")
    assert fixed.planned == {"slots": 12} and lora_server_args(fixed) == ["--max-slots", "12"]
    assert lora_server_args(cli(adapter_dir)) == []


@pytest.mark.parametrize("own, worker, message", [
    (["--lora-server-slots", "zipf:1.2"], ["--model-path", "M"], "--max-running-requests"),
    (["--lora-server-slots", "zipf:x"], WORKER, "expected zipf:S"),
    (["--lora-server-slots", "lfu:3"], WORKER, "expected N, zipf:S or trace:FILE"),
    (["--lora-server-slots", "0"], WORKER, "at least 1 slot"),
    (["--lora-server-slots", "4", "--lora-server-arg=--max-slots", "--lora-server-arg=9"], WORKER,
     "leave it out of --lora-server-arg"),
])
def test_bad_plans_are_refused_naming_the_problem(adapter_dir, capsys, own, worker, message):
    with pytest.raises(SystemExit):
        cli(adapter_dir, *own, worker=worker)
    assert message in capsys.readouterr().err


def test_slots_need_a_lora_server_and_an_adapter(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--workers", "2", "--lora-server-slots", "4", "--", *WORKER])
    assert "pass that too" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli(tmp_path, "--lora-server-slots", "zipf:1.1")
    assert "holds no adapter" in capsys.readouterr().err
