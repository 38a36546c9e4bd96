"""Kernel tests run the Triton kernels in the interpreter (TRITON_INTERPRET=1) on CPU, in fp32 and fp16.

The variable is set per test (monkeypatch), never for the process: the kernels are compiled by `triton.jit` on
first launch in each mode (`sgl_multilora/triton_kernels/jit.py`), so SGLang's own Triton code in other test modules is unaffected.
On a machine with CUDA these tests still run on CPU tensors in the interpreter; tests/gpu covers the compiled kernels.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
