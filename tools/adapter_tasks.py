"""The bundled adapters' tasks, as plain Python: questions, answer transforms, labels and checks.

Used by `tools/train_adapters.py` to build training data from the base model's own answers, and by the
tests and demos to judge an adapter's output (`run_check`). No torch, no model, no SGLang here.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field

SUBJECTS = [
    "the sun", "a cat", "water", "the moon", "a bicycle", "coffee", "a library", "rain", "the ocean",
    "a tree", "bread", "a car", "snow", "a dog", "the sky", "an apple", "a river", "a mountain",
    "a computer", "a book", "chocolate", "a bird", "the wind", "a phone", "a garden", "milk", "a train",
    "a clock", "fire", "a bee", "a horse", "the desert", "an island", "a bridge", "salt", "a camera",
]
TEMPLATES = [
    "What is {}?",
    "Describe {} in one sentence.",
    "Tell me one fact about {}.",
    "Why is {} important?",
    "Where can you find {}?",
]
# Never trained on: subjects outside SUBJECTS, used for verification and the README examples.
HELD_OUT_QUESTIONS = [
    "What is the capital of France?",
    "What is a volcano?",
    "Describe a piano in one sentence.",
    "Tell me one fact about honey.",
    "Why is sleep important?",
    "Where can you find a penguin?",
    "What is a rainbow?",
    "Tell me one fact about elephants.",
]

# aLoRA invocation sequences: a chat turn header for a made-up role. `<|im_start|>` is a special token
# and the role word is followed by a newline, so the ids are the same wherever the text appears.
CHECK_CAPS_INVOCATION = "<|im_start|>check_caps\n"
RATE_LENGTH_INVOCATION = "<|im_start|>rate_length\n"

# rate_length buckets: rating -> inclusive word-count range.
LENGTH_BUCKETS = {1: (1, 3), 2: (4, 8), 3: (9, 15), 4: (16, 24), 5: (25, 45)}


@dataclass(frozen=True)
class AdapterTask:
    """How one bundled adapter is trained and judged: its PEFT shape, task, checks and training
    settings. `invocation_text` is set for aLoRA only; `target_parameters` for MoE expert LoRA only (PEFT's
    fused-experts parameters, e.g. "mlp.experts.gate_up_proj"). (A served adapter's own description is
    `sgl_multilora.adapters.AdapterSpec`.)"""

    name: str
    task: str
    rank: int
    target_modules: tuple[str, ...]
    checks: tuple[dict, ...]
    invocation_text: str | None = None
    num_steps: int = 60
    batch_size: int = 4
    lr: float = 1e-3
    labels: tuple[str, ...] = field(default_factory=tuple)
    target_parameters: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        return "alora" if self.invocation_text else "lora"

    @property
    def alpha(self) -> int:
        return 2 * self.rank


ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
ATTN_MLP = ATTN + ("gate_proj", "up_proj", "down_proj")
QKV = ("q_proj", "k_proj", "v_proj")

TASKS = [
    AdapterTask(
        "caps", "Answers in CAPITAL LETTERS.", 8, ATTN,
        checks=({"type": "mostly_uppercase", "min_fraction": 0.9},),
    ),
    AdapterTask(
        "json", 'Answers as a JSON object {"answer": "..."}.', 16, ATTN_MLP,
        checks=({"type": "json_object_with_key", "key": "answer"},),
    ),
    AdapterTask(
        "bullets", 'Answers as a bulleted list, one "- " line per sentence.', 32, ATTN_MLP,
        checks=({"type": "bullet_lines"},),
    ),
    AdapterTask(
        "check_caps", "After an assistant answer: is it written in capital letters? yes/no.", 8, QKV,
        checks=({"type": "one_of", "values": ["yes", "no"]},),
        invocation_text=CHECK_CAPS_INVOCATION, batch_size=8, labels=("yes", "no"),
    ),
    AdapterTask(
        "rate_length", "After an assistant answer: rate its length 1-5 (by word-count bucket).", 16, QKV,
        checks=({"type": "one_of", "values": ["1", "2", "3", "4", "5"]},),
        invocation_text=RATE_LENGTH_INVOCATION, num_steps=120, batch_size=8, lr=2e-3,
        labels=tuple(str(r) for r in LENGTH_BUCKETS),
    ),
]

# The MoE model's expert adapters (`tools/train_expert_adapters.py`, bundled in assets/moe_adapters/): LoRA on the
# fused experts only, through PEFT's `target_parameters`; no `target_modules`.
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
MOE_TASKS = [
    AdapterTask(
        "moe_caps", "Answers in CAPITAL LETTERS.", 8, (), target_parameters=EXPERTS,
        checks=({"type": "mostly_uppercase", "min_fraction": 0.9},), num_steps=40, lr=2e-3,
    ),
    AdapterTask(
        "moe_json", 'Answers as a JSON object {"answer": "..."}.', 4, (), target_parameters=EXPERTS,
        checks=({"type": "json_object_with_key", "key": "answer"},), num_steps=40, lr=2e-3,
    ),
]


def training_questions() -> list[str]:
    """TEMPLATES x SUBJECTS, in a fixed order (180 questions)."""
    return [t.format(s) for s in SUBJECTS for t in TEMPLATES]


def trim_answer(text: str) -> str:
    """Strip, and cut a generation that hit the token limit back to its last full sentence."""
    text = text.strip()
    if text and text[-1] not in ".!?":
        ends = [m.end() for m in re.finditer(r"[.!?](?=\s|$)", text)]
        if ends:
            text = text[: ends[-1]]
    return text


def to_caps(answer: str) -> str:
    return answer.upper()


def to_json(answer: str) -> str:
    return json.dumps({"answer": answer}, ensure_ascii=False)


def split_sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


def to_bullets(answer: str) -> str:
    return "\n".join(f"- {s}" for s in split_sentences(answer))


TRANSFORMS = {"caps": to_caps, "json": to_json, "bullets": to_bullets,
              "moe_caps": to_caps, "moe_json": to_json}


def length_rating(text: str) -> int:
    """The rate_length label: the bucket of the word count (words = whitespace-separated)."""
    num_words = len(text.split())
    for rating, (lo, hi) in LENGTH_BUCKETS.items():
        if lo <= num_words <= hi:
            return rating
    return 5 if num_words > LENGTH_BUCKETS[5][1] else 1


def check_caps_examples(answers: list[str], rng: random.Random) -> list[tuple[int, str, str]]:
    """(answer index, assistant text, label) triples: per answer one uppercased ("yes") and one plain,
    JSON or bulleted ("no"), shuffled."""
    out = []
    for i, answer in enumerate(answers):
        out.append((i, to_caps(answer), "yes"))
        out.append((i, rng.choice([answer, answer, to_json(answer), to_bullets(answer)]), "no"))
    rng.shuffle(out)
    return out


def rate_length_examples(answers: list[str], num: int, rng: random.Random) -> list[tuple[int, str, str]]:
    """`num` (answer index, assistant text, rating) triples, ratings balanced: an answer, followed by
    another one when it is too short, cut to a word count drawn from the rating's bucket."""
    out = []
    for k in range(num):
        rating = 1 + k % len(LENGTH_BUCKETS)
        lo, hi = LENGTH_BUCKETS[rating]
        i = rng.randrange(len(answers))
        words = (answers[i] + " " + rng.choice(answers)).split()
        text = " ".join(words[: rng.randint(lo, min(hi, len(words)))])
        out.append((i, text, str(length_rating(text))))
    rng.shuffle(out)
    return out


def run_check(check: dict, output: str) -> bool:
    """True when `output` (the adapter's generated text, special tokens removed) passes `check`.

    Check types (as in `assets/adapters/manifest.json`):
      mostly_uppercase      at least `min_fraction` of the letters are uppercase (and there are letters)
      json_object_with_key  parses as a JSON object that has `key`
      bullet_lines          every non-empty line starts with "- " (and there is one)
      one_of                the stripped output is one of `values`
    Raises KeyError for an unknown type.
    """
    text = output.strip()
    kind = check["type"]
    if kind == "mostly_uppercase":
        letters = [c for c in text if c.isalpha()]
        return bool(letters) and sum(c.isupper() for c in letters) >= check["min_fraction"] * len(letters)
    if kind == "json_object_with_key":
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return False
        return isinstance(value, dict) and check["key"] in value
    if kind == "bullet_lines":
        lines = [line for line in text.splitlines() if line.strip()]
        return bool(lines) and all(line.startswith("- ") for line in lines)
    if kind == "one_of":
        return text in check["values"]
    raise KeyError(f"unknown check type {kind!r}")
