"""Batched CPU decode attention matches SGLang's `_run_sdpa_forward_decode`.

Each case builds a KV pool, a req_to_token table and a decode batch as `forward_decode` passes it (one query row
per request; every request's K/V, the new token's included, already in the pool at shuffled slots), runs SGLang's
own method and ours on the same inputs and compares the outputs (fp32, atol 1e-5). Lengths are chosen so that the
grouping makes one group, several groups and padded groups. The hook must leave what it does not handle to SGLang,
and the step's layout must be rebuilt whenever the step's inputs change. The upstream diff
(`patches/upstream/torch_native_decode.diff`, the same grouping written into SGLang's file) is applied to a copy of
the installed file and checked against SGLang's method alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sgl_multilora.patches import cpu_decode_attention, flags
from tests.integration.test_cpu_extend_attention import load_upstream, make_backend

pytestmark = pytest.mark.timeout(120)

HEAD_DIM = 64
ATOL = RTOL = 1e-5
GQA = dict(num_q_heads=9, num_kv_heads=3, enable_gqa=True)  # SmolLM2-135M's heads
MHA = dict(num_q_heads=2, num_kv_heads=2, enable_gqa=False)
UPSTREAM_DIFF = Path(__file__).parents[2] / "patches" / "upstream" / "torch_native_decode.diff"


@pytest.fixture(scope="module")
def backend():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    return make_backend(TorchNativeAttnBackend)  # the decode method reads no pool state either


def stock_method():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    return inspect.unwrap(TorchNativeAttnBackend._run_sdpa_forward_decode)  # SGLang's own, hooks or not


@dataclass(frozen=True)
class DecodeBatch:
    """`_run_sdpa_forward_decode`'s positional arguments; `args()` adds a fresh `output` buffer."""

    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor

    def args(self) -> tuple:
        output = torch.full_like(self.query, float("nan"))  # NaN shows a row left unwritten
        return (self.query, output, self.k_cache, self.v_cache, self.req_to_token, self.req_pool_indices,
                self.seq_lens)


def make_batch(seq_lens: list[int], num_q_heads: int, num_kv_heads: int, seed: int = 0) -> DecodeBatch:
    """Requests in shuffled req_to_token rows, their KV at shuffled pool slots, slot 0 unused; the rows past each
    request's length hold slots of other requests (stale entries, as a reused row has)."""
    g = torch.Generator().manual_seed(seed)
    num_reqs, total_len = len(seq_lens), sum(seq_lens)
    pool_size = total_len + 17
    slots = (torch.randperm(pool_size - 1, generator=g)[:total_len] + 1).split(seq_lens)
    width = max(seq_lens) + 5
    req_to_token = torch.randint(1, pool_size, (num_reqs + 3, width), generator=g, dtype=torch.int32)
    req_pool_indices = torch.randperm(num_reqs + 3, generator=g)[:num_reqs]
    for row, req_slots in zip(req_pool_indices.tolist(), slots):
        req_to_token[row, : len(req_slots)] = req_slots.to(torch.int32)
    return DecodeBatch(
        query=torch.randn(num_reqs, num_q_heads, HEAD_DIM, generator=g),
        k_cache=torch.randn(pool_size, num_kv_heads, HEAD_DIM, generator=g),
        v_cache=torch.randn(pool_size, num_kv_heads, HEAD_DIM, generator=g),
        req_to_token=req_to_token,
        req_pool_indices=req_pool_indices,
        seq_lens=torch.tensor(seq_lens),
    )


