"""SGLang's own LoRA kernels as a benchmark baseline, on a machine where SGLang itself cannot be installed.

The GPU machines this project is lent have PyTorch and Triton but no SGLang (and no network to fetch it and its
compiled dependencies). SGLang's LoRA kernels are plain Triton, so `stage(dest)` writes a package named `sglang`
under `dest` that holds SGLang's kernel files byte for byte, copied from the installed wheel, plus the few helpers
they import, each also taken from the wheel's source (`LoRABatchInfo`, `CachedKernel` / `cached_triton_kernel`,
`sglang.srt.environ` whole); only `is_cuda` and `get_device_name` are written here (one line each). Put `dest` first
on `PYTHONPATH` and `from sglang.kernels.ops.lora.dense... import ...` gives SGLang's kernels, unchanged.

`triton_batch_info` and `csgmv_batch_info` build the per-step metadata the way SGLang 0.5.23's `TritonLoRABackend`
and `ChunkedSgmvLoRABackend.prepare_lora_batch` do (csgmv: tokens stably sorted by adapter, cut into chunks of 16 /
32 / 128 by the step's token count); `tests/unit/test_sglang_kernels_stage.py` checks the csgmv builder against
SGLang's own `_get_segments_info` and the staged kernels against our torch reference in Triton's interpreter.

Usage: .venv/bin/python -m eval.bench.sglang_kernels DEST
"""

from __future__ import annotations

import argparse
import inspect
import shutil
import sys
import textwrap
from pathlib import Path

import torch

KERNEL_FILES = ["__init__.py", "kernel_utils.py", "sgemm_lora_a.py", "sgemm_lora_b.py", "qkv_lora_b.py",
                "gate_up_lora_b.py", "chunked_sgmv_shrink.py", "chunked_sgmv_expand.py", "lora_tuning_config.py"]
DENSE = Path("sglang/kernels/ops/lora/dense")
MIN_CHUNK_SIZE = 16  # ChunkedSgmvLoRABackend's


def stage(dest: Path) -> Path:
    """Writes the package under `dest` (replacing an earlier one); returns `dest`."""
    import sglang.kernels.ops.lora.dense as dense_pkg
    import sglang.srt.environ as environ
    import sglang.srt.utils.common as common
    from sglang.srt.lora.utils import LoRABatchInfo

    src_dense = Path(dense_pkg.__file__).parent
    root = dest / "sglang"
    if root.exists():
        shutil.rmtree(root)
    for pkg in ["sglang", "sglang/kernels", "sglang/kernels/ops", "sglang/kernels/ops/lora", "sglang/srt",
                "sglang/srt/lora", "sglang/srt/utils"]:
        (dest / pkg).mkdir(parents=True, exist_ok=True)
        (dest / pkg / "__init__.py").write_text('"""Staged by eval/bench/sglang_kernels.py."""\n')
    (dest / DENSE).mkdir(parents=True, exist_ok=True)
    for name in KERNEL_FILES:
        shutil.copyfile(src_dense / name, dest / DENSE / name)
    if (src_dense / "csgmv_configs").is_dir():
        shutil.copytree(src_dense / "csgmv_configs", dest / DENSE / "csgmv_configs")
    shutil.copyfile(environ.__file__, dest / "sglang/srt/environ.py")
    (dest / "sglang/srt/lora/utils.py").write_text(
        "from __future__ import annotations\n\nfrom dataclasses import dataclass\nfrom typing import Optional\n\n"
        "import torch\n\nMoELoRABatchInfo = object\n\n\n" + inspect.getsource(LoRABatchInfo))
    (dest / "sglang/srt/utils/__init__.py").write_text(
        "import functools\nimport inspect\nimport logging\n\nimport torch\nimport triton\n\n"
        "from sglang.srt.environ import envs\n\nlogger = logging.getLogger(__name__)\n\n\n"
        "def is_cuda():\n    return torch.cuda.is_available() and torch.version.cuda is not None\n\n\n"
        "def get_device_name(device_id: int = 0) -> str:\n"
        "    return torch.cuda.get_device_name(device_id) if torch.cuda.is_available() else 'cpu'\n\n\n"
        + inspect.getsource(common.CachedKernel) + "\n\n" + inspect.getsource(common.cached_triton_kernel))
    return dest


