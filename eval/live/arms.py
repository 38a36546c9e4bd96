"""The servers an experiment compares ("arms"): how to start each one, and SGLang's own bench_serving run.

Arms (DESIGN.md, "Testing without a GPU"):
- `ours`: the plugin with `--radix-cache-backend multilora` and the adapters of `adapters_dir`.
- `stock`: on a GPU, stock SGLang (`SGLANG_PLUGINS` set to a name no plugin has, `--enable-lora --lora-paths`);
  on a CPU, SGLang's own prefix cache over our CPU LoRA compute and extend attention (stock SGLang's LoRA layers do
  not reach the CPU model path), i.e. `ours` without `--radix-cache-backend multilora`.
A JSON config names the model (default: the embedded SmolLM2-135M on CPU), the device and per-arm extra flags,
environment or the `url` of a server that is already running. Not here: sending the workload (eval/live/driver.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from sgl_multilora.server import ServerHandle, cpu_server_args, launch

REPO = Path(__file__).resolve().parents[2]
ADAPTERS_DIR = REPO / "assets" / "adapters"
ARM_KINDS = ("ours", "stock")


@dataclass(frozen=True)
class ArmConfig:
    """One arm. kind: "ours" or "stock" (the flags it starts from); url: use this running server instead."""

    name: str
    kind: str
    extra_args: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    url: str | None = None


@dataclass(frozen=True)
class ExperimentConfig:
    model: str | None = None  # None: the embedded default model
    device: str = "cpu"
    adapters_dir: str = str(ADAPTERS_DIR)
    max_total_tokens: int = 16384
    max_loras_per_batch: int = 8
    arms: tuple[ArmConfig, ...] = ()


def load_config(path: str | Path | None, arm_names: list[str] | None) -> ExperimentConfig:
    """Reads a JSON config ({"model", "device", "adapters_dir", "max_total_tokens", "arms": {name: {"kind",
    "extra_args", "env", "url"}}}); keeps the config's arms named in `arm_names` (all of them for None). Without a
    config or config arms, builds arms named `arm_names` (default ours, stock) whose kind is the name up to ":".
    Raises ValueError naming an unknown key, arm or arm kind."""
    raw = json.loads(Path(path).read_text()) if path else {}
    known = {"model", "device", "adapters_dir", "max_total_tokens", "max_loras_per_batch", "arms"}
    if set(raw) - known:
        raise ValueError(
            f"{path}: unknown key(s) {sorted(set(raw) - known)}; known: {sorted(known)}"
        )
    arms_raw = raw.pop("arms", None) or {name: {} for name in arm_names or ARM_KINDS}
    missing = [name for name in arm_names or () if name not in arms_raw]
    if missing:
        raise ValueError(f"{path}: no arm named {missing}; the config has {sorted(arms_raw)}")
    arms = []
    for name, spec in arms_raw.items():
        if arm_names and name not in arm_names:
            continue
        kind = spec.get("kind", name.split(":")[0])
        if kind not in ARM_KINDS:
            raise ValueError(f"arm {name!r}: kind {kind!r} is not one of {ARM_KINDS}")
        arms.append(
            ArmConfig(
                name,
                kind,
                tuple(spec.get("extra_args", ())),
                dict(spec.get("env", {})),
                spec.get("url"),
            )
        )
    return ExperimentConfig(arms=tuple(arms), **raw)


def adapter_names(adapters_dir: str | Path) -> list[str]:
    root = Path(adapters_dir)
    return sorted(d.name for d in root.iterdir() if (d / "adapter_config.json").is_file())


def server_args(config: ExperimentConfig, arm: ArmConfig) -> tuple[list[str], dict]:
    """The launch_server flags and extra environment for `arm` on `config.device`. Every arm sleeps when idle
    (`--sleep-on-idle`): the harness keeps all arms up at once, and an idle scheduler that polls would take a core
    from the arm being measured."""
    env = dict(arm.env)
    if config.device == "cpu":
        args = [
            *cpu_server_args(config.max_total_tokens),
            "--multilora-adapter-dir",
            config.adapters_dir,
        ]
    elif arm.kind == "ours":
        args = [
            "--sleep-on-idle",
            "--multilora-adapter-dir",
            config.adapters_dir,
            "--max-total-tokens",
            str(config.max_total_tokens),
        ]
    else:
        paths = [f"{n}={Path(config.adapters_dir) / n}" for n in adapter_names(config.adapters_dir)]
        args = [
            "--sleep-on-idle",
            "--enable-lora",
            "--lora-paths",
            *paths,
            "--max-total-tokens",
            str(config.max_total_tokens),
        ]
        env.setdefault("SGLANG_PLUGINS", "none-stock-arm")
    args += ["--max-loras-per-batch", str(config.max_loras_per_batch)]
    if arm.kind == "ours":
        args += ["--radix-cache-backend", "multilora"]
    return [*args, *arm.extra_args], env


def start_arm(config: ExperimentConfig, arm: ArmConfig, log_dir: Path) -> ServerHandle:
    """Starts `arm`'s server and returns once it is ready (raises ServerStartError with the log's end)."""
    from sgl_multilora.embedded import ensure_embedded_model

    model = config.model or ensure_embedded_model()
    args, env = server_args(config, arm)
    log_dir.mkdir(parents=True, exist_ok=True)
    return launch(
        model, args, env=env, log_path=log_dir / f"server_{arm.name.replace(':', '_')}.log"
    )


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
