"""SGLang plugin entry point (`sglang.srt.plugins` group): `register()` runs in every SGLang process.

It checks the installed SGLang against the table of touch points (`hook_table.py`), then registers each hook with
SGLang's HookRegistry (which applies them right after all plugins registered) and adds each registry entry. It never fails silently: SGLang logs and skips a plugin whose
`register()` raises an Exception, so an incompatibility exits the process (SystemExit) with a message naming the
target and the supported SGLang version.
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version

from sgl_multilora.patches import cpu_compat
from sgl_multilora.patches.hook_table import (
    HOOKS,
    SUPPORTED_SGLANG,
    TOUCH_POINTS,
    IncompatibleSGLang,
    Kind,
    check,
    resolve_impl,
)
from sgl_multilora.patches.state import process_state


def _refuse(reason: str) -> None:
    message = (
        f"sgl_multilora: cannot start: {reason}. This sgl_multilora supports sglang=={SUPPORTED_SGLANG}; "
        "install that version, or start without the plugin (SGLANG_PLUGINS=<another name>)."
    )
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(message)


def register() -> None:
    """Idempotent per process."""
    state = process_state()
    if state.registered:
        return
    cpu_compat.install()  # no-op on a CUDA/ROCm torch; must precede SGLang's LoRA code on a CPU-only torch
    try:
        installed = version("sglang")
    except PackageNotFoundError:
        _refuse("sglang is not installed")
    if installed != SUPPORTED_SGLANG:
        _refuse(f"the installed sglang is {installed}")
    try:
        check()
    except IncompatibleSGLang as e:
        _refuse(str(e))

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for point in HOOKS:
        HookRegistry.register(point.target, resolve_impl(point.impl), HookType(point.hook_type))
    for point in TOUCH_POINTS:
        if point.kind is Kind.REGISTRY:
            resolve_impl(point.impl)()  # idempotent registration functions
    state.registered = True
