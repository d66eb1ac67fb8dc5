"""The meta model `from_pretrained` builds before it shards and loads: the config's model class on the meta
device in the asked dtype, with what transformers' own from_pretrained keeps in float32 cast to it, and,
for a kept-quantized load, transformers' quantized modules (FP8Linear/FP8Experts, or gpt-oss's MXFP4
experts) in place of the plain ones, so both hold the same tensors with the same names and dtypes.
"""
from __future__ import annotations

import contextlib
import fnmatch
from typing import Any, Dict, List, Optional

import torch

from ._shardcast import InvalidArgument, Unsupported


def _fp32_plan(model, dtype: Optional[torch.dtype]) -> List[str]:
    """The names transformers' from_pretrained keeps in float32 at this dtype (`_keep_in_fp32_modules`
    for fp16, `_keep_in_fp32_modules_strict` for fp16 and bf16: DeepSeek's e_score_correction_bias)."""
    if hasattr(model, "_get_dtype_plan"):  # transformers 5
        return [k for k, v in model._get_dtype_plan(dtype).items() if v == torch.float32]
    keep = []
    if dtype == torch.float16:
        keep += list(getattr(model, "_keep_in_fp32_modules", None) or ())
    if dtype in (torch.float16, torch.bfloat16):
        keep += list(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    return keep


def _keep_in_fp32(model, dtype: Optional[torch.dtype]) -> None:
    """Casts (on meta: no memory) what from_pretrained would keep in float32, so both load the same dtypes."""
    keep = _fp32_plan(model, dtype)
    if not keep:
        return
    for name, module in model.named_modules():
        for leaf, p in list(module._parameters.items()):
            full = f"{name}.{leaf}" if name else leaf
            if p is not None and p.is_floating_point() and any(fnmatch.fnmatchcase(full, f"*{k}*") for k in keep):
                module._parameters[leaf] = torch.nn.Parameter(p.to(torch.float32), requires_grad=p.requires_grad)
        for leaf, b in list(module._buffers.items()):
            full = f"{name}.{leaf}" if name else leaf
            if b is not None and b.is_floating_point() and any(fnmatch.fnmatchcase(full, f"*{k}*") for k in keep):
                module._buffers[leaf] = b.to(torch.float32)


def _untied():
    """transformers' own context for building a model whose tied weights stay apart (its from_pretrained
    builds under it, lays the model out with distributed_config's plans, loads, then ties): a TP plan names
    lm_head.weight, which a tied model does not hold as a parameter of its own. A null context where
    transformers has none."""
    try:
        from transformers import initialization
        return initialization.no_tie_weights()
    except (ImportError, AttributeError):
        return contextlib.nullcontext()


def _build_meta(config, dtype: Optional[torch.dtype], trust_remote_code: bool, model_cls=None, untied: bool = False):
    """The model on meta: model_cls (default AutoModelForCausalLM) built from `config` in `dtype`; with
    `untied`, its tied weights left apart, as transformers builds a model it lays out by distributed_config."""
    with _untied() if untied else contextlib.nullcontext():
        return _build_meta_tied(config, dtype, trust_remote_code, model_cls)


def _build_meta_tied(config, dtype: Optional[torch.dtype], trust_remote_code: bool, model_cls=None):
    from transformers import AutoModelForCausalLM
    if model_cls is not None and model_cls is not AutoModelForCausalLM:
        return _build_meta_with(model_cls, config, dtype, trust_remote_code)
    kwargs: Dict[str, Any] = {"trust_remote_code": trust_remote_code}
    _import_modeling(config)
    with torch.device("meta"):
        try:  # transformers >= 4.56 names it dtype; older releases torch_dtype
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
        except TypeError:
            model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype, **kwargs)
    _keep_in_fp32(model, dtype)
    return model


def _import_modeling(config, model_cls=None) -> None:
    """Imports the modeling module of `config`'s model for model_cls (an AutoModel* class; default
    AutoModelForCausalLM), which transformers imports lazily, on the first look-up of its class. Before
    the meta device context: with torch 2.6, importing e.g. DeepSeek-V3's under it fails (module-level code
    calls .item() on what is then a meta tensor); and from_pretrained charges it to its import phase."""
    from transformers import AutoModelForCausalLM
    mapping = getattr(model_cls or AutoModelForCausalLM, "_model_mapping", None)
    try:
        mapping[type(config)]
    except Exception:  # noqa: BLE001 -- remote code, an unmapped config, no mapping: from_config says what is wrong
        pass


