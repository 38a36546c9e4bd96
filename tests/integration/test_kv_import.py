"""A KV import (`patches/kv_transfer.py` `import_kv`) into SGLang's real memory objects under the LoRA-aware cache
with the unified pool: the moved KV of an adapter that is not resident at the destination, into a pool full of
cached KV. Making the adapter resident and then room for its KV must not evict the adapter itself (it had been, and
the import then gave up with "adapter not resident"). The live routes run in tests/e2e/test_cluster.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

from eval.bench import tree_overhead_arms as arms

KV_TOKENS, LORA_ID = 1200, "lora-0"


def _fill_with_base_kv(cache, allocator) -> None:
    """Every free slot becomes cached base-model KV, one run per 100 tokens (distinct prompts)."""
    namespace = cache.namespace_for(None, None)
    for i in range(allocator.available_size() // 100):
        tokens = [10_000 + i] + list(range(99))
        ids = allocator.alloc(100)
        cache.tree.insert(cache.key_for(namespace, None, tokens, tokens), ids.tolist())
        allocator.mark_cached(ids)


def _export(path, cache, spec, token_ids: list[int]) -> None:
    """A KV export of `token_ids` under `spec`, as a source server writes one (`export_kv`)."""
    from sgl_multilora.patches.kv_transfer import FORMAT, _layout

    k_buffers = cache.token_to_kv_pool_allocator.get_kvcache().k_buffer
    g = torch.Generator().manual_seed(0)
    shape = (len(k_buffers), len(token_ids), *k_buffers[0].shape[1:])
    metadata = {"format": FORMAT, "model": cache.model_id, **{f: json.dumps(x) for f, x in _layout(k_buffers).items()},
                "extra_key": json.dumps(None), "cache_salt": json.dumps(None), "adapter_name": json.dumps(spec.name),
                "adapter_identity": json.dumps(spec.identity), "input_ids": json.dumps(token_ids),
                "prompt_ids": json.dumps(token_ids)}
    save_file({"k": torch.randn(shape, generator=g), "v": torch.randn(shape, generator=g)}, str(path),
              metadata=metadata)


def test_an_import_makes_its_adapter_resident_and_keeps_it_while_making_room(tmp_path):
    from sgl_multilora.patches.kv_transfer import import_kv

    arms.setup_sglang()
    with arms.registered_adapters([LORA_ID], [32]):
        cache, _, allocator = arms.build_arm("ours:unified", KV_TOKENS, window=4)
        memory, spec = cache.memory, cache.adapters.spec(LORA_ID)
        assert not memory.residency.is_resident(spec.identity)
        _fill_with_base_kv(cache, allocator)
        assert allocator.available_size() < 100
        token_ids = list(range(300, 600))
        _export(tmp_path / "kv.safetensors", cache, spec, token_ids)

        answer = import_kv(SimpleNamespace(tree_cache=cache), {"path": str(tmp_path / "kv.safetensors")})

        assert answer == {"tokens": 300, "imported": 300, "cached": 0, "reason": None}, answer
        assert memory.residency.is_resident(spec.identity) and memory.residency.num_running(spec.identity) == 0
        namespace = cache.namespace_for(None, None)
        assert cache.tree.match(cache.key_for(namespace, spec, token_ids, token_ids)).prefix_len == 300
        memory.check_invariants()
        cache.tree.check_invariants()
