"""shardcast.dcp's training-state files in this process (single-rank saves, no_dist): plain values and
numpy read back with their types, dtype conversion as torch's reader does it, torch's positional arguments,
pickles only where both sides allow them, and the metadata codec, the value codec and the rank-file parser
as hostile input. The multi-rank round trips against torch's are in test_dcp_state.py."""
import io
import json
import os

import pytest

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import shardcast
from shardcast import CheckpointError
from shardcast.dcp._state import StorageReader, StorageWriter
from shardcast.dcp._state_codec import decode_metadata
from shardcast.dcp._state_values import decode_value, encode_value
from shardcast.dcp._state_files import _RankFile


def _single(tmp_path, writer):
    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "x": {"a": (1, 2.5), "b": [None, b"\x00", {"k": "y"}]},
             "buf": io.BytesIO(b"abc")}
    dcp.save(state, storage_writer=writer, no_dist=True)
    return state


@pytest.mark.parametrize("threads", [1, 3])
def test_plain_values_read_back_with_their_types(tmp_path, threads):
    _single(tmp_path, StorageWriter(tmp_path, thread_count=threads))
    back = {"w": torch.zeros(3, 4), "x": {"a": None, "b": [0, 0, {"k": 0}]}, "buf": None}
    dcp.load(back, storage_reader=StorageReader(tmp_path), no_dist=True)
    assert torch.equal(back["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert back["x"] == {"a": (1, 2.5), "b": [None, b"\x00", {"k": "y"}]} and type(back["x"]["a"]) is tuple
    assert back["buf"].getvalue() == b"abc"


# Regression (review): a destination of another dtype took the file's raw bytes (fp32 bit patterns read as
# bf16, silently), where torch's FileSystemReader converts with copy_.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64, torch.int32, torch.float16])
def test_a_destination_of_another_dtype_is_converted_as_torch_converts(tmp_path, dtype):
    state = {"w": torch.arange(24, dtype=torch.float32).reshape(6, 4) * 1.5, "v": torch.tensor(2.25)}
    dcp.save(state, storage_writer=StorageWriter(tmp_path / "ours"), no_dist=True)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "torch"), no_dist=True)
    ours, theirs = ({k: torch.zeros_like(v, dtype=dtype) for k, v in state.items()} for _ in range(2))
    dcp.load(ours, storage_reader=StorageReader(tmp_path / "ours"), no_dist=True)
    dcp.load(theirs, storage_reader=dcp.FileSystemReader(tmp_path / "torch"), no_dist=True)
    for k in state:
        assert ours[k].dtype == dtype and torch.equal(ours[k], theirs[k]), (k, ours[k], theirs[k])


# Regression (review): options were keyword-only, so FileSystemWriter(path, True, True, 4)-style calls, as
# written for torch's classes, raised TypeError.
# Regression (review): saving over a checkpoint torch's FileSystemWriter wrote left its .metadata and
# .distcp files beside the new one, so dcp.load(checkpoint_id=path) (torch's reader) went on loading the old
# values without a word; overwrite=False did not refuse it either.
def test_a_checkpoint_torch_wrote_in_path_is_replaced_not_left_beside_the_new_one(tmp_path):
    old, new = {"w": torch.full((4,), 1.0)}, {"w": torch.full((4,), 2.0)}
    dcp.save(old, storage_writer=dcp.FileSystemWriter(tmp_path / "a"), no_dist=True)
    with pytest.raises(CheckpointException, match=r"already holds a checkpoint \(.*/\.metadata\) and overwrite=False"):
        dcp.save(new, storage_writer=StorageWriter(tmp_path / "a", overwrite=False), no_dist=True)
    dcp.save(new, storage_writer=StorageWriter(tmp_path / "a"), no_dist=True)
    assert sorted(os.listdir(tmp_path / "a")) == [".metadata.json", "__0_0.safetensors"]
    with pytest.raises(CheckpointException, match="metadata"):
        dcp.load({"w": torch.zeros(4)}, checkpoint_id=tmp_path / "a", no_dist=True)
    back = {"w": torch.zeros(4)}
    dcp.load(back, storage_reader=StorageReader(tmp_path / "a"), no_dist=True)
    assert torch.equal(back["w"], new["w"])


