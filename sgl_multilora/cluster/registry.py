"""Packers by name, for the simulator and a router that picks one by flag.

Lives here: `PACKERS` and `create_packer`. Not here: the packers (mell.py, baselines.py).
"""

from __future__ import annotations

from collections.abc import Callable

from sgl_multilora.cluster.base import BasePacker
from sgl_multilora.cluster.baselines import FitPacker, LlumnixLikePacker
from sgl_multilora.cluster.mell import MellPacker


def _best_fit(capacity_tokens: int, **kwargs) -> BasePacker:
    return FitPacker(capacity_tokens, fit="best", **kwargs)


def _worst_fit(capacity_tokens: int, **kwargs) -> BasePacker:
    return FitPacker(capacity_tokens, fit="worst", **kwargs)


PACKERS: dict[str, Callable[..., BasePacker]] = {
    "mell": MellPacker,
    "best-fit": _best_fit,
    "worst-fit": _worst_fit,
    "llumnix": LlumnixLikePacker,
}


def create_packer(name: str, capacity_tokens: int, **kwargs) -> BasePacker:
    """Raises ValueError naming the supported packers for an unknown name."""
    try:
        factory = PACKERS[name]
    except KeyError:
        raise ValueError(f"unknown packer {name!r}; supported: {', '.join(PACKERS)}") from None
    return factory(capacity_tokens, **kwargs)
