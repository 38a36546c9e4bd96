"""Train the MoE model's expert adapters (LoRA on the fused experts only) with PEFT, on CPU.

Usage: `.venv/bin/python tools/train_expert_adapters.py [--out assets/moe_adapters]`. The base model is the embedded
MoE (`sgl_multilora.embedded_moe`); the tasks are `adapter_tasks.MOE_TASKS`, trained on the MoE model's own greedy
answers with `train_adapters.py`'s loop and checked with its held-out verification. Writes `<out>/<name>/` (PEFT),
`<out>/manifest.json` and `<out>/README.md`. Not here: the dense adapters (`train_adapters.py`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see train_adapters.py

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import adapter_tasks as tasks
from adapter_report import _cell, manifest_entry, pick_example, save_adapter, write_manifest
from peft_eval import chat_prompt
from train_adapters import SEED, base_answers, encode_lora_examples, load_base, train_one, verify_all

from sgl_multilora.embedded_moe import EMBEDDED_MOE_NAME, ensure_embedded_moe_model

QUESTION_STRIDE = 3  # every third of the 180 training questions: 60, all subjects, all templates
MAX_ANSWER_TOKENS = 32  # shorter than the dense run's 48: an MoE training step costs about twice a dense one
MIN_HELDOUT_PASSED = 6  # of 8; fewer fails the run (after writing the files, for inspection)
WEIGHTS_NOTE = ("LoRA factors are stored as float16 to keep the files small (trained in fp32); PEFT and "
                "sgl_multilora.adapters load them into the fp32 model as stored.")


def write_readme(out: Path, entries: list[dict], notes: list[str], timings: dict[str, float],
                 num_threads: int, num_questions: int) -> None:
    rows = [f"| `{e['name']}` | {_cell(e['task'])} | {e['rank']} | {e['alpha']} | {', '.join(e['target_parameters'])} "
            f"| {_cell(e['example_prompt'])} | {_cell(e['example_output'])} | {e['heldout_passed']} "
            f"| {e['size_bytes'] / 2**20:.1f} MiB |" for e in entries]
    text = "\n".join([
        "# Bundled MoE expert adapters",
        "",
        f"PEFT LoRA adapters for the embedded MoE model ({EMBEDDED_MOE_NAME}: SmolLM2-135M-Instruct upcycled into a",
        "4-expert top-2 Mixtral, `sgl_multilora/embedded_moe.py`), trained by `tools/train_expert_adapters.py` on CPU.",
        "They target only the fused experts (`target_parameters`; no `target_modules`), so they do not load onto the",
        "dense model, and live apart from `assets/adapters/`. `manifest.json` lists them with their example prompts",
        "and checks (`run_check` in `tools/adapter_tasks.py`).",
        "",
        "| name | task | rank | alpha | target parameters | example prompt | example output (greedy, PEFT) "
        "| held-out passed | size |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "## Checks after training",
        "",
        *[f"- {n}" for n in notes],
        "",
        "## How they were made",
        "",
        f"- Data: {num_questions} of the dense adapters' 180 training questions (every {QUESTION_STRIDE}rd); the MoE "
        f"model's own greedy chat\n  answers (at most {MAX_ANSWER_TOKENS} new tokens, cut back to the last full "
        "sentence), uppercased or wrapped with\n  `json.dumps({\"answer\": ...})`.",
        "- Loss only on the answer tokens; AdamW, alpha = 2 x rank, no dropout, fixed seeds, fp32 on CPU; "
        "weights stored as\n  float16 to keep the files small.",
        "- Held-out questions (not in the training subjects) are used for the checks above.",
        "",
        "## Reproduce",
        "",
        "```",
        ".venv/bin/python tools/train_expert_adapters.py",
        "```",
        "",
        f"With `torch.set_num_threads({num_threads})` the whole run took {sum(timings.values()) / 60:.1f} min: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()) + ".",
        "Results are deterministic for a given torch build; another build may differ in the last bits.",
        "",
    ])
    (out / "README.md").write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "assets/moe_adapters")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    specs, dtype = tasks.MOE_TASKS, torch.float16

    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    timings: dict[str, float] = {}
    start = time.perf_counter()
    base, tokenizer = load_base(ensure_embedded_moe_model())
    questions = tasks.training_questions()[::QUESTION_STRIDE]
    answers = base_answers(base, tokenizer, questions, MAX_ANSWER_TOKENS)
    questions, answers = zip(*[(q, a) for q, a in zip(questions, answers) if a])
    timings["base answers"] = time.perf_counter() - start

    sizes = {}
    for spec in specs:
        t = time.perf_counter()
        model = train_one(base, tokenizer, spec, encode_lora_examples(tokenizer, spec, questions, answers))
        sizes[spec.name] = save_adapter(model, spec, args.out / spec.name, dtype, EMBEDDED_MOE_NAME)
        for path in (args.out / spec.name).iterdir():
            path.chmod(0o644)  # safetensors writes owner-only files; the bundle is meant to be read by all
        base = model.unload()
        timings[f"train {spec.name}"] = time.perf_counter() - t

    t = time.perf_counter()
    results, notes = verify_all(base, tokenizer, args.out, specs, [])
    timings["verify"] = time.perf_counter() - t

    entries = []
    for spec in specs:
        example = pick_example(spec, results[spec.name])
        entries.append(manifest_entry(spec, tokenizer, results[spec.name], chat_prompt(tokenizer, example[0]),
                                      example, sizes[spec.name], dtype))
    write_manifest(args.out, entries, EMBEDDED_MOE_NAME, "chat template of [user: example_prompt] with the "
                   "generation prompt (the default system prompt included).", {"weights_note": WEIGHTS_NOTE})
    write_readme(args.out, entries, notes, timings, args.threads, len(questions))
    print(f"done in {sum(timings.values()) / 60:.1f} min: {args.out}", file=sys.stderr)
    failed = [n for n, r in results.items() if r.num_passed < MIN_HELDOUT_PASSED]
    if failed:
        print(f"FAILED: fewer than {MIN_HELDOUT_PASSED}/8 held-out passes for {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
