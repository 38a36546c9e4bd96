"""The plugin against the installed SGLang: discovery by SGLang's own load_plugins(), the flags in the real
launcher (--help, bad values), and refusal to start on a drifted SGLang."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sgl_multilora.patches import hook_table, plugin


def run(code_or_args: list[str], timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *code_or_args], capture_output=True, text=True, timeout=timeout)


def test_load_plugins_discovers_and_applies_every_hook():
    code = (
        "import logging, pkgutil\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from sglang.srt.plugins import load_plugins\n"
        "from sgl_multilora.patches.hook_table import HOOKS\n"
        "load_plugins()\n"
        "for spec in HOOKS:\n"
        "    owner, attr = spec.target.rsplit('.', 1)\n"
        "    fn = getattr(pkgutil.resolve_name(owner), attr)\n"
        "    assert hasattr(fn, '__wrapped__'), spec.target\n"
        "print('applied', len(HOOKS))\n"
    )
    result = run(["-c", code])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"applied {len(hook_table.HOOKS)}" in result.stdout
    assert "Loaded plugin multilora from group sglang.srt.plugins" in result.stderr
    assert "Executed general plugin: multilora" in result.stderr


def test_flags_appear_in_launch_server_help():
    result = run(["-m", "sglang.launch_server", "--help"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sgl_multilora" in result.stdout
    for flag in ("--multilora-lora-compute", "--multilora-adapter-dir"):
        assert flag in result.stdout


def test_bad_flag_value_stops_the_launcher_with_a_clear_error():
    result = run(["-m", "sglang.launch_server", "--model-path", "unused", "--multilora-lora-compute", "fast"])
    assert result.returncode == 2
    assert "argument --multilora-lora-compute: invalid choice: 'fast'" in result.stderr


def test_hook_table_matches_installed_sglang():
    hook_table.check()


def test_missing_target_is_named():
    spec = hook_table.HookSpec("sglang.srt.server_args.ServerArgs.no_such_method", "around", "cli:add_cli_args",
                               (), "test")
    with pytest.raises(hook_table.IncompatibleSGLang, match="ServerArgs.no_such_method is missing"):
        hook_table.check((spec,))


def test_changed_signature_is_named():
    spec = hook_table.HookSpec("sglang.srt.server_args.ServerArgs.add_cli_args", "around", "cli:add_cli_args",
                               ("parser", "extra_arg"), "test")
    with pytest.raises(hook_table.IncompatibleSGLang, match=r"add_cli_args has parameters \['parser'\]"):
        hook_table.check((spec,))


def test_register_refuses_another_sglang_version(monkeypatch, capsys):
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(plugin, "version", lambda name: "0.5.22")
    with pytest.raises(SystemExit, match="supports sglang==0.5.23"):
        plugin.register()
    assert "the installed sglang is 0.5.22" in capsys.readouterr().err
