"""Parameter and buffer names as a checkpoint knows them: the wrappers' infixes removed, as DCP does.

    _orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight
                                    |
                                    v
    model.layers.0.mlp.up_proj.weight

torch.compile (`_orig_mod`), activation checkpointing's checkpoint_wrapper (`_checkpoint_wrapped_module`)
and FSDP1 (`_fsdp_wrapped_module`) each add a module level that no checkpoint names. torch's DCP drops
the same three (torch/distributed/checkpoint/state_dict.py, _get_fqns), so a model saved by either
loads into the other. Load and save pair every entry with its checkpoint key through `fqn`.
"""
from __future__ import annotations

from typing import Iterator, Tuple

import torch

_WRAPPERS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def fqn(name: str) -> str:
    """`name` without the wrappers' levels (unchanged where it has none)."""
    atoms = name.split(".")
    if _WRAPPERS.isdisjoint(atoms):
        return name
    return ".".join(a for a in atoms if a not in _WRAPPERS)


def named_parameters(model: torch.nn.Module, remove_duplicate: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
    for name, p in model.named_parameters(remove_duplicate=remove_duplicate):
        yield fqn(name), p


def named_buffers(model: torch.nn.Module) -> Iterator[Tuple[str, torch.Tensor]]:
    for name, b in model.named_buffers():
        yield fqn(name), b


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The module torch.compile wrapped (itself where it is not an OptimizedModule): the one whose class,
    config and transformers' helpers describe the checkpoint."""
    while type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None),
                                                                    torch.nn.Module):
        model = model._orig_mod
    return model
