"""The unified pool under SGLang's own LoRA layers (`--lora-backend multilora`), on CPU with SGLang's real classes.

A two-layer Llama-shaped model built of SGLang's parallel linear layers; SGLang's real `LoRAManager` over it (its
adapter loading and normalisation, its layer wrapping, its `LoRAMemoryPool` and batch-slot assignment) with the
plugin's hooks wrapped around the methods the server hooks; real PEFT adapter files, made by PEFT for a Hugging Face
Llama of the same shape; SGLang's real KV pool under `UnifiedTokenAllocator` / `LiveMemory`. Every wrapped layer's
LoRA delta is checked against PEFT's own modules of the same adapters. (SGLang's native models do not run on this
CPU machine, so the server path itself runs on the transformers model; these are the same objects it would use.)
"""

from __future__ import annotations

import json
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

from tests.integration.test_lora_backend import no_pinning, sglang_tp1  # noqa: F401 (fixtures)

H, HEAD, HEADS, KV_HEADS, INTER, LAYERS, SLOTS, R_MAX = 64, 16, 4, 2, 96, 2, 4, 16
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name -> (rank, alpha, target modules)
    "full": (16, 32, ALL),
    "attn": (8, 8, ["q_proj", "v_proj", "o_proj"]),
    "mlp": (4, 16, ["gate_proj", "up_proj", "down_proj"]),
}
SUBMODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
              "o_proj": ("o_proj",), "down_proj": ("down_proj",)}
KV_SLOTS, KV_HEAD_DIM = 600, 32  # one slot: 2 x 2 x 32 floats per layer; the adapters take 46-126 slots each


def _hf_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS,
                       num_key_value_heads=KV_HEADS, head_dim=HEAD, num_hidden_layers=LAYERS, vocab_size=128)


@pytest.fixture(scope="module")
def peft_adapters(tmp_path_factory):
    """name -> (directory, PEFT model): random A and B (init_lora_weights=False), saved as PEFT saves them."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    out = {}
    for i, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(10 + i)
        model = get_peft_model(LlamaForCausalLM(_hf_config()),
                               LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False))
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = (path, model)
    return out


def _peft_delta(peft_model, layer: int, target: str, x: torch.Tensor) -> torch.Tensor:
    """PEFT's LoRA delta of SGLang's fused module `target` (its sub-projections side by side), float64."""
    blocks = peft_model.base_model.model.model.layers[layer]
    parts = []
    for sub in SUBMODULES[target]:
        module = getattr(blocks.self_attn if sub in ("q_proj", "k_proj", "v_proj", "o_proj") else blocks.mlp, sub)
        if not hasattr(module, "lora_A"):  # not targeted: no delta
            parts.append(torch.zeros(x.shape[0], module.out_features, dtype=torch.float64))
            continue
        a, b = module.lora_A["default"].weight.double(), module.lora_B["default"].weight.double()
        parts.append(module.scaling["default"] * (x.double() @ a.t() @ b.t()))
    return torch.cat(parts, dim=1)


def _sglang_model():
    from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    def block():
        attn, mlp, layer = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
        attn.qkv_proj = QKVParallelLinear(H, HEAD, HEADS, KV_HEADS, bias=False)
        attn.o_proj = RowParallelLinear(HEADS * HEAD, H, bias=False)
        mlp.gate_up_proj = MergedColumnParallelLinear(H, [INTER, INTER], bias=False)
        mlp.down_proj = RowParallelLinear(INTER, H, bias=False)
        layer.self_attn, layer.mlp = attn, mlp
        return layer

    torch.manual_seed(0)
    model, inner = torch.nn.Module(), torch.nn.Module()
    inner.layers = torch.nn.ModuleList([block() for _ in range(LAYERS)])
    model.model, model.config = inner, _hf_config()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return model


def _wrap(monkeypatch, owner, name: str, hook) -> None:
    """Wraps `owner.name` with an AROUND hook, as SGLang's HookRegistry does in the server."""
    original = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda self, *a, **k: hook(original, self, *a, **k))