def _cast_floating(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Parameters and persistent buffers of a floating dtype to `dtype`, as transformers' dtype= builds
    them. Non-persistent buffers keep theirs: RoPE's inv_freq stays float32 (model.to(dtype) made it
    bf16, and its rule then refused it)."""
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_floating_point() and p.dtype != dtype:
                module._parameters[name] = torch.nn.Parameter(p.to(dtype), requires_grad=p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None and b.is_floating_point() and name not in module._non_persistent_buffers_set:
                module._buffers[name] = b.to(dtype)


def _build_meta_with(model_cls, config, dtype: Optional[torch.dtype], trust_remote_code: bool):
    """model_cls: an AutoModel* class (its from_config), a transformers model class (its _from_config), or
    a callable(config) returning a module on meta, whose floating tensors are then cast to `dtype`."""
    with torch.device("meta"):
        if hasattr(model_cls, "from_config"):  # AutoModel, AutoModelForSequenceClassification, ...
            try:
                model = model_cls.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
            except TypeError:
                model = model_cls.from_config(config, torch_dtype=dtype, trust_remote_code=trust_remote_code)
        elif isinstance(model_cls, type) and hasattr(model_cls, "_from_config"):  # LlamaForCausalLM, ...
            model = model_cls._from_config(config, dtype=dtype)
        elif callable(model_cls):
            model = model_cls(config)
            if not isinstance(model, torch.nn.Module):
                raise InvalidArgument(f"model_cls={model_cls!r} returned {type(model).__name__}, not a torch.nn.Module")
            if dtype is not None:
                _cast_floating(model, dtype)
        else:
            raise InvalidArgument(f"model_cls={model_cls!r}: expected an AutoModel* class, a transformers model "
                                  f"class or a callable(config) returning a module")
    on = {t.device.type for t in list(model.parameters()) + list(model.buffers())}
    if on - {"meta"}:
        raise InvalidArgument(f"model_cls={model_cls!r} built tensors on {sorted(on - {'meta'})}, not on meta: "
                              f"build them under the current device (from_pretrained enters torch.device('meta'))")
    _keep_in_fp32(model, dtype)
    return model


# The quantization methods whose layout a kept-quantized load builds: transformers' own quantized modules
# hold the checkpoint's tensors unchanged (fp8 weights and their block scales, fused experts included;
# MXFP4 experts' packed blocks, with their E8M0 scales beside them).
_KEPT_QUANTIZED = ("fp8", "mxfp4")


def _quantized_layout(model, config, path: str, dtype: Optional[torch.dtype]) -> None:
    """Replaces the meta model's modules by transformers' quantized ones for the checkpoint's
    quantization_config, as its from_pretrained does before loading a pre-quantized checkpoint on a GPU,
    so the load keeps the checkpoint's quantized tensors as they are: FP8Linear/FP8Experts (fp8 weights,
    F32 or E8M0 `*_scale_inv`), or Mxfp4GptOssExperts (see `_mxfp4_layout`)."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        raise InvalidArgument(f"keep_quantized=True, but {path}/config.json has no quantization_config: the "
                              f"checkpoint is not quantized")
    from transformers.quantizers import AutoHfQuantizer
    quantizer = AutoHfQuantizer.from_config(qc, pre_quantized=True)
    method = str(getattr(quantizer.quantization_config.quant_method, "value",
                         quantizer.quantization_config.quant_method))
    if method not in _KEPT_QUANTIZED:
        raise Unsupported(f"keep_quantized=True: {path} is quantized with '{method}', which shardcast loads only "
                          f"dequantized (keep_quantized=False); kept quantized: {', '.join(_KEPT_QUANTIZED)}")
    # transformers dequantizes on a machine without a suitable GPU (its validate_environment, not called
    # here); the caller asked for the quantized layout, whatever this rank's device.
    quantizer.quantization_config.dequantize = False
    if method == "mxfp4":
        _mxfp4_layout(model, quantizer, path)
    else:
        quantizer.preprocess_model(model, dtype=dtype)


def _mxfp4_layout(model, quantizer, path: str) -> None:
    """gpt-oss kept in MXFP4: every converted GptOssMLP becomes transformers' Mxfp4GptOssMLP around an
    Mxfp4GptOssExperts, whose `gate_up_proj` / `down_proj` are uint8 [E, out, in / 2], the checkpoint's
    `*_blocks` [E, out, in / 32, 16] with the last two dims merged (the same bytes). transformers keeps
    the matching `*_scales` [E, out, in / 32] outside the parameters (a GPU swizzle into a triton
    precision config, which needs its Hub kernels); here they are uint8 parameters of the same module,
    so FSDP2 and transformers' EP plan (extended by the quantizer's own `update_parallel_plan`, as for
    fp8) cut them over experts exactly as their blocks. Nothing is swizzled: a rank that runs the
    experts hands its local blocks and scales to transformers' `swizzle_mxfp4_convertops` on its GPU."""
    from transformers.integrations.mxfp4 import Mxfp4GptOssExperts, Mxfp4GptOssMLP
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from transformers.quantizers.quantizers_utils import should_convert_module
    model.is_quantized = True
    model.quantization_method = quantizer.quantization_config.quant_method
    skip = quantizer.get_modules_to_not_convert(model, quantizer.quantization_config.modules_to_not_convert,
                                                getattr(model, "_keep_in_fp32_modules", None))
    converted = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, GptOssMLP) or not should_convert_module(f"{name}.experts", skip):
            continue
        with torch.device("meta"):
            experts = Mxfp4GptOssExperts(model.config)
            for proj in ("gate_up_proj", "down_proj"):
                packed = getattr(experts, proj)  # [E, out, in / 2]
                scales = torch.zeros(*packed.shape[:-1], packed.shape[-1] * 2 // 32, dtype=torch.uint8)
                experts.register_parameter(f"{proj}_scales", torch.nn.Parameter(scales, requires_grad=False))
            model.set_submodule(name, Mxfp4GptOssMLP(module.router, experts))
        converted += 1
    if converted == 0:
        raise Unsupported(f"keep_quantized=True: {path} is MXFP4, but {type(model).__name__} has no gpt-oss "
                          f"experts (GptOssMLP) to keep quantized outside modules_to_not_convert")
    quantizer.update_parallel_plan(model, model.tp_plan)
    quantizer.update_parallel_plan(model, model.ep_plan)
