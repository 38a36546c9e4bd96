"""The benchmark's SGLang baseline outside a full SGLang install (eval/bench/sglang_kernels.py): the csgmv metadata
builder against SGLang's own segmenting, and the staged kernel package (SGLang's files, run in Triton's
interpreter in a process where only the staged package is importable as `sglang`) against our torch reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from eval.bench.sglang_kernels import csgmv_chunk_size, csgmv_segments, stage

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _no_pin(fn):
    def call(*args, **kwargs):
        kwargs.pop("pin_memory", None)  # CPU-only torch has no pinned allocator; the values are what is compared
        return fn(*args, **kwargs)
    return call


@pytest.mark.parametrize("runs, chunk", [([5, 2, 1], 3), ([1], 16), ([40, 7, 129], 32), ([300], 128)])
def test_csgmv_segments_match_sglang(monkeypatch, runs, chunk):
    from sglang.srt.lora.backend.chunked_backend import ChunkedSgmvLoRABackend

    for name in ("tensor", "empty"):
        monkeypatch.setattr(torch, name, _no_pin(getattr(torch, name)))
    w = torch.repeat_interleave(torch.arange(len(runs), dtype=torch.int32), torch.tensor(runs))
    expected_w, expected_indptr = ChunkedSgmvLoRABackend._get_segments_info(None, w, chunk)
    got_w, got_indptr = csgmv_segments(w, chunk)
    assert got_w.tolist() == expected_w.tolist()
    assert got_indptr.tolist() == expected_indptr.tolist()


def test_csgmv_chunk_size_rule():
    assert [csgmv_chunk_size(n) for n in (1, 63, 64, 255, 256, 8192)] == [16, 16, 32, 32, 128, 128]
    assert csgmv_chunk_size(8192, max_chunk_size=16) == 16


CHECK = r"""
import json, sys, torch
import sglang
assert sglang.__file__.startswith(sys.argv[1]), sglang.__file__  # the staged package, not the installed one
from eval.bench.lora_kernels import problem, sglang_kernels
from sgl_multilora.segments import SegmentMeta
from sgl_multilora.triton_kernels.ops import lora_forward
import eval.bench.lora_kernels as lk
lk.MODULES = {"qkv": (64, [64, 16, 16]), "o": (64, [64]), "gate_up": (64, [48, 48])}
out = {}
for module in lk.MODULES:
    for backend in ("csgmv", "triton"):
        x, base_w, token_slot, weights, buffers = problem(module, 8, 40, 3, 5, torch.float32, "cpu")
        ref = lora_forward(x, torch.zeros(40, weights.out_features), SegmentMeta.build(token_slot, 3), weights,
                           impl="torch")
        run = sglang_kernels(x, buffers, module, weights, token_slot, 5, backend)
        y = run(torch.zeros(40, weights.out_features))
        out[f"{module}/{backend}"] = float((y - ref).abs().max() / ref.abs().max())
print(json.dumps(out))
"""


def test_staged_sglang_kernels_match_our_reference(tmp_path):
    stage(tmp_path)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}", "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", CHECK, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(errors) == 6
    assert all(e < 1e-4 for e in errors.values()), errors


def test_only_backends_that_agree_in_bf16_are_timed():
    from eval.bench.lora_kernels import AGREEMENT_TOL, agreeing_backends

    rows = [  # as the H200 run recorded them: csgmv right in fp32, NaN or huge in bf16
        {"dtype": "float32", "sglang_csgmv": 1.6e-3, "sglang_triton": 1.6e-3},
        {"dtype": "bfloat16", "sglang_csgmv": float("nan"), "sglang_triton": 5.3e-3},
        {"dtype": "bfloat16", "sglang_csgmv": 1.9e32, "sglang_triton": 6.0e-3},
    ]
    kept, dropped = agreeing_backends(rows, ["csgmv", "triton"])
    assert kept == ["triton"] and list(dropped) == ["csgmv"]
    faulted = [{"dtype": "bfloat16", "sglang_triton": "RuntimeError: Triton Error [CUDA]: an illegal memory access"}]
    assert agreeing_backends(faulted, ["triton"])[0] == []
    assert agreeing_backends([{"dtype": "bfloat16", "sglang_triton": None}], ["triton"])[1] == {
        "triton": "its kernels did not import"}
    assert agreeing_backends([{"dtype": "bfloat16", "sglang_triton": 2 * AGREEMENT_TOL}], ["triton"])[0] == []
    assert "no agreement rows" in agreeing_backends([], ["triton"])[1]["triton"]
