"""New-tokens-only CPU extend attention matches SGLang's `_run_sdpa_forward_extend`.

Each case builds a KV pool, a req_to_token table and a batch of requests as `forward_extend` passes
them (requests back to back in `query`; each request's cached prefix and new tokens' K/V already in
the pool), runs SGLang's method and ours on the same inputs and compares the outputs (fp32, atol
1e-5). The hook must leave the cases it does not handle to SGLang, and the upstream diff (applied
to a copy of the installed file) must match SGLang in every case, those included.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sgl_multilora.patches import cpu_extend_attention, flags

pytestmark = pytest.mark.timeout(120)

HEAD_DIM = 64
ATOL = RTOL = 1e-5
UPSTREAM_DIFF = Path(__file__).parents[2] / "patches" / "upstream" / "torch_native_extend.diff"


def make_backend(backend_cls):
    # The extend method reads no pool state; a stub runner lets the real constructor run on CPU.
    runner = SimpleNamespace(device="cpu", req_to_token_pool=None, token_to_kv_pool=None)
    return backend_cls(runner)


@pytest.fixture(scope="module")
def backend():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    return make_backend(TorchNativeAttnBackend)


def stock_method():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    # Unwrapped: SGLang's own method even where the plugin's hooks were applied in this process.
    return inspect.unwrap(TorchNativeAttnBackend._run_sdpa_forward_extend)


@dataclass(frozen=True)
class ExtendBatch:
    """`_run_sdpa_forward_extend`'s positional arguments; `args()` adds a fresh `output` buffer."""

    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_prefix_lens: torch.Tensor
    extend_seq_lens: torch.Tensor

    def args(self) -> tuple:
        output = torch.full_like(self.query, float("nan"))  # NaN shows a row left unwritten
        return (self.query, output, self.k_cache, self.v_cache, self.req_to_token,
                self.req_pool_indices, self.seq_lens, self.extend_prefix_lens,
                self.extend_seq_lens)


