"""Whether a tensor's boxes (chunks, pieces) hold each of its elements exactly once: what a checkpoint
written by DCP promises and what its readers rely on, since an element no box holds is left as the
destination had it, silently.

A box is (offsets, sizes). Exactly once means no two boxes overlap and their volumes add up to the
tensor's. Overlaps are found by a sweep along the dim whose box starts are most varied: boxes sorted by
their start there, each compared only with those still open at its start (a few per box in the layouts
DCP writes: rows, columns, grids), not with every other box.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

Box = Tuple[Sequence[int], Sequence[int]]


def first_overlap(boxes: Sequence[Box]) -> Optional[Tuple[Box, Box]]:
    """Two boxes that share an element, or None. Boxes of no elements share nothing."""
    live = [b for b in boxes if all(n > 0 for n in b[1])]
    if len(live) < 2:
        return None
    ndim = len(live[0][0])
    if ndim == 0:
        return live[0], live[1]  # two 0-dim boxes hold the same one element
    d = max(range(ndim), key=lambda k: len({b[0][k] for b in live}))
    live.sort(key=lambda b: b[0][d])
    active: list = []
    for b in live:
        active = [a for a in active if a[0][d] + a[1][d] > b[0][d]]
        for a in active:
            if all(x < y + m and y < x + n for x, n, y, m in zip(a[0], a[1], b[0], b[1])):
                return a, b
        active.append(b)
    return None


def cover_problem(shape: Sequence[int], boxes: Sequence[Box]) -> Optional[str]:
    """Why `boxes` do not hold each element of a tensor of `shape` exactly once (boxes outside it, two that
    overlap, or too few elements), or None when they do."""
    for o, s in boxes:
        if len(o) != len(shape) or len(s) != len(shape) or any(
                x < 0 or n < 0 or x + n > dim for x, n, dim in zip(o, s, shape)):
            return f"a box at {list(o)} of size {list(s)} lies outside the shape {list(shape)}"
    pair = first_overlap(boxes)
    if pair is not None:
        (oa, sa), (ob, sb) = pair
        return f"boxes at {list(oa)} (size {list(sa)}) and {list(ob)} (size {list(sb)}) overlap"
    held, numel = sum(math.prod(s) for _, s in boxes), math.prod(shape)
    if held != numel:
        return f"its boxes hold {held} of its {numel} elements"
    return None
