"""Train the bundled LoRA / aLoRA adapters on the embedded SmolLM2-135M-Instruct with PEFT, on CPU.

Usage: `.venv/bin/python tools/train_adapters.py [--out assets/adapters]`. Writes `<out>/<name>/`
(PEFT `adapter_config.json` + `adapter_model.safetensors`), `<out>/manifest.json` and `<out>/README.md`.
Training data is the base model's own greedy answers, transformed per task (see `adapter_tasks.py`).
Deterministic for a given torch build: fixed seeds, 2 threads, greedy decoding.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning: when other jobs share the cores, spinning threads
# made every op wait for a descheduled partner (15x slower on 2 busy cores). Read when torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import adapter_tasks as tasks
from adapter_report import save_adapter, write_manifest, write_readme
from peft_eval import (
    alora_prefix_sanity,
    chat_prompt,
    generate,
    verify_alora,
    verify_lora,
)

from sgl_multilora.embedded import ensure_embedded_model

SEED = 0
MAX_ANSWER_TOKENS = 48
NUM_WARMUP_STEPS = 5
NUM_LABEL_TOKENS = 2  # an aLoRA label is one token, then <|im_end|>


def encode_lora_examples(tokenizer, spec, questions, answers) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target ids) with target = transformed answer + `<|im_end|>`; loss on target only."""
    transform = tasks.TRANSFORMS[spec.name]
    return [
        (tokenizer(chat_prompt(tokenizer, q)).input_ids,
         tokenizer(transform(a)).input_ids + [tokenizer.eos_token_id])
        for q, a in zip(questions, answers)
    ]


def encode_alora_examples(tokenizer, spec, questions, answers, rng) -> list[tuple[list[int], list[int]]]:
    """(context ids, suffix ids): context = finished chat, suffix = invocation + label + `<|im_end|>`."""
    if spec.name == "check_caps":
        triples = tasks.check_caps_examples(answers, rng)
    else:
        triples = tasks.rate_length_examples(answers, 2 * len(answers), rng)
    invocation = tokenizer(spec.invocation_text).input_ids
    out = []
    for i, text, label in triples:
        label_ids = tokenizer(label).input_ids
        assert len(label_ids) == 1, f"label {label!r} must be one token so suffixes align in a batch"
        context = tokenizer(chat_prompt(tokenizer, questions[i], text)).input_ids
        out.append((context, invocation + label_ids + [tokenizer.eos_token_id]))
    return out


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask), both [len(rows), max_len], rows right-aligned."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return ids, mask


def lora_loss(model, batch, pad_id: int) -> torch.Tensor:
    """Mean CE over target tokens. Left padding aligns targets at the end, so only the last
    `max target len + 1` positions need vocabulary logits."""
    ids, mask = left_pad([p + t for p, t in batch], pad_id)
    keep = max(len(t) for _, t in batch) + 1
    labels = ids[:, -keep + 1:].clone()
    for i, (_, target) in enumerate(batch):
        labels[i, : keep - 1 - len(target)] = -100
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids,
                   logits_to_keep=keep).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def alora_loss(model, batch, pad_id: int) -> torch.Tensor:
    """Mean CE over the label + `<|im_end|>` after the invocation.

    aLoRA leaves every token before the invocation to the base model, so the context runs once without
    the adapter and without gradients; only the short suffix (equal length in a batch) is trained.
    """
    ctx_ids, ctx_mask = left_pad([c for c, _ in batch], pad_id)
    suffix = torch.tensor([s for _, s in batch])
    with torch.no_grad(), model.disable_adapter():
        cache = model(input_ids=ctx_ids, attention_mask=ctx_mask, use_cache=True,
                      position_ids=(ctx_mask.cumsum(-1) - 1).clamp(min=0),
                      logits_to_keep=1).past_key_values
    mask = torch.cat([ctx_mask, torch.ones_like(suffix)], dim=1)
    position_ids = ctx_mask.sum(-1, keepdim=True) + torch.arange(suffix.shape[1])
    logits = model(input_ids=suffix, attention_mask=mask, position_ids=position_ids,
                   past_key_values=cache).logits
    pred = logits[:, -NUM_LABEL_TOKENS - 1:-1]
    return torch.nn.functional.cross_entropy(pred.reshape(-1, pred.shape[-1]),
                                             suffix[:, -NUM_LABEL_TOKENS:].reshape(-1))


