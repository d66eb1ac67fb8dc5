"""`shardcast plan --schedule --rank R`: one rank's setup derived in one process, with no other rank. Each
rank derives only its own part of the schedule, so the parts must add up: over all ranks of a world, every
byte of the model is kept exactly once (FSDP: one holder per piece) and read exactly once by a striped
source, whatever the world size; each rank's part is what the whole walk (`--whole`, as every rank did
before) says it is. A small config (two Qwen3-MoE layers) keeps each call well under a second."""
import json
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "models" / "qwen3-30b-a3b.json"


def plan(shardcast_bin, *args):
    r = subprocess.run([str(shardcast_bin), "plan", "--config", str(CONFIG), "--layers", "2", "--schedule", "--json",
                        *map(str, args)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def total(shardcast_bin):
    """The model's bytes: what the one rank of a world of one keeps."""
    one = plan(shardcast_bin, "--world-size", 1, "--rank", 0)
    assert one["bytes_kept"] == one["bytes_read"] > 0
    return one["bytes_kept"]


@pytest.mark.parametrize("world", [3, 8])
def test_the_ranks_parts_add_up_to_the_model_once(shardcast_bin, total, world):
    parts = [plan(shardcast_bin, "--world-size", world, "--rank", r) for r in range(world)]
    assert sum(p["bytes_kept"] for p in parts) == total
    assert sum(p["bytes_read"] for p in parts) == total  # striped: each piece read by one of its holders
    assert sum(p["bytes_received"] for p in parts) == 0  # FSDP: every holder reads its own piece
    for p in parts:
        assert p["messages_walked"] == p["messages"] > 0  # a rank walks only its own messages


def test_a_ranks_part_is_what_the_whole_walk_says(shardcast_bin):
    for rank in (0, 5):
        mine = plan(shardcast_bin, "--world-size", 8, "--rank", rank, "--replicas", 2)
        whole = plan(shardcast_bin, "--world-size", 8, "--rank", rank, "--replicas", 2, "--whole")
        for key in ("messages", "bytes_read", "bytes_received", "bytes_kept"):
            assert mine[key] == whole[key], (rank, key, mine[key], whole[key])
        assert whole["messages_walked"] > mine["messages_walked"]  # the whole walk saw the other ranks' too


@pytest.mark.parametrize("args,needle", [
    (["--world-size", 8], "--schedule needs a rank in [0, 8)"),
    (["--world-size", 8, "--rank", 0, "--replicas", 3], "replicas"),
    (["--world-size", 8, "--rank", 0, "--source", "nowhere"], "nowhere"),
])
def test_bad_input_is_one_line_and_exit_2(shardcast_bin, args, needle):
    r = subprocess.run([str(shardcast_bin), "plan", "--config", str(CONFIG), "--layers", "2", "--schedule",
                        *map(str, args)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
