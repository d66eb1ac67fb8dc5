"""shardcast.save: FSDP2 shards back to a Hugging Face checkpoint, with no gather.

The output's keys and shapes come from transformers itself, computed on meta tensors the way
`save_pretrained` computes them: the model's state dict (parameters' global shapes and persistent
buffers), tied duplicates dropped (`remove_tied_weights_from_state_dict`), and the model type's
conversion mapping reverted (`revert_weight_conversion`: fused experts split back into per-expert
tensors, renamed modules restored). `_mapping.compositions` then says which output tensors each model
entry becomes and in which order, exactly as a load of the finished checkpoint would resolve them;
the C++ core lays the files out and streams every rank's rows to their final offsets.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Dict, List, Optional, Tuple, Union

import torch

from . import _shardcast
from ._shardcast import InvalidArgument
from ._log import logged
from ._mapping import _class_name, _own_class, compositions, quantized_keys
from ._names import fqn, named_buffers, named_parameters, unwrapped
from ._report import SaveReport

_DTYPES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32"}


def _meta_state_dict(model) -> Dict[str, torch.Tensor]:
    """The model's state dict as meta tensors of the global shapes (DTensor shapes are global)."""
    return {fqn(k): torch.empty(tuple(v.shape), dtype=v.dtype, device="meta")
            for k, v in model.state_dict(keep_vars=True).items()}


@contextlib.contextmanager
def _own_class_names(model):
    """transformers looks up class-keyed conversions (GPTNeoXForCausalLM's "lm_head." <- "embed_out.") by
    type(module).__name__, which fully_shard made "FSDP<name>": the saved checkpoint then kept the loaded
    name. Within this, each such module's class is its base again (the same object layout; restored after)."""
    changed = []
    for module in model.modules():
        cls = type(module)
        if _own_class(cls) is not cls:
            module.__class__ = _own_class(cls)
            changed.append((module, cls))
    try:
        yield
    finally:
        for module, cls in changed:
            module.__class__ = cls


def output_tensors(model) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """{key: (shape, dtype)} of the tensors `save_pretrained` would write for this model, in its order."""
    sd = _meta_state_dict(model)
    for key in getattr(model, "_keys_to_ignore_on_save", None) or []:
        sd.pop(key, None)
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:
        PreTrainedModel = None
    if PreTrainedModel is not None and isinstance(unwrapped(model), PreTrainedModel):
        sd = remove_tied_weights_from_state_dict(sd, unwrapped(model))
        with _own_class_names(unwrapped(model)):
            sd = revert_weight_conversion(unwrapped(model), sd)
    else:  # a plain module: tied parameters are one object under several names; keep the first
        names, by_name = {}, {}
        for name, p in named_parameters(model, remove_duplicate=False):
            names.setdefault(id(p), name)
            by_name[name] = p
        sd = {k: v for k, v in sd.items() if k not in by_name or names[id(by_name[k])] == k}
    sd = _per_expert_scales(model, _mxfp4_blocks(model, sd))
    return {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}


