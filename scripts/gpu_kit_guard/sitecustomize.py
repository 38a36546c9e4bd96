"""Import guard for the GPU kit's checks (scripts/gpu_kit.py): on PYTHONPATH ahead of an unpacked kit, it makes a
CPU process see the Python environment the GPU image would offer, and records what the process imports.

- `KIT_GUARD_BLOCKED` (comma-separated top-level names): importing one raises ModuleNotFoundError, as it would on
  the GPU image (installed here, absent there, not carried by the kit).
- `KIT_GUARD_LOG` (a directory): every module found is appended, as "name<TAB>origin", to `<dir>/<pid>.tsv` at once
  (a server's processes are killed, never asked to flush); a blocked attempt is written as "BLOCKED<TAB>name".
Then it runs the next `sitecustomize` on sys.path (the kit's, which installs gpu_compat), so both apply.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_BLOCKED = frozenset(filter(None, os.environ.get("KIT_GUARD_BLOCKED", "").split(",")))
_LOG_DIR = os.environ.get("KIT_GUARD_LOG")
_log = open(os.path.join(_LOG_DIR, f"{os.getpid()}.tsv"), "a", buffering=1) if _LOG_DIR else None


class _Guard(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in _BLOCKED:
            if _log:
                _log.write(f"BLOCKED\t{name}\n")
            raise ModuleNotFoundError(f"No module named {name!r} (kit guard: not on the GPU image)", name=name)
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if _log:
                    _log.write(f"{name}\t{spec.origin}\n")
                return spec
        return None


sys.meta_path.insert(0, _Guard())


def _run_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    entries = [os.path.abspath(p or ".") for p in sys.path]
    later = entries[entries.index(here) + 1:] if here in entries else []
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", later)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_run_next_sitecustomize()
