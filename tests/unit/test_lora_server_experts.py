"""Expert LoRA on a tiny random Mixtral over the wire: PEFT `target_parameters` on the fused experts.

The oracle is PEFT's own `ParamWrapper.get_delta_weight` (per expert, (out, in)) applied to each row's input, for
adapters read back from the files the server read.
"""

from __future__ import annotations

import pytest
import torch

from sgl_multilora.lora_server import LoRAServerClient, LoRAServerError
from sgl_multilora.lora_server.catalog import Catalog, ServerModel
from sgl_multilora.lora_server.server import LoRAServer
from sgl_multilora.lora_server.slots import SlotPool

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

NUM_EXPERTS, HIDDEN, INTER = 4, 32, 24
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_server_moe")
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=INTER,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        num_local_experts=NUM_EXPERTS, num_experts_per_tok=2)
    config.save_pretrained(str(root / "model"))
    specs = {"e8": (8, 16, ["q_proj"], EXPERT_PARAMS), "e4": (4, 4, None, EXPERT_PARAMS[:1])}
    for seed, (name, (rank, alpha, targets, params)) in enumerate(specs.items()):
        torch.manual_seed(seed)
        lc = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, target_parameters=params,
                             init_lora_weights=False)
        peft.get_peft_model(transformers.MixtralForCausalLM(config), lc).save_pretrained(str(root / "adapters" / name))
    oracles = {}
    for name in specs:
        base = transformers.MixtralForCausalLM(config)
        oracles[name] = peft.PeftModel.from_pretrained(base, str(root / "adapters" / name), adapter_name=name)
    model = ServerModel.from_config(root / "model")
    catalog = Catalog.from_dir(root / "adapters", model)
    address = f"ipc://{root}/moe.sock"
    server = LoRAServer(catalog, SlotPool(catalog, 2), address)
    server.start()
    client = LoRAServerClient(address, timeout_s=5.0)
    yield client, oracles, root
    assert client.stats()["invariants"] == "ok"
    client.close()
    server.stop(), server.join()
    server.pool.check_invariants()


def expert_delta_weight(oracle, name: str, layer: int, param: str) -> torch.Tensor | None:
    """PEFT's delta weight (E, out, in) of `param` at `layer`, or None when the adapter does not target it."""
    from peft.tuners.lora.layer import ParamWrapper

    prefix = f"model.layers.{layer}.mlp.experts"
    for mod_name, mod in oracle.base_model.model.named_modules():
        if isinstance(mod, ParamWrapper) and mod_name.startswith(prefix) and mod.parameter_name == param:
            with torch.no_grad():
                return mod.get_delta_weight(name)
    return None


@pytest.mark.parametrize("group,param,width", [("experts.gate_up", "gate_up_proj", HIDDEN),
                                               ("experts.down", "down_proj", INTER)])
def test_expert_deltas_equal_peft(moe, group, param, width):
    client, oracles, _ = moe
    gen = torch.Generator().manual_seed(7)
    names = ["e8", "e4"]
    index = torch.tensor([0, 1, 0, -1, 1, 0, 1, 0], dtype=torch.int32)
    experts = torch.tensor([0, 0, 3, 2, 1, 3, 3, 1], dtype=torch.int32)
    for layer in (0, 1):
        x = torch.randn(len(index), width, generator=gen)
        delta = client.submit_delta(layer, group, x, index, names, expert_ids=experts).result()
        assert delta.shape == (len(index), 2 * INTER if param == "gate_up_proj" else HIDDEN)
        for row, (i, e) in enumerate(zip(index.tolist(), experts.tolist())):
            dw = expert_delta_weight(oracles[names[i]], names[i], layer, param) if i >= 0 else None
            assert (dw is None) == (i < 0 or (names[i] == "e4" and param == "down_proj"))  # e4: gate_up only
            want = torch.zeros(delta.shape[1]) if dw is None else x[row] @ dw[e].T
            torch.testing.assert_close(delta[row], want, atol=1e-5, rtol=1e-5)


def test_catalog_reports_experts_and_dense_targets(moe):
    client, oracles, _ = moe
    cat = client.catalog()
    assert cat["num_experts"] == NUM_EXPERTS and "gate_up" not in cat["groups"]
    e8, e4 = cat["adapters"]["e8"], cat["adapters"]["e4"]
    assert e8["experts"] == e4["experts"] == [0, 1, 2, 3]
    assert e8["modules"]["1"] == ["experts.down_proj", "experts.gate_up_proj", "q_proj"]
    assert e4["modules"]["0"] == ["experts.gate_up_proj"] and e4["scaling"] == 1.0
    x = torch.randn(2, HIDDEN)
    delta = client.submit_delta(0, "qkv", x, torch.zeros(2, dtype=torch.int32), ["e8"]).result()
    q = oracles["e8"].base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        torch.testing.assert_close(delta[:, :HIDDEN], q(x) - q.base_layer(x), atol=1e-5, rtol=1e-5)
    assert not delta[:, HIDDEN:].any()  # k and v not targeted


def test_expert_requests_are_checked(moe):
    client, _, _ = moe
    x, one = torch.randn(2, HIDDEN), torch.zeros(2, dtype=torch.int32)
    with pytest.raises(LoRAServerError, match="bad_expert"):
        client.submit_delta(0, "experts.gate_up", x, one, ["e8"], expert_ids=torch.tensor([0, 4])).result()
    with pytest.raises(LoRAServerError, match="unknown_group"):
        client.submit_delta(0, "gate_up", x, one, ["e8"]).result()  # Mixtral has no dense MLP
    with pytest.raises(LoRAServerError, match="per-row expert ids"):
        client.submit_delta(0, "experts.gate_up", x, one, ["e8"]).result()
