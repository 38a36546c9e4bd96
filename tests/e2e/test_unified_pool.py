"""End to end: adapter weights and KV in one pool (the default of the tree backend).

24 random PEFT adapters (ranks 8 to 64; attention only, MLP only or every projection; a quarter of them aLoRAs;
some in PEFT's other layouts: `q_proj` alone, k/v without q, a regex or dotted `target_modules`,
`layers_to_transform`, rsLoRA scaling, a fractional alpha, weights in a pickled `.bin`) on a server whose pool
holds about a third of their weights plus some KV. Concurrent base, LoRA and aLoRA traffic
over all of them, twice in different orders: adapters are evicted and copied back into KV slots while the tree
evicts KV, and every output must equal PEFT's (tokens and logprobs). The server runs in test mode: the tree's and
the pool's invariants after every step (`--multilora-check-invariants`: free + adapter + cached + running KV ==
total, cached KV == the tree's tokens, no KV of a non-resident adapter) and SGLang's own slot accounting
(`SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY`); a violation stops the server and fails every later request.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.conftest import start_server
from tests.e2e.served import generate, memory, wait_idle
from tests.oracle import assert_matches

pytestmark = pytest.mark.e2e

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
TARGETS = [ATTN, ATTN + MLP, MLP]
RANKS = [8, 16, 32, 64]
NUM_ADAPTERS = 24
INVOCATION = "<|im_start|>verify\n"
NEW_TOKENS = 8
PROMPT_WORDS = 40
# SmolLM2-135M: a slot (one token's K and V over 30 layers) holds 46,080 B. The 24 adapters take about 12.7k
# slots; the pool holds a third of that plus room for the KV of a few running requests.
POOL_SLOTS = 6000
# Adapters in PEFT's other layouts (by index; the rest use TARGETS), loaded at start-up through SGLang's own reading
# of the directory as well as ours: SGLang stacks q/k/v and once failed on any of them missing.
VARIANTS = {
    0: {"target_modules": ["q_proj"]},
    4: {"target_modules": r".*\.(q_proj|v_proj|up_proj)"},  # PEFT saves a regex as a string
    5: {"target_modules": ["k_proj", "v_proj", "gate_proj"], "use_rslora": True},  # an aLoRA
    8: {"layers_to_transform": list(range(0, 30, 3)), "lora_alpha": 12.5},
    12: {"target_modules": ["self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj"], "use_rslora": True},
}
PICKLED = {16}  # saved as adapter_model.bin (PEFT's safe_serialization=False)


def _make_adapters(model_path: str, tokenizer, root) -> list[dict]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    invocation = tokenizer(INVOCATION, add_special_tokens=False).input_ids
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    out = []
    for i in range(NUM_ADAPTERS):
        rank, targets, alora = RANKS[i % 4], TARGETS[(i // 4) % 3], i % 4 == 1
        torch.manual_seed(100 + i)
        kwargs = {"r": rank, "lora_alpha": 2 * rank, "target_modules": targets, **VARIANTS.get(i, {})}
        config = LoraConfig(init_lora_weights=False, task_type="CAUSAL_LM",
                            alora_invocation_tokens=invocation if alora else None, **kwargs)
        model = get_peft_model(base, config)
        with torch.no_grad():  # random weights of a scale that moves greedy outputs without breaking the model
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(0.5)
        name = f"a{i:02d}_r{rank}_{'alora' if alora else 'lora'}"
        model.save_pretrained(str(root / name), safe_serialization=i not in PICKLED)
        base = model.unload()
        out.append({"name": name, "path": str(root / name), "rank": rank, "alora": alora})
    return out


@pytest.fixture(scope="module")
def adapters(model_path, tokenizer, tmp_path_factory) -> list[dict]:
    return _make_adapters(model_path, tokenizer, tmp_path_factory.mktemp("unified_pool_adapters"))


def _start(model_path, adapters, name: str, overlap: bool = False):
    root = adapters[0]["path"].rsplit("/", 1)[0]
    return start_server(model_path, [
        "--multilora-adapter-dir", root, "--max-loras-per-batch", "4", "--max-lora-rank", "256",
        "--radix-cache-backend", "multilora", "--chunked-prefill-size", "128", "--multilora-check-invariants",
    ], name=name, max_total_tokens=POOL_SLOTS, env={"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1"},
        overlap=overlap)


@pytest.fixture(scope="module")
def server(model_path, adapters):
    handle = _start(model_path, adapters, "e2e_unified_pool")
    yield handle
    handle.stop()


def _prompt(tokenizer, rng: random.Random, words: list[str], alora: bool) -> list[int]:
    text = " ".join(rng.choices(words, k=PROMPT_WORDS))
    messages = [{"role": "user", "content": f"Summarise: {text}"}]
    if alora:
        messages.append({"role": "assistant", "content": "It is a list of words."})
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        return ids + tokenizer(INVOCATION, add_special_tokens=False).input_ids
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_adapters_move_between_pool_and_host_and_outputs_match_peft(server, adapters, tokenizer, oracle):
    _serve_everything_twice_and_check(server, adapters, tokenizer, oracle)


def test_under_the_overlap_scheduler_kv_moves_and_outputs_match_peft(model_path, adapters, tokenizer, oracle):
    """The same traffic with SGLang's overlap scheduler (its default on GPUs): each batch is built while the last
    one's results are still to be processed, so KV moves while a batch is in flight; that batch's result processing
    (finished requests' KV into the tree, over-allocated slots freed) must find the moved ids."""
    handle = _start(model_path, adapters, "e2e_unified_pool_overlap", overlap=True)
    try:
        info = requests.get(f"{handle.url}/get_server_info", timeout=30).json()
        assert info["disable_overlap_schedule"] is False, "the server runs without the overlap scheduler"
        swapper = _serve_everything_twice_and_check(handle, adapters, tokenizer, oracle)
        assert swapper["kv_compactions"] > 0, swapper
    finally:
        handle.stop()


def _serve_everything_twice_and_check(server, adapters, tokenizer, oracle) -> dict:
    """Every adapter and the base model, twice in different orders, 4 at a time; outputs against PEFT's, then the
    idle accounting. Returns the swapper's counters."""
    pool = memory(server)["unified_pool"]
    sizes = [a["num_slots"] for a in pool["adapter_sizes"].values()]
    assert len(sizes) == NUM_ADAPTERS and min(sizes) >= 1, pool
    assert sum(sizes) > 2 * pool["num_slots"], "the adapters together must be several times what the pool holds"

    rng = random.Random(11)
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 3)
    work = [(a["name"], a["path"], _prompt(tokenizer, rng, words, a["alora"])) for a in adapters]
    work += [(None, None, _prompt(tokenizer, rng, words, False)) for _ in range(4)]
    rounds = []
    with ThreadPoolExecutor(max_workers=4) as executor:
        for order in range(2):  # the second round, in another order, finds most adapters evicted again
            shuffled = work[:] if order == 0 else rng.sample(work, len(work))
            rounds.append((shuffled, list(executor.map(lambda w: generate(server, w[0], w[2], NEW_TOKENS), shuffled))))
    oracle.prefetch([(path, ids, NEW_TOKENS) for _, path, ids in work], ignore_eos=True)
    for shuffled, responses in rounds:
        for (name, path, ids), response in zip(shuffled, responses):
            expected = oracle.greedy(path, ids, NEW_TOKENS, ignore_eos=True)
            assert_matches(response, expected, f"{name or 'base'} through the unified pool")

    m = wait_idle(server)
    pool = m["unified_pool"]
    swapper = pool["swapper"]
    assert swapper["adapter_evictions"] > 0 and swapper["adapter_loads"] + swapper["prefetches"] > NUM_ADAPTERS, pool
    assert swapper["invalid_kv_slots"] == 0, pool
    # Loads refused for scattered free slots moved KV out of a window: the outputs above, PEFT's to the token, were
    # served with KV that moved under running requests (17 moves in 20 refusals in one run).
    assert swapper["refused_loads"] == 0 or swapper["kv_compactions"] > 0, swapper
    slots = pool["slots"]
    assert slots["kv_running"] == 0 and slots["in_flight"] == 0, slots
    assert slots["free"] + slots["adapter"] + slots["kv_cached"] == pool["num_slots"] == m["total"], slots
    assert slots["kv_cached"] == pool["tree_kv_tokens"], pool
    # SGLang's view when idle: every slot free or reclaimable (cached KV and unused adapters), none pinned.
    assert m["cache_protected"] == 0 and m["free"] + m["cache_evictable"] == m["total"], m
    # No separate adapter tensors: the serving copies are the pool's slots; the host keeps one copy each.
    assert m["adapters"]["weights"] == {} and m["adapters"]["slot_buffers"] == 0, m["adapters"]
    return swapper


