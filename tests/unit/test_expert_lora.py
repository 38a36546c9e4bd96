"""MoE expert LoRA in-process: our loader (`sgl_multilora.adapters`) and layers (`MultiLoRAExperts` beside
`MultiLoRALinear`) against Hugging Face PEFT 0.21.2 on the embedded MoE model (a 4-expert Mixtral).

Random adapters (`init_lora_weights=False`, fixed seeds) target the fused experts through PEFT's `target_parameters`
(one of them the attention's q/v projections too). The story: the per-expert A_e, B_e we read give PEFT's own delta
weights; one mixed batch (expert adapter, attention+expert adapter, base rows) through our layers gives, row by row,
the logits PEFT gives for that row's adapter; rows before an activation start get the base model's logits.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from sgl_multilora.adapters import EXPERT_MODULES, AdapterError, expert_unit, load_adapter

EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# name -> (rank, seed, extra target modules)
ADAPTERS = {"experts_r8": (8, 501, None), "attn_experts_r16": (16, 502, ["q_proj", "v_proj"])}
PROMPT = "The capital of France is Paris. The capital of Italy is"
LOGIT_ATOL = 2e-3  # fp32, ours unmerged vs PEFT's merged delta weights: max 5.8e-5 measured (2026-12-02)


def make_expert_adapter(base, out_dir: str, rank: int, seed: int, target_modules: list[str] | None) -> str:
    """Saves a random PEFT adapter on `base`'s fused experts (and `target_modules`) to `out_dir`; `base` is left as
    it was (the adapter is unloaded)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False, task_type="CAUSAL_LM",
                        target_modules=target_modules, target_parameters=EXPERT_PARAMS)
    model = get_peft_model(base, config)
    model.save_pretrained(out_dir)
    model.unload()
    return out_dir


def served_model(path: str):
    """The HF MoE model with our LoRA layers (as `lora_transformers.init_lora_modules` wraps a served one): its
    projections in `MultiLoRALinear`s, its experts in `MultiLoRAExperts`, all reading one `LoRAStep`."""
    from transformers import AutoModelForCausalLM

    from sgl_multilora.patches.lora_experts import attach, wrap_experts
    from sgl_multilora.patches.lora_linear import LoRAStep
    from sgl_multilora.patches.lora_transformers import _wrap_projections

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    shape, layers = _wrap_projections(model.model)
    shape, experts = wrap_experts(model.model, shape)
    step = LoRAStep()
    for layer in layers:
        layer.step = step
    attach(experts, step)
    return model, shape, step, experts


@pytest.fixture(scope="module")
def adapter_dirs(moe_model_path, tmp_path_factory) -> dict[str, str]:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("expert_adapters")
    base = AutoModelForCausalLM.from_pretrained(moe_model_path, dtype=torch.float32)
    return {name: make_expert_adapter(base, str(root / name), rank, seed, extra)
            for name, (rank, seed, extra) in ADAPTERS.items()}