def test_torch_positional_arguments_are_accepted(tmp_path):
    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    dcp.save(state, storage_writer=StorageWriter(tmp_path, True, True, 2, 10_000_000, False, True), no_dist=True)
    back = {"w": torch.zeros(3, 4)}
    dcp.load(back, storage_reader=StorageReader(tmp_path, None), no_dist=True)
    assert torch.equal(back["w"], state["w"])
    with pytest.raises(shardcast.Unsupported, match="_extensions"):
        StorageWriter(tmp_path, _extensions=[object()])


# Regression (review): numpy arrays and scalars (an RNG state, a data loader's position) were refused where
# torch's FileSystemWriter saves them.
def test_numpy_arrays_and_scalars_round_trip_and_object_arrays_do_not(tmp_path):
    import numpy as np
    rng = np.random.RandomState(3).get_state()
    state = {"rng": rng, "a": np.arange(5, dtype=np.float16).reshape(5, 1), "i": np.int64(-3), "b": np.bool_(True),
             "w": torch.ones(2)}
    dcp.save(state, storage_writer=StorageWriter(tmp_path / "ok"), no_dist=True)
    back = {"rng": None, "a": None, "i": None, "b": None, "w": torch.zeros(2)}
    dcp.load(back, storage_reader=StorageReader(tmp_path / "ok"), no_dist=True)
    assert back["rng"][0] == "MT19937" and back["rng"][1].dtype == rng[1].dtype
    assert np.array_equal(back["rng"][1], rng[1]) and back["rng"][2:] == rng[2:]
    assert back["a"].dtype == np.float16 and back["a"].shape == (5, 1) and np.array_equal(back["a"], state["a"])
    assert type(back["i"]) is np.int64 and back["i"] == -3 and type(back["b"]) is np.bool_ and back["b"]
    with pytest.raises(CheckpointException, match="not plain data"):
        dcp.save({"o": np.array([object()], dtype=object), "w": torch.ones(1)},
                 storage_writer=StorageWriter(tmp_path / "object"), no_dist=True)
    with pytest.raises(CheckpointError, match="malformed numpy value"):
        decode_value({"ndarray": {"dtype": "|O8", "shape": [1], "data": ""}}, "v")
    with pytest.raises(CheckpointError, match="holds 3 bytes"):
        decode_value({"ndarray": {"dtype": "<i4", "shape": [1], "data": "AAAA"}}, "v")


def test_value_codec_keeps_every_plain_type():
    import collections
    v = {3: (1, 2.5, float("inf")), "o": collections.OrderedDict(z=[True, None]), "s": torch.Size([2, 0]),
         "d": torch.bfloat16, "b": b"\x00\xff", "t": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
         "dev": torch.device("cpu"), "e": torch.empty(0, 4)}
    back = decode_value(json.loads(json.dumps(encode_value(v, "v"), allow_nan=False)), "v")
    assert list(back) == list(v) and back[3] == v[3] and type(back["o"]) is collections.OrderedDict
    assert back["o"] == v["o"] and back["s"] == v["s"] and back["d"] is torch.bfloat16 and back["b"] == v["b"]
    assert back["t"].dtype == torch.bfloat16 and torch.equal(back["t"], v["t"]) and back["e"].shape == (0, 4)
    with pytest.raises(CheckpointError, match="unknown value tag"):
        decode_value({"pickle": "x"}, "v")


class _Custom:
    def __eq__(self, other):
        return isinstance(other, _Custom)


def test_pickled_values_need_allow_pickle_on_both_sides(tmp_path):
    state = {"obj": _Custom(), "w": torch.ones(2)}
    with pytest.raises(CheckpointException, match="allow_pickle"):
        dcp.save(state, storage_writer=StorageWriter(tmp_path / "a"), no_dist=True)
    dcp.save(state, storage_writer=StorageWriter(tmp_path / "b", allow_pickle=True), no_dist=True)
    with pytest.raises(CheckpointException, match="allow_pickle=True to the reader"):
        dcp.load({"obj": None, "w": torch.zeros(2)}, storage_reader=StorageReader(tmp_path / "b"), no_dist=True)
    back = {"obj": None, "w": torch.zeros(2)}
    dcp.load(back, storage_reader=StorageReader(tmp_path / "b", allow_pickle=True), no_dist=True)
    assert back["obj"] == _Custom()


def _row(doc, fqn):
    return next(r for r in doc["storage_data"] if r["fqn"] == fqn)