def test_an_adapter_larger_than_the_pool_is_refused_with_both_sizes(server, model_path, tokenizer, tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = LoraConfig(r=256, lora_alpha=256, init_lora_weights=False, task_type="CAUSAL_LM",
                        target_modules=ATTN + MLP, layers_to_transform=[0])  # one layer: a small file, many slots
    get_peft_model(base, config).save_pretrained(str(tmp_path / "huge"))
    res = requests.post(server.url + "/load_lora_adapter", json={"lora_name": "huge", "lora_path": str(tmp_path / "huge")},
                        timeout=120)
    assert res.status_code == 400, res.text
    assert "'huge' takes" in res.text and f"of the pool's {POOL_SLOTS}" in res.text, res.text
    assert "no request on it could ever run" in res.text, res.text
    # The server still serves, and the refused adapter left nothing behind.
    assert generate(server, None, tokenizer("Hello", add_special_tokens=False).input_ids, NEW_TOKENS)["meta_info"]
    assert "huge" not in memory(server)["adapters"]["host"]


def _save_peft(model_path: str, root, name: str, **config) -> str:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(7)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, task_type="CAUSAL_LM", **config))
    model.save_pretrained(str(root / name))
    return str(root / name)


def _load(server, name: str, path: str) -> requests.Response:
    return requests.post(server.url + "/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=120)


def _with_config(adapter: dict, root, name: str, **fields) -> str:
    """A copy of `adapter`'s directory whose config sets `fields` (as PEFT writes them)."""
    import json
    import shutil

    path = root / name
    shutil.copytree(adapter["path"], path)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, **fields}))
    return str(path)


