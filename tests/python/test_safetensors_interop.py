"""Interop with the reference safetensors package: it reads our files, we read its files, every dtype
both support, bit-exact."""
import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": "uint16",
    "I32": torch.int32, "U32": "uint32", "I64": torch.int64, "U64": "uint64", "F16": torch.float16,
    "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64, "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu", "C64": torch.complex64,
}


def torch_dtype(name):
    d = DTYPES[name]
    if isinstance(d, str):
        d = getattr(torch, d, None)
        if d is None:
            pytest.skip(f"torch {torch.__version__} has no dtype for {name}")
    return d


def random_tensor(dtype, shape, gen):
    raw = torch.randint(0, 256, (int(torch.tensor(shape).prod()) * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    t = raw.view(dtype).reshape(shape)
    if dtype == torch.bool:
        t = (raw % 2).bool().reshape(shape)
    return t


def bits(t):
    flat = t.contiguous().reshape(-1)
    return flat.view(torch.uint8) if t.dtype != torch.bool else flat.to(torch.uint8)


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_reference_file_through_our_reader_and_writer(tmp_path, build_dir, name):
    dtype = torch_dtype(name)
    gen = torch.Generator().manual_seed(len(name))
    tensors = {"a": random_tensor(dtype, (3, 5), gen), "b.scalar": random_tensor(dtype, (), gen),
               "c": random_tensor(dtype, (0, 2), gen), "d": random_tensor(dtype, (7,), gen)}
    ref = tmp_path / "ref.safetensors"
    try:
        save_file(tensors, str(ref), metadata={"who": "reference"})
    except Exception as e:  # an older safetensors may not know the dtype
        pytest.skip(f"safetensors cannot save {name}: {e}")
    ours = tmp_path / "ours.safetensors"
    subprocess.run([build_dir / "tests" / "st_copy", ref, ours], check=True)
    back = load_file(str(ours))
    assert set(back) == set(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape, k
        assert torch.equal(bits(back[k]), bits(t)), k


def test_reference_reads_our_sharded_synth_checkpoint(tmp_path, shardcast_bin):
    root = pathlib_root()
    out = tmp_path / "ckpt"
    subprocess.run([shardcast_bin, "synth", "--config", root / "configs" / "tiny-moe.json", "--out", out,
                    "--layers", "2", "--max-shard-size", "16M", "--seed", "3"], check=True, capture_output=True)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    listed = json.loads(subprocess.run([shardcast_bin, "inspect", out, "--json"], check=True,
                                       capture_output=True, text=True).stdout)
    ours = {t["key"]: t for t in listed["tensors"]}
    seen = set()
    for f in sorted(set(index["weight_map"].values())):
        for k, t in load_file(str(out / f)).items():
            seen.add(k)
            assert list(t.shape) == ours[k]["shape"] and ours[k]["file"] == f
            assert torch.isfinite(t.float()).all(), k
    assert seen == set(index["weight_map"]) == set(ours)


def pathlib_root():
    import pathlib
    return pathlib.Path(__file__).resolve().parents[2]
