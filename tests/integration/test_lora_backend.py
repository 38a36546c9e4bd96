"""`--lora-backend multilora` driven by SGLang's own LoRA layer classes on CPU.

SGLang's real `QKVParallelLinearWithLoRA`, `MergedColumnParallelLinearWithLoRA` and `RowParallelLinearWithLoRA`
wrap real base layers (tensor parallel size 1 over gloo) and read SGLang-layout stacked buffers (slot 0 is SGLang's
rank-0 "no adapter" slot; ranks 16 / 8 / 4 share one max-rank-16 buffer). Each layer's output is compared with plain
torch math (base GEMM plus per-token deltas) and with SGLang's own `torch_native` backend on the same layers.
The batch record passed to `prepare_lora_batch` carries only the fields the backends read (a real ForwardBatch
needs a model runner); the forward modes are SGLang's own.
"""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
import torch

HIDDEN, HEAD, HEADS, KV_HEADS, INTER, SLOTS, R_MAX = 64, 16, 4, 2, 96, 4, 16
RANKS = [0, 16, 8, 4]
SCALINGS = [0.0, 2.0, 0.5, 1.0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sglang_tp1():
    """SGLang's parallel state for one CPU process (gloo), torn down after the module."""
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    from sgl_multilora.embedded import ensure_embedded_model

    publish(ServerArgs(model_path=str(ensure_embedded_model()), device="cpu"), role="scheduler",
            ranks=SpawnRanks(world_rank=0))
    ps.init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                                    distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
    ps.initialize_model_parallel(backend="gloo")
    yield
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()


@pytest.fixture
def no_pinning(monkeypatch):
    """A CPU-only torch has no pinned-memory allocator; SGLang's layers and torch_native ask for pinned host tensors
    (a transfer optimisation only). Drop the flag for this test's duration.

    torch's device contexts (`with torch.device(...)`) recognise factory functions by identity, from a set cached on
    first use (`torch.utils._device._device_constructors`). Filled while the wrappers are in place, it would keep them
    for the whole process, and every later meta-device model build (transformers' `from_pretrained`) would put its
    buffers on the CPU uninitialised. So the set is filled with the real factories before they are wrapped, and
    dropped after."""
    from torch.utils import _device

    _device._device_constructors()
    for name in ("tensor", "zeros", "empty"):
        original = getattr(torch, name)

        def factory(*args, _original=original, pin_memory=False, **kwargs):
            return _original(*args, **kwargs)

        monkeypatch.setattr(torch, name, factory)
    yield
    _device._device_constructors.cache_clear()


def _buffers(out_features: int, in_features: int, num_slices: int, g: torch.Generator):
    a = torch.zeros(SLOTS, num_slices * R_MAX, in_features)
    b = torch.zeros(SLOTS, out_features, R_MAX)
    for s, r in enumerate(RANKS):
        a[s, : num_slices * r] = torch.randn(num_slices * r, in_features, generator=g) / in_features**0.5
        b[s, :, :r] = torch.randn(out_features, r, generator=g) / max(r, 1) ** 0.5
    return a, b


def _layers(backend, g):
    from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from sglang.srt.lora.layers import (
        MergedColumnParallelLinearWithLoRA,
        QKVParallelLinearWithLoRA,
        RowParallelLinearWithLoRA,
    )

    torch.manual_seed(0)
    qkv = QKVParallelLinearWithLoRA(QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, bias=False), backend)
    gate_up = MergedColumnParallelLinearWithLoRA(MergedColumnParallelLinear(HIDDEN, [INTER, INTER], bias=False),
                                                 backend)
    down = RowParallelLinearWithLoRA(RowParallelLinear(INTER, HIDDEN, bias=False), backend)
    for layer in (qkv, gate_up, down):
        torch.nn.init.normal_(layer.base_layer.weight, std=0.05)
    qkv.set_lora_info(*_buffers(HEAD * (HEADS + 2 * KV_HEADS), HIDDEN, 3, g))
    gate_up.set_lora_info(*_buffers(2 * INTER, HIDDEN, 2, g))
    down.set_lora_info(*_buffers(HIDDEN, INTER, 1, g))
    return {"qkv": (qkv, (0, 64, 96, 128)), "gate_up": (gate_up, (0, INTER, 2 * INTER)),
            "down": (down, (0, HIDDEN))}


def _expected(layer, offsets, x, token_slot):
    """Base GEMM plus, per token and slice j, scale * (x @ A_j.T) @ B_j.T (float64)."""
    y = x.double() @ layer.base_layer.weight.double().t()
    a_buf, b_buf = layer.lora_a, layer.lora_b
    for i, s in enumerate(token_slot):
        r = RANKS[s]
        for j in range(len(offsets) - 1):
            a = a_buf[s, j * r : (j + 1) * r].double()  # SGLang packs A's slices at the adapter's rank
            b = b_buf[s, offsets[j] : offsets[j + 1], :r].double()
            y[i, offsets[j] : offsets[j + 1]] += SCALINGS[s] * (b @ (a @ x[i].double()))
    return y


def _batch(mode: str, weight_indices: list[int], seq_lens: list[int]):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return SimpleNamespace(
        forward_mode=ForwardMode.EXTEND if mode == "extend" else ForwardMode.DECODE,
        batch_size=len(weight_indices), extend_seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        extend_seq_lens_cpu=list(seq_lens), extend_num_tokens=sum(seq_lens),
    )


