"""Reports of the GPU benchmarks from their committed JSON lines: eval/results/lora_kernels/lora_kernels.md (+ .png),
eval/results/host_copy_gpu/host_copy_gpu.md and eval/results/pool_views_gpu/pool_views_gpu.md. Runs anywhere (no
GPU needed).

Usage: .venv/bin/python -m eval.bench.gpu_report
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
KERNELS, HOST_COPY, POOL_VIEWS = RESULTS / "lora_kernels", RESULTS / "host_copy_gpu", RESULTS / "pool_views_gpu"
CORE_TOKENS = (1, 32, 256, 2048)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def _key(r: dict) -> tuple:
    s = r["setup"]
    return s["phase"], s["module"], s["rank"], s["num_tokens"], s["num_adapters"]


def _ratios(results) -> list[float]:
    return [r["latency_us"]["multilora_triton"] / r["latency_us"]["sglang_triton"] for r in results
            if "sglang_triton" in r["latency_us"]]


def _headline_rows(rows: dict) -> list[str]:
    """Per (phase, module): ours / SGLang triton and LoRA op / base GEMM, as table rows."""
    groups: dict[tuple, list] = defaultdict(list)
    for k, r in rows.items():
        groups[(k[0], k[1])].append(r)
    return [f"| {phase} | {module} | {_spread(_ratios(rs))} | "
            f"{statistics.median(r['lora_over_base_gemm'] for r in rs):.2f} | {len(rs)} |"
            for (phase, module), rs in sorted(groups.items())]


def kernel_other_gpu_report(record: dict, reference: dict, earlier: dict | None = None) -> str:
    """The same benchmark on another GPU (one record, the configs as committed), next to the main record; with
    `earlier` (the previous record on that GPU), ours now against ours then on the shapes both timed."""
    rows = {_key(r): r for r in record["results"] if "setup" in r}
    ref = {_key(r): r for r in reference["results"] if "setup" in r}
    ratio_all, ref_all = _ratios(rows.values()), _ratios(ref.values())
    command = record.get("command", "bash scripts/gpu_checks.sh OUT 150` (`python3 -m eval.bench.lora_kernels "
                                    "--max-seconds 150")
    truncated = [r["truncated"] for r in record["results"] if "truncated" in r]
    lines = [
        f"# Segmented LoRA kernels on another GPU: {record['device']}", "",
        f"{record['date']}; torch {record['versions']['torch']}, triton {record['versions']['triton']}. Command: "
        f"`{command}`, the launch configs as committed (tuned on the H200 of `lora_kernels.md`)"
        + (f" ({truncated[0]}, every module's core shapes first)" if truncated else "")
        + "; method as there: bf16, Llama-3-8B shapes, CUDA-graph replay, median of 50, every op checked against "
        "the torch reference first.", "",
        "| phase | module | ours / SGLang triton, median (min-max) | LoRA op / base GEMM, median | shapes |",
        "|---|---|---|---|---|", *_headline_rows(rows), "",
        f"All {len(ratio_all)} shapes: ours / SGLang {_spread(ratio_all)}, ours faster on "
        f"{sum(x < 1 for x in ratio_all)}; on the {reference['device']} ({reference['date'][:10]}): "
        f"{_spread(ref_all)} over {len(ref_all)} shapes. SGLang's csgmv kernels: "
        f"{record.get('sglang_backends_not_timed', {}).get('csgmv', 'timed')}.", "",
    ]
    if earlier is not None:
        then = {_key(r): r for r in earlier["results"] if "setup" in r}
        by_rank: dict[int, list[float]] = defaultdict(list)
        for k in rows.keys() & then.keys():
            by_rank[k[2]].append(rows[k]["latency_us"]["multilora_triton"] / then[k]["latency_us"]["multilora_triton"])
        lines += [f"Ours now / ours in the previous record on this GPU kind ({earlier['date'][:10]}), same shapes: "
                  + "; ".join(f"rank {rank} {_spread(v)} over {len(v)}" for rank, v in sorted(by_rank.items()))
                  + ". Two runs on different machines and days, not interleaved: the drift between them is in these "
                  "ratios (a shape whose launch did not change shows it); the ratios to SGLang above are within one "
                  "run.", ""]
    return "\n".join(lines)


def kernel_report(records: list[dict]) -> str:
    timed = [r for r in records if r.get("gpu_figures") and any("setup" in x for x in r["results"])]
    final, first = timed[-1], timed[0]
    rows = {_key(r): r for r in final["results"] if "setup" in r}
    before = {_key(r): r for r in first["results"] if "setup" in r}
    lines = [
        "# Segmented LoRA kernels on a GPU", "",
        f"Device: {final['device']}; {final['date']}; torch {final['versions']['torch']}, triton "
        f"{final['versions']['triton']}. Command: `{final.get('command', '')}`. bf16, Llama-3-8B projection shapes, "
        "each op replayed from a CUDA graph (median of 50). Every timed op was first checked against the torch "
        "reference. `sglang` is SGLang 0.5.23's `triton` LoRA backend kernels (its files, staged by "
        "`eval/bench/sglang_kernels.py`) with the metadata that backend builds.", "",
        "## Headline (the final record)", "",
        "| phase | module | ours / SGLang triton, median (min-max) | LoRA op / base GEMM, median | shapes |",
        "|---|---|---|---|---|",
    ]
    lines += _headline_rows(rows)
    ratio_all = _ratios(rows.values())
    faster = sum(x < 1 for x in ratio_all)
    tuned = [rows[k]["latency_us"]["multilora_triton"] / before[k]["latency_us"]["multilora_triton"]
             for k in rows if k in before]
    lines += [
        "", f"All shapes: ours / SGLang {_spread(ratio_all)}; ours faster on {faster} of {len(ratio_all)}. "
        f"Launch-config tuning on this GPU (first record -> final): ours after / before {_spread(tuned)}.", "",
        f"Records in `lora_kernels.jsonl` (label field): " + "; ".join(
            f"{r['date']}: {r.get('label', 'unlabelled')}" for r in records if r.get("gpu_figures")), "",
        "## SGLang's default backend (csgmv)", "",
        "Not timed: on this machine's Triton its kernels give wrong values in fp16 and bf16 (NaN or huge; fp32 agrees "
        "with the reference), with SGLang's tuned block sizes and with its defaults alike, and an illegal memory "
        "access that ends the process. SGLang 0.5.23 ships its tuned configs for Triton 3.5.1; the lent machine has "
        "Triton 3.6.0 and no way to install another, so this is most likely a compiler mismatch, not a fault of "
        "SGLang's release as users run it. Relative error of the LoRA term vs the torch reference:", "",
        "| config | module | rank | tokens | adapters | dtype | ours | SGLang csgmv |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        for a in r.get("agreement_with_torch_reference", []):
            if "sglang_csgmv" not in a:
                continue
            v = a["sglang_csgmv"]
            shown = f"{v:.3g}" if isinstance(v, float) else str(v)[:60]
            config = "defaults" if "empty folder" in r.get("label", "") else "SGLang's tuned"
            lines.append(f"| {config} | {a['module']} | {a['rank']} | {a['num_tokens']} | "
                         f"{a['num_adapters']} | {a['dtype']} | {a['multilora_triton']:.3g} | {shown} |")
    lines += ["", "## Core shapes (final record), microseconds", "",
              "| phase | module | rank | tokens | adapters | ours | SGLang triton | base GEMM | % of roofline |",
              "|---|---|---|---|---|---|---|---|---|"]
    for k in sorted(rows):
        if k[3] in CORE_TOKENS or k[0] == "prefill":
            r = rows[k]
            lat = r["latency_us"]
            lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {k[4]} | {lat['multilora_triton']:.1f} | "
                         f"{lat.get('sglang_triton', float('nan')):.1f} | {lat['base_gemm']:.1f} | "
                         f"{r['pct_of_roofline']:.0f} |")
    lines += ["", "![latency by tokens](lora_kernels.png)", "",
              "Up to 256 tokens the steps are decode (one token per request, so SGLang's triton backend runs one "
              "segment per token); from 512 they are prefill (one request per 512 tokens): hence SGLang's drop at "
              "512.", ""]
    _plot(rows, KERNELS / "lora_kernels.png")
    return "\n".join(lines)


def _plot(rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 4), sharey=True)
    for ax, module in zip(axes, ("qkv", "o", "gate_up", "down")):
        for rank, style in ((16, "-"), (64, "--")):
            pts = sorted((k[3], r["latency_us"]) for k, r in rows.items()
                         if k[1] == module and k[2] == rank and k[4] == 8)
            xs = [p[0] for p in pts]
            ax.plot(xs, [p[1]["multilora_triton"] for p in pts], "o" + style, color="C0", label=f"ours r{rank}")
            ax.plot(xs, [p[1].get("sglang_triton") for p in pts], "s" + style, color="C1",
                    label=f"SGLang triton r{rank}")
            ax.plot(xs, [p[1]["base_gemm"] for p in pts], ":", color="grey",
                    label="base GEMM" if rank == 16 else None)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{module}, 8 adapters")
        ax.set_xlabel("tokens in the step")
    axes[0].set_ylabel("microseconds (CUDA graph replay)")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def host_copy_report(records: list[dict]) -> str:
    r = records[-1]
    lines = [
        "# The host tier's copies on a GPU", "",
        f"Device: {r['device']}; {r['date']}; torch {r['versions']['torch']}. Command: "
        f"`{r.get('command', 'python3 -m eval.bench.host_copy_gpu (scripts/gpu_checks.sh)')}`. "
        f"KV of Llama-3-8B shape ({r['setup']['bytes_per_token']} bytes per token), copied by the server's "
        "`HostKVStore` (pinned slot-major host pool, side-stream copies) vs the prefill of the same tokens through a "
        "Llama-3-8B-shaped model (random weights, bf16, SDPA): what a server without a host tier recomputes. "
        "Medians of CUDA-event timings.", "",
        "| history tokens | recompute prefill ms | load-back ms (one run) | recompute / load-back | GB/s | "
        "load-back ms (runs of 16) | recompute / load-back | spill ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in r["results"]:
        one, frag = row["one run"], row["runs of 16"]
        lines.append(f"| {row['tokens']} | {row['recompute_prefill_ms']:.1f} | {one['load_back_ms']:.2f} | "
                     f"{one['recompute_over_load_back']:.1f}x | {one['load_back_GBps']:.0f} | "
                     f"{frag['load_back_ms']:.2f} | {frag['recompute_over_load_back']:.1f}x | {one['spill_ms']:.2f} |")
    lines += ["", "Overlap with compute on the current stream (an 8192^3 bf16 matmul repeated for about the copy's "
              "time):", "", "| history tokens | compute ms | spill ms | both ms (sum would be) | load-back ms | "
              "load-back queued behind compute ms (sum would be) |", "|---|---|---|---|---|---|"]
    for row in r["results"]:
        o = row["overlap"]
        lines.append(f"| {row['tokens']} | {o['compute_ms']:.2f} | {o['spill_ms']:.2f} | "
                     f"{o['spill_with_compute_ms']:.2f} ({o['compute_ms'] + o['spill_ms']:.2f}) | "
                     f"{o['load_back_ms']:.2f} | {o['load_back_behind_compute_ms']:.2f} "
                     f"({o['compute_ms'] + o['load_back_ms']:.2f}) |")
    lines += ["", "Not measured here: SGLang's HiCache and a live GPU server (SGLang cannot be installed on the lent "
              "machine: no network, and its compiled kernels do not travel within the 64 MiB the tool carries).", ""]
    return "\n".join(lines)


def pool_views_report(records: list[dict]) -> str:
    r = records[-1]
    s = r["summary"]
    lines = [
        "# Adapter weights read in place from the unified pool, on a GPU", "",
        f"Device: {r['device']}; {r['date']}; torch {r['versions']['torch']}, triton {r['versions'].get('triton')}. "
        f"Command: `python3 -m eval.bench.pool_views_gpu --repeats {r['repeats']}` (scripts/gpu_checks.sh). The same "
        "Triton shrink + expand on the same adapters and batch, weights in SGLang's stacked slot buffers (what "
        "`--lora-backend multilora` reads with the pool off) vs views of a KV buffer's rows (each adapter copied "
        "into a slot run of its own, Llama-3-8B's 1,024-element rows, as `LiveMemory` places it: what it reads "
        "with the pool on, through one `TableSet` of device tables). bf16, Llama-3-8B shapes, CUDA-graph replay, "
        "arms interleaved, median of "
        f"{r['repeats']} medians of 50 replays. Outputs agree up to the order of split-K's atomic adds.", "",
        f"**Pool / stacked over {s['shapes']} shapes: median {s['median_pool_over_stacked']:.3f}x "
        f"(min {s['min']:.3f}, max {s['max']:.3f}).**", "",
        "| module | tokens | adapters | rank | stacked us | pool us | pool / stacked |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in r["results"]:
        lines.append(f"| {row['module']} | {row['tokens']} | {row['adapters']} | {row['rank']} | "
                     f"{row['stacked_us']:.1f} | {row['pool_us']:.1f} | {row['pool_over_stacked']:.3f} |")
    for earlier in records[:-1]:
        how = ("through a `TableSet`, as above" if "rebinding" in earlier else
               "each module's tables built from its own views (before `TableSet`)")
        lines += ["", f"Earlier record ({earlier['date']}, {earlier['device']}): pool / stacked median "
                  f"{earlier['summary']['median_pool_over_stacked']:.3f}x ({earlier['summary']['min']:.3f}-"
                  f"{earlier['summary']['max']:.3f}), {how}" + (
                      f"; rebinding {earlier['rebinding']['rebinding_ms_median'] * 1e3:.0f} us, first binding "
                      f"{earlier['rebinding']['first_binding_ms_median']:.2f} ms." if "rebinding" in earlier
                      else ".")]
    rb = r.get("rebinding")
    if rb:
        lines += ["", f"Rebinding (the batch slots bound to other adapters: `TableSet.refill` of all {rb['modules']} "
                  f"LoRA modules of Llama-3-8B, {rb['slots']} slots, rank {rb['rank']}, host time with the copy "
                  f"synchronised): {rb['first_binding_ms_median']:.2f} ms median when all {rb['slots']} adapters are "
                  f"bound for the first time (each adapter's table rows computed once), "
                  f"{rb['rebinding_ms_median'] * 1e3:.0f} us median when bound again (rows cached). It happens only "
                  "when the adapters in the batch slots change; tests/gpu replays a captured graph across one."]
    lines += ["", "Not measured here: a live GPU server with the pool (SGLang cannot be installed on the lent "
              "machine).", ""]
    return "\n".join(lines)


def main() -> None:
    (KERNELS / "lora_kernels.md").write_text(kernel_report(_records(KERNELS / "lora_kernels.jsonl")))
    (HOST_COPY / "host_copy_gpu.md").write_text(host_copy_report(_records(HOST_COPY / "host_copy_gpu.jsonl")))
    (POOL_VIEWS / "pool_views_gpu.md").write_text(
        pool_views_report(_records(POOL_VIEWS / "pool_views_gpu.jsonl")))
    kernels = [r for r in _records(KERNELS / "lora_kernels.jsonl")
               if r.get("gpu_figures") and any("setup" in x for x in r["results"])]
    h100 = _records(KERNELS / "lora_kernels_h100.jsonl")
    (KERNELS / "lora_kernels_h100.md").write_text(
        kernel_other_gpu_report(h100[-1], kernels[-1], h100[-2] if len(h100) > 1 else None))
    (HOST_COPY / "host_copy_gpu_h100.md").write_text(
        host_copy_report(_records(HOST_COPY / "host_copy_gpu_h100.jsonl")))
    print(f"wrote {KERNELS / 'lora_kernels.md'}, {KERNELS / 'lora_kernels.png'}, {HOST_COPY / 'host_copy_gpu.md'}, "
          f"{POOL_VIEWS / 'pool_views_gpu.md'}")


if __name__ == "__main__":
    main()
