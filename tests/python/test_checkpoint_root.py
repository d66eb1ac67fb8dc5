"""The key reader is the C++ loader's (through the binding), resolving a checkpoint's names beneath its
root: a symlink out of the checkpoint is never opened (the checkpoint is refused, no key is reported, and
the load's handshake raises the precise error), while a hub snapshot's links into ../../blobs are read."""
import json
import os

import shardcast
from shardcast._mapping import checkpoint_keys


def write_safetensors(path, keys):
    header = {k: {"dtype": "U8", "shape": [2], "data_offsets": [2 * i, 2 * i + 2]} for i, k in enumerate(keys)}
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + b"\x01\x02" * len(keys))


# Regression (issue 20): the key reader opened whatever a checkpoint's symlinks pointed at.
def test_keys_of_a_symlink_out_of_the_checkpoint_are_not_read(tmp_path):
    ckpt, outside = tmp_path / "ckpt", tmp_path / "outside"
    ckpt.mkdir()
    outside.mkdir()
    write_safetensors(ckpt / "a.safetensors", ["inside"])
    write_safetensors(outside / "b.safetensors", ["secret"])
    (ckpt / "b.safetensors").symlink_to(outside / "b.safetensors")
    (ckpt / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"inside": "a.safetensors", "secret": "b.safetensors"}}))
    assert checkpoint_keys(str(ckpt)) == {}
    try:
        shardcast._shardcast.checkpoint_tensors(str(ckpt))
    except shardcast.CheckpointError as e:
        assert "b.safetensors: resolves outside" in str(e), e
    else:
        raise AssertionError("read a checkpoint with a name outside its root")

    # The index itself, and model.safetensors, resolve beneath the root too.
    (ckpt / "model.safetensors.index.json").unlink()
    (outside / "index.json").write_text(json.dumps({"weight_map": {"secret": "b.safetensors"}}))
    (ckpt / "model.safetensors.index.json").symlink_to(outside / "index.json")
    assert checkpoint_keys(str(ckpt)) == {}
    (ckpt / "model.safetensors.index.json").unlink()
    (ckpt / "model.safetensors").symlink_to(os.path.join("..", "outside", "b.safetensors"))
    assert checkpoint_keys(str(ckpt)) == {}


def test_a_hub_snapshots_links_into_blobs_are_read(tmp_path):
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    write_safetensors(repo / "blobs" / "aaaa", ["w"])
    (snap / "model.safetensors").symlink_to("../../blobs/aaaa")
    assert checkpoint_keys(str(snap)) == {"w": (2,)}


def test_the_binding_refuses_names_outside_the_root(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "x").symlink_to("../y")
    (tmp_path / "y").write_text("")
    try:
        shardcast._shardcast.open_checkpoint_name(str(tmp_path / "ckpt"), "x")
    except shardcast.CheckpointError as e:
        assert f"{tmp_path}/ckpt/x: resolves outside {tmp_path}/ckpt" in str(e)
    else:
        raise AssertionError("opened a name outside the root")
    assert shardcast._shardcast.open_checkpoint_name(str(tmp_path / "ckpt"), "missing") is None
