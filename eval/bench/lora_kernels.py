"""Segmented LoRA kernels: our Triton shrink + expand vs the layer's dense base GEMM, a memory roofline, and SGLang's
own LoRA kernels (its default csgmv backend and its triton one), at Llama-3-8B projection shapes (one JSON line
per shape).
Not here: the kernels (sgl_multilora/triton_kernels/) or their correctness tests (tests/kernels/).

On a GPU: bf16, ranks 16 and 64, modules qkv (4096 -> 4096 + 1024 + 1024), o (4096 -> 4096), gate_up
(4096 -> 2 x 14336) and down (14336 -> 4096); decode batches of 1..256 tokens (one token per request) on 1..64
adapters, prefill of 512..8192 tokens. Every timed op is first checked against the torch reference. Roofline bytes:
x read, y read and written, each segment's weights read once (the shrink intermediate is ignored); bandwidth is a
measured device-to-device copy. SGLang's kernels run with the metadata each backend builds in eager mode
(eval/bench/sglang_kernels.py, which also stages them where SGLang is not installed). Before timing, each SGLang
backend's agreement with the torch reference is checked per dtype in a process of its own (a faulting kernel
poisons the CUDA context); a backend that does not agree in bf16 is recorded as not timed, with the reason.
On a CPU: the torch references at a few shapes (fp32), and the record says plainly that no GPU figures exist.

Usage: .venv/bin/python -m eval.bench.lora_kernels [--quick] [--out eval/results/lora_kernels/lora_kernels.jsonl]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

from sgl_multilora.segments import SegmentMeta
from sgl_multilora.triton_kernels.ops import lora_forward
from sgl_multilora.triton_kernels.weights import LoRAWeights

OUT = Path(__file__).resolve().parents[1] / "results" / "lora_kernels" / "lora_kernels.jsonl"
HIDDEN, KV, MLP = 4096, 1024, 14336
MODULES = {  # name: (in_features, slice widths)
    "qkv": (HIDDEN, [HIDDEN, KV, KV]),
    "o": (HIDDEN, [HIDDEN]),
    "gate_up": (HIDDEN, [MLP, MLP]),
    "down": (MLP, [HIDDEN]),
}
DECODE_TOKENS = [1, 8, 32, 64, 128, 256]
ADAPTERS = [1, 8, 64]
PREFILL_TOKENS = [512, 2048, 8192]


def versions() -> dict[str, str]:
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()}


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def request_lens(num_tokens: int, num_requests: int) -> torch.Tensor:
    lens = torch.full((num_requests,), num_tokens // num_requests, dtype=torch.int32)
    lens[: num_tokens % num_requests] += 1
    return lens


def problem(module: str, rank: int, num_tokens: int, num_adapters: int, num_requests: int, dtype, device,
            seed: int = 0):
    """SGLang-layout stacked buffers for `num_adapters` slots; request k (contiguous tokens) uses slot k mod n."""
    in_features, widths = MODULES[module]
    g = torch.Generator(device="cpu").manual_seed(seed)
    n_sl, out = len(widths), sum(widths)
    a = (torch.randn(num_adapters, n_sl * rank, in_features, generator=g) / in_features**0.5).to(device, dtype)
    b = (torch.randn(num_adapters, out, rank, generator=g) / rank**0.5).to(device, dtype)
    x = torch.randn(num_tokens, in_features, generator=g).to(device, dtype)
    base_w = (torch.randn(out, in_features, generator=g) / in_features**0.5).to(device, dtype)
    req_slot = (torch.arange(num_requests) % num_adapters).to(torch.int32)
    token_slot = torch.repeat_interleave(req_slot, request_lens(num_tokens, num_requests)).to(device)
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    weights = LoRAWeights.from_stacked(a, b, offsets, [rank] * num_adapters, [1.0] * num_adapters)
    return x, base_w, token_slot, weights, (a, b)


def roofline_bytes(num_tokens: int, weights: LoRAWeights, num_segments: int, elem: int) -> int:
    in_f, out, r = weights.in_features, weights.out_features, weights.max_rank
    per_adapter = (weights.num_slices * r * in_f + out * r) * elem
    return num_tokens * in_f * elem + 2 * num_tokens * out * elem + num_segments * per_adapter


def time_cuda(fn, reps: int = 50) -> float:
    """Median microseconds of `fn` replayed from a CUDA graph (launch overhead as in a captured decode step)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = time_cuda(lambda: dst.copy_(src), reps=20)
    return 2 * src.numel() / (us * 1e-6)


