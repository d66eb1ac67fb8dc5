"""QuantizedHuggingFaceStorageReader: torch's quantized HF reader's surface over shardcast's HF reader
(_hf_reader.py), every quantized tensor dequantized in shardcast's stream."""
from __future__ import annotations

import os
from typing import Any, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.quantized_hf_storage import \
    QuantizedHuggingFaceStorageReader as _TorchQuantizedReader

from .. import _shardcast
from .._mapping import quantized_keys
from ._hf_reader import HuggingFaceStorageReader, _swapped


_KERNEL_TARGETS = (torch.float32, torch.bfloat16, torch.float16)  # what the stream's kernels dequantize to
_ROUNDED_TARGETS = (torch.float8_e4m3fn, torch.float8_e5m2)  # dequantized to float32, then rounded
_TARGETS = _KERNEL_TARGETS + _ROUNDED_TARGETS


class QuantizedHuggingFaceStorageReader(HuggingFaceStorageReader, _TorchQuantizedReader):
    """`torch.distributed.checkpoint.QuantizedHuggingFaceStorageReader`, served by shardcast.

    The same Metadata as torch's quantized reader (an MXFP4 "<name>_blocks" key reports its dequantized
    size, and here also a chunk of that size: torch's keeps the packed chunk, so DCP reads only part of each
    row through it); every read of a quantized tensor is dequantized to `target_dtype` in shardcast's stream:
    float8_e4m3fn weights with their "<name>.weight_scale_inv" block scales (fp32 or E8M0; DeepSeek-V3,
    MiniMax-M2), MXFP4 "_blocks"/"_scales" pairs, and NVFP4 (ModelOpt's "<m>.weight" packed E2M1 with
    "<m>.weight_scale" and "<m>.weight_scale_2", which torch's reader does not read: its key reports the
    dequantized [out, in] here). Any box works: one that cuts a scale block, and a weight whose scale sits
    in another file.

    target_dtype: float32 (default), bfloat16 or float16, or an fp8 dtype (dequantized to float32, then
    rounded to it, as torch's reader does); float64 and the rest are Unsupported. block_size: the fp8 scale
    blocks (N x N). Not given (None), the checkpoint's config.json decides
    (quantization_config.weight_block_size), else 128, as torch's default; given, it is used where the config
    says nothing, and a config that names another block is an InvalidArgument on every rank where an fp8
    weight is dequantized (torch's reader would use the argument against the checkpoint's scales). A
    block_size that differs between ranks is a ManifestMismatch on every rank. An fp8 target stages each
    quantized box in float32 before rounding it: 4 bytes an element of this rank's boxes of a round (the whole
    checkpoint's, for an HF checkpoint read whole) at once, beside the destinations.
    """

    def __init__(self, path: Union[str, os.PathLike], thread_count: int = 1, target_dtype: torch.dtype = torch.float32,
                 block_size: Optional[int] = None, **options: Any) -> None:
        if target_dtype not in _TARGETS:
            raise _shardcast.Unsupported(
                f"target_dtype={target_dtype}: the quantized reader dequantizes to "
                f"{', '.join(str(d) for d in _TARGETS)}")
        if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)
                                       or block_size < 1):
            raise _shardcast.InvalidArgument(f"block_size={block_size!r}: expected a positive int (or None: the "
                                             "checkpoint's config.json decides, else 128)")
        HuggingFaceStorageReader.__init__(self, path, thread_count, **options)
        if block_size is not None:
            self._shardcast_options["weight_block_size"] = str(block_size)
        self.target_dtype = target_dtype
        self.block_size = 128 if block_size is None else block_size  # torch's attribute; the engine's block is agreed
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
            if q["format"] in ("nvfp4", "mxfp4") and not q["model_shape"]:
                continue  # not the format's rank (an MXFP4 "_blocks" of 2 dims): as stored, as torch's reader reads it
            if q["format"] == "mxfp4" and fqn[: -len("_blocks")] in keys:
                plain = fqn[: -len("_blocks")]
                raise _shardcast.CheckpointError(
                    f"{self.path}: key '{fqn}' (MXFP4 blocks of the model's '{plain}', in "
                    f"{_file_of(metadata, fqn)}) and a tensor '{plain}' (in {_file_of(metadata, plain)}) are both "
                    "in the checkpoint: which one is the model's weight is ambiguous")
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
        """What the engine delivers: target_dtype for a quantized key, float32 for an fp8 target (the item is
        then staged and rounded into its destination by copy_, as any other dtype is converted)."""
        if key not in self._quantized:
            return stored
        return torch.float32 if self.target_dtype in _ROUNDED_TARGETS else self.target_dtype

    def _delivered(self, fqn: str, staged: torch.Tensor) -> torch.Tensor:
        """An fp8 target's box, dequantized to float32 by the engine, rounded to it (then copied into a
        destination of any dtype, as torch's reader copies its target_dtype tensor)."""
        if fqn in self._quantized and self.target_dtype in _ROUNDED_TARGETS:
            return staged.to(self.target_dtype)
        return staged

    def _engine_key(self, fqn: str) -> Tuple[str, bool]:
        """An MXFP4 "<name>_blocks" key is resolved by its model name "<name>", which the engine dequantizes
        in transformers' layout [..., in, out]; torch's reader reports [..., out, in]."""
        if fqn in self._quantized and fqn.endswith("_blocks"):
            return fqn[: -len("_blocks")], True
        return fqn, False


def _file_of(metadata: Metadata, fqn: str) -> str:
    """The file holding key `fqn`'s (first) chunk, as read_metadata recorded it."""
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn == fqn:
            return str(getattr(info, "relative_path", info))
    return "?"
