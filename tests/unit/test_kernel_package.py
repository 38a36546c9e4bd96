"""The kernels are importable only as `sgl_multilora.triton_kernels`, never as a top-level package.

SGLang's MoE code imports OpenAI's `triton_kernels` on a GPU. A checkout on `sys.path` (pytest's
`pythonpath`, `python -m` from the repository root, a server started there) must not hide it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent(
    """
    import importlib.util, json, sys
    sys.path[0] = sys.argv[1]  # the repository root first, as `python -m` from a checkout has it
    spec = importlib.util.find_spec("triton_kernels")
    where = []
    if spec is not None:
        where = [spec.origin or "", *(spec.submodule_search_locations or [])]
    import sgl_multilora.triton_kernels.ops as ops
    print(json.dumps({"top_level": where, "ops": ops.__file__}))
    """
)


def test_top_level_triton_kernels_never_resolves_inside_the_checkout():
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(REPO)], cwd=REPO, capture_output=True, text=True,
        timeout=120, check=True,
    )
    found = json.loads(out.stdout.strip().splitlines()[-1])
    inside = [p for p in found["top_level"] if p and Path(p).resolve().is_relative_to(REPO)]
    assert not inside, f"`import triton_kernels` would load {inside} from the checkout"
    assert Path(found["ops"]).resolve().is_relative_to(REPO / "sgl_multilora" / "triton_kernels")