def run_both(backend, batch: DecodeBatch, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    stock = stock_method()(backend, *batch.args(), **kwargs)
    ours = cpu_decode_attention.sdpa_forward_decode(backend, *batch.args(), **kwargs)
    return stock, ours


def num_groups(batch: DecodeBatch, window: int | None = None) -> int:
    return len(cpu_decode_attention.decode_layout(batch.req_to_token, batch.req_pool_indices, batch.seq_lens,
                                                  window).groups)


CASES = {
    # name: (seq_lens, heads, groups the layout makes with PAD_ROWS_PER_CALL = 64)
    "one-request": ([37], GQA, 1),
    "equal-lengths": ([64, 64, 64, 64], GQA, 1),
    "close-lengths-padded": ([300, 290, 180, 251, 299], GQA, 2),  # 300 299 290 251 | 180
    "short-and-long": ([2048, 3, 1, 2000, 700, 5, 1500], GQA, 4),  # 2048 2000 | 1500 | 700 | 5 3 1
    "mixed-mha": ([17, 1, 511, 1200, 9], MHA, 3),  # 1200 | 511 | 17 9 1
    "sixty-four-requests": ([1 + (i * 37) % 900 for i in range(64)], GQA, 13),
}


@pytest.fixture
def pad_rows(monkeypatch):
    """The grouping constant at a value of the test's choosing (64 unless set)."""
    monkeypatch.setattr(cpu_decode_attention, "PAD_ROWS_PER_CALL", 64)
    return lambda rows: monkeypatch.setattr(cpu_decode_attention, "PAD_ROWS_PER_CALL", rows)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_stock(backend, pad_rows, name):
    seq_lens, heads, groups = CASES[name]
    batch = make_batch(seq_lens, heads["num_q_heads"], heads["num_kv_heads"])
    stock, ours = run_both(backend, batch, scaling=HEAD_DIM**-0.5, enable_gqa=heads["enable_gqa"])
    assert not ours.isnan().any(), "a request's row was left unwritten"
    torch.testing.assert_close(ours, stock, atol=ATOL, rtol=RTOL)
    assert num_groups(batch) == groups


@pytest.mark.parametrize("rows,groups", [(0, 7), (10**9, 1)])
def test_grouping_extremes_match_stock(backend, pad_rows, rows, groups):
    """No padding at all (a group per distinct length) and a single padded block give SGLang's result alike."""
    pad_rows(rows)
    batch = make_batch([5, 900, 33, 33, 2, 1200, 64, 901], 9, 3, seed=9)
    stock, ours = run_both(backend, batch, scaling=0.125, enable_gqa=True)
    torch.testing.assert_close(ours, stock, atol=ATOL, rtol=RTOL)
    assert num_groups(batch) == groups


@pytest.mark.parametrize("window", [0, 4, 100, 5000, -1])
def test_sliding_window_matches_stock(backend, window):
    batch = make_batch([1, 40, 300, 1000, 101], 9, 3, seed=1)
    stock, ours = run_both(backend, batch, scaling=0.1, enable_gqa=True, sliding_window_size=window)
    torch.testing.assert_close(ours, stock, atol=ATOL, rtol=RTOL)


def test_window_trims_each_request_to_its_last_positions(backend, pad_rows):
    batch = make_batch([3000, 20, 2500], 9, 3, seed=2)
    layout = cpu_decode_attention.decode_layout(batch.req_to_token, batch.req_pool_indices, batch.seq_lens, 100)
    assert [tuple(g.slots.shape) for g in layout.groups] == [(2, 101), (1, 20)]  # 20 tokens: all of request 1
    first = layout.groups[0]
    row = first.rows.tolist().index(0)  # request 0: positions 2899..2999 of its row
    expected = batch.req_to_token[batch.req_pool_indices[0], 2899:3000].long()
    assert torch.equal(first.slots[row], expected)


def test_default_scaling(backend):
    batch = make_batch([33, 1, 400], 9, 3, seed=3)
    stock, ours = run_both(backend, batch, enable_gqa=True)
    torch.testing.assert_close(ours, stock, atol=ATOL, rtol=RTOL)


def test_bf16_cache_is_cast_to_query_dtype(backend):
    batch = make_batch([50, 3, 700], 9, 3, seed=4)
    batch = replace(batch, k_cache=batch.k_cache.bfloat16(), v_cache=batch.v_cache.bfloat16())
    stock, ours = run_both(backend, batch, scaling=0.125, enable_gqa=True)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, stock, atol=ATOL, rtol=RTOL)


