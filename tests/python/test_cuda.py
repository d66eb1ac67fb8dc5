"""The FSDP2 flow at world size 1 on CUDA with target="cuda" (issue 6), the CLI's cuda target, dcp.load/save
into CUDA tensors, and from_pretrained's stream beside the build into GPU buffers.
Skipped, with this message, where torch sees no GPU; runs as-is on a GPU machine."""
import os
import pathlib
import subprocess
import sys

import pytest

import torch
ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU path runs on a GPU machine")


def test_example_flow_on_cuda(build_dir, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(build_dir / "python"), PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                        str(ROOT / "python" / "examples" / "fsdp2_load.py"), "--target", "cuda"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "verify ok" in r.stdout and "finite: True" in r.stdout, r.stdout


def test_cli_load_to_cuda(shardcast_bin, tmp_path):
    ckpt = tmp_path / "ckpt"
    subprocess.run([str(shardcast_bin), "synth", "--config", str(ROOT / "configs" / "tiny-moe.json"), "--out", str(ckpt),
                    "--layers", "2", "--max-shard-size", "16M"], check=True, capture_output=True)
    r = subprocess.run([str(shardcast_bin), "load", "--checkpoint", str(ckpt), "--nproc", "1", "--target", "cuda",
                        "--verify", "--quiet"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert " ok" in r.stdout, r.stdout


def test_cli_load_over_nccl(shardcast_bin, tmp_path):
    """--backend nccl uses NCCL at every world size, one GPU included (world 1 is a one-rank communicator)."""
    ckpt = tmp_path / "ckpt"
    subprocess.run([str(shardcast_bin), "synth", "--config", str(ROOT / "configs" / "tiny-moe.json"), "--out", str(ckpt),
                    "--layers", "2", "--max-shard-size", "16M"], check=True, capture_output=True)
    world = max(1, torch.cuda.device_count())
    report = tmp_path / "report.json"
    r = subprocess.run([str(shardcast_bin), "load", "--checkpoint", str(ckpt), "--nproc", str(world), "--target", "cuda",
                        "--backend", "nccl", "--verify", "--quiet", "--json", str(report)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    import json
    j = json.loads(report.read_text())
    assert j["backend"] == "nccl" and all(x["verify"] == "ok" for x in j["ranks"]), j


def test_kept_quantized_fp8_equals_transformers_on_cuda(shardcast_bin, tmp_path):
    """fp8 kept quantized on the GPU: transformers' own quantized from_pretrained(device_map="cuda") (its
    FP8Linear/FP8Experts path on a GPU with compute capability >= 8.9; below that it dequantizes, and this
    test says so) against shardcast.from_pretrained(keep_quantized=True, target="cuda"), bit for bit."""
    import json
    import ranks
    from test_fp8 import DEEPSEEK_FP8
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("transformers keeps fp8 quantized only on compute capability >= 8.9")
    (tmp_path / "deepseek.json").write_text(json.dumps(DEEPSEEK_FP8))
    subprocess.run([str(shardcast_bin), "synth", "--config", str(tmp_path / "deepseek.json"), "--out",
                    str(tmp_path / "deepseek_fp8"), "--max-shard-size", "1M", "--seed", "3"], check=True,
                   capture_output=True, timeout=300)
    (r,) = ranks.run("fp8_worker.py", "kept_cuda", tmp_path, 1, tmp_path)
    t = r["kept_cuda"]
    assert t["bad"] == [] and t["missing"] == [], t
    assert t["devices"] == ["cuda"] and "torch.float8_e4m3fn" in t["dtypes"] and t["verify"] == "ok", t


def test_dcp_readers_and_writers_on_cuda_tensors(tiny_checkpoints, tmp_path):
    """shardcast.dcp behind dcp.load/dcp.save with every tensor on the GPU, over NCCL (one rank per GPU):
    the FSDP llama and the fp8 keys read through shardcast's readers equal torch's readers' bit for bit,
    the HF writer's files hold the model's tensors, and a training state (AdamW after a step) saved and read
    back equals itself. dcp_cuda_worker.py runs the same checks on CPU with its argument `cpu`."""
    import shutil
    import ranks
    from test_dcp_reader import _write_quantized
    src = tiny_checkpoints("rope-scaled", models=("llama",))
    shutil.copytree(src / "llama", tmp_path / "llama")
    _write_quantized(str(tmp_path / "quantized"))
    world = max(1, torch.cuda.device_count())
    for rank, r in enumerate(ranks.run("dcp_cuda_worker.py", "cuda", tmp_path, world, tmp_path, timeout=600)):
        assert "crash" not in r, f"rank {rank}:\n{r['crash']}"
        assert r["problems"] == [], f"rank {rank}: {r['problems']}"
        assert r["devices"] == ["cuda"], r
        assert r["checked"]["fsdp"] > 10 and r["checked"]["quantized"] == 8 and r["checked"]["save"] > 10, r
        assert r["checked"]["state"] > 20, r


def test_from_pretrained_streams_beside_the_build_into_gpu_buffers(tiny_checkpoints, tmp_path):
    """from_pretrained's default where the job runs on GPUs (target cuda, a CUDA mesh of the whole world):
    the stream beside the build lands each rank's rows in zeros on its GPU, which become FSDP2's padded
    sharded buffers (no copy), bit for bit what the same call loaded after the build lands; llama tied,
    qwen3_moe's fused experts, deepseek_v3's persistent buffer (loaded after the build)."""
    import ranks
    models = ("deepseek_v3", "llama", "qwen3_moe")
    root = tiny_checkpoints("tied", models=models)
    world = max(1, torch.cuda.device_count())
    for rank, result in enumerate(ranks.run("pretrained_stream_worker.py", "stream_cuda", root, world, tmp_path,
                                            timeout=600)):
        for name in models:
            r = result[name]
            assert r["beside"] == [True, False], (rank, name, r, result["debug"])
            assert r["devices"] == ["cuda"], (rank, name, r)
            assert r["differ"] == [] and r["copied"] == [] and r["params"] > 10, (rank, name, r)
