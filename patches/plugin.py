"""SGLang plugin entry point (`sglang.srt.plugins` group): `register()` runs in every SGLang process.

It checks the installed SGLang against the hook table, then registers each hook with SGLang's HookRegistry (which
applies them right after all plugins registered). It never fails silently: SGLang logs and skips a plugin whose
`register()` raises an Exception, so an incompatibility exits the process (SystemExit) with a message naming the
target and the supported SGLang version.
"""

from __future__ import annotations

import importlib
import sys
from importlib.metadata import PackageNotFoundError, version

from sgl_multilora.patches import cpu_compat
from sgl_multilora.patches.hook_table import HOOKS, SUPPORTED_SGLANG, IncompatibleSGLang, check

_registered = False


def _refuse(reason: str) -> None:
    message = (
        f"sgl_multilora: cannot start: {reason}. This sgl_multilora supports sglang=={SUPPORTED_SGLANG}; "
        "install that version, or start without the plugin (SGLANG_PLUGINS=<another name>)."
    )
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(message)


def register() -> None:
    """Idempotent per process."""
    global _registered
    if _registered:
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

    for spec in HOOKS:
        module_name, fn_name = spec.hook.split(":")
        fn = getattr(importlib.import_module(f"sgl_multilora.patches.{module_name}"), fn_name)
        HookRegistry.register(spec.target, fn, HookType(spec.kind))
    from sgl_multilora.patches import radix_backend

    radix_backend.register()  # --radix-cache-backend multilora
    from sgl_multilora.patches import lora_backend

    lora_backend.register()  # --lora-backend multilora
    _registered = True
