"""target="pinned" from Python: pinned host memory where CUDA is available, a clear Unsupported where it
is not. Regression (issue 20): both prepare and load silently gave ordinary pageable memory."""
import pytest
import torch
from safetensors.torch import save_file

import shardcast


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.register_buffer("scale", torch.ones(3))


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    ref = Tiny()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(tmp_path / "model.safetensors"))
    return tmp_path, ref


def meta_model():
    with torch.device("meta"):
        return Tiny()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: pinned memory is supported")
def test_pinned_without_cuda_is_unsupported_not_pageable(checkpoint):
    path, _ = checkpoint
    with pytest.raises(shardcast.Unsupported, match='target="pinned": pinned host memory needs CUDA'):
        shardcast.prepare(meta_model(), target="pinned")
    with pytest.raises(shardcast.Unsupported, match='target="pinned": pinned host memory needs CUDA'):
        shardcast.load(meta_model(), path, target="pinned")
    # cpu still loads, bit for bit.
    model = meta_model()
    shardcast.load(model, path, target="cpu")
    assert torch.equal(model.lin.weight, checkpoint[1].lin.weight)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU path runs on a GPU machine")
def test_pinned_with_cuda_gives_pinned_parameters_and_buffers(checkpoint):
    path, ref = checkpoint
    model = meta_model()
    shardcast.prepare(model, target="pinned")
    assert model.scale.is_pinned()
    shardcast.load(model, path, target="pinned")
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        assert t.device.type == "cpu" and t.is_pinned(), name
    assert torch.equal(model.lin.weight, ref.lin.weight) and torch.equal(model.scale, ref.scale)


# Regression (review): SHARDCAST_TARGET reached only the report; the shards were allocated on the CPU
# whatever it said, so "pinned" from the environment silently gave pageable memory.
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: pinned memory is supported")
def test_shardcast_target_from_the_environment_is_the_keyword_s_twin(checkpoint, monkeypatch):
    path, ref = checkpoint
    monkeypatch.setenv("SHARDCAST_TARGET", "pinned")
    with pytest.raises(shardcast.Unsupported, match='target="pinned": pinned host memory needs CUDA'):
        shardcast.load(meta_model(), path)
    monkeypatch.setenv("SHARDCAST_TARGET", "gpu")
    with pytest.raises(shardcast.InvalidArgument, match='SHARDCAST_TARGET: "gpu" is not a target'):
        shardcast.load(meta_model(), path)
    monkeypatch.setenv("SHARDCAST_TARGET", "cpu")
    model = meta_model()
    report = shardcast.load(model, path)
    assert report["target"] == "cpu" and torch.equal(model.lin.weight, ref.lin.weight)
