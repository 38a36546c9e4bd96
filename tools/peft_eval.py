"""Greedy generation and adapter checks with Hugging Face PEFT, for `tools/train_adapters.py`.

Lives here: batched chat generation (base or adapter), the aLoRA prefix-equality sanity check, and the
held-out verification whose results go into `assets/adapters/manifest.json` and its README.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from adapter_tasks import AdapterTask, length_rating, run_check, to_caps


@dataclass
class VerifyResult:
    """Held-out results of one adapter: its examples and how many passed."""

    name: str
    # (question, assistant answer before an aLoRA invocation or "", output, expected aLoRA label or "")
    examples: list[tuple[str, str, str, str]]
    num_passed: int
    num_total: int
    note: str = ""


def chat_prompt(tokenizer, question: str, answer: str | None = None) -> str:
    """The chat-templated text of a user turn, then either the assistant header or a finished answer."""
    messages = [{"role": "user", "content": question}]
    if answer is None:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    messages.append({"role": "assistant", "content": answer})
    return tokenizer.apply_chat_template(messages, tokenize=False)


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 16,
             progress=None) -> list[str]:
    """Greedy continuations of raw prompt texts, batched with left padding; special tokens dropped.

    Works for the base model and for a PEFT model (PEFT finds aLoRA invocations in each row itself).
    """
    tokenizer.padding_side = "left"
    outputs = []
    for start in range(0, len(prompts), batch_size):
        enc = tokenizer(prompts[start:start + batch_size], return_tensors="pt", padding=True)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        new = out[:, enc["input_ids"].shape[1]:]
        outputs += [tokenizer.decode(row, skip_special_tokens=True).strip() for row in new]
        if progress is not None:
            progress.update(len(new))
    return outputs


@torch.no_grad()
def alora_prefix_sanity(model, tokenizer, spec: AdapterTask, context: str) -> tuple[float, float]:
    """(max |logit diff| before the invocation, max |logit diff| from it on) between adapter and base.

    The first must be 0 (aLoRA leaves the prefix, hence its KV cache, to the base model); the second not.
    """
    text = context + spec.invocation_text + "yes"
    ids = tokenizer(text, return_tensors="pt").input_ids
    inv_len = len(tokenizer(spec.invocation_text).input_ids)
    start = ids.shape[1] - 1 - inv_len  # invocation starts here; one label token follows it
    adapted = model(input_ids=ids).logits[0]
    with model.disable_adapter():
        base = model(input_ids=ids).logits[0]
    diff = (adapted - base).abs().amax(dim=-1)
    return diff[:start].max().item(), diff[start:].max().item()


def verify_lora(model, tokenizer, spec: AdapterTask, questions: list[str]) -> VerifyResult:
    outputs = generate(model, tokenizer, [chat_prompt(tokenizer, q) for q in questions], 64)
    passed = sum(all(run_check(c, o) for c in spec.checks) for o in outputs)
    return VerifyResult(spec.name, [(q, "", o, "") for q, o in zip(questions, outputs)], passed,
                        len(outputs))


def verify_alora(model, tokenizer, spec: AdapterTask, questions: list[str],
                 base_answers: list[str]) -> VerifyResult:
    """Accuracy on held-out contexts whose label is known programmatically."""
    contexts = []
    for q, a in zip(questions, base_answers):
        if spec.name == "check_caps":
            contexts += [(q, a, "no"), (q, to_caps(a), "yes")]
        else:
            for cut in (2, 6, 12, 20, 1000):
                text = " ".join(a.split()[:cut])
                contexts.append((q, text, str(length_rating(text))))
    prompts = [chat_prompt(tokenizer, q, a) + spec.invocation_text for q, a, _ in contexts]
    outputs = generate(model, tokenizer, prompts, 4)
    passed = sum(o == label for o, (_, _, label) in zip(outputs, contexts))
    examples = [(q, a, o, label) for (q, a, label), o in zip(contexts, outputs)]
    return VerifyResult(spec.name, examples, passed, len(outputs), note="exact label accuracy")