def test_empty_batch(backend):
    batch = make_batch([5], 9, 3, seed=5)
    empty = replace(batch, query=batch.query[:0], req_pool_indices=batch.req_pool_indices[:0],
                    seq_lens=batch.seq_lens[:0])
    out = cpu_decode_attention.sdpa_forward_decode(backend, *empty.args(), scaling=0.125, enable_gqa=True)
    assert out.shape == (0, 9, HEAD_DIM)


def test_layout_follows_the_step(backend):
    """Same tensors, same layout object; a new seq_lens, or a req_to_token written in place (as each decode step
    writes its new slot), gives a new layout and SGLang's result."""
    batch = make_batch([10, 200, 31], 9, 3, seed=6)
    kwargs = dict(scaling=0.125, enable_gqa=True)
    first = cpu_decode_attention.decode_layout(batch.req_to_token, batch.req_pool_indices, batch.seq_lens, None)
    assert cpu_decode_attention.decode_layout(batch.req_to_token, batch.req_pool_indices, batch.seq_lens,
                                              None) is first
    # The next step: every request one token longer, its new slot written into req_to_token in place.
    new_slots = torch.arange(3, dtype=torch.int32) + 1
    batch.req_to_token[batch.req_pool_indices, batch.seq_lens] = new_slots
    grown = replace(batch, seq_lens=batch.seq_lens + 1)
    stock, ours = run_both(backend, grown, **kwargs)
    torch.testing.assert_close(ours, stock, atol=ATOL, rtol=RTOL)
    # Same seq_lens object, a slot rewritten in place: the version change is seen.
    layout = cpu_decode_attention.decode_layout(grown.req_to_token, grown.req_pool_indices, grown.seq_lens, None)
    grown.req_to_token[grown.req_pool_indices[1], 5] = 7
    assert cpu_decode_attention.decode_layout(grown.req_to_token, grown.req_pool_indices, grown.seq_lens,
                                              None) is not layout
    stock, ours = run_both(backend, grown, **kwargs)
    torch.testing.assert_close(ours, stock, atol=ATOL, rtol=RTOL)


