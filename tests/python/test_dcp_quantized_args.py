"""shardcast.dcp.QuantizedHuggingFaceStorageReader's arguments and odd checkpoints, in one process
(dcp.load(no_dist=True)), against torch's quantized reader where torch reads them (found by a fault
campaign; each case gave wrong values, a crash or a bare exception before):

- block_size and a config.json that names another block; block_size not an int of at least 1;
- target_dtype fp8 (torch dequantizes, then rounds: shardcast returned the stored bytes unscaled) and float64;
- an MXFP4 "<p>_blocks" beside a plain tensor "<p>" (shardcast's reader served "<p>" for the blocks);
- a "_blocks"/"_scales" pair or a U8 ".weight"/".weight_scale" of a rank no format reads (read_metadata
  raised IndexError for every key of the checkpoint).
The multi-rank cases (block_size per rank, bit for bit at W=3) are in test_dcp_reader.py.
"""
import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader as TorchQReader

import shardcast
import shardcast.dcp as sdcp
from test_dcp_reader import _fp8_blocks


def _write(path, tensors, config=None):
    """One file and its index (torch's quantized reader needs the index), config.json where given."""
    os.makedirs(path, exist_ok=True)
    name = "model-00001-of-00001.safetensors"
    save_file(tensors, os.path.join(path, name))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: name for k in tensors}}, f)
    if config is not None:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
    return str(path)


def _load(reader, sd):
    dcp.load(sd, storage_reader=reader, no_dist=True)
    return sd


def _failure(call):
    """The shardcast error a dcp.load raised (DCP wraps it in a CheckpointException, per rank)."""
    with pytest.raises(BaseException) as info:
        call()
    failures = getattr(info.value, "failures", None)
    return next(iter(failures.values()))[0] if failures else info.value


@pytest.fixture
def fp8_120(tmp_path):
    """A 300 x 300 fp8 weight in 120 x 120 blocks (a [3, 3] grid, as 128-blocks also need), no config."""
    q, s = _fp8_blocks(torch.randn(300, 300, generator=torch.Generator().manual_seed(1)), block=120)
    return _write(tmp_path / "fp8", {"w.weight": q, "w.weight_scale_inv": s}), q, s


def test_block_size_is_used_where_no_config_says(fp8_120):
    path, q, s = fp8_120
    theirs = _load(TorchQReader(path, block_size=120), {"w.weight": torch.zeros(300, 300)})["w.weight"]
    ours = _load(sdcp.QuantizedHuggingFaceStorageReader(path, block_size=120),
                 {"w.weight": torch.zeros(300, 300)})["w.weight"]
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))
    # shardcast.load takes it as weight_block_size
    out = torch.zeros(300, 300)
    shardcast.load({"w.weight": (out, [0, 0])}, path, weight_block_size=120)
    assert torch.equal(out.view(torch.int32), theirs.view(torch.int32))