@pytest.mark.parametrize("edit,words", [
    (lambda d: d["storage_data"][0].update(file="../../etc/passwd"), "not a rank file name"),
    # a row pointing at another item's bytes of the same length (fault campaign: loaded them silently)
    (lambda d: _row(d, "w").update(key="x"), "stored under key 'x', not its own 'w@0,0'"),
    (lambda d: d["storage_data"][0].update(length=d["storage_data"][0]["length"] + 4), "matches no chunk"),
    (lambda d: d["state_dict_metadata"]["w"]["properties"].update(dtype="float128"), "unknown dtype"),
    (lambda d: d["state_dict_metadata"]["w"]["chunks"][0].update(sizes=[4, 4]), "outside the tensor"),
    (lambda d: d["storage_data"].pop(), "no place in any rank file"),
    (lambda d: d.update(planner_data={"w": [1.5]}), "planner_data"),
    (lambda d: d.update(format="torch"), "not a shardcast"),
])
def test_hostile_metadata_is_refused_by_name(tmp_path, edit, words):
    _single(tmp_path, StorageWriter(tmp_path))
    doc = json.loads((tmp_path / ".metadata.json").read_text())
    edit(doc)
    with pytest.raises(CheckpointError, match=words):
        decode_metadata(json.dumps(doc).encode(), "md")


# Regression (fault campaign): a value nested 600 deep (a list in a list ..., as long as the string saved)
# raised a bare RecursionError on every rank, naming neither the file nor the key.
def test_a_value_nested_past_the_recursion_limit_is_refused_by_file_and_key(tmp_path):
    depth = 600
    dcp.save({"w": torch.ones(2), "extra": {"deep": "x" * (2 * depth - 2)}}, storage_writer=StorageWriter(tmp_path),
             no_dist=True)
    row = _row(json.loads((tmp_path / ".metadata.json").read_text()), "extra.deep")
    path = tmp_path / row["file"]
    raw = bytearray(path.read_bytes())
    assert row["length"] == 2 * depth, row
    raw[row["byte_offset"]:row["byte_offset"] + row["length"]] = b"[" * depth + b"]" * depth
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointException) as caught:
        dcp.load({"w": torch.zeros(2), "extra": {"deep": ""}}, storage_reader=StorageReader(tmp_path), no_dist=True)
    error = caught.value.failures[0][0]
    assert isinstance(error, CheckpointError), repr(error)
    assert f"{row['file']}: byte item 'extra.deep': the value nests too deep" in str(error), str(error)


def test_hostile_rank_file_header_is_refused(tmp_path):
    _single(tmp_path, StorageWriter(tmp_path))
    path = tmp_path / "__0_0.safetensors"
    raw = path.read_bytes()
    (tmp_path / "big").write_bytes((1 << 40).to_bytes(8, "little") + raw[8:])
    with pytest.raises(CheckpointError, match="exceeds the cap"):
        _RankFile(str(tmp_path / "big"), 1 << 20)
    (tmp_path / "tail").write_bytes(raw + b"\x00" * 8)
    with pytest.raises(CheckpointError, match="trailing bytes"):
        _RankFile(str(tmp_path / "tail"), 1 << 20)
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    key = next(k for k in header if k.startswith("w@"))
    header[key]["data_offsets"][1] += 4
    text = json.dumps(header).encode()
    (tmp_path / "overlap").write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    with pytest.raises(CheckpointError, match=r"tensor 'w@0,0': F32 \[3, 4\] needs 48 bytes but data_offsets"):
        _RankFile(str(tmp_path / "overlap"), 1 << 20)


