"""Which checkpoint tensors make up each model entry.

Most entries are one checkpoint tensor under the same key. transformers >= 5 also fuses MoE experts in
the model (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) while checkpoints
keep one tensor per expert, and renames some modules (Mixtral's `block_sparse_moe` -> `mlp`). Both are
read from transformers' own conversion mapping for the model type, so shardcast follows whatever the
installed transformers declares; a fused entry becomes the list of its per-expert tensors in row order,
which the C++ core streams as consecutive parts of one entry.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import torch


class CheckpointKeys(Dict[str, Tuple[int, ...]]):
    """{key: shape}, with `dtypes` {key: safetensors dtype name} and `quant` {key: the C++ registry's
    verdict on it (loaders/quant/format.h, through the binding's quantization_of)} beside it.
    `stored` maps a model key the checkpoint holds under another key (MXFP4's "<p>" as "<p>_blocks")
    to that key."""

    def __init__(self, shapes=(), dtypes: Optional[Dict[str, str]] = None,
                 quant: Optional[Dict[str, dict]] = None) -> None:
        super().__init__(shapes)
        self.dtypes: Dict[str, str] = dict(dtypes or {})
        self.quant: Dict[str, dict] = dict(quant or {})
        self.stored: Dict[str, str] = {q["model_key"]: k for k, q in self.quant.items()
                                       if q["piece"] == "data" and q["model_key"] != k}


def quantized_keys(tensors) -> CheckpointKeys:
    """The CheckpointKeys of [(key, dtype, shape)] (a safetensors dtype name or a torch.dtype), each key's
    quantized format decided by the C++ registry (loaders/quant/format.h): Python keeps no detection rule."""
    from . import _shardcast

    tensors = [(k, d, tuple(s)) for k, d, s in tensors]
    verdicts = _shardcast.quantization_of([(k, d, list(s)) for k, d, s in tensors])
    return CheckpointKeys({k: s for k, _, s in tensors}, {k: d for k, d, _ in tensors if isinstance(d, str)},
                          {k: q for (k, _, _), q in zip(tensors, verdicts) if q is not None})


def checkpoint_keys(path: str) -> CheckpointKeys:
    """{key: shape} of a checkpoint (a file, a dir with model.safetensors, or with an index), read by the C++
    loader's own validating reader (headers, index, names beneath the checkpoint's root), each key's
    quantized format decided by the C++ registry: Python parses no checkpoint header and keeps no detection
    rule. {} when it is missing, malformed or resolves outside its root: the C++ core raises the precise
    CheckpointError on every rank in its handshake."""
    from . import _shardcast

    try:
        tensors = _shardcast.checkpoint_tensors(os.fspath(path))
    except (OSError, _shardcast.ShardcastError):
        return CheckpointKeys()
    return quantized_keys((k, d, s) for k, d, s, _ in tensors)


def entry_shape(keys: Dict[str, Tuple[int, ...]], key: str, floating: bool = True) -> Optional[Tuple[int, ...]]:
    """The shape checkpoint entry `key` loads as: for a floating entry whose checkpoint tensor is a
    quantized format's data, the shape it dequantizes to (NVFP4's [out, in] from its packed [out, in / 2]);
    for a model key stored under another key (MXFP4's "<key>_blocks" [..., out, in / 32, 16]) the shape
    it dequantizes to ([..., in, out]); otherwise the stored shape. The C++ registry decides which tensors
    are which and then checks the pieces, naming what is wrong. None when the checkpoint has neither."""
    quant = getattr(keys, "quant", {})
    if key in keys:
        q = quant.get(key)
        if floating and q is not None and q["piece"] == "data" and q["model_key"] == key and q["model_shape"]:
            return tuple(q["model_shape"])
        return keys[key]
    stored = getattr(keys, "stored", {}).get(key)
    if stored is None or not quant[stored]["model_shape"]:
        return None
    return tuple(quant[stored]["model_shape"])


def conversion_rules(model):
    """transformers' checkpoint conversion rules for the model ([] without any), looked up as transformers
    looks them up (extract_weight_conversions_for_model): by the model's class name first (class-specific
    rules: GPTNeoXForCausalLM's "embed_out." -> "lm_head."), then by its config's model_type. A stand-in
    for a model not yet built (the stream beside the build) names its class in `class_name`."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return []
    for name in (getattr(model, "class_name", None) or _class_name(type(model)), model_type):
        rules = get_checkpoint_conversion_mapping(name) if name else None
        if rules is not None:
            return rules
    return []


def _own_class(cls) -> type:
    """The module's own class: fully_shard makes a class "FSDP<name>" of it, whose base it is."""
    if cls.__name__.startswith("FSDP"):
        base = next((c for c in cls.__mro__[1:] if c.__name__ == cls.__name__[len("FSDP"):]), None)
        if base is not None:
            return base
    return cls


def _class_name(cls) -> str:
    """The module's own class name (_own_class's)."""
    return _own_class(cls).__name__


def _op_names(rule) -> List[str]:
    return [f"{type(op).__name__}{getattr(op, 'dim', '')}" for op in getattr(rule, "operations", []) or []]


def expert_merges(rules) -> list:
    """The converters that stack per-expert tensors into one fused entry (MergeModulelist on dim 0,
    optionally then Concatenate on dim 1): the only conversions shardcast streams."""
    return [r for r in rules if type(r).__name__ == "WeightConverter"
            and _op_names(r) in (["MergeModulelist0"], ["MergeModulelist0", "Concatenate1"])]


_SCALE_INV = "_scale_inv"


def kept_quantized(model, keys: Dict[str, Tuple[int, ...]]) -> Dict[str, List[str]]:
    """{model key: [stored key]} for every uint8 parameter the checkpoint holds under another key (MXFP4's
    "<key>_blocks") in the shape the model keeps it quantized (the registry's kept_shape: [..., out, in / 2],
    the same bytes), loaded as they are; its scales load as their own parameter. A shape that does not
    match is left out: the C++ core names both shapes."""
    from ._names import named_parameters
    quant = getattr(keys, "quant", {})
    out: Dict[str, List[str]] = {}
    for name, p in named_parameters(model):
        stored = getattr(keys, "stored", {}).get(name)
        if (p.dtype == torch.uint8 and name not in keys and stored is not None
                and quant[stored]["kept_shape"] and tuple(quant[stored]["kept_shape"]) == tuple(p.shape)):
            out[name] = [stored]
    return out


def _renamed_keys(rules, keys) -> Dict[str, str]:
    """{model-side name: checkpoint key} for every checkpoint key transformers' renamings change, applied
    forward exactly as transformers applies them when it loads (its patterns are regular expressions,
    with anchors, groups and look-arounds, and renamings chain in order), so no rename has to be inverted.
    A converter's per-expert source names are model-side names too: they come after the renamings."""
    renamings = [r for r in rules if type(r).__name__ != "WeightConverter" and hasattr(r, "rename_source_key")]
    if not renamings:
        return {}
    try:
        from transformers.core_model_loading import apply_renamings
    except ImportError:  # a transformers with rules but without this helper: each renaming in turn
        def apply_renamings(key, transforms):
            for t in transforms:
                key, _ = t.rename_source_key(key)
            return key
    out: Dict[str, str] = {}
    for key in keys:
        name = apply_renamings(key, renamings)
        if name != key:
            out.setdefault(name, key)
    return out


def compositions(model, keys: Dict[str, Tuple[int, ...]]) -> Dict[str, List[str]]:
    """{model key: [checkpoint keys, concatenated in order]} for model entries not stored under their
    own key. `keys` is a CheckpointKeys (checkpoint_keys, quantized_keys): the formats come from it. Entries
    it cannot explain are left out; the load then names them as missing."""
    packed = kept_quantized(model, keys)
    rules = conversion_rules(model)
    if not rules:
        return packed
    converters = expert_merges(rules)
    renamed = _renamed_keys(rules, keys)

    def to_checkpoint(name: str) -> Optional[str]:
        if name in keys:
            return name
        return renamed.get(name)

    out: Dict[str, List[str]] = dict(packed)
    from ._names import named_buffers, named_parameters
    names = [n for n, _ in named_parameters(model)] + [n for n, _ in named_buffers(model)]
    shapes = dict(named_parameters(model))
    shapes.update(dict(named_buffers(model)))
    for name in names:
        if name in keys or name in out:
            continue
        plain = to_checkpoint(name)
        if plain is not None:
            out[name] = [plain]
            continue
        for rule in converters:
            target = rule.target_patterns[0]
            # A kept-quantized fp8 model (FineGrainedFP8Config) fuses the experts' block scales the same
            # way as their weights: "<fused>_scale_inv" from each "<expert>.weight_scale_inv", in the
            # same order (the scale grid's rows follow the weight's rows block by block).
            suffix = next((s for s in ("", _SCALE_INV) if name.endswith(target + s)), None)
            if suffix is None:
                continue
            prefix = name[: len(name) - len(target) - len(suffix)]
            experts = int(shapes[name].shape[0])
            parts = []
            for e in range(experts):
                for src in rule.source_patterns:
                    parts.append(to_checkpoint(prefix + src.replace("*", str(e)) + suffix))
            if all(p is not None for p in parts):
                out[name] = parts
                break
    return out