def test_a_block_size_the_config_contradicts_is_refused_naming_both(fp8_120, tmp_path):
    _, q, s = fp8_120
    path = _write(tmp_path / "configured", {"w.weight": q, "w.weight_scale_inv": s},
                  {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    e = _failure(lambda: _load(sdcp.QuantizedHuggingFaceStorageReader(path, block_size=120),
                               {"w.weight": torch.zeros(300, 300)}))
    assert isinstance(e, shardcast.InvalidArgument), e
    assert "120x120 was asked for" in str(e) and "config.json" in str(e) and "[128, 128]" in str(e), e
    # the config's block given, or none: loads
    for given in (128, None):
        _load(sdcp.QuantizedHuggingFaceStorageReader(path, block_size=given), {"w.weight": torch.zeros(300, 300)})


def test_a_block_the_config_contradicts_does_not_matter_where_nothing_is_dequantized(tmp_path):
    """A bf16 checkpoint whose config names a block, loaded with another weight_block_size: no fp8 weight
    is dequantized, so the block shapes nothing and the load goes on (it was refused on rank 0 alone)."""
    w = torch.randn(6, 4).to(torch.bfloat16)
    path = _write(tmp_path / "bf16", {"w.weight": w},
                  {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    out = torch.zeros(6, 4, dtype=torch.bfloat16)
    shardcast.load({"w.weight": (out, [0, 0])}, path, weight_block_size=64)
    assert torch.equal(out, w)


@pytest.mark.parametrize("bad", [0, -128, True, "128", 1.5])
def test_block_size_must_be_a_positive_int(fp8_120, bad):
    with pytest.raises(shardcast.InvalidArgument, match="block_size="):
        sdcp.QuantizedHuggingFaceStorageReader(fp8_120[0], block_size=bad)


@pytest.mark.parametrize("target", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("into", ["fp8", torch.float32, torch.bfloat16])
def test_an_fp8_target_is_dequantized_then_rounded_as_torch_does(fp8_120, target, into):
    """Into a destination of the target's dtype, or of another (torch rounds to the target, then copies)."""
    path, q, s = fp8_120
    dest = target if into == "fp8" else into
    theirs = _load(TorchQReader(path, target_dtype=target, block_size=120),
                   {"w.weight": torch.zeros(300, 300, dtype=dest)})["w.weight"]
    ours = _load(sdcp.QuantizedHuggingFaceStorageReader(path, target_dtype=target, block_size=120),
                 {"w.weight": torch.zeros(300, 300, dtype=dest)})["w.weight"]
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
    assert not torch.equal(ours.to(target).view(torch.uint8), q.to(target).view(torch.uint8))  # not the stored bytes


def test_a_float64_target_is_unsupported_at_once(fp8_120):
    with pytest.raises(shardcast.Unsupported, match="target_dtype=torch.float64"):
        sdcp.QuantizedHuggingFaceStorageReader(fp8_120[0], target_dtype=torch.float64)


def test_mxfp4_blocks_beside_a_plain_tensor_of_their_model_name_are_refused(tmp_path):
    g = torch.Generator().manual_seed(2)
    path = _write(tmp_path / "mx", {
        "experts.down_proj_blocks": torch.randint(0, 256, (3, 5, 2, 16), dtype=torch.uint8, generator=g),
        "experts.down_proj_scales": torch.randint(118, 134, (3, 5, 2), dtype=torch.uint8, generator=g),
        "experts.down_proj": torch.randn(3, 64, 5, generator=g).to(torch.bfloat16)})
    e = _failure(lambda: _load(sdcp.QuantizedHuggingFaceStorageReader(path),
                               {"experts.down_proj_blocks": torch.zeros(3, 5, 64)}))
    # (DCP re-raises a read_metadata failure as its AssertionError, the message kept)
    assert "'experts.down_proj_blocks'" in str(e) and "'experts.down_proj'" in str(e) and "ambiguous" in str(e), e


def test_pieces_of_a_rank_no_format_reads_stay_as_stored(tmp_path):
    """A 2-D "_blocks" with 1-D "_scales", and a 1-D U8 ".weight" beside a ".weight_scale": read_metadata
    raised IndexError for every key; now they load as stored, as torch's reader loads them."""
    x = torch.randn(4, 4)
    path = _write(tmp_path / "odd", {
        "x.weight": x, "foo_blocks": torch.arange(32, dtype=torch.uint8).reshape(2, 16),
        "foo_scales": torch.zeros(2, dtype=torch.uint8), "bar.weight": torch.arange(16, dtype=torch.uint8),
        "bar.weight_scale": torch.ones(1).to(torch.float8_e4m3fn)})
    for reader in (TorchQReader, sdcp.QuantizedHuggingFaceStorageReader):
        sd = _load(reader(path), {"x.weight": torch.zeros(4, 4), "bar.weight": torch.zeros(16, dtype=torch.uint8)})
        assert torch.equal(sd["x.weight"], x), reader
        assert torch.equal(sd["bar.weight"], torch.arange(16, dtype=torch.uint8)), reader
    # (torch's reports foo_blocks as MXFP4 of 64 values, which it cannot dequantize from 2 dims)
    sd = _load(sdcp.QuantizedHuggingFaceStorageReader(path), {"foo_blocks": torch.zeros(2, 16, dtype=torch.uint8)})
    assert torch.equal(sd["foo_blocks"], torch.arange(32, dtype=torch.uint8).reshape(2, 16))
