"""End to end: a real CPU SGLang server with the plugin on the embedded MoE model (a 4-expert Mixtral), two random
expert LoRA adapters (rank 8 on the fused experts; rank 16 on the experts and the attention's q/v) and the base
model; PEFT is the oracle.

Stock SGLang cannot start a transformers-path MoE model on a CPU (`patches/moe_cpu.py`); with the plugin, HF's own
experts run, wrapped in `MultiLoRAExperts`. Requests for all three arms are sent at once (so batches mix expert
adapters and base rows), and every greedy output equals PEFT's token for token with its logprobs and top-5
(`tests/oracle.py`); the base arm is HF transformers' own greedy output. Each adapter visibly changes the output.
The server runs without the unified pool (the default path); MULTILORA_TEST_MOE_POOL=1 runs the same test with
`--radix-cache-backend multilora` (the unified pool holds the expert units; invariants checked every step), which
costs another server start and so is left out of the default suite.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import start_server
from tests.e2e.served import assert_cases_match, chat_cases, generate
from tests.unit.test_expert_lora import ADAPTERS, make_expert_adapter

pytestmark = pytest.mark.e2e

MAX_NEW_TOKENS = 10
QUESTIONS = ["What is the capital of France?", "What do bees make?"]


@pytest.fixture(scope="module")
def adapter_dirs(moe_model_path, tmp_path_factory) -> dict[str, str]:
    import torch
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("moe_adapters")
    base = AutoModelForCausalLM.from_pretrained(moe_model_path, dtype=torch.float32)
    return {name: make_expert_adapter(base, str(root / name), rank, seed, extra)
            for name, (rank, seed, extra) in ADAPTERS.items()}


@pytest.fixture(scope="module")
def server(moe_model_path, adapter_dirs):
    root = next(iter(adapter_dirs.values())).rsplit("/", 1)[0]
    pool = ["--radix-cache-backend", "multilora", "--multilora-check-invariants"]
    handle = start_server(moe_model_path, ["--multilora-adapter-dir", root, "--max-loras-per-batch", "4",
                                           "--max-lora-rank", "16",
                                           *(pool if os.environ.get("MULTILORA_TEST_MOE_POOL") == "1" else [])],
                          name="e2e_moe_lora")
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def moe_oracle(moe_model_path, tokenizer):
    from tests.oracle import PeftOracle

    return PeftOracle(moe_model_path, eos_token_ids={tokenizer.eos_token_id})


def test_expert_adapters_and_base_match_peft_concurrently(server, adapter_dirs, moe_oracle, tokenizer):
    cases = chat_cases(tokenizer, (None, *ADAPTERS), adapter_dirs, QUESTIONS)
    with ThreadPoolExecutor(len(cases)) as pool:
        responses = list(pool.map(lambda c: generate(server, c[0], c[2], MAX_NEW_TOKENS), cases))
    assert_cases_match(moe_oracle, tokenizer, cases, responses, MAX_NEW_TOKENS)
