"""Materialization in the Python path, the device that follows the model, HSDP from_pretrained and a plain
teardown (issue 33).

Real rank processes over c10d Gloo on CPU meshes: one launch at world size 4 runs every CPU scenario of
materialize_worker.py, and each test below checks one scenario's result. RSS is each rank's RssAnon from
/proc/self/status. The CUDA scenarios run in one launch at world size 1 and skip, saying so, where torch
sees no GPU (tools/gpu_check.sh runs them on a GPU machine).
"""
import os

import pytest

import torch

import ranks

WORLD = 4
# Materializing must not commit the shards: what RssAnon may grow by, as a fraction of a rank's shard bytes
# (Python objects and DTensor metadata; committed shards would be 100%).
MATERIALIZE_GROWTH = 0.05


def write_plain(root):
    from safetensors.torch import save_file
    from materialize_worker import IN, ROWS_A, ROWS_B
    g = torch.Generator().manual_seed(3)
    tensors = {"0.weight": torch.randn(ROWS_A, IN, generator=g), "0.bias": torch.randn(ROWS_A, generator=g),
               "1.weight": torch.randn(ROWS_B, ROWS_A, generator=g), "1.bias": torch.randn(ROWS_B, generator=g)}
    os.makedirs(root / "plain")
    save_file(tensors, str(root / "plain" / "model.safetensors"))


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_checkpoints):
    root = tmp_path_factory.mktemp("materialize")
    write_plain(root)
    os.symlink(tiny_checkpoints("tied", models=("deepseek_v3", "llama", "qwen3_moe")), root / "hf")
    return root


@pytest.fixture(scope="module")
def cpu_run(root, tmp_path_factory):
    """Every CPU scenario, in one launch of WORLD ranks; every rank must exit 0 (the teardown scenario)."""
    # fresh interpreters: a forked rank's heap, shaped by its server's imports, could hide pages committed
    return ranks.run("materialize_worker.py", "cpu", root, WORLD, tmp_path_factory.mktemp("cpu"), timeout=600,
                     fork=False)


def scenario(results, name):
    for rank, r in enumerate(results):
        assert "error" not in r[name], f"rank {rank} {name}: {r[name]['error']}\n{r[name]['traceback']}"
    return [r[name] for r in results]


@pytest.mark.parametrize("mesh", ["lazy_zero_1d", "lazy_zero_hsdp"])
def test_materialized_shards_are_zero_and_commit_nothing_then_load_bit_exact(cpu_run, mesh):
    rows = scenario(cpu_run, mesh)
    assert len({tuple(r["local_rows"]) for r in rows}) > 1, "uneven dims: some rank must hold fewer rows"
    for rank, r in enumerate(rows):
        assert r["zeros"], f"rank {rank}: a materialized shard is not all zeros"
        assert r["shard_bytes"] > 8_000_000, r
        assert r["grew_materialize"] < MATERIALIZE_GROWTH * r["shard_bytes"], (
            f"rank {rank}: RssAnon grew by {r['grew_materialize']} bytes while materializing "
            f"{r['shard_bytes']} bytes of shards")
        assert r["grew_reading_zeros"] < MATERIALIZE_GROWTH * r["shard_bytes"], (rank, r)
        assert r["bad_shards"] == [] and r["bad_unsharded"] == [] and r["verify"] == "ok", (rank, r)


def test_from_pretrained_hsdp_2d_mesh_equals_transformers(cpu_run):
    for rank, result in enumerate(scenario(cpu_run, "pretrained_hsdp")):
        assert set(result) == {"llama", "qwen3_moe", "deepseek_v3"}
        for name, r in result.items():
            assert r["bad"] == [], f"rank {rank} {name}: {r['bad']}"
            assert r["logits_equal"] and r["finite"], (rank, name, r)
            assert r["checked"] > 10 and r["verify"] == "ok", (rank, name, r)


def test_device_follows_a_cpu_mesh_and_defaults_to_the_host_without_gpus(cpu_run):
    for r in scenario(cpu_run, "device"):
        assert r["shard_devices"] == ["cpu"] and r["mesh_target"] is None, r
        assert r["default_target"] == ("cuda" if r["gpu_for_local_rank"] else None), r


def test_destroy_process_group_right_after_a_load_exits_cleanly(cpu_run):
    # ranks.run asserted that every rank exited 0 within its deadline after destroy_process_group.
    for r in scenario(cpu_run, "teardown"):
        assert r["bad_shards"] == [], r


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: the device-follows-the-model cases run on a GPU machine "
                                       "(tools/gpu_check.sh)")


@pytest.fixture(scope="module")
def cuda_run(root, tmp_path_factory):
    return ranks.run("materialize_worker.py", "cuda", root, 1, tmp_path_factory.mktemp("cuda"), timeout=600,
                     fork=False)


@needs_cuda
def test_load_into_a_cuda_mesh_lands_on_its_gpu(cuda_run):
    r = scenario(cuda_run, "follows_mesh")[0]
    assert r["devices"] == ["cuda:0"] and r["bad_shards"] == [] and r["bad_unsharded"] == [], r


@needs_cuda
def test_cpu_target_into_a_cuda_mesh_is_invalid_argument(cuda_run):
    r = scenario(cuda_run, "cpu_target_into_cuda_mesh")[0]
    assert r["raised"] == "InvalidArgument" and "CUDA device mesh" in r["message"], r


@needs_cuda
def test_from_pretrained_defaults_to_cuda_on_a_gpu(cuda_run):
    r = scenario(cuda_run, "pretrained_default")[0]
    assert r["devices"] == ["cuda:0"] and r["mesh"] == "cuda", r


def test_prepare_pretrained_is_public_and_the_old_import_still_works():
    from shardcast._accelerate import prepare_pretrained as old
    from shardcast.integrations.accelerate import prepare_pretrained
    assert prepare_pretrained is old and prepare_pretrained.__module__ == "shardcast.integrations.accelerate"


def test_a_refused_mapping_falls_back_to_committed_zeros(monkeypatch, caplog):
    """A rank with more large tensors than vm.max_map_count allows mappings gets heap zeros for the rest,
    with one warning, instead of failing the load. The refusal is the allocator's own IoError."""
    import shardcast._materialize as m
    from shardcast import IoError

    def refused(shape, dtype):
        raise IoError("lazy-zero mapping of 131072 bytes: Cannot allocate memory")

    monkeypatch.setattr(m._shardcast, "lazy_zero_tensor", refused)
    monkeypatch.setattr(m, "_WARNED", [])
    with caplog.at_level("WARNING", logger="shardcast"):
        a = m.zeros((256, 256), torch.bfloat16, torch.device("cpu"))
        b = m.zeros((512, 128), torch.float32, torch.device("cpu"))
    assert a.shape == (256, 256) and a.dtype == torch.bfloat16 and not a.any()
    assert b.shape == (512, 128) and not b.any()
    assert sum("lazy-zero mapping refused" in r.getMessage() for r in caplog.records) == 1
