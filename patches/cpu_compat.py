"""CPU compatibility for SGLang 0.5.23 on a CPU-only torch build: everything the CPU server path needs, in one place.

What lives here and why (each fix is a no-op where torch is a CUDA/ROCm build):
- torchvision: PyPI only has a CUDA build. SGLang imports `torchvision.transforms` unconditionally
  (`srt/configs` -> `multimodal/internvl_utils.py`); the wheel's top-level `register_fake` calls for its C ops fail on
  a CPU-only torch ("operator torchvision::nms does not exist"). While torchvision's top-level package executes,
  `torch.library.register_fake` becomes a no-op; its Python parts then work, its C ops raise only if called.
- pin_memory: SGLang's LoRA code pins host tensors with `.pin_memory()`, which a CPU-only torch rejects ("Cannot
  access accelerator device when none is available"). Pinning only speeds up host-to-device copies, and there is no
  device: `Tensor.pin_memory` returns the tensor itself. The factory functions (`torch.tensor(..., pin_memory=True)`)
  are deliberately left alone: wrapping them breaks transformers' meta-device initialisation (its rotary
  `inv_freq` buffers come out uninitialised), and the CPU LoRA path (`lora_transformers.py`) never reaches the SGLang
  code that passes `pin_memory=True`.

Both are rows of the touch-point table (`hook_table.py`, kind "process-wide patch").
`install()` puts an import hook on `sys.meta_path` that applies the fixes when torch / torchvision are first imported,
so it must run before SGLang is imported: the CPU set-up (`scripts/setup_env.sh`) writes a one-line `.pth` file that
calls it at interpreter start-up. It imports nothing itself and costs nothing until torch is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys


def torch_is_cpu_only(torch_module) -> bool:
    """True for a torch build without CUDA or ROCm (the `+cpu` wheel)."""
    return torch_module.version.cuda is None and getattr(torch_module.version, "hip", None) is None


def _unpinned(self, *args, **kwargs):
    """`Tensor.pin_memory` on a CPU-only torch: the tensor itself (there is no device to copy to)."""
    return self


def _patch_pin_memory(torch_module) -> None:
    if torch_is_cpu_only(torch_module) and torch_module.Tensor.pin_memory is not _unpinned:
        torch_module.Tensor.pin_memory = _unpinned


class _PostImportLoader(importlib.abc.Loader):
    """Runs the real loader, wrapping `exec_module` with the fix for this module."""

    def __init__(self, inner: importlib.abc.Loader, name: str):
        self._inner = inner
        self._name = name

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        if self._name == "torchvision":
            import torch
            import torch.library

            if not torch_is_cpu_only(torch):
                self._inner.exec_module(module)
                return
            original = torch.library.register_fake
            torch.library.register_fake = lambda *args, **kwargs: (lambda fn: fn)
            try:
                self._inner.exec_module(module)
            finally:
                torch.library.register_fake = original
        else:  # torch
            self._inner.exec_module(module)
            _patch_pin_memory(module)


class _Finder(importlib.abc.MetaPathFinder):
    _TARGETS = ("torch", "torchvision")

    def find_spec(self, name, path, target=None):
        if name not in self._TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PostImportLoader(spec.loader, name)
        return spec


def install() -> None:
    """Idempotent. Call before torch is imported; if torch is already imported, patches it now."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    if "torch" in sys.modules:
        _patch_pin_memory(sys.modules["torch"])