@pytest.fixture
def served(sglang_tp1, no_pinning, peft_adapters, monkeypatch):  # noqa: F811
    """SGLang's LoRAManager with the plugin's hooks, `--lora-backend multilora`, and the unified pool holding its
    adapters; yields (manager, memory, registry)."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.lora.lora_manager import LoRAManager
    from sglang.srt.lora.lora_registry import LoRARef
    from sglang.srt.lora.mem_pool import LoRAMemoryPool
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.server_args import ServerArgs

    from sgl_multilora.patches import flags, lora_backend, lora_pool_layers, lora_transformers
    from sgl_multilora.patches.state import process_state
    from sgl_multilora.patches.unified_memory import LiveMemory, UnifiedTokenAllocator
    from sgl_multilora.tree import LoraRadixTree

    monkeypatch.setenv(flags.ENV_VAR, json.dumps(asdict(flags.MultiLoRAArgs(radix_backend=True))))
    state = process_state()
    monkeypatch.setattr(state, "lora", None)
    monkeypatch.setattr(state, "memory", None)
    monkeypatch.setattr(state, "lora_backend", None)
    lora_backend.register()
    _wrap(monkeypatch, LoRAMemoryPool, "init_buffers", lora_transformers.init_buffers)
    _wrap(monkeypatch, LoRAMemoryPool, "load_lora_weight_to_buffer", lora_pool_layers.load_to_slot)
    _wrap(monkeypatch, LoRAMemoryPool, "_clear_buffer_slot_for_base", lora_pool_layers.clear_slot)
    _wrap(monkeypatch, LoRAManager, "update_lora_info", lora_pool_layers.update_lora_info)
    _wrap(monkeypatch, LoRAManager, "_load_lora_adapter", lora_transformers.load_lora_adapter)
    _wrap(monkeypatch, LoRAManager, "_unload_lora_adapter", lora_transformers.unload_lora_adapter)
    _wrap(monkeypatch, LoRAManager, "prepare_lora_batch", lora_transformers.prepare_lora_batch)

    refs = [LoRARef(lora_name=name, lora_path=str(path), pinned=False) for name, (path, _) in peft_adapters.items()]
    manager = LoRAManager(_sglang_model(), _hf_config(), SLOTS, LoadConfig(), torch.float32,
                          ServerArgs(model_path="m", device="cpu"), lora_backend="multilora", max_lora_rank=R_MAX,
                          target_modules=ALL, lora_paths=refs)
    kv = MHATokenToKVPool(KV_SLOTS, 1, torch.float32, KV_HEADS, KV_HEAD_DIM, LAYERS, "cpu", False)
    memory = LiveMemory(UnifiedTokenAllocator(KV_SLOTS, torch.float32, "cpu", kv, False), LoraRadixTree())
    registry = state.adapters
    for lora_id, adapter in registry.loaded_items():  # as MultiLoRARadixCache does when the scheduler starts
        memory.register(lora_id, adapter)
    state.memory = memory
    lora_pool_layers.check_memory(memory)
    manager.ids = {ref.lora_name: ref.lora_id for ref in refs}
    yield manager, memory, registry
    for ref in list(manager.lora_refs.values()):
        registry.remove(ref.lora_id)


def _batch(manager, memory, registry, names: list[str | None], seq_lens: list[int], mode: str = "extend"):
    """One batch through what the scheduler and ForwardBatch.init_new do: admission makes each adapter resident,
    SGLang assigns batch slots (`fetch_new_loras`), then `prepare_lora_batch`."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    lora_ids = [None if n is None else manager.ids[n] for n in names]
    for uid in set(lora_ids) - {None}:
        assert memory.admit(f"req-{uid}", registry.identity(uid), None)
    memory.set_running([SimpleNamespace(lora_id=uid) for uid in lora_ids])
    fb = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND if mode == "extend" else ForwardMode.DECODE, batch_size=len(names),
        extend_seq_lens=torch.tensor(seq_lens, dtype=torch.int32), extend_seq_lens_cpu=list(seq_lens),
        extend_num_tokens=sum(seq_lens), lora_ids=lora_ids)
    manager.fetch_new_loras(set(lora_ids))
    manager.prepare_lora_batch(fb)
    return [n for n, k in zip(names, seq_lens) for _ in range(k)]


