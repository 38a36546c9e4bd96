"""The plugin against the installed SGLang: discovery by SGLang's own load_plugins(), the flags in the real
launcher (--help, bad values), and refusal to start on a drifted SGLang."""

from __future__ import annotations

import re

import pytest

from sgl_multilora.patches import hook_table, plugin
from tests.conftest import SideBySide


LOAD_PLUGINS = (
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

# Run after LOAD_PLUGINS in the same process (each fresh process importing SGLang costs a core for ~15 s).
OVERLAP = (
    "from sglang.srt.server_args import prepare_server_args\n"
    "from sgl_multilora.embedded import ensure_embedded_model\n"
    "base = ['--model-path', str(ensure_embedded_model()), '--model-impl', 'transformers',\n"
    "        '--attention-backend', 'torch_native', '--max-total-tokens', '4096']\n"
    "for name, extra in [('ours-cpu', ['--device', 'cpu', '--radix-cache-backend', 'multilora']),\n"
    "                    ('stock-cpu', ['--device', 'cpu']),\n"
    "                    ('ours-cpu-kept', ['--device', 'cpu', '--radix-cache-backend', 'multilora',\n"
    "                                       '--multilora-stock-baseline', 'cpu-overlap']),\n"
    "                    ('ours-cuda', ['--device', 'cuda', '--radix-cache-backend', 'multilora'])]:\n"
    "    print(name, prepare_server_args(base + extra).disable_overlap_schedule)\n"
)


@pytest.fixture(scope="module")
def runs():
    """The fresh Python processes the tests below read, started side by side (each imports SGLang)."""
    started = SideBySide({
        "load_plugins": ["-c", LOAD_PLUGINS + OVERLAP],
        "help": ["-m", "sglang.launch_server", "--help"],
        "bad_flag": ["-m", "sglang.launch_server", "--model-path", "unused", "--multilora-stock-baseline", "fast"],
    }, timeout_s=180)
    yield started
    started.close()


def test_load_plugins_discovers_and_applies_every_hook(runs):
    result = runs.result("load_plugins")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"applied {len(hook_table.HOOKS)}" in result.stdout
    assert "Loaded plugin multilora from group sglang.srt.plugins" in result.stderr
    assert "Executed general plugin: multilora" in result.stderr


def test_flags_appear_in_launch_server_help(runs):
    result = runs.result("help")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sgl_multilora" in result.stdout
    for flag in ("--multilora-stock-baseline", "--multilora-adapter-dir"):
        assert flag in result.stdout
    assert len(set(re.findall(r"--multilora-[a-z0-9-]+", result.stdout))) <= 16, "every flag earns its place"


def test_bad_flag_value_stops_the_launcher_with_a_clear_error(runs):
    result = runs.result("bad_flag")
    assert result.returncode == 2
    assert "argument --multilora-stock-baseline: unknown part(s) ['fast']" in result.stderr


def test_overlap_scheduler_is_off_only_for_our_backend_on_cpu(runs):
    """On a CPU the overlap loop only defers each batch's results by one forward; the plugin turns it off there when
    its backend is on, says so, and leaves stock SGLang, GPU servers and `--multilora-stock-baseline cpu-overlap` as
    they are."""
    result = runs.result("load_plugins")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[-5:-1] == ["ours-cpu True", "stock-cpu False", "ours-cpu-kept False",
                                                "ours-cuda False"], result.stdout
    assert "overlap scheduler disabled on --device cpu" in result.stderr


def test_hook_table_matches_installed_sglang():
    hook_table.check()


def _point(target: str, params: tuple[str, ...]) -> hook_table.TouchPoint:
    return hook_table.TouchPoint(target, hook_table.Kind.HOOK, "patches.cli:add_cli_args", params, "test",
                                 hook_type="around")


def test_missing_target_is_named():
    with pytest.raises(hook_table.IncompatibleSGLang, match="ServerArgs.no_such_method is missing"):
        hook_table.check((_point("sglang.srt.server_args.ServerArgs.no_such_method", ()),))


def test_changed_signature_is_named():
    point = _point("sglang.srt.server_args.ServerArgs.add_cli_args", ("parser", "extra_arg"))
    with pytest.raises(hook_table.IncompatibleSGLang, match=r"add_cli_args has parameters \['parser'\]"):
        hook_table.check((point,))


def test_every_touch_point_names_code_that_exists():
    """Each row's `impl` resolves, and every kind the table declares is installed by someone: hooks and registry
    entries by `plugin.register`, the rest by the code each row names."""
    for point in hook_table.TOUCH_POINTS:
        assert callable(hook_table.resolve_impl(point.impl)), point
    kinds = {point.kind for point in hook_table.TOUCH_POINTS}
    assert kinds == set(hook_table.Kind), kinds - set(hook_table.Kind)


def test_no_hook_module_reaches_into_sglang_outside_the_table():
    """Every `sglang` symbol a patches/ module imports at top level is a row's target, one of its `also` symbols, or
    SGLang's cache / LoRA-backend base API that the registered classes implement."""
    import ast
    from pathlib import Path

    listed = {p for t in hook_table.TOUCH_POINTS for p in (t.target, *t.also)}
    base_api = ("sglang.srt.mem_cache.", "sglang.srt.lora.backend.base_backend", "sglang.srt.lora.utils")
    patches_dir = Path(hook_table.__file__).parent
    for path in sorted(patches_dir.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sglang"):
                for alias in node.names:
                    symbol = f"{node.module}.{alias.name}"
                    assert symbol.startswith(base_api) or any(s.startswith(symbol) for s in listed), (
                        f"{path.name} imports {symbol}, which no row of the touch-point table names"
                    )


def test_register_refuses_another_sglang_version(monkeypatch, capsys):
    monkeypatch.setattr(plugin.process_state(), "registered", False)
    monkeypatch.setattr(plugin, "version", lambda name: "0.5.22")
    with pytest.raises(SystemExit, match="supports sglang==0.5.23"):
        plugin.register()
    assert "the installed sglang is 0.5.22" in capsys.readouterr().err