def sglang_kernels(x, buffers, module: str, weights: LoRAWeights, token_slot, num_requests: int, backend: str):
    """A closure running SGLang 0.5.23's LoRA kernels of `backend` ("triton" or "csgmv", its default) on the same
    problem with the metadata that backend builds, or None if they do not import (see eval/bench/sglang_kernels.py
    for running them where SGLang is not installed)."""
    try:
        from sglang.srt.lora.utils import LoRABatchInfo

        if backend == "csgmv":
            from sglang.kernels.ops.lora.dense.chunked_sgmv_expand import chunked_sgmv_lora_expand_forward
            from sglang.kernels.ops.lora.dense.chunked_sgmv_shrink import chunked_sgmv_lora_shrink_forward
        else:
            from sglang.kernels.ops.lora.dense.gate_up_lora_b import gate_up_lora_b_fwd
            from sglang.kernels.ops.lora.dense.qkv_lora_b import qkv_lora_b_fwd
            from sglang.kernels.ops.lora.dense.sgemm_lora_a import sgemm_lora_a_fwd
            from sglang.kernels.ops.lora.dense.sgemm_lora_b import sgemm_lora_b_fwd
    except Exception:  # noqa: BLE001 - any import failure means "not loadable here"
        return None
    from eval.bench.sglang_kernels import csgmv_batch_info, triton_batch_info

    a, b = buffers
    dev = x.device
    seg_lens = request_lens(x.shape[0], num_requests)
    seg_start = torch.zeros(num_requests, dtype=torch.int64)
    seg_start[1:] = torch.cumsum(seg_lens, 0)[:-1]
    req_slot = token_slot.cpu()[seg_start]
    build = csgmv_batch_info if backend == "csgmv" else triton_batch_info
    info = build(LoRABatchInfo, seg_lens, req_slot, weights.ranks_cpu, weights.scalings_cpu, dev)
    offsets_cpu = torch.tensor(weights.slice_offsets, dtype=torch.int32)
    offsets = offsets_cpu.to(dev)
    widths = [e - s for s, e in zip(weights.slice_offsets, weights.slice_offsets[1:])]
    n_sl = weights.num_slices

    if backend == "csgmv":
        def run(y):
            t = chunked_sgmv_lora_shrink_forward(x, a, info, num_slices=n_sl)
            return chunked_sgmv_lora_expand_forward(t, b, info, offsets, max(widths), y, slice_offsets_cpu=offsets_cpu)
        return run

    def run(y):
        t = sgemm_lora_a_fwd(x, a, info, stack_num=n_sl)
        if module == "qkv":
            return qkv_lora_b_fwd(t, b, info, offsets, max(widths), y)
        if module == "gate_up":
            return gate_up_lora_b_fwd(t, b, info, widths[0], y)
        return sgemm_lora_b_fwd(t, b, info, y)

    return run


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-12))