def _check_layers(manager, peft_adapters, token_names: list[str | None], rows: int | None = None) -> None:
    """Every wrapped layer's output minus its base output equals PEFT's delta of each token's adapter."""
    from sglang.srt.lora.utils import get_target_module_name

    g = torch.Generator().manual_seed(len(token_names))
    n = rows or len(token_names)
    for layer, modules in enumerate(manager.lora_modules):
        for full_name, module in modules.items():
            target = get_target_module_name(full_name, manager.memory_pool.target_modules)
            x = torch.randn(n, module.base_layer.input_size, generator=g)
            delta = module(x)[0].double() - module.base_layer(x)[0].double()
            for i, name in enumerate(token_names):
                expected = (torch.zeros_like(delta[i : i + 1]) if name is None
                            else _peft_delta(peft_adapters[name][1], layer, target, x[i : i + 1]))
                torch.testing.assert_close(delta[i : i + 1], expected, atol=1e-5, rtol=1e-4,
                                           msg=f"layer {layer} {target} token {i} ({name})")


def test_sglang_layers_compute_from_the_pool_as_peft(served, peft_adapters):
    manager, memory, registry = served
    # No adapter memory outside the pool but one host copy: SGLang's buffers are placeholders, its host copies freed.
    for buffers in (*manager.memory_pool.A_buffer.values(), *manager.memory_pool.B_buffer.values()):
        for t in buffers:
            assert t.untyped_storage().nbytes() == 4 and t.shape[0] == SLOTS
    for uid, adapter in manager.loras.items():
        assert all(not layer.weights for layer in adapter.layers)
        assert registry.loaded(uid) is not None
    steps = [(["full", None, "attn", "mlp"], [5, 3, 4, 2]), (["mlp", "mlp", "full"], [1, 6, 2]), ([None, None], [3, 1])]
    for names, seq_lens in steps:
        tokens = _batch(manager, memory, registry, names, seq_lens)
        _check_layers(manager, peft_adapters, tokens)
        memory.check_invariants()
    stats = memory.stats()
    assert stats["adapters"]["resident"] == 3 and stats["bytes"]["adapter_weights"] > 0
    # The weights the layers read are views of SGLang's K/V buffers, not copies.
    views = memory.weights(registry.identity(manager.ids["full"]))
    bases = {t.untyped_storage().data_ptr() for t in (*memory.k_buffers, *memory.v_buffers)}
    assert all(a.untyped_storage().data_ptr() in bases for a, _ in views.weights.values())


def test_evicted_adapter_comes_back_elsewhere_and_is_rebound(served, peft_adapters):
    manager, memory, registry = served
    _check_layers(manager, peft_adapters, _batch(manager, memory, registry, ["full", "attn"], [2, 2]))
    memory.set_running([])
    full = registry.identity(manager.ids["full"])
    before = memory.weights(full)
    # KV fills the pool: every adapter no request runs on is evicted (the dependency rule holds throughout).
    kv = memory.allocator.alloc(KV_SLOTS - memory.pool.num_of("adapter") - 8)
    assert memory.evict(memory.pool.num_slots) > 0 and memory.weights(full) is None
    memory.allocator.free(kv)
    memory.check_invariants()
    tokens = _batch(manager, memory, registry, ["attn", "full", None], [3, 1, 2])
    assert memory.weights(full) is not None and memory.weights(full) is not before
    _check_layers(manager, peft_adapters, tokens)