def _backend(name: str):
    from sglang.srt.lora.backend.lora_registry import get_backend_from_name

    from sgl_multilora.patches import lora_backend

    lora_backend.register()
    return get_backend_from_name(name)(SLOTS, torch.device("cpu"))


STEPS = [
    ("extend", [1, 0, 2, 3], [5, 3, 4, 2]),  # mixed ranks plus a base request (slot 0, rank 0)
    ("decode", [2, 2, 0, 1, 3, 1], [1] * 6),
    ("decode", [0, 0, 0], [1] * 3),  # only base tokens
]


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_sglang_layers_with_multilora_match_torch_math_and_torch_native(sglang_tp1, no_pinning, monkeypatch, impl):
    if impl == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(1)
    ours, native = _backend("multilora"), _backend("torch_native")
    assert type(ours).__name__ == "MultiLoRABackend"
    ours.impl = impl
    layers = _layers(ours, g)
    metas = set()
    for mode, weight_indices, seq_lens in STEPS:
        token_slot = [w for w, n in zip(weight_indices, seq_lens) for _ in range(n)]
        x = torch.randn(len(token_slot), HIDDEN, generator=g)
        fb = _batch(mode, weight_indices, seq_lens)
        for name, (layer, offsets) in layers.items():
            inp = x if name != "down" else torch.randn(len(token_slot), INTER, generator=g)
            expected = _expected(layer, offsets, inp, token_slot)
            layer.lora_backend = ours
            ours.prepare_lora_batch(fb, weight_indices, RANKS, SCALINGS, use_cuda_graph=False)
            ours.meta.check_invariants()
            metas.add(id(ours.meta))
            got, _ = layer(inp)
            torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-4, msg=f"{name} {mode}")
            layer.lora_backend = native
            native.prepare_lora_batch(fb, weight_indices, RANKS, SCALINGS, use_cuda_graph=False)
            stock, _ = layer(inp)
            torch.testing.assert_close(got, stock, atol=1e-4, rtol=1e-4, msg=f"{name} {mode} vs torch_native")
    assert len(metas) == 1  # every eager step refilled the same preallocated layout


def test_split_shrink_and_expand_calls_match_torch_math(sglang_tp1, no_pinning):
    """run_lora_a_sgemm then run_lora_b_sgemm: the path SGLang takes when a tensor-parallel all-reduce sits between
    them (the q/k/v slices of the shrink output travel between the two calls)."""
    g = torch.Generator().manual_seed(3)
    ours = _backend("multilora")
    qkv, offsets = _layers(ours, g)["qkv"]
    weight_indices, seq_lens = [3, 0, 1, 2], [2, 3, 1, 4]
    ours.prepare_lora_batch(_batch("extend", weight_indices, seq_lens), weight_indices, RANKS, SCALINGS,
                            use_cuda_graph=False)
    x = torch.randn(sum(seq_lens), HIDDEN, generator=g)
    t = ours.run_lora_a_sgemm(x, qkv.lora_a, stack_num=3)
    base = x @ qkv.base_layer.weight.t()
    got = ours.run_lora_b_sgemm(t, qkv.lora_b, output_offset_cpu=torch.tensor(offsets), base_output=base.clone())
    token_slot = [w for w, n in zip(weight_indices, seq_lens) for _ in range(n)]
    torch.testing.assert_close(got.double(), _expected(qkv, offsets, x, token_slot), atol=1e-4, rtol=1e-4)


def test_decode_graph_buffers_refilled_with_another_adapter_set(sglang_tp1, no_pinning, monkeypatch):
    """The decode CUDA-graph path on CPU: buffers sized for 8 requests, refilled for batches whose adapter sets
    differ (6 requests on slots {1, 2, 3}, then 3 requests on slots {0, 3}); inputs padded to the captured 8 rows."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(2)
    ours = _backend("multilora")
    ours.impl = "triton"
    ours.init_decode_cuda_graph_batch_info(max_bs_in_cuda_graph=8, num_tokens_per_req=1)
    qkv, offsets = _layers(ours, g)["qkv"]
    graph_meta = ours._graph["meta"]
    for weight_indices in ([2, 1, 3, 1, 2, 2], [0, 3, 0]):
        ours.prepare_lora_batch(_batch("decode", weight_indices, [1] * len(weight_indices)), weight_indices,
                                RANKS, SCALINGS, use_cuda_graph=True)
        assert ours.meta is graph_meta and graph_meta.num_tokens == 8 and graph_meta.padded
        graph_meta.check_invariants()
        x = torch.randn(8, HIDDEN, generator=g)
        got, _ = qkv(x)
        token_slot = weight_indices + [0] * (8 - len(weight_indices))  # padding rows: no adapter
        torch.testing.assert_close(got.double(), _expected(qkv, offsets, x, token_slot), atol=1e-4, rtol=1e-4)


def test_launcher_accepts_lora_backend_multilora():
    import argparse

    from sglang.srt.server_args import ServerArgs

    from sgl_multilora.patches import cli

    parser = argparse.ArgumentParser()
    cli.add_cli_args(ServerArgs.add_cli_args.__wrapped__ if hasattr(ServerArgs.add_cli_args, "__wrapped__")
                     else ServerArgs.add_cli_args, parser)
    assert parser.parse_args(["--model-path", "m", "--lora-backend", "multilora"]).lora_backend == "multilora"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "m", "--lora-backend", "nope"])