# Regression (fault campaign): a FIFO as the metadata or a rank file blocked every rank in open() past any
# timeout; /dev/zero as the metadata was read without end (two ranks killed by the kernel for memory); a
# directory in place of a rank file raised a bare IsADirectoryError naming no file or rank.
@pytest.mark.parametrize("what,words", [("dir", "a directory"), ("fifo", "a FIFO"), ("devzero", "a device")])
@pytest.mark.parametrize("target", [".metadata.json", "__0_0.safetensors"])
def test_a_metadata_or_rank_file_that_is_not_a_regular_file_is_refused_at_once(tmp_path, what, words, target):
    import signal
    dcp.save({"w": torch.ones(3, 4)}, storage_writer=StorageWriter(tmp_path), no_dist=True)
    p = tmp_path / target
    p.unlink()
    {"dir": p.mkdir, "fifo": lambda: os.mkfifo(p), "devzero": lambda: p.symlink_to("/dev/zero")}[what]()

    def late(*_):
        raise TimeoutError(f"{target} as {what}: the load blocked")
    old = signal.signal(signal.SIGALRM, late)
    signal.alarm(30)
    try:
        with pytest.raises(CheckpointException, match=f"{target}.*: {words}, not a regular file"):
            dcp.load({"w": torch.zeros(3, 4)}, storage_reader=StorageReader(tmp_path), no_dist=True)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_a_rank_file_of_another_save_is_refused(tmp_path):
    dcp.save({"w": torch.full((4,), 1.0)}, storage_writer=StorageWriter(tmp_path / "a"), no_dist=True)
    dcp.save({"w": torch.full((4,), 2.0)}, storage_writer=StorageWriter(tmp_path / "b"), no_dist=True)
    (tmp_path / "a" / "__0_0.safetensors").write_bytes((tmp_path / "b" / "__0_0.safetensors").read_bytes())
    with pytest.raises(CheckpointException, match="__0_0.safetensors: written by save [0-9a-f]{32}, the metadata is"):
        dcp.load({"w": torch.zeros(4)}, storage_reader=StorageReader(tmp_path / "a"), no_dist=True)


# Regression (fault campaign): a save with use_collectives=False succeeded and wrote rank-local metadata that
# every later load refused (its chunks cover only the saving rank's pieces); it is refused at the save now.
def test_a_save_without_collectives_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(shardcast.Unsupported, match="use_collectives=True"):  # raised as is: DCP runs no collective
        dcp.save({"w": torch.ones(4)}, storage_writer=StorageWriter(tmp_path / "nc"), no_dist=True, use_collectives=False)
    assert not any(n.endswith(".safetensors") or n.endswith(".json") for n in os.listdir(tmp_path / "nc"))


# Regression (review): with DCP's plan cache the rank files of every later save named the first save's id (the
# cached final plans carry it) while the metadata named the new save: every such checkpoint failed to load.
def test_saves_with_plan_caching_load(tmp_path):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    for step in range(3):
        dcp.save({"w": torch.full((3, 4), float(step)), "n": step}, no_dist=True,
                 storage_writer=StorageWriter(tmp_path / "c"), planner=DefaultSavePlanner(enable_plan_caching=True))
        back = {"w": torch.zeros(3, 4), "n": -1}
        dcp.load(back, storage_reader=StorageReader(tmp_path / "c"), no_dist=True)
        assert torch.equal(back["w"], torch.full((3, 4), float(step))) and back["n"] == step, step


def test_subclasses_of_plain_types_are_not_stored_as_their_base():
    """numpy.float64 (a float) came back as a float, an IntEnum as an int: numpy's scalars keep their type,
    and a subclass of the user's is not plain data (allow_pickle keeps it)."""
    import enum
    import numpy as np

    class Level(enum.IntEnum):
        LOW = 1

    for v in (np.float64(1.5), np.int64(-3), np.bool_(True)):
        back = decode_value(json.loads(json.dumps(encode_value(v, "v"))), "v")
        assert type(back) is type(v) and back == v, (type(v), type(back))
    with pytest.raises(shardcast.Unsupported, match="Level is not plain data"):
        encode_value(Level.LOW, "v")

    class Rows(list):
        pass

    with pytest.raises(shardcast.Unsupported, match="Rows is not plain data"):
        encode_value(Rows([1]), "v")


def test_metadata_is_read_within_an_address_space_limit(tmp_path):
    """read_metadata asked for a buffer of its whole cap (4 GiB + 1 byte) to read a file of some hundred
    bytes: under an address-space limit (ulimit -v, as batch schedulers set it) every resume failed with a
    MemoryError. A process limited to what it maps now plus 1 GiB reads it."""
    import subprocess
    import sys
    dcp.save({"w": torch.arange(4.0)}, storage_writer=StorageWriter(str(tmp_path)), no_dist=True)
    code = (
        "import resource, sys, torch, torch.distributed.checkpoint as dcp\n"
        "from shardcast.dcp import StorageReader\n"
        "size = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()\n"
        "resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), resource.RLIM_INFINITY))\n"
        "out = {'w': torch.zeros(4)}\n"
        "dcp.load(out, storage_reader=StorageReader(sys.argv[1]), no_dist=True)\n"
        "print(out['w'].tolist())\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[0.0, 1.0, 2.0, 3.0]", done.stdout
