"""Where an adapter's weight matrices sit inside the KV slots it holds: sizing and placement, plain Python.

Lives here: `slots_needed` (how many token slots an adapter takes), `min_run` (the shortest run a placement
needs) and `place` (each matrix's buffer, slot run and element offset for the slot runs the pool handed out).
Not here: the slots themselves (`pool.py`), the copy and the tensor views (the server's loader), which adapter
is resident (`residency.py`).

A slot of layer l is two rows of `half_elems` elements (kv_heads x head_dim): one in K's buffer, one in V's.
The slots [a, a + n) of one run are, per layer, two contiguous areas of n x half_elems elements (the rows
a..a+n-1 of k_buffer[l] and of v_buffer[l]). Layer l's matrices (A: rank x in, B: out x rank of every target
module) are packed whole into those areas, first-fit by decreasing size, so each matrix is one contiguous
view of one buffer and the LoRA compute reads it in place:
```
run (a, n), layer l    k_buffer[l][a : a+n].flatten()          v_buffer[l][a : a+n].flatten()
                       | down.B | gate.A | up.A | q.A | .. |   | gate.B | up.B | o.A | k.B | .. |  (free) |
                       ^ offset 0                              ^ offset 0
```
Every layer uses the same placement when its matrices have the same shapes (the common case), but layers
are placed independently. With several runs (a fragmented pool) the areas of every run are bins; a placement
that does not fit (a matrix longer than every free area) is reported as None, and the caller frees more.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Shape = tuple[int, int]
MatrixKey = tuple[int, str, str]  # (layer, module, "A" | "B")


@dataclass(frozen=True, slots=True)
class Placement:
    """One matrix: `buffer` 0 (K) or 1 (V) of its layer, the first slot of its run, the element offset
    inside that run's area and its shape."""

    buffer: int
    run_start: int
    offset: int
    shape: Shape


def _numel(shape: Shape) -> int:
    return shape[0] * shape[1]


def _pack(matrices: Sequence[tuple[str, str, Shape]], bins: Sequence[tuple[int, int, int]]
          ) -> dict[tuple[str, str], tuple[int, int, int]] | None:
    """First-fit decreasing of one layer's matrices into `bins` (buffer, run_start, capacity in elements):
    (module, A|B) -> (buffer, run_start, offset), or None if one does not fit. Ties keep the input order."""
    used = [0] * len(bins)
    out = {}
    for module, which, shape in sorted(matrices, key=lambda m: -_numel(m[2])):
        n = _numel(shape)
        for i, (buffer, run_start, capacity) in enumerate(bins):
            if used[i] + n <= capacity:
                out[(module, which)] = (buffer, run_start, used[i])
                used[i] += n
                break
        else:
            return None
    return out


def _by_layer(shapes: Mapping[MatrixKey, Shape]) -> dict[int, list[tuple[str, str, Shape]]]:
    layers: dict[int, list[tuple[str, str, Shape]]] = {}
    for (layer, module, which), shape in shapes.items():
        layers.setdefault(layer, []).append((module, which, shape))
    return layers


def slots_needed(shapes: Mapping[MatrixKey, Shape], half_elems: int) -> int:
    """The fewest slots of one run that hold every layer's matrices (`shapes`: (layer, module, A|B) ->
    shape) with each matrix whole in one buffer. At least the total over two buffers; grown until first-fit
    decreasing places every layer. Raises ValueError for a non-positive `half_elems` or no matrices."""
    if half_elems <= 0 or not shapes:
        raise ValueError(f"need half_elems > 0 and at least one matrix, got {half_elems}, {len(shapes)} matrices")
    layers = _by_layer(shapes)
    n = 1
    for matrices in layers.values():
        total = sum(_numel(s) for _, _, s in matrices)
        largest = max(_numel(s) for _, _, s in matrices)
        n = max(n, -(-total // (2 * half_elems)), -(-largest // half_elems))
    while any(_pack(m, ((0, 0, n * half_elems), (1, 0, n * half_elems))) is None for m in layers.values()):
        n += 1
    return n


def min_run(shapes: Mapping[MatrixKey, Shape], half_elems: int) -> int:
    """The shortest slot run any placement needs: the largest matrix's rows of one buffer,
    ceil(numel / half_elems). Free runs all shorter than this can never take the adapter, however many; a run
    this long can (with enough other room; `place` decides). Raises ValueError as `slots_needed` does."""
    if half_elems <= 0 or not shapes:
        raise ValueError(f"need half_elems > 0 and at least one matrix, got {half_elems}, {len(shapes)} matrices")
    return -(-max(_numel(s) for s in shapes.values()) // half_elems)


def place(shapes: Mapping[MatrixKey, Shape], runs: Sequence[tuple[int, int]], half_elems: int
          ) -> dict[MatrixKey, Placement] | None:
    """Each matrix's place in the slot `runs` ((start, length) pairs, as the pool hands them out), or None
    when some layer does not fit (possible only with several runs)."""
    bins = [(buffer, start, length * half_elems) for start, length in runs for buffer in (0, 1)]
    out: dict[MatrixKey, Placement] = {}
    for layer, matrices in _by_layer(shapes).items():
        packed = _pack(matrices, bins)
        if packed is None:
            return None
        shape_of = {(m, w): s for m, w, s in matrices}
        for (module, which), (buffer, run_start, offset) in packed.items():
            out[(layer, module, which)] = Placement(buffer, run_start, offset, shape_of[(module, which)])
    return out
