"""GPU compatibility for SGLang 0.5.23 on a CUDA machine without sgl_kernel (and without FlashInfer or tvm-ffi).

Active only where sgl_kernel cannot be found and torch sees a CUDA device (or when forced, see `mode`); a no-op on a
CPU machine and on a full GPU install. What it does there, and why:
- `sgl_kernel` stub: on CUDA, SGLang imports sgl_kernel's ops unconditionally at module import time (layernorm,
  activation, sampler, rotary, memory pools, ... : dozens of names in submodules such as `sgl_kernel.kvcacheio`).
  The stub package serves the ops on a Llama text path from `gpu_compat_ops` (rmsnorm, fused_add_rmsnorm, gemma
  variants, silu/gelu_and_mul, rotary_embedding, top-k / top-p renorm, is_arch_support_pdl) and answers every other
  name with a placeholder that imports fine and raises NotImplementedError naming the op when called.
- SGLang's JIT kernels (`sglang.kernels.ops.*`, compiled at run time through tvm-ffi): the launchers on the Llama
  path are replaced by the same torch ops right after their module executes (before any layer imports them by name):
  activation `silu/gelu(_tanh)_and_mul`, `fused_add_rmsnorm`, `rmsnorm_hf`, RoPE; `can_use_store_cache` answers False
  (SGLang then stores KV with plain indexing) and `enable_fused_set_kv_buffer` answers False (RoPE and the KV store
  run apart, so the native RoPE path is allowed).
- Fused ops (`BaseFusedOp`: RMSNorm, SiluAndMul, RotaryEmbedding, ...) are forced onto their pure-torch
  `forward_native` through SGLang's own switch `SGLANG_FORCE_FUSED_OP_BACKEND=torch` (set if unset) unless
  `MULTILORA_GPU_COMPAT_FUSED_OPS=cuda`, which keeps their CUDA forwards on the replaced ops. The engine's
  sgl-kernel version check is skipped (`SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1`).
Attention (`--attention-backend triton`) and sampling (`--sampling-backend pytorch`) are SGLang's own Triton and
torch code and need nothing here. Rows of the touch-point table (`hook_table.py`, kind "process-wide patch").
`install()` must run at interpreter start-up in every process (the GPU kit's `sitecustomize.py` calls it): it puts a
finder on `sys.meta_path` and imports nothing until a targeted module is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

STUB_ROOT = "sgl_kernel"
_NEVER = "never"  # a patch value: the attribute becomes a function answering False
JIT_PATCHES: dict[str, dict[str, str]] = {
    "sglang.kernels.ops.activation.activation": {
        "silu_and_mul": "silu_and_mul", "gelu_and_mul": "gelu_and_mul", "gelu_tanh_and_mul": "gelu_tanh_and_mul"},
    "sglang.kernels.ops.layernorm.norm": {"fused_add_rmsnorm": "fused_add_rmsnorm"},
    "sglang.kernels.ops.layernorm.rmsnorm_hf": {"rmsnorm_hf": "rmsnorm_hf"},
    "sglang.kernels.ops.attention.rope": {
        "apply_rope_with_cos_sin_cache_inplace": "apply_rope_with_cos_sin_cache_inplace",
        "rotary_embedding": "rotary_embedding"},
    "sglang.kernels.ops.kvcache.kvcache": {"can_use_store_cache": _NEVER},
    "sglang.srt.models.utils": {"enable_fused_set_kv_buffer": _NEVER},
}
"""module -> {attribute: the `gpu_compat_ops` op that replaces it, or "never"}; applied right after the module runs."""

ENV_MODE = "MULTILORA_GPU_COMPAT"  # "auto" (default), "1" (force on, for tests on a CPU), "0" (off)
_state: dict[str, bool] = {}


def mode() -> str:
    return os.environ.get(ENV_MODE, "auto")


def active() -> bool:
    """Whether the compatibility layer applies in this process; decided once, on first need (torch is imported then).
    auto: sgl_kernel is not installed and torch has a CUDA device."""
    if "active" not in _state:
        if mode() in ("0", "1"):
            _state["active"] = mode() == "1"
        else:
            import torch

            missing = importlib.machinery.PathFinder.find_spec(STUB_ROOT) is None
            _state["active"] = missing and torch.version.cuda is not None and torch.cuda.is_available()
        if _state["active"]:
            _set_env_defaults()
    return _state["active"]


def _set_env_defaults() -> None:
    """Set before SGLang reads them (children inherit them through the environment)."""
    os.environ.setdefault("SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK", "1")
    if os.environ.get("MULTILORA_GPU_COMPAT_FUSED_OPS", "native") != "cuda":
        os.environ.setdefault("SGLANG_FORCE_FUSED_OP_BACKEND", "torch")


class MissingOp:
    """Stands in for an sgl_kernel name gpu_compat does not provide: importable, raises when called."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self._name} is not provided by sgl_multilora's gpu_compat (sgl_kernel is not installed); "
            "the serving flags must keep SGLang off this op"
        )

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return MissingOp(f"{self._name}.{attr}")

    def __repr__(self) -> str:
        return f"<gpu_compat missing op {self._name}>"


def _stub_getattr(module_name: str):
    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(f"module {module_name!r} has no attribute {attr!r}")
        from sgl_multilora.patches.gpu_compat_ops import STUB_OPS

        return STUB_OPS.get(attr) or MissingOp(f"{module_name}.{attr}")

    return __getattr__


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        module.__path__ = []  # a package: `sgl_kernel.<anything>` resolves to a stub too
        module.__version__ = "0.0.0+gpu_compat"
        module.__getattr__ = _stub_getattr(module.__name__)


def _replacement(op: str):
    if op == _NEVER:
        return lambda *args, **kwargs: False
    from sgl_multilora.patches import gpu_compat_ops

    return getattr(gpu_compat_ops, op)


def apply_patches(module: types.ModuleType) -> None:
    """Replaces `module`'s attributes listed in JIT_PATCHES (mutates the module). Raises AttributeError naming a
    listed attribute the module lacks (SGLang drifted)."""
    for attr, op in JIT_PATCHES.get(module.__name__, {}).items():
        if not hasattr(module, attr):
            raise AttributeError(f"gpu_compat: {module.__name__}.{attr} is gone; update JIT_PATCHES")
        setattr(module, attr, _replacement(op))


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        apply_patches(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        is_stub = name == STUB_ROOT or name.startswith(STUB_ROOT + ".")
        if not is_stub and name not in JIT_PATCHES:
            return None
        if is_stub:
            if name == STUB_ROOT and importlib.machinery.PathFinder.find_spec(name) is not None:
                return None  # the real sgl_kernel is installed
            if not active():
                return None
            return importlib.machinery.ModuleSpec(name, _StubLoader(), is_package=True)
        if not active():
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader)
        return spec


def install() -> None:
    """Idempotent. Call at start-up, before SGLang is imported; where a targeted module is already imported (and the
    layer is active), patches it now (too late for modules that already imported its names)."""
    if mode() == "0":
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    for name in JIT_PATCHES:
        if name in sys.modules and active():
            apply_patches(sys.modules[name])
