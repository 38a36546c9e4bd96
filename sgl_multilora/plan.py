"""`python -m sgl_multilora.plan`: size a LoRA server from the SLOs (InfiniLoRA's provisioning; sgl_multilora/planner.py).

Example: python -m sgl_multilora.plan --popularity zipf:1.2 --adapters 512 --batch 256 --instances 4 --alpha 0.95
             --adapter-gb 1.69 --gpu-gb 96 [--profile FILE --tpot-slo-s 0.1 --layers 48] [--total-gpus 16]
             [--plot iar.png] [--json]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from sgl_multilora import planner


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m sgl_multilora.plan", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--popularity", metavar="zipf:S", help="adapter popularity: Zipf with exponent S")
    source.add_argument("--trace", metavar="FILE", help="popularity from a request trace (JSON lines or CSV with an "
                        "'adapter' field)")
    parser.add_argument("--adapters", type=int, help="number of adapters N (with --popularity)")
    parser.add_argument("--batch", type=int, required=True, help="batch size B per instance")
    parser.add_argument("--instances", type=int, required=True, help="LLM instances L (the starting point with "
                        "--total-gpus)")
    parser.add_argument("--alpha", type=float, default=0.95, help="target immediate admissibility rate (the tail "
                        "TTFT quantile; default 0.95)")
    parser.add_argument("--adapter-gb", type=float, required=True, help="GPU memory of one adapter, GB")
    parser.add_argument("--gpu-gb", type=float, required=True, help="memory of one LoRA-server GPU usable for "
                        "adapters, GB")
    parser.add_argument("--profile", metavar="FILE", help="profiled per-instance recv / compute / send seconds by "
                        "server GPU count: JSON {\"<gpus>\": {\"recv_s\", \"compute_s\", \"send_s\"}}")
    parser.add_argument("--tpot-slo-s", type=float, help="average TPOT SLO (with --profile)")
    parser.add_argument("--layers", type=int, help="MoE layers of the model (with --profile)")
    parser.add_argument("--ffn-share", type=float, default=0.5, help="share of a layer's time its expert GEMMs take: "
                        "SLO_FFN = share x TPOT SLO / layers (default 0.5)")
    parser.add_argument("--total-gpus", type=int, help="GPUs shared by the server and the instances: the instances "
                        "left are iterated to a fixed point")
    parser.add_argument("--gpus-per-instance", type=int, default=1)
    parser.add_argument("--plot", metavar="PNG", help="write IAR against M (with M* and alpha marked)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args(argv)
    if args.popularity is not None:
        kind, _, value = args.popularity.partition(":")
        try:
            args.zipf_s = float(value)
        except ValueError:
            args.zipf_s = None
        if kind != "zipf" or args.zipf_s is None:
            parser.error(f"--popularity {args.popularity!r}: expected zipf:S, e.g. zipf:1.2")
        if args.adapters is None or args.adapters < 1:
            parser.error("--popularity needs --adapters N (N >= 1)")
    if args.profile and (args.tpot_slo_s is None or args.layers is None):
        parser.error("--profile needs --tpot-slo-s and --layers")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tqdm import tqdm

    if args.trace:
        p, _names = planner.trace_popularity(args.trace)
    else:
        p = planner.zipf_popularity(args.adapters, args.zipf_s)
    profile = planner.load_profile(args.profile) if args.profile else None
    bar = tqdm(desc="IAR(M) for M = 1, 2, ...", unit="M", disable=args.json, leave=False)
    try:
        plan = planner.provision(p, batch=args.batch, instances=args.instances, alpha=args.alpha,
                                 adapter_gb=args.adapter_gb, gpu_gb=args.gpu_gb, profile=profile,
                                 tpot_slo_s=args.tpot_slo_s, num_layers=args.layers, ffn_share=args.ffn_share,
                                 total_gpus=args.total_gpus, gpus_per_instance=args.gpus_per_instance,
                                 progress=lambda m: bar.update(1))
    except ValueError as e:
        bar.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    bar.close()
    if args.plot:
        plot(p, plan, args.plot)
    if args.json:
        print(planner.as_json(plan))
        return 0
    c = plan.cache
    print(f"min cached adapters M* = {c.min_cached_adapters} of {c.num_adapters} (IAR {c.iar:.4f}, tau {c.tau})")
    print(f"LoRA server: {plan.server_gpus} GPU(s) ({plan.gpus_for_memory} for memory, "
          f"{plan.gpus_for_tpot if plan.gpus_for_tpot is not None else 'no profile'} for TPOT); "
          f"instances: {plan.instances}")
    for line in plan.why:
        print("  " + line)
    print(f"  convention: {c.tau_convention}; M* by scanning M upward (Eq 1)")
    return 0


def plot(p: np.ndarray, plan: planner.Plan, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tqdm import tqdm

    n, lb = len(p), plan.cache.global_batch
    ms = sorted(set(np.unique(np.linspace(1, n, min(n, 48)).astype(int)).tolist()) | {plan.cache.min_cached_adapters})
    with tqdm(total=len(ms), desc="IAR curve", unit="M", leave=False) as bar:
        curve = planner.iar_curve(p, lb, ms, progress=lambda m: bar.update(1))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([m for m, _ in curve], [v for _, v in curve], marker=".")
    ax.axhline(plan.cache.alpha, color="grey", linestyle="--", label=f"alpha {plan.cache.alpha}")
    ax.axvline(plan.cache.min_cached_adapters, color="red", linestyle=":",
               label=f"M* = {plan.cache.min_cached_adapters}")
    ax.set_xlabel("cached adapters M")
    ax.set_ylabel("immediate admissibility rate")
    ax.set_title(f"{n} adapters, global batch {lb:g}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