def train_one(base, tokenizer, spec, examples) -> torch.nn.Module:
    """Wrap `base` with a fresh adapter for `spec`, train it, return the PEFT model (base mutated)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(SEED)
    config = LoraConfig(
        r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0, target_modules=list(spec.target_modules) or None,
        target_parameters=list(spec.target_parameters) or None, task_type="CAUSAL_LM",
        alora_invocation_tokens=tokenizer(spec.invocation_text).input_ids if spec.invocation_text else None,
    )
    model = get_peft_model(base, config)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / NUM_WARMUP_STEPS)
                                              * max(0.1, 1 - s / spec.num_steps))
    loss_fn = alora_loss if spec.kind == "alora" else lora_loss
    rng = random.Random(SEED)
    order: list[int] = []
    model.train()
    bar = tqdm(range(spec.num_steps), desc=f"train {spec.name}", leave=True)
    for _ in bar:
        if len(order) < spec.batch_size:
            order += rng.sample(range(len(examples)), len(examples))
        batch = [examples[order.pop()] for _ in range(spec.batch_size)]
        loss = loss_fn(model, batch, tokenizer.pad_token_id)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return model


def load_base(checkpoint: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return model, tokenizer


def base_answers(model, tokenizer, questions: list[str], max_new_tokens: int = MAX_ANSWER_TOKENS) -> list[str]:
    prompts = [chat_prompt(tokenizer, q) for q in questions]
    with tqdm(total=len(prompts), desc="base answers") as bar:
        raw = generate(model, tokenizer, prompts, max_new_tokens, progress=bar)
    return [tasks.trim_answer(a) for a in raw]


def verify_all(base, tokenizer, out: Path, specs, heldout_answers) -> tuple[dict, list[str]]:
    """Reload every saved adapter from disk onto `base` and run the held-out checks.

    Returns ({name: VerifyResult}, notes for the README).
    """
    from peft import PeftModel

    model = None
    results, notes = {}, []
    questions = tasks.HELD_OUT_QUESTIONS
    for spec in specs:
        if model is None:
            model = PeftModel.from_pretrained(base, str(out / spec.name), adapter_name=spec.name)
        else:
            model.load_adapter(str(out / spec.name), adapter_name=spec.name)
        model.set_adapter(spec.name)
        model.eval()
        if spec.kind == "lora":
            result = verify_lora(model, tokenizer, spec, questions)
        else:
            result = verify_alora(model, tokenizer, spec, questions, heldout_answers)
            before, after = alora_prefix_sanity(
                model, tokenizer, spec, chat_prompt(tokenizer, questions[0], heldout_answers[0]))
            assert before == 0.0, f"{spec.name}: aLoRA changed logits before its invocation ({before})"
            assert after > 0.0, f"{spec.name}: aLoRA did not change logits after its invocation"
            notes.append(f"`{spec.name}`: logits before the invocation equal the base model's exactly "
                         f"(max diff {before:g}); from the invocation on they differ (max {after:.2f}).")
        notes.append(f"`{spec.name}`: {result.num_passed}/{result.num_total} held-out "
                     f"{result.note or 'outputs pass the checks ' + str([c['type'] for c in spec.checks])}.")
        results[spec.name] = result
        tqdm.write(f"{spec.name}: {result.num_passed}/{result.num_total} "
                   + " | ".join(repr(e[2]) for e in result.examples[:3]))
    return results, notes


def example_input(tokenizer, spec, example) -> str:
    question, context_answer = example[:2]
    if spec.kind == "lora":
        return chat_prompt(tokenizer, question)
    return chat_prompt(tokenizer, question, context_answer) + spec.invocation_text


def main(argv: list[str] | None = None) -> None:
    from adapter_report import manifest_entry, pick_example

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "assets/adapters")
    parser.add_argument("--only", default="", help="comma-separated adapter names (default: all)")
    parser.add_argument("--save-dtype", default="float16", choices=["float16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    specs = [s for s in tasks.TASKS if not args.only or s.name in args.only.split(",")]
    dtype = getattr(torch, args.save_dtype)

    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    timings: dict[str, float] = {}
    start = time.perf_counter()
    base, tokenizer = load_base(ensure_embedded_model())
    questions = tasks.training_questions()
    answers = base_answers(base, tokenizer, questions + tasks.HELD_OUT_QUESTIONS)
    answers, heldout_answers = answers[:len(questions)], answers[len(questions):]
    kept = [(q, a) for q, a in zip(questions, answers) if a]
    questions, answers = [q for q, _ in kept], [a for _, a in kept]
    timings["base answers"] = time.perf_counter() - start

    sizes = {}
    for spec in specs:
        t = time.perf_counter()
        rng = random.Random(SEED)
        if spec.kind == "lora":
            examples = encode_lora_examples(tokenizer, spec, questions, answers)
        else:
            examples = encode_alora_examples(tokenizer, spec, questions, answers, rng)
        model = train_one(base, tokenizer, spec, examples)
        sizes[spec.name] = save_adapter(model, spec, args.out / spec.name, dtype)
        base = model.unload()
        timings[f"train {spec.name}"] = time.perf_counter() - t

    t = time.perf_counter()
    results, notes = verify_all(base, tokenizer, args.out, specs, heldout_answers)
    timings["verify"] = time.perf_counter() - t

    entries = []
    for spec in specs:
        example = pick_example(spec, results[spec.name])
        entries.append(manifest_entry(spec, tokenizer, results[spec.name],
                                      example_input(tokenizer, spec, example), example,
                                      sizes[spec.name], dtype))
    write_manifest(args.out, entries)
    write_readme(args.out, entries, notes, timings)
    print(f"done in {sum(timings.values()) / 60:.1f} min: {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