def test_decode_graph_tables_are_refilled_in_place(served, peft_adapters, monkeypatch):
    """The CUDA-graph decode path on CPU (Triton interpreter): the device tables a captured graph reads keep their
    addresses while the adapters bound to the slots change."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    manager, memory, registry = served
    backend = manager.lora_backend
    backend.impl = "triton"
    backend._pool_key = None  # rebuild with the kernels' tables
    manager.init_decode_cuda_graph_batch_info(max_bs_in_cuda_graph=4, num_tokens_per_req=1)
    seen = None
    for names in (["full", "attn", "full"], ["mlp", None, "attn", "mlp"]):
        padded = names + [None] * (4 - len(names))
        tokens = _batch(manager, memory, registry, padded, [1] * 4, mode="decode")
        assert backend.batch_info.use_cuda_graph
        ptrs = {k: w.tables()["a_ptrs"].data_ptr() for k, w in backend._pool_weights.items()}
        assert len(ptrs) == 4 * LAYERS and backend._table_set is not None  # every module reads the table set
        assert seen is None or ptrs == seen
        seen = ptrs
        _check_layers(manager, peft_adapters, tokens)


def test_adapter_larger_than_the_pool_is_refused_and_nothing_changes(served, peft_adapters, monkeypatch):
    """`/load_lora_adapter` after start-up into a pool of 64 slots: the rank-16 adapter over every projection needs
    more; the load fails naming both sizes, SGLang and the registry forget it, the pool is untouched."""
    from sglang.srt.lora.lora_registry import LoRARef
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from sgl_multilora.patches.state import process_state
    from sgl_multilora.patches.unified_memory import LiveMemory, UnifiedTokenAllocator
    from sgl_multilora.tree import LoraRadixTree

    manager, _, registry = served
    kv = MHATokenToKVPool(64, 1, torch.float32, KV_HEADS, KV_HEAD_DIM, LAYERS, "cpu", False)
    small = LiveMemory(UnifiedTokenAllocator(64, torch.float32, "cpu", kv, False), LoraRadixTree())
    monkeypatch.setattr(process_state(), "memory", small)
    ref = LoRARef(lora_name="too-big", lora_path=str(peft_adapters["full"][0]), pinned=False)
    result = manager.load_lora_adapter(ref)
    assert not result.success and "too-big" in result.error_message and "64" in result.error_message, result
    assert ref.lora_id not in manager.loras and ref.lora_id not in manager.lora_refs
    assert registry.spec(ref.lora_id) is None and registry.loaded(ref.lora_id) is None
    assert small.stats()["adapters"]["registered"] == 0 and small.pool.num_free == 64
    small.check_invariants()
    # The same adapter under another name fits the served pool: it loads, and computes as PEFT's.
    ok = LoRARef(lora_name="full-again", lora_path=str(peft_adapters["full"][0]), pinned=False)
    monkeypatch.setattr(process_state(), "memory", served[1])
    assert manager.load_lora_adapter(ok).success
    manager.ids["full-again"] = ok.lora_id
    peft_adapters = {**peft_adapters, "full-again": peft_adapters["full"]}
    _check_layers(manager, peft_adapters, _batch(manager, served[1], registry, ["full-again", "attn"], [2, 1]))
    assert manager.unload_lora_adapter(ok).success
    assert registry.loaded(ok.lora_id) is None and ok.lora_id not in manager.loras


def test_flashinfer_ops_are_refused_with_the_pool(sglang_tp1):  # noqa: F811
    """FlashInfer's segment GEMM needs stacked buffers: with the pool on, the server refuses it at start-up."""
    from sgl_multilora.patches import lora_backend
    from sgl_multilora.patches.state import process_state

    saved = process_state().lora_backend
    try:
        backend = lora_backend.MultiLoRABackend(SLOTS, torch.device("cpu"))
        backend.impl = "flashinfer"
        with pytest.raises(RuntimeError, match="--multilora-stock-baseline memory"):
            backend.use_pool([])
    finally:
        process_state().lora_backend = saved