def test_layers_with_different_windows_share_the_step(backend):
    """Layers alternating between a window and none (as some models' do) each keep their layout for the step."""
    batch = make_batch([500, 20, 260], 9, 3, seed=10)
    args = (batch.req_to_token, batch.req_pool_indices, batch.seq_lens)
    full, windowed = (cpu_decode_attention.decode_layout(*args, w) for w in (None, 50))
    assert full is not windowed
    assert cpu_decode_attention.decode_layout(*args, None) is full
    assert cpu_decode_attention.decode_layout(*args, 50) is windowed
    for window in (None, 50, None):
        stock, ours = run_both(backend, batch, scaling=0.125, enable_gqa=True, sliding_window_size=window)
        torch.testing.assert_close(ours, stock, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("kwargs", [
    dict(causal=True),
    dict(encoder_lens=torch.tensor([4, 4])),
    dict(is_cross_attn=True, encoder_lens=torch.tensor([4, 4])),
], ids=["causal", "decoder-with-encoder-tokens", "cross-attention"])
def test_hook_routes_unhandled_cases_to_stock(backend, kwargs):
    batch = make_batch([20, 6], 9, 3, seed=7)
    sentinel = object()
    got = cpu_decode_attention.run_sdpa_forward_decode(
        lambda self, *args, **kw: sentinel, backend, *batch.args(), scaling=0.125, **kwargs
    )
    assert got is sentinel


def test_hook_follows_the_flag(backend, monkeypatch):
    batch = make_batch([40, 3], 9, 3, seed=8)
    taken = []

    def original(self, *args, **kwargs):
        taken.append("stock")
        return stock_method()(self, *args, **kwargs)

    for argv in ([], ["--multilora-stock-baseline", "decode-attention"]):
        parser = argparse.ArgumentParser()
        flags.add_cli_args(parser)
        args = flags.pop_from_namespace(parser.parse_args(argv))
        monkeypatch.setenv(flags.ENV_VAR, json.dumps(dataclasses.asdict(args)))
        out = cpu_decode_attention.run_sdpa_forward_decode(original, backend, *batch.args(), scaling=0.125,
                                                           enable_gqa=True)
        assert not out.isnan().any()
    assert taken == ["stock"], "only --multilora-stock-baseline decode-attention should take SGLang's path"


@pytest.fixture(scope="module")
def upstream_backend(tmp_path_factory):
    """SGLang's backend class with the upstream decode diff applied."""
    return make_backend(load_upstream(UPSTREAM_DIFF, tmp_path_factory.mktemp("upstream")).TorchNativeAttnBackend)


def new_forward(upstream_backend) -> None:
    """What SGLang's model runner calls before each forward (no SWA pool here: out_cache_loc is not read)."""
    upstream_backend.init_forward_metadata(SimpleNamespace(out_cache_loc=None))


@pytest.mark.parametrize("window", [None, 0, 100, -1])
@pytest.mark.parametrize("name", list(CASES))
def test_upstream_diff_matches_stock(backend, upstream_backend, pad_rows, name, window):
    seq_lens, heads, _ = CASES[name]
    batch = make_batch(seq_lens, heads["num_q_heads"], heads["num_kv_heads"])
    kwargs = dict(scaling=HEAD_DIM**-0.5, enable_gqa=heads["enable_gqa"], sliding_window_size=window)
    stock = stock_method()(backend, *batch.args(), **kwargs)
    new_forward(upstream_backend)
    upstream = upstream_backend._run_sdpa_forward_decode(*batch.args(), **kwargs)
    assert not upstream.isnan().any(), "a request's row was left unwritten"
    torch.testing.assert_close(upstream, stock, atol=ATOL, rtol=RTOL)
    # The same groups as the hook's (same rule, same constant).
    assert len(upstream_backend.decode_groups[window][1]) == num_groups(batch, window)


def test_upstream_diff_builds_groups_once_per_forward_and_window(backend, upstream_backend):
    batch = make_batch([500, 20, 260], 9, 3, seed=10)
    kwargs = dict(scaling=0.125, enable_gqa=True)
    new_forward(upstream_backend)
    built = {}
    for window in (None, 50, None, 50):  # layers alternating windows in one forward
        upstream = upstream_backend._run_sdpa_forward_decode(*batch.args(), sliding_window_size=window, **kwargs)
        stock = stock_method()(backend, *batch.args(), sliding_window_size=window, **kwargs)
        torch.testing.assert_close(upstream, stock, atol=ATOL, rtol=RTOL)
        groups = upstream_backend.decode_groups[window]
        assert built.setdefault(window, groups) is groups, "a later layer rebuilt the forward's groups"
    assert set(upstream_backend.decode_groups) == {None, 50}
    # The next forward: every request one token longer, its new slot written into req_to_token in place.
    batch.req_to_token[batch.req_pool_indices, batch.seq_lens] = torch.arange(3, dtype=torch.int32) + 1
    grown = replace(batch, seq_lens=batch.seq_lens + 1)
    new_forward(upstream_backend)
    assert upstream_backend.decode_groups == {}
    upstream = upstream_backend._run_sdpa_forward_decode(*grown.args(), **kwargs)
    torch.testing.assert_close(upstream, stock_method()(backend, *grown.args(), **kwargs), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("kwargs", [
    dict(encoder_lens=torch.tensor([4, 4])),
    dict(is_cross_attn=True, encoder_lens=torch.tensor([4, 4])),
], ids=["decoder-with-encoder-tokens", "cross-attention"])
def test_upstream_diff_leaves_encoder_batches_to_the_loop(backend, upstream_backend, kwargs):
    batch = make_batch([20, 6], 9, 3, seed=7)
    new_forward(upstream_backend)
    upstream = upstream_backend._run_sdpa_forward_decode(*batch.args(), scaling=0.125, enable_gqa=True, **kwargs)
    stock = stock_method()(backend, *batch.args(), scaling=0.125, enable_gqa=True, **kwargs)
    torch.testing.assert_close(upstream, stock, atol=ATOL, rtol=RTOL)
    assert upstream_backend.decode_groups == {}, "an encoder batch took the grouped path"
