"""The servers an experiment compares ("arms"), named in one of two ways, for every live benchmark.

- A JSON config (eval/live/harness.py): it names the model (default: the embedded SmolLM2-135M on CPU), the device
  and per-arm extra flags, environment or the `url` of a server that is already running (`load_config`,
  `server_args`, `start_arm`). Kinds (DESIGN.md, "Testing without a GPU"):
  - `ours`: the plugin with `--radix-cache-backend multilora` and the adapters of `adapters_dir`;
  - `stock`: on a GPU, stock SGLang (`SGLANG_PLUGINS` set to a name no plugin has, `--enable-lora --lora-paths`);
    on a CPU, SGLang's own prefix cache over our CPU LoRA compute and extend attention (stock SGLang's LoRA layers
    do not reach the CPU model path), i.e. `ours` without `--radix-cache-backend multilora`.
- An arm name (the load benchmarks under eval/bench/: unified_memory, ttft_floor, ...; `parse_arm`, `arm_spec`,
  `ordered_arms`), every arm on the same total memory:
  `<base>[-cap<N>][-hold<X>][-nomove][-host<GB>][-drain]`.
  - bases: `stock` (SGLang's prefix cache and memory split: slot buffers for `--max-loras-per-batch` adapters of
    `--max-lora-rank` over the adapters' target modules come off the same budget, `stock_buffer_tokens`, and the KV
    pool gets the rest; on the CPU path its LoRA computes with our CPU layers from the host copies, so its adapter
    swaps cost nothing here, which favours it), `ours` (`--radix-cache-backend multilora`, adapters and KV in one
    pool evicted by the benchmark's `--policy`), `ours-mq` (`ours` with the multi-queue scheduler and its TTFT SLO);
  - `-cap<N>`: `--max-loras-per-batch N` instead of the common cap (a stock arm's KV shrinks or grows with it);
  - `-hold<X>` (ours-mq): `--multilora-memory-hold-share X` (0: never hold);
  - `-nomove` (ours, ours-mq): `--multilora-stock-baseline kv-moves`; `-host<GB>` (ours, ours-mq): a host KV tier of GB
    (`--multilora-host-kv-gb`: more memory than the other arms, which the report names);
  - `-drain` (any, last): SGLang's LoRA drainer (`--lora-drain-wait-threshold`, the benchmark's `--drain-wait-s`).
Not here: sending the workload (driver.py), SGLang's bench_serving (bench_serving.py), the adapters (adapters.py).
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import requests

from eval.live.adapters import ELEMS_PER_RANK, NUM_LAYERS, SLOT_BYTES
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


def flush(url: str) -> None:
    """Empties a running arm's prefix cache (between replays)."""
    requests.post(url + "/flush_cache", timeout=60)