def test_adapters_with_parts_no_lora_layer_holds_are_refused_by_name(server, adapters, tokenizer, tmp_path):
    bias = _with_config(adapters[2], tmp_path, "with_bias", bias="lora_only")
    saved = _with_config(adapters[2], tmp_path, "with_head", modules_to_save=["lm_head"])
    for name, path, says in [("with_bias", bias, "'bias': 'lora_only'"), ("with_head", saved, "'modules_to_save'")]:
        res = _load(server, name, path)
        assert res.status_code == 400, res.text
        assert f"LoRA adapter '{name}'" in res.text and says in res.text, res.text
        assert name not in memory(server)["adapters"]["host"]
    assert generate(server, None, tokenizer("Hello", add_special_tokens=False).input_ids, NEW_TOKENS)["meta_info"]


def test_an_adapter_on_q_proj_alone_loads_at_run_time_and_matches_peft(server, model_path, tokenizer, oracle,
                                                                        tmp_path):
    path = _save_peft(model_path, tmp_path, "q_only", r=16, lora_alpha=64, target_modules=["q_proj"])
    res = _load(server, "q_only", path)
    assert res.status_code == 200, res.text
    try:
        ids = _prompt(tokenizer, random.Random(5), sorted(w for w in tokenizer.get_vocab() if w.isalpha()), False)
        expected = oracle.greedy(path, ids, NEW_TOKENS, ignore_eos=True)
        base = oracle.greedy(None, ids, NEW_TOKENS, ignore_eos=True)
        assert max(abs(a - b) for a, b in zip(expected.logprobs, base.logprobs)) > 1e-2, "the adapter changes nothing"
        assert_matches(generate(server, "q_only", ids, NEW_TOKENS), expected, "q_proj-only adapter loaded at run time")
    finally:
        assert requests.post(server.url + "/unload_lora_adapter", json={"lora_name": "q_only"}, timeout=60).ok
