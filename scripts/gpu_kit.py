"""The GPU kit: SGLang 0.5.23 (pruned), this project and the wheels a GPU image without SGLang lacks, in one folder.

`build DIR`: writes DIR/site.tar.xz (or .gz) holding site/ (pruned sglang + its dist-info, sgl_multilora with
patches/ mapped to sgl_multilora.patches as the editable install maps it, its dist-info with entry_points.txt, a
sitecustomize.py that installs patches/gpu_compat.py) and tokenizer/ (the embedded model's), DIR/wheels/*.whl,
DIR/install.sh and DIR/MANIFEST.json. Wheels come from a cache folder that scripts/gpu_kit.sh fills.
`check-live KIT_DIR OUT_JSON`: unpacks the kit, starts a real CPU server from it (our flags, one adapter) under
scripts/gpu_kit_guard (modules the GPU image lacks are blocked), asks it one /generate, records every module imported.
`blocked`: prints the top-level modules installed here that the GPU image lacks and the kit does not carry.
Not here: downloading (gpu_kit.sh), the GPU run (gpu_live.sh).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import io
import json
import os
import re
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SGLANG_VERSION = "0.5.23"
BUDGET_BYTES = 60 * 2**20
PRUNED_DIRS = ("sglang/multimodal_gen", "sglang/test", "sglang/benchmark", "sglang/srt/rust_extensions/target")
PRUNED_SUFFIXES = (".so", ".pyc")
"""Pruned: multimodal generation (not a text server's), tests and benchmarks, every compiled extension (the Rust
ones are built for CPython 3.11 and cannot load on 3.12; SGLang then falls back to its Python TreeCore). The CUDA
sources of SGLang's JIT kernels stay: `sglang.kernels.jit` refuses to import without its include/ and csrc/ folders
(found by `check-live`), and they compress well."""
PRUNED_MODULES = ("sglang.multimodal_gen", "sglang.test", "sglang.benchmark", "sglang.srt.rust_extensions._",
                  "sglang.srt.mem_cache.rust_tree_core.mem_cache")
WHEELS = """fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pyzmq==27.3.0 orjson==3.13.0 pydantic==2.14.3
pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 python-multipart==0.0.34 msgspec==0.22.0
openai==2.8.0 distro==1.9.0 sniffio==1.3.1 jiter==0.19.0 setproctitle==1.3.8 pybase64==1.5.1
partial-json-parser==0.2.1.1.post7 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
rpds-py==2026.9.1 dill==0.4.1 gguf==0.19.0 compressed-tensors==0.18.0 soundfile==0.13.1 cffi==2.1.1
pycparser==3.12 xgrammar==0.2.7 apache-tvm-ffi==0.1.11 loguru==0.7.3 opentelemetry-api==1.45.2 ipython==9.18.1
traitlets==5.16.1""".split()
"""Pinned to the versions tested here. Found by importing SGLang's server path (`check-live`): every non-stdlib
distribution it loaded that the GPU image's list (GPU_IMAGE) lacks; nearly all are imported unguarded."""
GPU_IMAGE = [line.strip() for line in (REPO / "scripts" / "gpu_image_packages.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
"""The H200 image's Python packages as /work/.library/device/KINDS.md listed them (read 2026-11-17)."""
TOKENIZER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "chat_template.jinja", "special_tokens_map.json")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pruned(rel: str) -> bool:
    """`rel`: a path in the archive (site/sglang/...) or in site-packages (sglang/...)."""
    rel = rel.removeprefix("site/")
    return any(rel == d or rel.startswith(d + "/") for d in PRUNED_DIRS) or rel.endswith(PRUNED_SUFFIXES) \
        or "/__pycache__" in rel


def _sglang_root() -> Path:
    return Path(md.distribution("sglang").locate_file("sglang"))


def _add_tree(tar: tarfile.TarFile, src: Path, arcname: str, skip=lambda rel: False) -> None:
    for path in sorted(src.rglob("*")):
        rel = f"{arcname}/{path.relative_to(src).as_posix()}"
        if path.is_file() and "__pycache__" not in path.parts and not skip(rel):
            tar.add(path, rel, recursive=False)


def _add_text(tar: tarfile.TarFile, arcname: str, text: str) -> None:
    data = text.encode()
    info = tarfile.TarInfo(arcname)
    info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
    tar.addfile(info, io.BytesIO(data))


def _project_dist_info() -> dict[str, str]:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    groups = project["entry-points"]
    entry_points = "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
                           for g, eps in groups.items())
    metadata = f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    return {"METADATA": metadata, "entry_points.txt": entry_points, "top_level.txt": "sgl_multilora\n"}