def stock_buffer_tokens(workload, max_loras_per_batch: int, max_rank: int) -> int:
    """Token slots SGLang's LoRA slot buffers take: max_loras_per_batch adapters of max_rank over the union of
    the workload's target modules, fp32, every layer."""
    modules = sorted({m for a in workload.adapters for m in a.target_modules})
    per_adapter = NUM_LAYERS * max_rank * sum(ELEMS_PER_RANK[m] for m in modules) * 4
    return -(-max_loras_per_batch * per_adapter // SLOT_BYTES)


ARM_BASES = ("stock", "ours", "ours-mq")


def split_hold(name: str) -> tuple[str, float | None]:
    """`<...>-hold<X>[-drain]` -> (the name without `-hold<X>`, X), else (name, None); `-nomove` and `-host<GB>` are
    dropped first. Raises ValueError for a share that is not a number >= 0."""
    name = _without_options(name)
    head, sep, tail = name.partition("-hold")
    if not sep:
        return name, None
    share, _, rest = tail.partition("-")
    value = float(share) if _NUMBER.fullmatch(share) else -1.0
    if value < 0 or rest not in ("", "drain"):
        raise ValueError(f"unknown arm {name!r}: -hold<X> takes a memory-hold share X >= 0 (0: never hold), "
                         "then -drain, optional")
    return head + ("-drain" if rest else ""), value


def no_kv_moves(name: str) -> bool:
    """Whether the arm runs with `--multilora-stock-baseline kv-moves` (`-nomove` in its name)."""
    return "-nomove" in name


def host_gb(name: str) -> float | None:
    """The arm's host tier in GB (`-host<GB>` in its name), else None. Raises ValueError for a size that is not a
    number > 0."""
    match = _HOST.search(name)
    if match is None:
        return None
    value = float(match.group(1)) if _NUMBER.fullmatch(match.group(1)) else 0.0
    if value <= 0:
        raise ValueError(f"unknown arm {name!r}: -host<GB> takes a host tier size GB > 0")
    return value


_HOST = re.compile(r"-host([^-]*)")
_NUMBER = re.compile(r"[0-9]+(\.[0-9]*)?")


def _without_options(name: str) -> str:
    """The arm name without its `-nomove` and `-host<GB>` parts (the rest of the grammar is positional)."""
    return _HOST.sub("", name.replace("-nomove", "", 1), count=1)


def parse_arm(name: str) -> tuple[str, int | None, bool]:
    """`<base>[-cap<N>][-hold<X>][-nomove][-host<GB>][-drain]` -> (base, cap or None for the common one, drainer
    on); `-hold<X>` (`split_hold`) only on `ours-mq`, `-nomove` (`no_kv_moves`) and `-host<GB>` (`host_gb`) not on
    `stock`. Raises ValueError for any other name."""
    ours_only = "-nomove" if no_kv_moves(name) else "-host<GB>" if host_gb(name) is not None else None
    bare, hold = split_hold(name)
    rest, drain = (bare[:-len("-drain")], True) if bare.endswith("-drain") else (bare, False)
    base, _, cap = rest.partition("-cap")
    if base not in ARM_BASES or (cap and not (cap.isdigit() and int(cap) >= 1)) or rest.endswith("-cap") or (
            hold is not None and base != "ours-mq"):
        raise ValueError(f"unknown arm {name!r}: expected <base>[-cap<N>][-hold<X>][-nomove][-host<GB>][-drain], "
                         f"base one of {', '.join(ARM_BASES)}, -hold<X> only on ours-mq")
    if ours_only and base == "stock":
        raise ValueError(f"unknown arm {name!r}: {ours_only} is an option of our arms, not of stock SGLang")
    return base, int(cap) if cap else None, drain


def arm_spec(name: str, args: argparse.Namespace, workload, max_rank: int) -> tuple[int, list[str]]:
    """An arm's token slots (`--max-total-tokens`) and its own flags. Stock arms give their slot buffers' share of
    `--pool-tokens` up, at their own cap; ours keep every slot. Raises ValueError for an unknown name or a cap whose
    buffers leave a stock arm no KV."""
    base, cap, drain = parse_arm(name)
    cap = args.max_loras_per_batch if cap is None else cap
    extra = ["--max-loras-per-batch", str(cap)]
    tokens = args.pool_tokens
    if base == "stock":
        tokens -= stock_buffer_tokens(workload, cap, max_rank)
        if tokens <= 0:
            raise ValueError(f"{name}: SGLang's slot buffers for {cap} adapters of rank {max_rank} take "
                             f"{args.pool_tokens - tokens} token slots, more than --pool-tokens {args.pool_tokens}")
    else:
        extra += ["--radix-cache-backend", "multilora", "--multilora-eviction-policy", args.policy]
    if base == "ours-mq":
        extra += ["--multilora-scheduler", "multiqueue", "--multilora-ttft-slo-s", f"{args.slo_s:g}"]
        hold = split_hold(name)[1]
        if hold is not None:
            extra += ["--multilora-memory-hold-share", f"{hold:g}"]
    if no_kv_moves(name):
        extra += ["--multilora-stock-baseline", "kv-moves"]
    if host_gb(name) is not None:
        extra += ["--multilora-host-kv-gb", f"{host_gb(name):g}"]
    if drain:
        extra += ["--lora-drain-wait-threshold", f"{args.drain_wait_s:g}"]
    return tokens, extra


def ordered_arms(names) -> list[str]:
    """The arms among `names` in report order: stock, ours, ours-mq, each at the common cap first, then by cap, the
    drainer after each."""
    def key(name):
        base, cap, drain = parse_arm(name)
        hold = split_hold(name)[1]
        return (ARM_BASES.index(base), cap or 0, hold is not None, hold or 0.0, no_kv_moves(name),
                host_gb(name) or 0.0, drain)

    return sorted(names, key=key)