@pytest.fixture(scope="module")
def peft_model(moe_model_path, adapter_dirs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(moe_model_path, dtype=torch.float32).eval()
    names = list(adapter_dirs)
    model = PeftModel.from_pretrained(base, adapter_dirs[names[0]], adapter_name=names[0]).eval()
    for name in names[1:]:
        model.load_adapter(adapter_dirs[name], adapter_name=name)
    return model


@pytest.fixture(scope="module")
def ours(moe_model_path, adapter_dirs):
    model, shape, step, experts = served_model(moe_model_path)
    adapters = {name: load_adapter(path, shape) for name, path in adapter_dirs.items()}
    return model, shape, step, experts, adapters


@torch.no_grad()
def peft_logits(peft_model, name: str | None, input_ids: torch.Tensor) -> torch.Tensor:
    if name is None:
        with peft_model.disable_adapter():
            return peft_model(input_ids=input_ids).logits[0]
    peft_model.set_adapter(name)
    return peft_model(input_ids=input_ids).logits[0]


def test_experts_are_wrapped_and_the_shape_knows_them(ours):
    _, shape, _, experts, _ = ours
    assert len(experts) == shape.num_layers == 30
    assert shape.num_experts == 4 and set(shape.expert_modules) == set(EXPERT_MODULES)
    assert shape.expert_modules["experts.gate_up_proj"].out_features == 2 * 1536


def test_per_expert_factors_give_pefts_delta_weights(ours, peft_model):
    """scaling * B_e @ A_e == PEFT's `ParamWrapper.get_delta_weight` for every expert of every wrapper, layer 0."""
    from peft.tuners.lora.layer import ParamWrapper

    adapters = ours[4]
    for name, adapter in adapters.items():
        wrappers = [m for n, m in peft_model.named_modules()
                    if isinstance(m, ParamWrapper) and ".layers.0.mlp.experts" in n]
        assert len(wrappers) == 2
        for wrapper in wrappers:
            module = f"experts.{wrapper.parameter_name}"
            delta = wrapper.get_delta_weight(name)  # (E, out, in)
            for e in range(delta.shape[0]):
                a, b = adapter.weights[(0, expert_unit(module, e))]
                torch.testing.assert_close(adapter.spec.scaling * b @ a, delta[e], atol=1e-6, rtol=1e-5)


def test_mixed_batch_matches_peft_row_by_row(ours, peft_model, tokenizer):
    """One forward of three rows (expert adapter, attention+expert adapter, base) through our layers: each row's
    logits are PEFT's for its adapter, and each adapter visibly changes them."""
    model, _, step, _, adapters = ours
    ids = torch.tensor([tokenizer(PROMPT).input_ids])
    keys = ["experts_r8", "attn_experts_r16", None]
    step.prepare(keys, [ids.shape[1]] * 3, None, adapters, num_slots=4, device="cpu")
    with torch.no_grad():
        logits = model(input_ids=ids.repeat(3, 1)).logits
    base = peft_logits(peft_model, None, ids)
    for row, key in enumerate(keys):
        expected = peft_logits(peft_model, key, ids)
        torch.testing.assert_close(logits[row], expected, atol=LOGIT_ATOL, rtol=0)
        if key is not None:
            assert (expected - base).abs().max() > 1.0, f"adapter {key} hardly changes the logits"


def test_rows_before_the_activation_start_get_no_expert_delta(ours, peft_model, tokenizer):
    """The expert-only adapter applied from token k on (an aLoRA's layout): logits before k are the base model's,
    from k on they differ."""
    model, _, step, _, adapters = ours
    ids = torch.tensor([tokenizer(PROMPT).input_ids])
    k = ids.shape[1] // 2
    step.prepare(["experts_r8"], [ids.shape[1]], [k], adapters, num_slots=4, device="cpu")
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    base = peft_logits(peft_model, None, ids)
    torch.testing.assert_close(logits[:k], base[:k], atol=LOGIT_ATOL, rtol=0)
    assert (logits[k:] - base[k:]).abs().amax(dim=-1).min() > 0.1


def test_all_base_step_is_hfs_own_experts_forward(ours, peft_model, tokenizer):
    model, _, step, _, adapters = ours
    ids = torch.tensor([tokenizer(PROMPT).input_ids])
    step.prepare([None], [ids.shape[1]], None, adapters, num_slots=4, device="cpu")
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    torch.testing.assert_close(logits, peft_logits(peft_model, None, ids), atol=LOGIT_ATOL, rtol=0)


def test_loader_refuses_what_it_cannot_serve(ours, adapter_dirs, tmp_path):
    """Experts on a model without fused experts; a parameter other than the experts'; a rank that does not fit."""
    from sgl_multilora.adapters import ModelShape

    shape = ours[1]
    dense_only = ModelShape(shape.num_layers, shape.modules, shape.max_rank)
    with pytest.raises(AdapterError, match="fused experts"):
        load_adapter(adapter_dirs["experts_r8"], dense_only)
    for change, pattern in (({"target_parameters": ["mlp.gate.weight"]}, "not supported"),
                            ({"r": 4, "lora_alpha": 8}, "match no targeted fused-experts parameter")):
        bad = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        shutil.copytree(adapter_dirs["experts_r8"], bad)
        config = json.loads((bad / "adapter_config.json").read_text())
        (bad / "adapter_config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(AdapterError, match=pattern):
            load_adapter(bad, shape)


def test_delta_source_sees_one_call_per_sub_layer_with_rows_sorted_by_expert(ours, tokenizer):
    """The `ExpertDeltaSource` seam (what a remote LoRA server would implement): per layer and step one "gate_up" then
    one "down" call, each submitted before its result is asked for, with all routed rows (top-2: twice the tokens)
    sorted by expert, and base rows marked NO_ADAPTER."""
    from sgl_multilora.patches.lora_experts import LocalExpertDeltas
    from sgl_multilora.segments import NO_ADAPTER

    model, _, step, experts, adapters = ours
    calls = []

    class Recording(LocalExpertDeltas):
        def submit(self, layer_id, call, expert_ids, slot_ids, x):
            calls.append(("submit", layer_id, call, expert_ids.clone(), slot_ids.clone(), x.shape))
            return super().submit(layer_id, call, expert_ids, slot_ids, x)

        def result(self, handle):
            calls.append(("result", handle[0]))
            return super().result(handle)

    ids = torch.tensor([tokenizer(PROMPT).input_ids])
    n = ids.shape[1]
    source = Recording(step)
    saved = [layer.deltas for layer in experts]
    try:
        for layer in experts:
            layer.deltas = source
        step.prepare(["experts_r8", None], [n, n], None, adapters, num_slots=4, device="cpu")
        with torch.no_grad():
            model(input_ids=ids.repeat(2, 1))
    finally:
        for layer, deltas in zip(experts, saved):
            layer.deltas = deltas
    assert [c[0] for c in calls] == ["submit", "result"] * 2 * len(experts)
    submits = [c for c in calls if c[0] == "submit"]
    assert [(c[1], c[2]) for c in submits] == [(i, call) for i in range(len(experts)) for call in ("gate_up", "down")]
    for _, _, call, expert_ids, slot_ids, x_shape in submits:
        assert x_shape == (4 * n, 576 if call == "gate_up" else 1536)
        assert bool((expert_ids[1:] >= expert_ids[:-1]).all())
        assert int((slot_ids == NO_ADAPTER).sum()) == 2 * n and int((slot_ids == 0).sum()) == 2 * n