SITECUSTOMIZE = '''"""GPU kit start-up hook (no .pth: a --target folder on PYTHONPATH is no site dir): installs gpu_compat, then
runs the next sitecustomize on sys.path, if any."""
import importlib.machinery, importlib.util, os, sys
try:
    from sgl_multilora.patches import gpu_compat
    gpu_compat.install()
except Exception as e:  # never break the interpreter's start-up
    print(f"sgl_multilora kit: gpu_compat not installed: {e!r}", file=sys.stderr)
_here = os.path.dirname(os.path.abspath(__file__))
_entries = [os.path.abspath(p or ".") for p in sys.path]
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", _entries[_entries.index(_here) + 1:] if _here in _entries else [])
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
'''


def build(out: Path, wheels_dir: Path, compression: str = "xz", model_dir: Path | None = None) -> dict:
    """Writes the kit into `out` (created; existing kit files replaced). Raises FileNotFoundError naming wheels
    missing from `wheels_dir` and ValueError when the kit exceeds BUDGET_BYTES. Returns the manifest."""
    wheels = {norm(w.name.split("-")[0]): w for w in wheels_dir.glob("*.whl")}
    missing = [w for w in WHEELS if norm(w.split("==")[0]) not in wheels]
    if missing:
        raise FileNotFoundError(f"wheels missing from {wheels_dir}: {missing} (run scripts/gpu_kit.sh)")
    out.mkdir(parents=True, exist_ok=True)
    (out / "wheels").mkdir(exist_ok=True)
    for spec in WHEELS:
        shutil.copy2(wheels[norm(spec.split("==")[0])], out / "wheels")
    if model_dir is None:
        sys.path.insert(0, str(REPO))
        from sgl_multilora.embedded import ensure_embedded_model

        model_dir = ensure_embedded_model()
    archive = out / f"site.tar.{compression}"
    with tarfile.open(archive, f"w:{compression}", **({"preset": 6} if compression == "xz" else {})) as tar:
        _add_tree(tar, _sglang_root(), "site/sglang", skip=_pruned)
        dist = md.distribution("sglang")
        for name in ("METADATA", "entry_points.txt", "top_level.txt"):
            if dist.read_text(name) is not None:
                _add_text(tar, f"site/sglang-{SGLANG_VERSION}.dist-info/{name}", dist.read_text(name))
        _add_tree(tar, REPO / "sgl_multilora", "site/sgl_multilora", skip=lambda rel: rel.endswith(".pyc"))
        _add_tree(tar, REPO / "patches", "site/sgl_multilora/patches", skip=lambda rel: "/upstream/" in rel)
        for name, text in _project_dist_info().items():
            _add_text(tar, f"site/sgl_multilora-0.1.0.dist-info/{name}", text)
        _add_text(tar, "site/sitecustomize.py", SITECUSTOMIZE)
        for name in TOKENIZER_FILES:
            if (Path(model_dir) / name).is_file():
                tar.add(Path(model_dir) / name, f"tokenizer/{name}")
    shutil.copy2(REPO / "scripts" / "gpu_kit_install.sh", out / "install.sh")
    sizes = {p.relative_to(out).as_posix(): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
    manifest = {"sglang": SGLANG_VERSION, "archive": archive.name, "pruned_dirs": PRUNED_DIRS,
                "pruned_suffixes": PRUNED_SUFFIXES, "wheels": WHEELS, "total_bytes": sum(sizes.values()),
                "bytes": sizes, "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    if manifest["total_bytes"] > BUDGET_BYTES:
        raise ValueError(f"kit is {manifest['total_bytes'] / 2**20:.1f} MiB, over {BUDGET_BYTES / 2**20:.0f} MiB")
    return manifest


def blocked_modules() -> list[str]:
    """Top-level modules of distributions installed here that neither the GPU image nor the kit provides."""
    provided = {norm(n) for n in GPU_IMAGE} | {norm(w.split("==")[0]) for w in WHEELS} | {"sglang", "sgl-multilora"}
    names = set()
    for top, dists in md.packages_distributions().items():
        if all(norm(d) not in provided for d in dists) and top.isidentifier():
            names.add(top)
    return sorted(names - set(sys.stdlib_module_names) - {"sitecustomize", "_distutils_hack"})


def unpack(kit: Path, into: Path) -> Path:
    archive = next(kit.glob("site.tar.*"))
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into


def guard_env(site: Path, log_dir: Path) -> dict[str, str]:
    """The environment a process needs to run from the unpacked kit `site`, as the GPU image would see it."""
    return {"PYTHONPATH": f"{REPO / 'scripts' / 'gpu_kit_guard'}:{site}", "KIT_GUARD_LOG": str(log_dir),
            "KIT_GUARD_BLOCKED": ",".join(blocked_modules()), "OMP_NUM_THREADS": "1"}


def read_log(log_dir: Path) -> tuple[dict[str, str], list[str]]:
    """(module -> origin, blocked attempts) over every process's log."""
    found, blocked = {}, []
    for path in log_dir.glob("*.tsv"):
        for line in path.read_text().splitlines():
            name, _, origin = line.partition("\t")
            if name == "BLOCKED":
                blocked.append(origin)
            else:
                found[name] = origin
    return found, sorted(set(blocked))


def check_live(kit: Path, out_json: Path) -> dict:
    """Starts our CPU server from the unpacked kit under the guard; raises AssertionError when a pruned module was
    imported or an sglang module came from elsewhere than the kit; writes the record to `out_json`."""
    sys.path.insert(0, str(REPO))
    from sgl_multilora.server import cpu_server_args, launch

    work = Path(tempfile.mkdtemp(prefix="gpu_kit_check_"))
    site, logs = unpack(kit, work) / "site", work / "logs"
    logs.mkdir()
    adapter = REPO / "assets" / "adapters" / "caps"
    flags = [*cpu_server_args(2048), "--radix-cache-backend", "multilora", "--lora-backend", "multilora",
             "--enable-lora", "--lora-paths", f"caps={adapter}", "--max-lora-rank", "64", "--max-loras-per-batch", "4"]
    handle = launch(_model(), flags, env=guard_env(site, logs),
                    log_path=work / "server.log")
    try:
        import urllib.request

        body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                "lora_path": "caps"}
        request = urllib.request.Request(handle.url + "/generate", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(request, timeout=120).read())
    finally:
        handle.stop(timeout_s=10)
    found, blocked = read_log(logs)
    tops = {m.split(".")[0] for m in found} - set(sys.stdlib_module_names)
    record = {"answer": answer.get("text"), "num_modules": len(found), "blocked_attempts": blocked,
              "blocked": blocked_modules(), "top_level": sorted(tops), "modules": sorted(found),
              "date": time.strftime("%Y-%m-%d")}
    pruned = [m for m in found if m.startswith(PRUNED_MODULES)]
    outside = [m for m in found if m.split(".")[0] == "sglang" and found[m] != "None"  # None: namespace package
               and not str(found[m]).startswith(str(site))]
    assert not pruned, f"pruned modules were imported: {pruned}"
    assert not outside, f"sglang modules came from outside the kit: {outside[:5]}"
    out_json.write_text(json.dumps(record, indent=0))
    shutil.rmtree(work, ignore_errors=True)
    return record


def _model() -> Path:
    from sgl_multilora.embedded import ensure_embedded_model

    return ensure_embedded_model()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("out", type=Path)
    b.add_argument("--wheels", type=Path, default=REPO / ".cache" / "gpu_kit_wheels")
    b.add_argument("--compression", choices=("xz", "gz"), default="xz")
    c = sub.add_parser("check-live")
    c.add_argument("kit", type=Path)
    c.add_argument("out_json", type=Path)
    sub.add_parser("blocked")
    sub.add_parser("wheels")
    args = parser.parse_args()
    if args.cmd == "build":
        print(json.dumps({k: v for k, v in build(args.out, args.wheels, args.compression).items() if k != "bytes"}))
    elif args.cmd == "check-live":
        record = check_live(args.kit, args.out_json)
        print(json.dumps({k: v for k, v in record.items() if k != "modules"}))
    elif args.cmd == "blocked":
        print(" ".join(blocked_modules()))
    else:
        print(" ".join(WHEELS))


if __name__ == "__main__":
    main()
