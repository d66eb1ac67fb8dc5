"""shardcast inside an accelerate FSDP2 script, in place of `cpu_ram_efficient_loading`.

    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, ...))
    from shardcast.integrations.accelerate import prepare_pretrained
    model = prepare_pretrained(accelerator, "org/name")                         # instead of
    #   model = AutoModelForCausalLM.from_pretrained(...); model = accelerator.prepare(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)                  # after the load
    optimizer, dataloader, scheduler = accelerator.prepare(optimizer, dataloader, scheduler)

The model is built on meta, accelerate shards it exactly as it would (its auto-wrap policy, the
embedding and tail groups, its mixed-precision and offload policies, its mesh) with nothing allocated,
and shardcast then streams each rank only its rows. No rank ever holds the full state dict.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Union

import torch

from .._meta_model import _build_meta
from .._pretrained import resolve_checkpoint
from .._shardcast import InvalidArgument

__all__ = ["prepare_pretrained"]


def prepare_pretrained(accelerator, path_or_local_repo_id: Union[str, os.PathLike],
                       dtype: Optional[torch.dtype] = torch.bfloat16, *, source: Optional[str] = None,
                       revision: Optional[str] = None, trust_remote_code: bool = False,
                       buffer_init: Optional[Dict[str, Any]] = None, **load_kwargs):
    """`accelerator.prepare(model)` of a meta model, then `shardcast.load`; returns the prepared model
    with `model.shardcast_report`. Every rank calls it together. Create the optimizer afterwards:
    accelerate maps an optimizer's parameters by data pointer, which meta parameters do not have.

    The plugin's `cpu_ram_efficient_loading` is turned off for this call (shardcast does the loading;
    accelerate's would broadcast rank 0's state dict, which on meta holds nothing). buffer_init: as for
    shardcast.prepare (values for non-persistent buffers no built-in rule covers).
    """
    from transformers import AutoConfig
    from .. import load, prepare

    path = resolve_checkpoint(path_or_local_repo_id, revision=revision)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    model = _build_meta(config, dtype, trust_remote_code)
    device = getattr(accelerator, "device", torch.device("cpu"))
    target = "cuda" if torch.device(device).type == "cuda" else None
    prepare(model, config=config, target=target or "cpu", buffer_init=buffer_init)
    plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
    efficient = getattr(plugin, "cpu_ram_efficient_loading", None)
    if efficient:
        plugin.cpu_ram_efficient_loading = False
    try:
        model = accelerator.prepare(model)
    except NotImplementedError as e:  # torch's "Cannot copy out of meta tensor": no FSDP, the model moved whole
        if "meta" not in str(e):
            raise
        raise InvalidArgument(
            f"accelerator.prepare did not shard the meta model (distributed_type "
            f"{getattr(accelerator, 'distributed_type', '?')}) but moved it to {device}: prepare_pretrained "
            f"needs accelerate's FSDP2 (FullyShardedDataParallelPlugin(fsdp_version=2), launched with --use_fsdp "
            f"--fsdp_version 2); accelerate enables FSDP on GPUs only") from None
    finally:
        if efficient:
            plugin.cpu_ram_efficient_loading = efficient
    model.shardcast_report = load(model, path, source=source, target=target, config=config, **load_kwargs)
    return model
