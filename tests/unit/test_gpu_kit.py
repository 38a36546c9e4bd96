"""The GPU kit (scripts/gpu_kit.py): it builds into a temporary folder within its 60 MiB budget (gzip here, for speed;
the real kit uses xz and is smaller), prunes what it says and nothing the server imports (against the import list a
live CPU server recorded from the kit under the GPU-image guard: scripts/gpu_kit_imports.json, refreshed with
`python scripts/gpu_kit.py check-live KIT scripts/gpu_kit_imports.json`), and carries the plugin's entry point where
importlib.metadata finds it without a .pth. Wheels come from .cache/gpu_kit_wheels (scripts/gpu_kit.sh fills it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import gpu_kit  # noqa: E402

WHEELS = REPO / ".cache" / "gpu_kit_wheels"
RECORD = json.loads((REPO / "scripts" / "gpu_kit_imports.json").read_text())


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    missing = [w for w in gpu_kit.WHEELS
               if not list(WHEELS.glob(f"{gpu_kit.norm(w.split('==')[0]).replace('-', '_')}-*.whl"))
               and not list(WHEELS.glob(f"{w.split('==')[0]}-*.whl"))]
    if missing:
        result = subprocess.run(["bash", str(REPO / "scripts" / "gpu_kit.sh"), str(tmp_path_factory.mktemp("dl")),
                                 "gz"], capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            pytest.skip(f"wheels {missing[:3]}... not cached in {WHEELS} and not downloadable (offline?): "
                        f"{result.stderr[-300:]}")
    out = tmp_path_factory.mktemp("kit")
    manifest = gpu_kit.build(out, WHEELS, compression="gz")
    with tarfile.open(out / "site.tar.gz") as tar:
        names = set(tar.getnames())
    return out, manifest, names


def test_kit_fits_its_budget(kit):
    out, manifest, _ = kit
    assert manifest["total_bytes"] <= gpu_kit.BUDGET_BYTES
    assert sorted(p.name for p in (out / "wheels").iterdir()) and (out / "install.sh").is_file()
    assert len(list((out / "wheels").iterdir())) == len(gpu_kit.WHEELS)


def test_pruned_parts_are_gone_and_the_project_is_there(kit):
    _, _, names = kit
    assert not [n for n in names if gpu_kit._pruned(n.removeprefix("site/"))]
    assert not [n for n in names if n.startswith(("site/sglang/multimodal_gen/", "site/sglang/test/"))]
    assert not [n for n in names if n.endswith(".so")]
    for needed in ("site/sitecustomize.py", "site/sgl_multilora/patches/gpu_compat.py",
                   "site/sgl_multilora/patches/plugin.py", "site/sgl_multilora/triton_kernels/__init__.py",
                   "site/sgl_multilora-0.1.0.dist-info/entry_points.txt", "site/sglang-0.5.23.dist-info/METADATA",
                   "site/sglang/kernels/jit/include", "tokenizer/tokenizer.json"):
        assert needed in names or any(n.startswith(needed + "/") for n in names), (needed, sorted(names)[:5])


def test_every_module_the_live_server_imported_travels(kit):
    """The record: our CPU server (LoRA, the multilora cache) ran from the kit and answered; nothing it imported was
    pruned or blocked, and every sglang module it imported is in the kit."""
    _, _, names = kit
    assert RECORD["answer"].strip().startswith("Paris") and not RECORD["blocked_attempts"]
    sglang_modules = [m for m in RECORD["modules"] if m.split(".")[0] in ("sglang", "sgl_multilora")]
    assert len(sglang_modules) > 1000
    assert not [m for m in sglang_modules if m.startswith(gpu_kit.PRUNED_MODULES)]
    folders = {n.rsplit("/", i)[0] for n in names for i in range(1, n.count("/") + 1)}  # namespace packages
    missing = []
    for module in sglang_modules:
        path = "site/" + module.replace(".", "/")
        if f"{path}.py" not in names and path not in folders:
            missing.append(module)
    assert not missing, missing[:10]


def test_entry_point_is_found_without_a_pth(kit, tmp_path):
    out, _, _ = kit
    gpu_kit.unpack(out, tmp_path)
    code = ("import importlib.metadata as md; eps = md.entry_points(group='sglang.srt.plugins'); "
            "print([(e.name, e.value, e.dist.version) for e in eps]); print(md.version('sglang'))")
    env = {"PYTHONPATH": str(tmp_path / "site"), "PATH": os.environ["PATH"]}
    result = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert "('multilora', 'sgl_multilora.patches.plugin:register', '0.1.0')" in result.stdout, result.stderr
    assert result.stdout.strip().endswith("0.5.23")


FAKE_CUDA = """
import sys, torch
import torchvision, transformers.models.llama.modeling_llama  # before CUDA is faked: cpu_compat's torchvision fix
torch.cuda.is_available = lambda: True
torch.version.cuda = "13.0"
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H200"
import importlib
for m in sys.argv[1:]:
    importlib.import_module(m)
assert sys.modules["sgl_kernel"].__version__.endswith("gpu_compat")
print("imports ok")
"""
GPU_PATH = ("sglang.srt.models.llama", "sglang.srt.layers.attention.triton_backend", "sglang.srt.layers.sampler",
            "sglang.srt.lora.backend.triton_backend", "sglang.srt.model_executor.model_runner",
            "sglang.srt.managers.scheduler", "sglang.srt.entrypoints.http_server")


def test_gpu_path_modules_import_from_the_kit_with_cuda_faked(kit, tmp_path):
    """The modules a CUDA server imports (Llama, Triton attention, stock and our LoRA backends, scheduler, HTTP) import
    from the unpacked kit, under the GPU-image guard, with torch pretending to have CUDA: their sgl_kernel imports are
    served by gpu_compat's stub (installed by the kit's sitecustomize)."""
    out, _, _ = kit
    site = gpu_kit.unpack(out, tmp_path) / "site"
    (tmp_path / "logs").mkdir()
    env = {**os.environ, **gpu_kit.guard_env(site, tmp_path / "logs")}
    result = subprocess.run([sys.executable, "-c", FAKE_CUDA, *GPU_PATH], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0 and "imports ok" in result.stdout, result.stderr[-3000:]
    found, blocked = gpu_kit.read_log(tmp_path / "logs")
    assert set(blocked) <= {"wcwidth"}, blocked  # tabulate's optional import, tolerated (the imports succeeded)
    assert not [m for m in found if m.startswith(gpu_kit.PRUNED_MODULES)]
