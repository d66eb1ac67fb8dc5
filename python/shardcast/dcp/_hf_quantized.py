"""QuantizedHuggingFaceStorageReader: torch's quantized HF reader's surface over shardcast's HF reader
(_hf_reader.py), every quantized tensor dequantized in shardcast's stream."""
from __future__ import annotations

import os
from typing import Any, Tuple, Union

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.quantized_hf_storage import \
    QuantizedHuggingFaceStorageReader as _TorchQuantizedReader

from .. import _shardcast
from .._mapping import quantized_keys
from ._hf_reader import HuggingFaceStorageReader, _swapped


class QuantizedHuggingFaceStorageReader(HuggingFaceStorageReader, _TorchQuantizedReader):
    """`torch.distributed.checkpoint.QuantizedHuggingFaceStorageReader`, served by shardcast.

    The same Metadata as torch's quantized reader (an MXFP4 "<name>_blocks" key reports its dequantized
    size, and here also a chunk of that size: torch's keeps the packed chunk, so DCP reads only part of each
    row through it); every read of a quantized tensor is dequantized to `target_dtype` in shardcast's stream:
    float8_e4m3fn weights with their "<name>.weight_scale_inv" block scales (fp32 or E8M0; DeepSeek-V3,
    MiniMax-M2), MXFP4 "_blocks"/"_scales" pairs, and NVFP4 (ModelOpt's "<m>.weight" packed E2M1 with
    "<m>.weight_scale" and "<m>.weight_scale_2", which torch's reader does not read: its key reports the
    dequantized [out, in] here). Any box works: one that cuts a scale block,
    and a weight whose scale sits in another file. `block_size` is checked against the checkpoint's scale
    grid, which decides.
    """

    def __init__(self, path: Union[str, os.PathLike], thread_count: int = 1, target_dtype: torch.dtype = torch.float32,
                 block_size: int = 128, **options: Any) -> None:
        HuggingFaceStorageReader.__init__(self, path, thread_count, **options)
        self.target_dtype = target_dtype
        self.block_size = block_size
        self._quantized: set = set()

    def _adjust_metadata(self, metadata: Metadata) -> None:
        keys = metadata.state_dict_metadata
        self._quantized = set()
        if any(len(md.chunks) > 1 for md in keys.values() if isinstance(md, TensorStorageMetadata)):
            raise _shardcast.Unsupported(
                f"{self.path}: per-rank files (HuggingFaceStorageWriter(save_distributed=True)) are read by "
                "HuggingFaceStorageReader, not dequantized: a weight's scale blocks need not lie in its piece")
        tensors = [(fqn, md.properties.dtype, tuple(md.size)) for fqn, md in keys.items()
                   if isinstance(md, TensorStorageMetadata)]
        # Which tensors are a format's data with every partner there: the C++ registry decides, as for the
        # engine that reads them (an incomplete one stays as stored, as torch's reader leaves it)
        for fqn, q in quantized_keys(tensors).quant.items():
            if q["piece"] != "data" or not q["complete"]:
                continue
            self._quantized.add(fqn)
            md = keys[fqn]
            if q["format"] == "nvfp4":
                # ModelOpt's "<m>.weight" [out, in / 2] of packed E2M1: torch's reader has no NVFP4 and
                # reports the packed shape; here the dequantized [out, in]
                md.size = torch.Size(q["model_shape"])
            elif q["format"] == "mxfp4":
                # "<name>_blocks" [..., out, G, 16] as torch's reader reports it dequantized, [..., out, G * 32]
                # (the engine's model shape is its transpose, [..., in, out]). torch's reader keeps the packed
                # [..., G, 16] chunk beside that size, so DCP's planner reads only the first G columns of each
                # row and leaves the rest of the destination as it was (torch 2.15); the chunk here is the
                # whole dequantized tensor
                md.size = torch.Size(_swapped(q["model_shape"]))
            else:
                continue  # fp8: the stored shape is the dequantized one
            md.chunks = [ChunkStorageMetadata(offsets=torch.Size([0] * len(md.size)), sizes=md.size)]

    def _delivered_dtype(self, key: str, stored: torch.dtype) -> torch.dtype:
        return self.target_dtype if key in self._quantized else stored

    def _engine_key(self, fqn: str) -> Tuple[str, bool]:
        """An MXFP4 "<name>_blocks" key is resolved by its model name "<name>", which the engine dequantizes
        in transformers' layout [..., in, out]; torch's reader reports [..., out, in]."""
        if fqn in self._quantized and fqn.endswith("_blocks"):
            return fqn[: -len("_blocks")], True
        return fqn, False