def _per_expert_scales(model, sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Kept-quantized fp8 experts (FP8Experts): transformers' save reverts the fused weights to one tensor
    per expert but leaves their block scales fused ("<experts>.gate_up_proj_scale_inv" [E, R, C]), a
    layout no fp8 checkpoint has and serving engines do not read. They are written as the checkpoint
    holds them instead: one "<expert>.<proj>.weight_scale_inv" per expert and source of the rule, each
    taking an even share of the grid's rows, in the order load composes them (_mapping.compositions).
    A grid whose rows do not split evenly stays fused."""
    from ._mapping import _SCALE_INV, conversion_rules, expert_merges
    rules = expert_merges(conversion_rules(model))
    if not rules:
        return sd
    out: Dict[str, torch.Tensor] = {}
    for key, v in sd.items():
        stem = key[: -len(_SCALE_INV)] if key.endswith(_SCALE_INV) else None
        rule = next((r for r in rules if stem is not None and stem.endswith(r.target_patterns[0])), None)
        if rule is None or v.dim() != 3:
            out[key] = v
            continue
        prefix, n = stem[: len(stem) - len(rule.target_patterns[0])], len(rule.source_patterns)
        experts, rows, cols = v.shape
        if rows % n or not all(prefix + src.replace("*", "0") in sd for src in rule.source_patterns):
            out[key] = v
            continue
        for e in range(experts):
            for src in rule.source_patterns:
                out[prefix + src.replace("*", str(e)) + _SCALE_INV] = torch.empty(
                    (rows // n, cols), dtype=v.dtype, device="meta")
    return out


def _mxfp4_blocks(model, sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Kept-quantized gpt-oss experts (transformers' Mxfp4GptOssExperts, see from_pretrained) written as
    the MXFP4 checkpoints hold them, as transformers' own quantized save does: "<proj>_blocks"
    [E, out, in / 32, 16] (the parameter's bytes, last dim split) beside "<proj>_scales"."""
    try:
        from transformers.integrations.mxfp4 import Mxfp4GptOssExperts
    except ImportError:
        return sd
    packed = {f"{fqn(name)}.{proj}" for name, m in model.named_modules() if isinstance(m, Mxfp4GptOssExperts)
              for proj in ("gate_up_proj", "down_proj")}
    out = {}
    for k, v in sd.items():
        if k in packed and v.dtype == torch.uint8 and v.dim() >= 2 and v.shape[-1] % 16 == 0:
            k, v = k + "_blocks", v.reshape(*v.shape[:-1], v.shape[-1] // 16, 16)
        out[k] = v
    return out


def _aliases(model) -> Dict[str, List[str]]:
    """{name: every name of the same parameter} (tied weights)."""
    by_id: Dict[int, List[str]] = {}
    for name, p in named_parameters(model, remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {n: names for names in by_id.values() for n in names}


def plan_entries(model, layouts, group_ranks=None):
    """[(key, local tensor, global shape, role, layout index, [(output key, shape)] or None)] in the
    model's order, for every entry that goes into the checkpoint; `layouts` (a _Layouts) collects the
    DTensor layouts. Raises Unsupported for an output tensor no entry explains, or a placement shardcast
    does not take (Partial)."""
    from ._layouts import _local
    from ._prepare import _non_persistent
    from ._shardcast import Unsupported
    outputs = output_tensors(model)
    shapes = {k: s for k, (s, _) in outputs.items()}
    comp = compositions(model, quantized_keys((k, d, s) for k, (s, d) in outputs.items()))
    aliases = _aliases(model)
    covered: Dict[str, str] = {}
    entries = []

    def parts_of(name):
        for alias in aliases.get(name, [name]):  # the name save_pretrained kept for a tied weight
            if alias in outputs:
                return [alias]
            if alias in comp:
                return comp[alias]
        return None

    non_persistent = {n for n, *_ in _non_persistent(model)}
    candidates = [(n, p, "parameter") for n, p in named_parameters(model)]
    candidates += [(n, b, "persistent_buffer") for n, b in named_buffers(model) if n not in non_persistent]
    for name, t, role in candidates:
        parts = parts_of(name)
        if parts is None:
            continue  # not written by save_pretrained either (_keys_to_ignore_on_save)
        for key in parts:
            if key in covered:
                raise Unsupported(f"output tensor '{key}' would be written from both '{covered[key]}' and '{name}'")
            covered[key] = name
        local, shape, layout = _local(t, f"'{name}'", group_ranks, layouts.meshes)
        own = parts == [name]
        entries.append((name, local.detach(), list(shape), role, layouts.index(layout),
                        None if own else [(k, list(shapes[k])) for k in parts]))
    missing = [k for k in outputs if k not in covered]
    if missing:
        model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise Unsupported(f"{len(missing)} tensor(s) save_pretrained writes for {model_type} come from a conversion "
                          f"shardcast cannot stream (only renames and expert merges are), e.g. '{missing[0]}'")
    return entries


def _written_dtype(model, dtype) -> Optional[torch.dtype]:
    if dtype is not None:
        return dtype
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return None


_QUANTIZED_DTYPES = (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2, getattr(torch, "float8_e8m0fnu", torch.uint8))


def _holds_quantized(model) -> bool:
    """Whether any parameter is in a quantized dtype (fp8, or packed bytes): a model loaded dequantized
    from a quantized checkpoint has none, and its config must not say it is quantized."""
    return any(p.dtype in _QUANTIZED_DTYPES for p in model.parameters())


def config_texts(model, config, dtype) -> Tuple[str, str]:
    """(config.json, generation_config.json) as save_pretrained writes them, with dtype set to what is
    written; "" where there is none. A quantization_config is dropped where the model holds no quantized
    parameter (transformers drops it from a model it dequantized), so the checkpoint never claims a
    format its tensors are not in."""
    written = _written_dtype(model, dtype)
    name = str(written).split(".")[1] if written is not None else None
    cfg = config if config is not None else getattr(model, "config", None)
    if cfg is None:
        return "", ""
    dequantized = not _holds_quantized(model)
    if isinstance(cfg, (str, os.PathLike)):
        with open(cfg) as f:
            cfg = json.load(f)
    if isinstance(cfg, dict):
        cfg = dict(cfg)
        if dequantized:
            cfg.pop("quantization_config", None)
        if name is not None:
            cfg["dtype"] = name
            if "torch_dtype" in cfg:
                cfg["torch_dtype"] = name
        config_text = json.dumps(cfg, indent=2, sort_keys=True) + "\n"
    else:
        import copy
        cfg = copy.deepcopy(cfg)
        if dequantized and hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        if name is not None:
            cfg.dtype = name
        cfg.architectures = [_class_name(type(unwrapped(model)))]
        config_text = _saved(cfg, "config.json")
    generation = ""
    gen = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", lambda: False)
    if gen is not None and can_generate():
        generation = _saved(gen, "generation_config.json")
    return config_text, generation


def _saved(obj, name: str) -> str:
    """The text transformers' own save_pretrained writes for a config object."""
    with tempfile.TemporaryDirectory(prefix="shardcast-config-") as d:
        obj.save_pretrained(d)
        with open(os.path.join(d, name)) as f:
            return f.read()


def shard_size_text(max_shard_size) -> str:
    """max_shard_size as the size parser's text: bytes as an int, or a size string ("5GB", "500MiB"), as
    transformers takes it. A float or a bool is refused: str(1.5) would be read as one byte."""
    if isinstance(max_shard_size, str) or (isinstance(max_shard_size, int) and not isinstance(max_shard_size, bool)):
        return str(max_shard_size)
    raise InvalidArgument(f"max_shard_size={max_shard_size!r}: takes bytes as an int or a size string such as "
                          f"\"5GB\", not {type(max_shard_size).__name__}")


def save(model: torch.nn.Module, out_dir: Union[str, os.PathLike], *, source: Optional[str] = None,
         max_shard_size: Union[int, str] = "5GB", dtype: Optional[Union[torch.dtype, str]] = None,
         overwrite: bool = False, config=None, process_group=None, timeout: Optional[float] = None,
         chunk_bytes: Optional[Union[int, str]] = None, staging_slots: Optional[int] = None, progress=None,
         mode: Optional[str] = None) -> SaveReport:
    """Writes an FSDP2-sharded model as a Hugging Face checkpoint (safetensors files, index, config.json,
    generation_config.json), with no gather: every rank calls it together after training. Every argument
    after `out_dir` is keyword-only.

    source "each-rank" (default; a filesystem every rank sees at the same path): rank 0 creates every file
    at its final size with its header and every rank writes its own rows at their offsets, in parallel.
    source "rank0" (node-local disks): the other ranks stream their rows to rank 0, which writes. No rank
    holds more than its shard plus the staging ring (chunk_bytes x staging_slots). mode= is its deprecated
    old name (a DeprecationWarning; removed in the next release): the same idea as load's source=.

    The keys, shapes and values are those save_pretrained writes (per-expert tensors, restored module
    names, tied weights once, persistent buffers in, non-persistent out), split into files by
    max_shard_size ("5GB", decimal as in transformers; or bytes); which file holds a tensor may differ
    from save_pretrained's split (the index names it). dtype: None keeps each tensor's dtype; float16,
    bfloat16 or float32 converts floating tensors on the way out (an InvalidArgument for a model kept
    quantized, whose F32 block scales it would convert too). config: what to write as config.json
    (default model.config; a PretrainedConfig, a dict or a path), its dtype set to the written one.

    Atomic: everything is written into out_dir.tmp-<id>, and renamed into place only once every rank
    synced its bytes; a kill -9 of any rank leaves the previous out_dir intact or no out_dir at all.
    An existing out_dir, or a leftover out_dir.tmp-* of a save that died, is an error unless
    overwrite=True (which replaces the one and removes the other). Replacing out_dir replaces its model's
    files (model.safetensors or model-NNNNN-of-NNNNN.safetensors, the index, config.json and
    generation_config.json) and keeps every other file and folder in it (the tokenizer, a README, an
    adapter), as save_pretrained does: saving back into the folder a model was loaded from loses nothing
    else. timeout: seconds per collective.

    Parameter and buffer names are written without the levels torch.compile (`_orig_mod.`),
    checkpoint_wrapper (`_checkpoint_wrapped_module.`) and FSDP1 (`_fsdp_wrapped_module.`) add, as DCP
    writes them. progress: as for load (None: a line on rank 0 when its stderr is a terminal).

    Returns a SaveReport (per-rank rows, seconds, gbps, peaks; `report["key"]` and `to_dict()` give the
    dict of earlier releases); raises a ShardcastError subclass, the same on every rank, on any failure:
    one found on this rank alone (a bad argument, an entry it cannot plan) is carried into the save's
    first verdict, so every rank raises it at once, naming this rank.
    """
    from ._carried import _agreed, _problem
    from ._group import _group, _store_host, operation_store
    from ._layouts import _Layouts, _group_ranks
    from ._load import _deprecated, _options, _timeout_alone, _timeout_ms
    from ._progress import _progress
    # Without its group this rank has no one to tell: the one step that may fail here alone.
    pg, rank, world, store = _group(process_group)
    problem, entries, config_json, generation_json, dtype_name = None, [], "", "", None
    options, layouts, progress_cb, out_text, max_shard_text, overwrite_flag = {}, _Layouts(), None, "", "5GB", False
    try:  # anything that fails on this rank is agreed in the save's first verdict: every rank raises it
        out_text = os.fspath(out_dir)
        source = _deprecated("mode=", "source=", mode, source)
        options = _options(source=source if source is not None else "each-rank", chunk_bytes=chunk_bytes,
                           staging_slots=staging_slots, timeout_ms=_timeout_ms(timeout))
        progress_cb = _progress(progress, rank, "save")
        max_shard_text, overwrite_flag = shard_size_text(max_shard_size), bool(overwrite)
        if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
            dtype = getattr(torch, dtype)  # "bfloat16"
        if dtype is not None:
            dtype_name = _DTYPES.get(dtype, str(dtype))
            if _holds_quantized(model):
                # The F32 block scales (*_scale_inv) are floating tensors too: converting them would change
                # every dequantized weight, with the checkpoint still claiming its quantization.
                raise InvalidArgument(
                    f"save(dtype={dtype}) of a model holding quantized parameters (kept quantized: fp8 "
                    f"weights with F32 block scales, or MXFP4 blocks): their scales would be converted too. "
                    f"Save without dtype; the other modules keep the dtype they were loaded in")
        entries = plan_entries(model, layouts, _group_ranks(pg, world))
        if rank == 0:
            config_json, generation_json = config_texts(model, config, dtype)
    except Exception as e:  # noqa: BLE001 -- any failure here must reach every rank, not only this one
        problem, entries, layouts, dtype_name = _problem(e), [], _Layouts(), None
        options = options or _timeout_alone(timeout)
    ops = operation_store(pg, store)  # numbered on every path, _agreed's shortcut too
    return logged("save", out_text, rank, SaveReport.from_dict(_agreed(problem, lambda: _shardcast.save_entries(
        entries, layouts.table, out_text, options, dtype_name, max_shard_text, overwrite_flag,
        config_json, generation_json, ops, rank, world, progress_cb,
        problem, _store_host(store) if store is not None else "", keep_other_files=True))))