def make_batch(prefix_lens: list[int], extend_lens: list[int], num_q_heads: int,
               num_kv_heads: int, seed: int = 0) -> ExtendBatch:
    """Requests in shuffled req_to_token rows, their KV at shuffled pool slots, slot 0 unused."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    num_reqs, total_len = len(seq_lens), sum(seq_lens)
    pool_size = total_len + 17
    slots = (torch.randperm(pool_size - 1, generator=g)[:total_len] + 1).split(seq_lens)
    req_to_token = torch.zeros(num_reqs + 3, max(seq_lens) + 5, dtype=torch.int32)
    req_pool_indices = torch.randperm(num_reqs + 3, generator=g)[:num_reqs]
    for row, req_slots in zip(req_pool_indices.tolist(), slots):
        req_to_token[row, : len(req_slots)] = req_slots.to(torch.int32)
    return ExtendBatch(
        query=torch.randn(sum(extend_lens), num_q_heads, HEAD_DIM, generator=g),
        k_cache=torch.randn(pool_size, num_kv_heads, HEAD_DIM, generator=g),
        v_cache=torch.randn(pool_size, num_kv_heads, HEAD_DIM, generator=g),
        req_to_token=req_to_token,
        req_pool_indices=req_pool_indices,
        seq_lens=torch.tensor(seq_lens),
        extend_prefix_lens=torch.tensor(prefix_lens),
        extend_seq_lens=torch.tensor(extend_lens),
    )


def run_both(backend, batch: ExtendBatch, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    stock = stock_method()(backend, *batch.args(), **kwargs)
    ours = cpu_extend_attention.sdpa_forward_extend(backend, *batch.args(), **kwargs)
    return stock, ours


GQA = dict(num_q_heads=9, num_kv_heads=3, enable_gqa=True)  # SmolLM2-135M's heads
MHA = dict(num_q_heads=2, num_kv_heads=2, enable_gqa=False)

CASES = {
    # name: (prefix_lens, extend_lens, heads)
    "cold-prefill": ([0], [37], GQA),
    "one-token-after-2048": ([2048], [1], GQA),
    "three-tokens-after-2048": ([2048], [3], MHA),
    "chunked-prefill": ([256], [128], GQA),
    "mostly-new": ([2, 100, 64], [300, 101, 64], GQA),  # prefix_len <= extend_len: padded query
    "mixed-batch": ([0, 5, 2048, 64, 300], [7, 1, 2, 64, 1], GQA),
    "mixed-batch-mha": ([17, 0, 511], [3, 9, 1], MHA),
    "single-token-no-prefix": ([0, 0], [1, 1], MHA),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_stock(backend, name):
    prefix_lens, extend_lens, heads = CASES[name]
    batch = make_batch(prefix_lens, extend_lens, heads["num_q_heads"], heads["num_kv_heads"])
    stock, ours = run_both(backend, batch, scaling=HEAD_DIM**-0.5,
                           enable_gqa=heads["enable_gqa"], causal=True)
    assert not ours.isnan().any(), "a new-token row was left unwritten"
    torch.testing.assert_close(ours, stock, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("window", [0, 4, 100, 5000])
def test_sliding_window_matches_stock(backend, window):
    batch = make_batch([0, 40, 300], [12, 1, 20], 9, 3, seed=1)
    stock, ours = run_both(backend, batch, scaling=0.1, enable_gqa=True, causal=True,
                           sliding_window_size=window)
    torch.testing.assert_close(ours, stock, atol=ATOL, rtol=RTOL)


def test_default_scaling_and_disabled_window(backend):
    batch = make_batch([33, 0], [5, 4], 9, 3, seed=2)
    stock, ours = run_both(backend, batch, enable_gqa=True, causal=True, sliding_window_size=-1)
    torch.testing.assert_close(ours, stock, atol=ATOL, rtol=RTOL)


def test_bf16_cache_is_cast_to_query_dtype(backend):
    batch = make_batch([50, 3], [4, 2], 9, 3, seed=3)
    batch = ExtendBatch(**{**batch.__dict__, "k_cache": batch.k_cache.bfloat16(),
                           "v_cache": batch.v_cache.bfloat16()})
    stock, ours = run_both(backend, batch, scaling=0.125, enable_gqa=True, causal=True)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, stock, atol=ATOL, rtol=RTOL)


def test_hook_leaves_non_causal_to_stock(backend, monkeypatch):
    calls = []

    def original(self, *args, **kwargs):
        calls.append(kwargs)
        return stock_method()(self, *args, **kwargs)

    def ours_must_not_run(*args, **kwargs):
        raise AssertionError("the non-causal case reached the new-tokens-only path")

    monkeypatch.setattr(cpu_extend_attention, "sdpa_forward_extend", ours_must_not_run)
    batch = make_batch([20, 0], [6, 3], 9, 3, seed=4)
    kwargs = dict(scaling=0.125, enable_gqa=True, causal=False)
    expected = stock_method()(backend, *batch.args(), **kwargs)
    got = cpu_extend_attention.run_sdpa_forward_extend(original, backend, *batch.args(), **kwargs)
    assert len(calls) == 1
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


@pytest.mark.parametrize("kwargs", [
    dict(causal=False),
    dict(causal=True, encoder_lens=torch.tensor([4, 4])),
    dict(causal=False, is_cross_attn=True, encoder_lens=torch.tensor([4, 4])),
], ids=["encoder-only", "decoder-with-encoder-tokens", "cross-attention"])
def test_hook_routes_unhandled_cases_to_stock(backend, kwargs):
    batch = make_batch([20, 0], [6, 3], 9, 3, seed=6)
    sentinel = object()
    got = cpu_extend_attention.run_sdpa_forward_extend(
        lambda self, *args, **kw: sentinel, backend, *batch.args(), scaling=0.125, **kwargs
    )
    assert got is sentinel


def test_hook_follows_the_flag(backend, monkeypatch):
    batch = make_batch([40], [3], 9, 3, seed=5)
    taken = []

    def original(self, *args, **kwargs):
        taken.append("stock")
        return stock_method()(self, *args, **kwargs)

    for argv in ([], ["--multilora-stock-baseline", "extend-attention"]):
        parser = argparse.ArgumentParser()
        flags.add_cli_args(parser)
        args = flags.pop_from_namespace(parser.parse_args(argv))
        monkeypatch.setenv(flags.ENV_VAR, json.dumps(dataclasses.asdict(args)))
        out = cpu_extend_attention.run_sdpa_forward_extend(
            original, backend, *batch.args(), scaling=0.125, enable_gqa=True, causal=True
        )
        assert not out.isnan().any()
    assert taken == ["stock"], "only --multilora-stock-baseline extend-attention should take SGLang's path"


def load_upstream(diff: Path, root: Path):
    """SGLang's torch_native_backend module from a copy of the installed file (under `root`) with `diff` applied."""
    import importlib.util

    import sglang.srt.layers.attention.torch_native_backend as installed

    assert shutil.which("git") is not None, "git is needed to apply the upstream diff (every checkout of this repo has it)"
    target = root / "python/sglang/srt/layers/attention/torch_native_backend.py"
    target.parent.mkdir(parents=True)
    shutil.copy(installed.__file__, target)
    subprocess.run(["git", "apply", str(diff)], cwd=root, check=True)
    spec = importlib.util.spec_from_file_location(f"torch_native_backend_{diff.stem}", target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def upstream_backend(tmp_path_factory):
    """SGLang's backend class with the upstream diff applied."""
    return make_backend(load_upstream(UPSTREAM_DIFF, tmp_path_factory.mktemp("upstream")).TorchNativeAttnBackend)


@pytest.mark.parametrize("causal,window,encoder", [
    (True, None, None), (True, 5, None), (False, None, None),
    (True, None, "self"), (True, 3, "self"), (False, None, "cross"),
])
def test_upstream_diff_matches_stock(backend, upstream_backend, causal, window, encoder):
    prefix_lens, extend_lens, encoder_len = [0, 5, 700, 64], [7, 1, 2, 30], 4
    offset = encoder_len if encoder else 0  # req_to_token rows hold the encoder tokens first
    batch = make_batch([p + offset for p in prefix_lens], extend_lens, 9, 3, seed=7)
    kwargs = dict(scaling=0.125, enable_gqa=True, causal=causal, sliding_window_size=window)
    if encoder:
        batch = ExtendBatch(**{**batch.__dict__, "seq_lens": batch.seq_lens - offset,
                               "extend_prefix_lens": batch.extend_prefix_lens - offset})
        kwargs.update(encoder_lens=torch.full((len(prefix_lens),), encoder_len),
                      is_cross_attn=encoder == "cross")
    stock = stock_method()(backend, *batch.args(), **kwargs)
    upstream = upstream_backend._run_sdpa_forward_extend(*batch.args(), **kwargs)
    torch.testing.assert_close(upstream, stock, atol=ATOL, rtol=RTOL)
