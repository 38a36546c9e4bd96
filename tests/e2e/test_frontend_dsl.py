"""End to end: a frontend DSL program picks the adapter per `gen` call through `MultiLoRAEndpoint`.

One real CPU server holds two random PEFT adapters on the embedded model: `style` (standard LoRA) and `check`
(aLoRA, invoked by "<|im_start|>check\\n"). The program runs base answer -> aLoRA check -> base continuation -> LoRA
restyle. Every request the endpoint sent names the right adapter; each call's text equals a direct `/generate` with
the same prompt and adapter, whose tokens equal PEFT's with that adapter (tokens, logprobs and top-5, compared
PEFT_TOKENS past any EOS), and the aLoRA's differs from the base model's; the aLoRA call reused the KV of the base
call before it (at least its whole prompt). Streaming, `select` and fork prefix commits carry the adapter too.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import requests

from tests.oracle import assert_matches, assert_shift_rejected, logprob_fields

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8
PEFT_TOKENS = 12  # tokens of each call's prompt compared with PEFT (ignore_eos)
INVOCATION = "<|im_start|>check\n"
QUESTION = "What is the capital of France?"
HEADER = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
TURN_MORE = "<|im_end|>\n<|im_start|>user\nTell me one more fact.<|im_end|>\n<|im_start|>assistant\n"
TURN_AGAIN = "<|im_end|>\n<|im_start|>user\nSay that again.<|im_end|>\n<|im_start|>assistant\n"
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapter_dirs(model_path, tokenizer, tmp_path_factory) -> dict[str, str]:
    """Two random adapters (fixed seed) saved by PEFT: `style` on every projection, `check` an aLoRA on q/k/v."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("dsl_adapters")
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    invocation_ids = tokenizer(INVOCATION, add_special_tokens=False).input_ids
    configs = {
        "style": {"target_modules": ATTN + MLP},
        "check": {"target_modules": ATTN[:3], "alora_invocation_tokens": invocation_ids},
    }
    dirs = {}
    for name, extra in configs.items():
        torch.manual_seed(0)
        config = LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, task_type="CAUSAL_LM", **extra)
        get_peft_model(copy.deepcopy(base), config).save_pretrained(str(root / name))
        dirs[name] = str(root / name)
    return dirs


@pytest.fixture(scope="module")
def server(tree_server, adapter_dirs):
    """The shared tree server with this module's two adapters loaded at run time (unloaded afterwards)."""
    for name, path in adapter_dirs.items():
        response = requests.post(tree_server.url + "/load_lora_adapter", json={"lora_name": name, "lora_path": path},
                                 timeout=120)
        assert response.status_code == 200, response.text
    yield tree_server
    for name in adapter_dirs:
        requests.post(tree_server.url + "/unload_lora_adapter", json={"lora_name": name}, timeout=120)


@pytest.fixture(scope="module")
def endpoint(server):
    from sgl_multilora.patches.frontend import MultiLoRAEndpoint

    return MultiLoRAEndpoint(server.url)


@contextlib.contextmanager
def recorded_bodies():
    """Yields the list of every JSON body the frontend sends while the block runs (requests still go out)."""
    from sglang.lang.backend import runtime_endpoint

    bodies, send = [], runtime_endpoint.http_request

    def recording(url, json=None, **kwargs):
        bodies.append(json)
        return send(url, json=json, **kwargs)

    runtime_endpoint.http_request = recording
    try:
        yield bodies
    finally:
        runtime_endpoint.http_request = send


def _pipeline():
    import sglang as sgl

    from sgl_multilora.patches.frontend import adapter, gen

    @sgl.function
    def pipeline(s):
        s += HEADER
        s += sgl.gen("answer", max_tokens=MAX_TOKENS)
        s += "<|im_end|>\n" + INVOCATION
        with adapter(s, "check"):
            s += sgl.gen("verdict", max_tokens=MAX_TOKENS)
        s += TURN_MORE
        s += sgl.gen("more", max_tokens=MAX_TOKENS)
        s += TURN_AGAIN
        s += gen("restyled", adapter="style", max_tokens=MAX_TOKENS)

    return pipeline


def expected_calls(state) -> list[tuple[str, str | None, str]]:
    """(prompt text, adapter, variable) of each call, built from the program's text and its outputs."""
    p_answer = HEADER
    p_verdict = p_answer + state["answer"] + "<|im_end|>\n" + INVOCATION
    p_more = p_verdict + state["verdict"] + TURN_MORE
    p_restyled = p_more + state["more"] + TURN_AGAIN
    return [(p_answer, None, "answer"), (p_verdict, "check", "verdict"), (p_more, None, "more"),
            (p_restyled, "style", "restyled")]


