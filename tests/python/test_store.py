"""What shardcast's exchanges (the DCP storage layer's, a load's) leave in, and ask of, the group's store:
real ranks over Gloo."""
import torch
from safetensors.torch import save_file

import ranks

WORKER = "store_worker.py"


# Regression (outside trial): each dcp.load through the HF reader left rank 0's reading of the headers in
# the store (one key, ~120 bytes a tensor) for the life of the process: +1 key a load, 22 -> 42 over 25.
def test_the_stores_keys_stay_flat_over_many_dcp_loads(tmp_path):
    (tmp_path / "small").mkdir()
    save_file({"w": torch.randn(100, 8)}, str(tmp_path / "small" / "model.safetensors"))
    for rank, r in enumerate(ranks.run(WORKER, "keys", tmp_path, 2, tmp_path, timeout=240)):
        assert r["ok"], f"rank {rank}: values differ"
        assert len(set(r["counts"][2:])) == 1, r["counts"]


# Regression (outside trial): the store's server refuses a value over 8 MiB and resets the connection.
# Rank 0's reading of 80,000 tensors' headers (9.4 MB) was refused: rank 0 called the store lost, rank 1
# waited out the timeout, and neither named the size. Now it goes in parts.
def test_headers_larger_than_one_store_value_reach_every_rank(tmp_path):
    _wide(tmp_path)
    for rank, r in enumerate(ranks.run(WORKER, "wide", tmp_path, 2, tmp_path, timeout=240)):
        assert r["tensors"] == 2300 and r["differ"] == [], (rank, r)


# Regression (review): an explicit mapping's boxes, every rank's to every rank, went in one store value a
# rank: over 8 MiB at DeepSeek-V3's 91,000 keys, that rank called the store lost while the others waited out
# the timeout and named it; so did rank 0's reading of the keys' shapes. Now each goes in parts.
def test_a_ranks_boxes_larger_than_one_store_value_reach_every_rank(tmp_path):
    _wide(tmp_path)
    for rank, r in enumerate(ranks.run(WORKER, "mapping", tmp_path, 2, tmp_path, timeout=240)):
        assert r["tensors"] == 2300 and r["differ"] == [], (rank, r)


def _wide(tmp_path):
    """ROOT/wide: 2,300 tensors whose names are 4,000 characters long, 9.2 MB of headers."""
    (tmp_path / "wide").mkdir()
    torch.manual_seed(0)
    tensors = {f"layer{i:05d}." + "x" * 3990: torch.randn(2) for i in range(2300)}
    save_file(tensors, str(tmp_path / "wide" / "model.safetensors"))
    assert (tmp_path / "wide" / "model.safetensors").stat().st_size > 9_000_000
