"""load's explicit mapping ({key: (local tensor, offsets) or (local tensor, row_begin, row_end)}): each value
checked, the checkpoint's shapes read by rank 0, every rank's boxes gathered, and the entries and layouts
the binding takes."""
from __future__ import annotations

import operator
from typing import Dict, Tuple

import torch

from ._carried import _problem
from ._exchange import computed_on_rank0, gathered
from ._layouts import _Layouts
from ._mapping import checkpoint_keys, entry_shape
from ._shardcast import InvalidArgument


def _mapping_value(key, value) -> Tuple[torch.Tensor, tuple]:
    """(local tensor, the rest) of one explicit mapping value; InvalidArgument for any other shape of it."""
    if (not isinstance(key, str) or not isinstance(value, (tuple, list)) or len(value) not in (2, 3)
            or not isinstance(value[0], torch.Tensor)):
        raise InvalidArgument(f"mapping key {key!r}: expected (local tensor, offsets) or (local tensor, row_begin, "
                              f"row_end) under a text key, got {type(value).__name__} {_short(value)}")
    try:
        if len(value) == 2:
            rest = (tuple(operator.index(x) for x in value[1]),)
        else:
            rest = (operator.index(value[1]), operator.index(value[2]))
    except TypeError:
        raise InvalidArgument(f"mapping key {key!r}: offsets and rows are ints, got {_short(value[1:])}") from None
    return value[0], rest


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _mapping_entries(mapping, path, ch, rank, world, timeout_s):
    """(entries, layouts, problem) of an explicit mapping, every value either (local, row_begin, row_end):
    rows of dim 0 under FSDP2's rule, or (local, offsets): the box of the global tensor at `offsets` with
    the local tensor's shape, any box (every rank's boxes are gathered, so each knows what the others
    hold). Every rank makes both exchanges, whatever fails: a problem is carried into the handshake,
    where every rank raises it; a rank that hears a peer failed enters it with nothing."""
    problem, values = None, {}
    try:
        values = {k: _mapping_value(k, v) for k, v in mapping.items()}
    except Exception as e:  # noqa: BLE001 -- carried into the handshake, where every rank raises it
        problem = _problem(e)

    def shapes_on_rank0():  # the checkpoint's shape of every key: read by rank 0 only
        if problem is not None:
            raise InvalidArgument(problem[1])  # rank 0 failed: the others hear it at once
        return _mapping_shapes(path, {k: t.is_floating_point() for k, (t, _) in values.items()})

    try:
        shapes = computed_on_rank0(ch, rank, world, shapes_on_rank0, timeout_s)
    except Exception as e:  # noqa: BLE001 -- carried into the handshake
        shapes, problem = None, problem or _problem(e)
    mine = None if problem is not None else {
        k: [list(rest[0]), [int(x) for x in t.shape]] for k, (t, rest) in values.items() if len(rest) == 1}
    try:
        boxes = gathered(ch, rank, world, mine, timeout_s)
    except Exception as e:  # noqa: BLE001 -- carried into the handshake
        boxes, problem = None, problem or _problem(e)
    if problem is not None:
        return [], _Layouts(), problem
    if shapes is None or any(b is None for b in boxes):  # a peer failed and carries its problem
        return [], _Layouts(), None
    try:
        entries, layouts = _mapping_layouts(values, shapes, boxes, rank, world)
    except Exception as e:  # noqa: BLE001 -- carried into the handshake
        return [], _Layouts(), _problem(e)
    return entries, layouts, None


def _mapping_layouts(values, shapes, boxes, rank: int, world: int):
    """(entries, layouts) of a checked mapping, given the checkpoint's shapes and every rank's boxes.
    InvalidArgument for a key given as a box on some ranks only, or rows FSDP2's rule does not give."""
    entries, layouts = [], _Layouts()
    for key, (tensor, rest) in values.items():
        if len(rest) == 1:
            shape = shapes.get(key)
            if shape is None:  # absent: the manifest check names it
                shape = [o + n for o, n in zip(*boxes[rank][key])]
            holders = [r for r in range(world) if key in boxes[r]]
            if len(holders) != world:
                raise InvalidArgument(f"key '{key}' is given as a box on ranks {holders} but not on the others: "
                                      f"every rank gives every key in the same form (an empty box for nothing)")
            layout = ((), tuple(holders), (), tuple((tuple(boxes[r][key][0]), tuple(boxes[r][key][1])) for r in holders))
            entries.append((key, tensor, list(shape), "parameter", layouts.index(layout), None))
            continue
        begin, end = rest
        shape = shapes.get(key)
        if shape is None:
            shape = (end,) + tuple(tensor.shape[1:])  # absent: the manifest check names it
        rows = shape[0] if shape else 1
        chunk = -(-rows // world)  # FSDP2's dim-0 rule for this rank
        want = (min(rows, rank * chunk), min(rows, rank * chunk + chunk))
        if (begin, end) != want:  # agreed in the handshake: every rank raises it
            raise InvalidArgument(f"key '{key}' on rank {rank}: rows [{begin}, {end}) given, but FSDP2's dim-0 rule "
                                  f"gives this rank [{want[0]}, {want[1]}) of {rows} over {world} ranks")
        entries.append((key, tensor, list(shape), "parameter", -2, None))
    return entries, layouts


def _mapping_shapes(path: str, keys: Dict[str, bool]) -> Dict[str, list]:
    """{key: shape} of the keys given as {key: whether the entry is floating}."""
    found = checkpoint_keys(path)
    return {k: list(s) for k, floating in keys.items() if (s := entry_shape(found, k, floating)) is not None}