def triton_batch_info(info_cls, seg_lens: torch.Tensor, req_slot: torch.Tensor, ranks, scalings, device):
    """SGLang's `triton` backend: one segment per request, in request order."""
    seg_indptr = torch.zeros(len(seg_lens) + 1, dtype=torch.int32)
    seg_indptr[1:] = torch.cumsum(seg_lens, 0)
    return info_cls(
        use_cuda_graph=False, bs=len(seg_lens), num_segments=len(seg_lens), seg_indptr=seg_indptr.to(device),
        weight_indices=req_slot.to(device, torch.int32),
        lora_ranks=torch.tensor(ranks, dtype=torch.int64, device=device),
        scalings=torch.tensor(scalings, dtype=torch.float32, device=device),
        max_len=int(seg_lens.max()), seg_lens=seg_lens.to(device), permutation=None,
    )


def csgmv_chunk_size(num_tokens: int, max_chunk_size: int = 128) -> int:
    """`ChunkedSgmvLoRABackend._determine_chunk_size_for_tokens` (SGLang's default --max-lora-chunk-size 128)."""
    if max_chunk_size <= MIN_CHUNK_SIZE:
        return MIN_CHUNK_SIZE
    return min(max_chunk_size, 128 if num_tokens >= 256 else 32 if num_tokens >= 64 else 16)


def csgmv_segments(weights_reordered: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight index per segment, seg_indptr): each run of one adapter cut into chunks of `chunk_size`."""
    unique, counts = torch.unique_consecutive(weights_reordered, return_counts=True)
    seg_w, seg_lens = [], []
    for w, n in zip(unique.tolist(), counts.tolist()):
        k = -(-n // chunk_size)
        seg_w += [w] * k
        seg_lens += [chunk_size] * (k - 1) + [n - (k - 1) * chunk_size]
    indptr = torch.zeros(len(seg_lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(seg_lens, dtype=torch.int32), 0)
    return torch.tensor(seg_w, dtype=torch.int32), indptr


def csgmv_batch_info(info_cls, seg_lens: torch.Tensor, req_slot: torch.Tensor, ranks, scalings, device):
    """SGLang's `csgmv` backend (its default): tokens grouped by adapter, then fixed-size chunks."""
    row_w = torch.repeat_interleave(req_slot.to(torch.int32), seg_lens)
    permutation = torch.argsort(row_w, stable=True)
    chunk = csgmv_chunk_size(int(seg_lens.sum()))
    seg_w, indptr = csgmv_segments(row_w[permutation], chunk)
    req_indptr = torch.zeros(len(seg_lens) + 1, dtype=torch.int32)
    req_indptr[1:] = torch.cumsum(seg_lens, 0)
    return info_cls(
        use_cuda_graph=False, bs=len(seg_lens), num_segments=len(seg_w), seg_indptr=indptr.to(device),
        weight_indices=seg_w.to(device), lora_ranks=torch.tensor(ranks, dtype=torch.int32, device=device),
        scalings=torch.tensor(scalings, dtype=torch.float32, device=device), max_len=chunk, seg_lens=None,
        permutation=permutation.to(device, torch.int32), req_seg_indptr=req_indptr.to(device),
        req_weight_indices=req_slot.to(device, torch.int32),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dest", type=Path)
    args = parser.parse_args(argv)
    stage(args.dest)
    print(textwrap.dedent(f"""\
        staged SGLang's LoRA kernels under {args.dest}; use them with PYTHONPATH={args.dest}"""), file=sys.stderr)


if __name__ == "__main__":
    main()