def sglang_agreement(device: str = "cuda", backends=("csgmv", "triton")) -> list[dict]:
    """SGLang's kernels and ours against the torch reference on a few shapes, per dtype (fp32 / fp16 / bf16)."""
    rows = []
    for module, rank, num_tokens, num_adapters in (("qkv", 16, 1, 1), ("o", 16, 32, 8), ("qkv", 64, 256, 8)):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            x, base_w, token_slot, weights, buffers = problem(module, rank, num_tokens, num_adapters, num_tokens,
                                                              dtype, torch.device(device))
            layout = SegmentMeta.build(token_slot, num_adapters)
            zero = torch.zeros(num_tokens, weights.out_features, dtype=dtype, device=device)
            ref = lora_forward(x, zero.clone(), layout, weights, impl="torch")
            row = {"module": module, "rank": rank, "num_tokens": num_tokens, "num_adapters": num_adapters,
                   "dtype": str(dtype).removeprefix("torch."),
                   "multilora_triton": relative_error(lora_forward(x, zero.clone(), layout, weights, impl="triton"),
                                                      ref)}
            for backend in backends:
                stock = sglang_kernels(x, buffers, module, weights, token_slot, num_tokens, backend)
                try:
                    row[f"sglang_{backend}"] = None if stock is None else relative_error(stock(zero.clone()), ref)
                except Exception as e:  # noqa: BLE001 - a kernel that does not compile for a dtype: say so
                    row[f"sglang_{backend}"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


AGREEMENT_TOL = 2e-2  # relative error of the LoRA term a bf16 kernel may show against the torch reference


def agreeing_backends(rows: list[dict], backends) -> tuple[list[str], dict[str, str]]:
    """The SGLang backends fit to be timed: every bf16 agreement row a finite relative error within AGREEMENT_TOL.
    Returns (kept, {dropped backend: why})."""
    kept, dropped = [], {}
    for b in backends:
        values = [r.get(f"sglang_{b}") for r in rows if r["dtype"] == "bfloat16" and f"sglang_{b}" in r]
        if not values:
            dropped[b] = "no agreement rows"
        elif any(v is None for v in values):
            dropped[b] = "its kernels did not import"
        elif not all(isinstance(v, float) and v <= AGREEMENT_TOL for v in values):  # NaN fails the comparison
            dropped[b] = f"bf16 output differs from the torch reference: {values}"[:300]
        else:
            kept.append(b)
    return kept, dropped


def agreement_in_subprocess(backend: str) -> list[dict] | str:
    """`sglang_agreement` for one backend in a process of its own: a kernel that faults (an illegal memory access
    poisons the CUDA context) cannot take the benchmark down with it. The rows, or why there are none."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "agreement.jsonl"
        done = subprocess.run([sys.executable, "-m", "eval.bench.lora_kernels", "--agreement-only",
                               "--sglang-backends", backend, "--out", str(out)], capture_output=True, text=True,
                              timeout=900)
        if done.returncode != 0 or not out.exists():
            return f"agreement run failed (exit {done.returncode}): {done.stderr[-300:]}"
        return json.loads(out.read_text().splitlines()[-1])["agreement_with_torch_reference"]


def gpu_records(quick: bool, max_seconds: float | None = None, backends=("csgmv", "triton")):
    dtype, dev = torch.bfloat16, torch.device("cuda")
    began = time.monotonic()
    bandwidth = copy_bandwidth()
    shapes = [(m, r, t, n, "decode") for m in MODULES for r in (16, 64) for t in DECODE_TOKENS for n in ADAPTERS
              if n <= t]
    shapes += [(m, r, t, n, "prefill") for m in MODULES for r in (16, 64) for t in PREFILL_TOKENS for n in (1, 8)]
    if quick:
        shapes = [s for s in shapes if s[0] == "qkv" and s[1] == 16 and s[2] in (1, 32, 256, 2048)]
    # Every module's core shapes first, so a run cut short by --max-seconds still covers each module.
    shapes.sort(key=lambda s: not (s[2] in (1, 32, 256, 2048) and s[3] in (1, 8)))
    for i, (module, rank, num_tokens, num_adapters, phase) in enumerate(shapes):
        if max_seconds is not None and time.monotonic() - began > max_seconds:
            yield {"truncated": f"stopped after {i} of {len(shapes)} shapes: --max-seconds {max_seconds:g}"}
            return
        num_requests = num_tokens if phase == "decode" else max(num_adapters, num_tokens // 512)
        x, base_w, token_slot, weights, buffers = problem(module, rank, num_tokens, num_adapters, num_requests,
                                                          dtype, dev)
        layout = SegmentMeta.build(token_slot, num_adapters)
        y0 = x @ base_w.t()
        y_ours, y_ref = y0.clone(), y0.clone()
        lora_forward(x, y_ours, layout, weights, impl="triton")
        lora_forward(x, y_ref, layout, weights, impl="torch")
        torch.testing.assert_close(y_ours.float(), y_ref.float(), atol=8e-2, rtol=8e-2)
        y = y0.clone()
        notes = []
        latency = {
            "multilora_triton": time_cuda(lambda: lora_forward(x, y, layout, weights, impl="triton")),
            "base_gemm": time_cuda(lambda: torch.matmul(x, base_w.t())),
        }
        for backend in backends:
            stock = sglang_kernels(x, buffers, module, weights, token_slot, num_requests, backend)
            if stock is None:
                notes.append(f"SGLang's {backend} LoRA kernels did not import")
                continue
            error = relative_error(stock(y0.clone()) - y0, y_ref - y0)
            if error > 2e-2:
                notes.append(f"SGLang {backend} output differs from the torch reference (max |diff| / max |ref| of "
                             f"the LoRA term {error:.3g}): not timed")
                continue
            try:
                latency[f"sglang_{backend}"] = time_cuda(lambda: stock(y))
            except Exception as e:  # noqa: BLE001 - e.g. a host sync inside the capture: record it, go on
                notes.append(f"SGLang {backend} kernels not timed: {type(e).__name__}: {e}"[:300])
        roof_us = roofline_bytes(num_tokens, weights, num_adapters, 2) / bandwidth * 1e6
        yield {
            "setup": {"module": module, "rank": rank, "num_tokens": num_tokens, "num_adapters": num_adapters,
                      "num_requests": num_requests, "phase": phase, "dtype": "bf16",
                      "popularity": "uniform (request k on adapter k mod n)"},
            "latency_us": latency,
            "roofline_us": roof_us,
            "copy_bandwidth_GBps": bandwidth / 1e9,
            "pct_of_roofline": 100 * roof_us / latency["multilora_triton"],
            "lora_over_base_gemm": latency["multilora_triton"] / latency["base_gemm"],
            "notes": notes,
        }


def cpu_records(quick: bool):
    """The torch references (the CPU serving path) on a few shapes; no kernel figures."""
    shapes = [("qkv", 16, 1, 1), ("qkv", 16, 32, 8), ("down", 64, 32, 8)]
    if not quick:
        shapes += [("qkv", 16, 512, 8), ("gate_up", 16, 64, 8)]
    for module, rank, num_tokens, num_adapters in shapes:
        x, base_w, token_slot, weights, _ = problem(module, rank, num_tokens, num_adapters, num_tokens,
                                                    torch.float32, "cpu")
        layout = SegmentMeta.build(token_slot, num_adapters)
        y = torch.zeros(num_tokens, weights.out_features)
        lora_forward(x, y, layout, weights, impl="torch")
        check = torch.zeros_like(y)  # plain per-slot torch math, before timing
        for s in range(num_adapters):
            rows = (token_slot == s).nonzero().flatten()
            for j, (a, b) in enumerate(zip(weights.a_views[s], weights.b_views[s])):
                lo, hi = weights.slice_offsets[j], weights.slice_offsets[j + 1]
                check[rows, lo:hi] = (x[rows] @ a.t()) @ b.t()
        torch.testing.assert_close(y, check, atol=1e-4, rtol=1e-4)
        times = []
        for _ in range(5 if quick else 20):
            start = time.perf_counter()
            lora_forward(x, y, layout, weights, impl="torch")
            times.append((time.perf_counter() - start) * 1e6)
        base = []
        for _ in range(5 if quick else 20):
            start = time.perf_counter()
            torch.matmul(x, base_w.t())
            base.append((time.perf_counter() - start) * 1e6)
        yield {
            "setup": {"module": module, "rank": rank, "num_tokens": num_tokens, "num_adapters": num_adapters,
                      "dtype": "fp32", "impl": "torch reference"},
            "latency_us": {"torch_reference": sorted(times)[len(times) // 2],
                           "base_gemm_cpu": sorted(base)[len(base) // 2]},
        }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--sglang-backends", default="csgmv,triton",
                        help="SGLang LoRA backends whose kernels are compared (comma-separated; '' for none)")
    parser.add_argument("--agreement-only", action="store_true",
                        help="only the agreement of every kernel with the torch reference, per dtype (GPU)")
    parser.add_argument("--max-seconds", type=float, default=None, help="stop adding shapes after this long (GPU)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"JSON lines appended here (default {OUT})")
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    backends = tuple(b for b in args.sglang_backends.split(",") if b)
    agreement, dropped = None, {}
    if on_gpu and args.agreement_only:
        agreement = sglang_agreement(backends=backends)
    elif on_gpu:  # each backend checked in a process of its own; only those that agree are timed
        agreement = []
        for backend in backends:
            rows = agreement_in_subprocess(backend)
            if isinstance(rows, str):
                dropped[backend] = rows
                continue
            agreement += rows
            dropped.update(agreeing_backends(rows, [backend])[1])
        backends = tuple(b for b in backends if b not in dropped)
        for backend, why in dropped.items():
            print(f"SGLang's {backend} kernels are not timed: {why}")
    if args.agreement_only:
        records = []
    else:
        records = list(gpu_records(args.quick, args.max_seconds, backends) if on_gpu else cpu_records(args.quick))
    record = {
        "experiment": "lora_kernels",
        "command": " ".join(["python3 -m eval.bench.lora_kernels", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(),
        "versions": versions(),
        "gpu_figures": on_gpu,
        "note": ("Triton kernels vs base GEMM, roofline and SGLang's Triton LoRA kernels, bf16, CUDA-graph replay."
                 if on_gpu else
                 "No GPU was available: NO GPU FIGURES EXIST YET. These are CPU timings of the torch references "
                 "(the CPU serving path), not of the Triton kernels, and say nothing about GPU performance."),
        "results": records,
    }
    if agreement is not None:
        record["agreement_with_torch_reference"] = agreement
    if dropped:
        record["sglang_backends_not_timed"] = dropped
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    for r in records:
        print(json.dumps(r))
    print(f"appended 1 record ({len(records)} shapes) to {args.out}; gpu_figures={on_gpu}")


if __name__ == "__main__":
    main()