def direct_generate(server, text: str, lora: str | None) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}, "lora_path": lora}
    response = requests.post(server.url + "/generate", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def program_run(server, endpoint):
    """The pipeline, run once on an empty cache, with the bodies it sent."""
    endpoint.flush_cache()
    with recorded_bodies() as bodies:
        state = _pipeline().run(backend=endpoint, temperature=0)
        state.sync()
    assert state.error() is None, state.error()
    return state, bodies


def test_each_request_names_the_adapter_of_its_call(program_run):
    state, bodies = program_run
    sent = [(b["text"], b["lora_path"]) for b in bodies]
    assert sent == [(prompt, lora) for prompt, lora, _ in expected_calls(state)]


def test_alora_call_reused_the_base_prefix(program_run):
    state, _ = program_run
    answer, verdict = state.get_meta_info("answer"), state.get_meta_info("verdict")
    # The cache was empty before the program: the check's cached tokens can only be the base call's KV.
    assert verdict["cached_tokens"] > 0, verdict
    assert verdict["cached_tokens"] >= answer["prompt_tokens"], (answer, verdict)


def test_each_call_matches_direct_generate_with_its_adapter(server, program_run):
    state, _ = program_run
    for prompt, lora, name in expected_calls(state):
        assert state[name] == direct_generate(server, prompt, lora)["text"], f"{name} on {lora or 'base'}"
    # The aLoRA really changed the output, so the equality above picks it out (the recorded bodies already pin
    # every call's lora_path; one base request here keeps the module short).
    prompt, lora, name = expected_calls(state)[1]
    assert state[name] != direct_generate(server, prompt, None)["text"], f"{lora} answers as the base model"


def test_each_call_matches_peft(server, program_run, tokenizer, oracle, adapter_dirs):
    """Each call's prompt, continued PEFT_TOKENS tokens past any EOS by the server with the call's adapter, equals
    PEFT's greedy continuation; the call's own output is its first tokens (cut at EOS), so the program's text is
    PEFT's. The aLoRA's comparison also rejects PEFT with its activation start shifted by one."""
    state, _ = program_run
    for prompt, lora, name in expected_calls(state):
        ids = tokenizer(prompt).input_ids  # the server's tokenization of a text prompt (no BOS is added)
        body = {"input_ids": ids, "lora_path": lora, **logprob_fields(),
                "sampling_params": {"max_new_tokens": PEFT_TOKENS, "temperature": 0, "ignore_eos": True}}
        response = requests.post(server.url + "/generate", json=body, timeout=300)
        assert response.status_code == 200, response.text
        out = response.json()
        path = adapter_dirs[lora] if lora else None
        expected = oracle.greedy(path, ids, PEFT_TOKENS, ignore_eos=True)
        assert_matches(out, expected, f"{name} on {lora or 'base'}")
        if lora == "check":
            assert_shift_rejected(out, oracle, path, ids, PEFT_TOKENS, f"{name} on {lora}")
        direct = direct_generate(server, prompt, lora)
        assert direct["text"] == state[name]
        assert direct["output_ids"] == expected.tokens[: len(direct["output_ids"])], (direct, expected.tokens)


def test_streaming_run_gives_the_same_calls(endpoint, program_run):
    state, _ = program_run
    with recorded_bodies() as bodies:
        streamed = _pipeline().run(backend=endpoint, temperature=0, stream=True)
        for _ in streamed.text_iter():
            pass
    assert streamed.error() is None, streamed.error()
    assert all(b["stream"] for b in bodies)
    assert [b["lora_path"] for b in bodies] == [None, "check", None, "style"]
    for name in ("answer", "verdict", "more", "restyled"):
        assert streamed[name] == state[name], name


def test_select_fork_and_cache_prefix_carry_the_adapter(endpoint, program_run):
    import sglang as sgl

    from sgl_multilora.patches.frontend import adapter, gen

    state, _ = program_run
    prompt = expected_calls(state)[1][0]  # ends with the aLoRA's invocation

    @sgl.function
    def judge(s):
        s += prompt
        with adapter(s, "check"):
            s += sgl.gen("pick", choices=["yes", "no"])
            s.sync()  # so that fork() sees the text and commits the prefix (under "check")
            forks = s.fork(2)
        forks += gen("alt", adapter="style", max_tokens=2)
        forks.join()

    with recorded_bodies() as bodies:
        run = judge.run(backend=endpoint, temperature=0)
        run.sync()
        endpoint.cache_prefix(HEADER, adapter="style")
    assert run.error() is None, run.error()
    assert run["pick"] in ("yes", "no")
    summary = [(b["sampling_params"]["max_new_tokens"], json.dumps(b["text"])[:1], b["lora_path"]) for b in bodies]
    assert summary == [
        (0, '"', "check"),  # select: prefill of the shared prefix
        (0, "[", "check"),  # select: the choices' logprobs
        (0, '"', "check"),  # fork(2): the prefix commit
        (2, '"', "style"), (2, '"', "style"),  # one gen per fork
        (0, '"', "style"),  # cache_prefix
    ]
