"""scripts/gpu_tree.sh, on a clone of this checkout: the tree a device call carries (64 MiB with the carried kit) does
not fit with the bundled adapters and result records; `out` sets them aside outside the checkout so that it fits,
refuses to run twice, and `in` puts back exactly what git holds."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def sh(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/gpu_tree.sh", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.fixture()
def clone(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git not installed")
    dst = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", "--shared", str(REPO), str(dst)], check=True, timeout=120)
    shutil.copy(REPO / "scripts" / "gpu_tree.sh", dst / "scripts" / "gpu_tree.sh")  # the one under test
    kit = dst / ".gpu_kit"
    kit.mkdir()
    with open(kit / "site.tar.xz", "wb") as f:  # the kit's measured size (21.7 MB), sparse
        f.truncate(22 * 1024 * 1024)
    return dst


def test_out_makes_the_tree_fit_and_in_restores_it(clone):
    full = sh(clone, "size")
    assert full.returncode == 1 and "of 64 MiB" in full.stdout, full.stdout + full.stderr
    assert int(full.stdout.split()[2]) > 64
    out = sh(clone, "out")
    assert out.returncode == 0, out.stdout + out.stderr
    assert not (clone / "assets").exists() and not (clone / "eval" / "results").exists()
    assert (clone / "scripts" / "gpu_live.sh").exists() and (clone / "sgl_multilora").is_dir()
    assert int(out.stdout.splitlines()[-1].split()[2]) <= 64
    again = sh(clone, "out")
    assert again.returncode == 1 and "exists already" in again.stderr
    back = sh(clone, "in")
    assert back.returncode == 0, back.stdout + back.stderr
    status = subprocess.run(["git", "status", "--porcelain", "--", "assets", "eval/results"], cwd=clone,
                            capture_output=True, text=True, check=True)
    assert status.stdout == "" and not (clone.parent / "gpu_tree_stash").exists()
    assert sh(clone, "in").returncode == 1  # nothing left to put back


def test_out_refuses_uncommitted_changes_in_what_it_would_move(clone):
    manifest = clone / "assets" / "adapters" / "manifest.json"
    manifest.write_text(manifest.read_text() + "\n")
    refused = sh(clone, "out")
    assert refused.returncode == 1 and "uncommitted changes" in refused.stderr
    assert manifest.exists()
