"""SGLang's own load generator, `python -m sglang.bench_serving`, run against an arm's server (as a subprocess: this
module imports nothing of SGLang). Lives here: the command and its run. Not here: the arms (arms.py) or our own
replay client (driver.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


# sglang.benchmark imports Hugging Face `datasets` at import time for its MMMU loader only; where `datasets` is
# not installed, this launcher puts a module in its place whose load_dataset raises, then runs bench_serving as
# `python -m sglang.bench_serving` would.
BENCH_LAUNCHER = """import importlib.util, runpy, sys, types
if importlib.util.find_spec("datasets") is None:
    def load_dataset(*args, **kwargs):
        raise RuntimeError("this dataset needs the Hugging Face `datasets` package")
    sys.modules["datasets"] = types.SimpleNamespace(load_dataset=load_dataset)
sys.argv[0] = "sglang.bench_serving"
runpy.run_module("sglang.bench_serving", run_name="__main__", alter_sys=True)
"""


def bench_serving_command(
    url: str,
    tokenizer: str,
    lora_names: list[str],
    out_file: Path,
    num_prompts: int,
    request_rate: float,
    input_len: int,
    output_len: int,
    seed: int = 0,
) -> list[str]:
    """`python -m sglang.bench_serving` (through BENCH_LAUNCHER) on random token ids (no dataset download),
    requests spread uniformly over `lora_names` (`--lora-name`; standard LoRAs only: an aLoRA request needs its
    invocation sequence)."""
    command = [sys.executable, "-c", BENCH_LAUNCHER, "--backend", "sglang", "--base-url", url]
    command += ["--tokenizer", tokenizer, "--model", tokenizer, "--dataset-name", "random-ids"]
    command += ["--random-input-len", str(input_len), "--random-output-len", str(output_len)]
    command += ["--random-range-ratio", "1.0", "--num-prompts", str(num_prompts)]
    command += ["--request-rate", str(request_rate), "--seed", str(seed)]
    command += ["--output-file", str(out_file), "--disable-tqdm", "--warmup-requests", "0"]
    if lora_names:
        command += ["--lora-name", *lora_names]
    return command


def run_bench_serving(command: list[str], out_file: Path, timeout_s: float = 1800) -> dict:
    """Runs bench_serving; returns its last JSON line. Raises RuntimeError with its output's end on failure."""
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0 or not out_file.is_file():
        raise RuntimeError(
            f"bench_serving failed ({done.returncode}): {(done.stdout + done.stderr)[-2000:]}"
        )
    return json.loads(out_file.read_text().strip().splitlines()[-1])
