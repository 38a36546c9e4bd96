"""Compiling the kernel bodies with `triton.jit` on first launch, once per mode (compiled / TRITON_INTERPRET=1).

Triton decides at decoration time whether a kernel runs interpreted. Decorating on first launch, keyed by the
mode, lets tests switch the interpreter on for their own launches without a module-import-order dependence, and
keeps triton out of processes that only run the torch references (`tl` is None when triton is missing).
Kernel bodies must not call triton.language's own jitted helpers (`tl.cdiv`, `tl.zeros`, ...): those were decorated
when triton was imported, in whatever mode was set then, and fail in the other one.
"""

from __future__ import annotations

import os
from collections.abc import Callable

try:
    import triton.language as tl
except ImportError:  # CPU-only install without triton: only the references run
    tl = None

_JITTED: dict[tuple[Callable, bool], object] = {}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def jit_kernel(body: Callable):
    """`triton.jit(body)` for the current mode, cached."""
    key = (body, interpreting())
    if key not in _JITTED:
        if tl is None:
            raise RuntimeError("the Triton LoRA kernels need triton; install it or use the torch references")
        import triton

        _JITTED[key] = triton.jit(body)
    return _JITTED[key]
