"""End to end, InfiniLoRA's setting: one LoRA server holding MoE expert adapters and two CPU workers of the embedded
MoE model (a 4-expert Mixtral) started with only `--multilora-lora-server ADDR`, which hold no adapter weights.

Adapters (random PEFT, unseen by other modules): rank 8 on the fused experts, rank 16 on the experts and q/v, and rank
8 on attention alone. Per layer a worker sends its q/k/v and o rows (one call per group) and, for each MoE sub-layer,
the routed rows of every expert with an adapter (`experts.gate_up`, `experts.down`), tagged by adapter and expert.
Concurrent mixed traffic over both workers gets PEFT's greedy output token by token and logprob by logprob, each
adapter visibly changes it, and the LoRA server's slot accounting closes when idle.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from sgl_multilora.lora_server.launch import LoRAServerProcess
from tests.conftest import REPO, start_server
from tests.e2e.served import assert_cases_match, chat_cases, generate
from tests.unit.test_expert_lora import ADAPTERS, make_expert_adapter

pytestmark = pytest.mark.e2e

MAX_NEW_TOKENS = 8
REMOTE_ADAPTERS = {**ADAPTERS, "attn_r8": (8, 503, ["q_proj", "k_proj", "o_proj"])}
QUESTIONS = ["What is the capital of France?", "What do bees make?"]


@pytest.fixture(scope="module")
def adapter_dirs(moe_model_path, tmp_path_factory) -> dict[str, str]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("remote_moe_adapters")
    base = AutoModelForCausalLM.from_pretrained(moe_model_path, dtype=torch.float32)
    dirs = {}
    for name, (rank, seed, extra) in REMOTE_ADAPTERS.items():
        if name == "attn_r8":  # no expert targets: a plain PEFT LoRA on the attention of the MoE model
            torch.manual_seed(seed)
            model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                                                    task_type="CAUSAL_LM", target_modules=extra))
            model.save_pretrained(str(root / name))
            base = model.unload()
            dirs[name] = str(root / name)
        else:
            dirs[name] = make_expert_adapter(base, str(root / name), rank, seed, extra)
    return dirs


@pytest.fixture(scope="module")
def cluster(moe_model_path, adapter_dirs, tmp_path_factory):
    root = next(iter(adapter_dirs.values())).rsplit("/", 1)[0]
    address = f"ipc://{tmp_path_factory.mktemp('sock')}/lora.sock"
    server = LoRAServerProcess(root, moe_model_path, address, REPO / ".pytest_cache" / "e2e_remote_moe_srv.log").start()
    workers = []
    try:
        for i in range(2):
            workers.append(start_server(moe_model_path, ["--multilora-lora-server", address,
                                                         "--max-loras-per-batch", "4"],
                                        name=f"e2e_remote_moe_worker{i}", max_total_tokens=4096))
        yield server, workers
    finally:
        for w in workers:
            w.stop()
        server.stop()


@pytest.fixture(scope="module")
def moe_oracle(moe_model_path, tokenizer):
    from tests.oracle import PeftOracle

    return PeftOracle(moe_model_path, eos_token_ids={tokenizer.eos_token_id})


def test_expert_and_attention_adapters_over_two_workers_match_peft(cluster, adapter_dirs, moe_oracle, tokenizer):
    server, workers = cluster
    cases = chat_cases(tokenizer, (None, *REMOTE_ADAPTERS), adapter_dirs, QUESTIONS)
    with ThreadPoolExecutor(len(cases)) as pool:
        responses = list(pool.map(lambda ic: generate(workers[ic[0] % 2], ic[1][0], ic[1][2], MAX_NEW_TOKENS),
                                  enumerate(cases)))
    assert_cases_match(moe_oracle, tokenizer, cases, responses, MAX_NEW_TOKENS, "remote ")
    stats = server.stats()
    assert stats["invariants"] == "ok" and stats["errors"] == 0, stats
    assert stats["delta_calls"] > 0, stats
