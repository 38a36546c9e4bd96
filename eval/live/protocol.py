"""The harness's measurement protocol: which replay runs when (repeats, arm order), the machine's load, and the
setup section of the report that records both. Not here: running the replays (`harness.py`, `driver.py`).

Every arm's server stays up for the whole run; for each repeat and each time scale the arms are replayed in turn,
and the arm order rotates by one per repeat, so with two arms it alternates:

    rep 0: ours, stock   rep 1: stock, ours   rep 2: ours, stock   ...

A drift of the machine over the run (heat, other load) then falls on every arm alike instead of on whichever runs
last, and the spread over repeats shows how much it moved the figures.
"""

from __future__ import annotations

import os
from typing import NamedTuple


class Replay(NamedTuple):
    repeat: int
    time_scale: float
    arm: str


def arm_order(arm_names: list[str], repeat: int) -> list[str]:
    """The arms' order in `repeat`: the given order rotated left by `repeat` (two arms: alternating)."""
    if not arm_names:
        return []
    shift = repeat % len(arm_names)
    return [*arm_names[shift:], *arm_names[:shift]]


def schedule(arm_names: list[str], num_repeats: int, time_scales: list[float]) -> list[Replay]:
    """Every replay of a run in the order they run: repeats outermost, then time scales, then arms in
    `arm_order(arm_names, repeat)`."""
    return [
        Replay(repeat, scale, arm)
        for repeat in range(num_repeats)
        for scale in time_scales
        for arm in arm_order(arm_names, repeat)
    ]


def load_average() -> tuple[float, float, float]:
    """The 1, 5 and 15 minute load averages (`os.getloadavg`); zeros where the OS has none."""
    try:
        return tuple(round(x, 2) for x in os.getloadavg())
    except OSError:
        return (0.0, 0.0, 0.0)


def _load_text(load: tuple[float, ...]) -> str:
    return " / ".join(f"{x:.2f}" for x in load)


def setup_section(argv, config, arms, workload, started, protocol: dict, records: list[dict]) -> str:
    """The run's setup for the report: command, start date, machine with its load average at the start and end
    and over the replays, the protocol, model, each arm's server flags, workload. `protocol`: num_repeats,
    time_scales, keep_cache, load_start, load_end (load_average() tuples); `records`: the run's results, whose
    `extra.load_avg` is the load when each replay started."""
    import platform
    import shlex

    import torch

    from eval.live.arms import server_args

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    replay_loads = [(r.get("extra") or {}).get("load_avg") for r in records]
    replay_loads = [x[0] for x in replay_loads if x]
    names = [a.name for a in arms]
    orders = "; ".join(
        f"rep {i}: {', '.join(arm_order(names, i))}" for i in range(min(2, protocol["num_repeats"]))
    )
    cache = "on the cache left by earlier replays" if protocol["keep_cache"] else "on a flushed prefix cache"
    scales = ", ".join(f"{x:g}" for x in protocol["time_scales"])
    machine = f"{platform.node()}, {platform.machine()}, {os.cpu_count()} CPU cores, GPU: {gpu}"
    load = f"{_load_text(protocol['load_start'])} at the start, {_load_text(protocol['load_end'])} at the end"
    if replay_loads:
        load += f"; 1 min at each replay's start {min(replay_loads):.2f}-{max(replay_loads):.2f}"
    lines = [
        f"- command: `{shlex.join(['python', '-m', 'eval.live.harness', *argv])}`",
        f"- started: {started.strftime('%Y-%m-%d %H:%M UTC')}",
        f"- machine: {machine}; device {config.device}",
        f"- load average (1 / 5 / 15 min): {load}",
        f"- protocol: {protocol['num_repeats']} repeats x time scales {scales}; every server up for the whole run "
        + "(those started here sleep when idle: `--sleep-on-idle`); per repeat and time scale the arms replay in "
        + f"turn, the order rotated per repeat ({orders}; ...), each replay {cache}; figures: median (min-max) "
        + "over repeats",
        f"- model: {config.model or 'embedded SmolLM2-135M-Instruct'}; adapters: {config.adapters_dir}",
    ]
    for arm in arms:
        if arm.url:
            lines.append(f"- arm `{arm.name}` ({arm.kind}): running server at {arm.url}")
        else:
            flags, env = server_args(config, arm)
            env_text = " ".join(f"{k}={v}" for k, v in env.items())
            lines.append(f"- arm `{arm.name}` ({arm.kind}): `{(env_text + ' ') if env_text else ''}"
                         f"launch_server {shlex.join(flags)}`")
    params = ", ".join(f"{k}={v}" for k, v in workload.params.items())
    lines.append(f"- workload: {workload.name}, seed {workload.seed}, {len(workload.requests)} requests; {params}")
    return "Setup:\n\n" + "\n".join(lines) + "\n"
