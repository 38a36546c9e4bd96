"""The --multilora-* flags: parsing, bad values, the stock baseline parts, one description behind --help and
docs/flags.md, and how the values reach spawned processes."""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import re
import subprocess
import sys
from pathlib import Path

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
    ns = parser().parse_args(["--model-path", "m", "--multilora-stock-baseline", "lora-compute",
                              "--multilora-adapter-dir", str(tmp_path)])
    ours = flags.pop_from_namespace(ns)
    assert ours.lora_compute == "sglang" and ours.adapter_dir == str(tmp_path)
    assert not any(name.startswith("multilora_") for name in vars(ns))  # SGLang never sees them
    assert flags.pop_from_namespace(parser().parse_args([])) == flags.MultiLoRAArgs()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--multilora-stock-baseline", "fast"], "unknown part(s) ['fast']"),
        (["--multilora-stock-baseline", "memory,shared"], "unknown part(s) ['shared']"),
        (["--multilora-adapter-dir", "/no/such/dir"], "is not a directory"),
        (["--multilora-eviction-policy", "fifo"], "invalid choice: 'fifo'"),
        (["--multilora-idle-watermark", "1.5"], "is not a number between 0 and 1"),
        (["--multilora-ttft-slo-s", "0"], "is not a positive number"),
        (["--multilora-max-adapter-mb", "0"], "is not a positive integer"),
        (["--multilora-slot-squash-share", "-0.1"], "is not a number between 0 and 1"),
        (["--multilora-adapter-source", "/no/such/dir"], "is not a directory"),
        (["--multilora-adapter-source", "nosuchscheme:x"], "no adapter resolver is registered for 'nosuchscheme'"),
        (["--multilora-adapter-source", "hf-cache:/no/such/dir"], "'/no/such/dir' is not a directory"),
        (["--multilora-host-adapter-gb", "-1"], "is not a number >= 0"),
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
    ns = parser().parse_args(["--multilora-stock-baseline", "memory", "--multilora-eviction-policy", "lru",
                              "--multilora-idle-watermark", "0.5"])
    ours = flags.pop_from_namespace(ns)
    assert (ours.memory, ours.eviction_policy, ours.idle_watermark, ours.swap_interval_ms) == (
        "separate", "lru", 0.5, 100.0)
    ns = parser().parse_args(["--multilora-scheduler", "multiqueue", "--multilora-slot-squash-share", "0.25"])
    assert flags.pop_from_namespace(ns).slot_squash_share == 0.25
    ns = parser().parse_args(["--multilora-adapter-source", "/tmp", "--multilora-adapter-source", "hf-cache:/tmp"])
    assert flags.pop_from_namespace(ns).adapter_source == (("dir", os.path.realpath("/tmp")),
                                                           ("hf-cache", os.path.realpath("/tmp")))
    assert flags.MultiLoRAArgs().memory_hold_share == 0.5
    ns = parser().parse_args(["--multilora-scheduler", "multiqueue", "--multilora-memory-hold-share", "0"])
    assert flags.pop_from_namespace(ns).memory_hold_share == 0.0
    with pytest.raises(SystemExit):
        parser().parse_args(["--multilora-memory-hold-share", "-0.5"])
    assert not flags.MultiLoRAArgs().disable_kv_moves  # KV moves to free a run for an adapter by default
    assert flags.pop_from_namespace(parser().parse_args(["--multilora-stock-baseline", "kv-moves"])).disable_kv_moves
    # the unified pool needs the tree backend (set at parse time) and `unified`
    for radix_backend, memory, expected in [(True, "unified", True), (False, "unified", False),
                                            (True, "separate", False)]:
        args = dataclasses.replace(flags.MultiLoRAArgs(), radix_backend=radix_backend, memory=memory)
        monkeypatch.setenv(flags.ENV_VAR, json.dumps(dataclasses.asdict(args)))
        assert flags.unified_memory_requested() is expected


STOCK = {"lora_compute": "sglang", "extend_attention": "stock", "decode_attention": "stock", "ingress": "stock",
         "memory": "separate", "disable_kv_moves": True, "cpu_overlap": True}
"""Each stock baseline part's field and stock SGLang's value for it, written out by hand."""


def test_stock_baseline_parts_restore_stock_behaviour_one_by_one_or_together():
    ours = flags.MultiLoRAArgs()
    assert {name: getattr(ours, name) for name in STOCK} == {
        "lora_compute": "auto", "extend_attention": "ours", "decode_attention": "ours", "ingress": "strict",
        "memory": "unified", "disable_kv_moves": False, "cpu_overlap": False}
    parts = ["lora-compute", "extend-attention", "decode-attention", "ingress", "memory", "kv-moves", "cpu-overlap"]
    for part, name in zip(parts, STOCK):
        got = flags.pop_from_namespace(parser().parse_args(["--multilora-stock-baseline", part]))
        assert got == dataclasses.replace(ours, **{name: STOCK[name]}), part
    # a comma list and a repeated flag are the same thing
    together = parser().parse_args(["--multilora-stock-baseline", ",".join(parts[:4]),
                                    "--multilora-stock-baseline", ",".join(parts[4:])])
    assert flags.pop_from_namespace(together) == dataclasses.replace(ours, **STOCK)
    assert not hasattr(together, "multilora_stock_baseline")


def test_help_defaults_and_docs_come_from_one_description():
    """Every flag's --help text, choices and default are its field's; docs/flags.md is exactly what the generator
    writes now (regenerate it with the command it names); at most 16 flags (the LoRA server's address is the 16th)."""
    actions = {a.option_strings[0]: a for a in parser()._actions if a.option_strings
               and a.option_strings[0].startswith("--multilora-")}
    described = {f.metadata["flag"]: f for f in dataclasses.fields(flags.MultiLoRAArgs) if "flag" in f.metadata}
    assert set(actions) == set(described) | {"--multilora-stock-baseline"} and len(actions) <= 16
    for name, f in described.items():
        action = actions[name]
        default = tuple(action.default) if f.metadata["repeatable"] else action.default  # append: a list
        assert (action.dest, default, action.help) == ("multilora_" + f.name, f.default, f.metadata["help"])
        assert tuple(action.choices or ()) == (f.metadata["choices"] or ())
        assert re.fullmatch(r"--multilora-[a-z0-9-]+", name) and name == "--multilora-" + f.name.replace("_", "-")
    docs = Path(__file__).resolve().parents[2] / "docs" / "flags.md"
    generated = subprocess.run([sys.executable, "-m", "sgl_multilora.patches.flags", "--markdown"], check=True,
                               capture_output=True, text=True).stdout
    assert docs.read_text() == generated, "docs/flags.md is stale: python -m sgl_multilora.patches.flags --markdown"
    for name, f in described.items():
        cell = f.metadata["help"].replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
        assert f"`{name}" in generated and cell in generated
    for part in ("lora-compute", "extend-attention", "decode-attention", "ingress", "memory", "kv-moves",
                 "cpu-overlap"):
        assert f"| `{part}` |" in generated
