"""The --multilora-* flags: parsing, bad values, and how they reach spawned processes."""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing

import pytest

from sgl_multilora.patches import flags


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sglang serve")
    p.add_argument("--model-path")
    flags.add_cli_args(p)
    return p


def test_defaults_and_values(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "adapter_config.json").write_text("{}")
    ns = parser().parse_args(["--model-path", "m", "--multilora-lora-compute", "sglang",
                              "--multilora-adapter-dir", str(tmp_path)])
    ours = flags.pop_from_namespace(ns)
    assert ours.lora_compute == "sglang" and ours.adapter_dir == str(tmp_path)
    assert not any(name.startswith("multilora_") for name in vars(ns))  # SGLang never sees them
    assert flags.pop_from_namespace(parser().parse_args([])) == flags.MultiLoRAArgs()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--multilora-lora-compute", "fast"], "invalid choice: 'fast'"),
        (["--multilora-adapter-dir", "/no/such/dir"], "is not a directory"),
        (["--multilora-memory", "shared"], "invalid choice: 'shared'"),
        (["--multilora-eviction-policy", "fifo"], "invalid choice: 'fifo'"),
        (["--multilora-idle-watermark", "1.5"], "is not a number between 0 and 1"),
        (["--multilora-swap-interval-ms", "0"], "is not a positive number"),
        (["--multilora-slot-squash-share", "-0.1"], "is not a number between 0 and 1"),
        (["--multilora-max-slot-squashes", "-1"], "is not a non-negative integer"),
        (["--multilora-max-slot-squashes", "1.5"], "is not a non-negative integer"),
    ],
)
def test_bad_values_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        parser().parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and argv[0] in err


def test_adapter_dir_without_adapters(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["--multilora-adapter-dir", str(tmp_path)])
    assert "holds no adapter" in capsys.readouterr().err


def _child(queue):
    queue.put(flags.current())


def test_exported_flags_reach_spawned_processes(monkeypatch):
    monkeypatch.delenv(flags.ENV_VAR, raising=False)
    flags.export(flags.MultiLoRAArgs(lora_compute="sglang"))
    try:
        ctx = multiprocessing.get_context("spawn")  # as SGLang starts its scheduler and detokenizer
        queue = ctx.Queue()
        child = ctx.Process(target=_child, args=(queue,))
        child.start()
        got = queue.get(timeout=60)
        child.join(timeout=60)
        assert got == flags.MultiLoRAArgs(lora_compute="sglang")
    finally:
        monkeypatch.delenv(flags.ENV_VAR, raising=False)
        assert flags.current() == flags.MultiLoRAArgs()  # defaults again once the variable is gone


def test_memory_flags(monkeypatch):
    ns = parser().parse_args(["--multilora-memory", "separate", "--multilora-eviction-policy", "lru",
                              "--multilora-idle-watermark", "0.5", "--multilora-swap-interval-ms", "20"])
    ours = flags.pop_from_namespace(ns)
    assert (ours.memory, ours.eviction_policy, ours.idle_watermark, ours.swap_interval_ms) == (
        "separate", "lru", 0.5, 20.0)
    ns = parser().parse_args(["--multilora-scheduler", "multiqueue", "--multilora-slot-squash-share", "0.25"])
    assert flags.pop_from_namespace(ns).slot_squash_share == 0.25
    ns = parser().parse_args(["--multilora-scheduler", "multiqueue", "--multilora-max-slot-squashes", "0"])
    assert flags.pop_from_namespace(ns).max_slot_squashes == 0
    assert flags.MultiLoRAArgs().memory_hold_share == 0.5
    ns = parser().parse_args(["--multilora-scheduler", "multiqueue", "--multilora-memory-hold-share", "0"])
    assert flags.pop_from_namespace(ns).memory_hold_share == 0.0
    with pytest.raises(SystemExit):
        parser().parse_args(["--multilora-memory-hold-share", "-0.5"])
    assert not flags.MultiLoRAArgs().disable_kv_moves  # KV moves to free a run for an adapter by default
    assert flags.pop_from_namespace(parser().parse_args(["--multilora-disable-kv-moves"])).disable_kv_moves
    # the unified pool needs the tree backend (set at parse time) and `unified`
    for radix_backend, memory, expected in [(True, "unified", True), (False, "unified", False),
                                            (True, "separate", False)]:
        args = dataclasses.replace(flags.MultiLoRAArgs(), radix_backend=radix_backend, memory=memory)
        monkeypatch.setenv(flags.ENV_VAR, json.dumps(dataclasses.asdict(args)))
        assert flags.unified_memory_requested() is expected
