"""`shardcast convert` and `shardcast synth` end to end: the values they write, their atomic commit, and
what they refuse to overwrite."""
import json

import pytest

from cli_run import ROOT, sc


# shardcast convert: the fp8 checkpoint rewritten in bf16 equals synth's bf16 twin tensor by tensor
# (the same dequantization), without quantization_config, atomically, by one or three processes.
@pytest.mark.parametrize("nproc", [1, 3])
def test_convert_fp8_to_bf16_equals_the_twin(shardcast_bin, tmp_path, nproc):
    import torch
    from safetensors.torch import load_file
    # DeepSeek-V3's published config, made small, with rows and columns that do not divide the block.
    raw = json.loads((ROOT / "configs" / "models" / "deepseek-v3.json").read_text())
    raw.update(num_hidden_layers=2, hidden_size=576, intermediate_size=720, moe_intermediate_size=200,
               num_attention_heads=4, q_lora_rank=200, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16,
               v_head_dim=32, n_routed_experts=4, first_k_dense_replace=1, vocab_size=1000)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(raw))
    fp8, twin, out = tmp_path / "fp8", tmp_path / "twin", tmp_path / "bf16"
    for args in (["--out", fp8], ["--out", twin, "--bf16-twin"]):
        assert sc(shardcast_bin, "synth", "--config", cfg, "--max-shard-size", "2M", *args).returncode == 0
    r = sc(shardcast_bin, "convert", fp8, out, "--nproc", nproc, "--max-shard-size", "3M")
    assert r.returncode == 0, r.stderr
    assert not list(tmp_path.glob("bf16.tmp-*")), "the temporary directory is gone"
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    def tensors(d):
        got = {}
        for f in sorted(d.glob("*.safetensors")):
            got.update(load_file(str(f)))
        return got
    a, b = tensors(out), tensors(twin)
    assert sorted(a) == sorted(b)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
    assert any(a[k].dtype == torch.bfloat16 and k.endswith("q_a_proj.weight") for k in a)
    assert sc(shardcast_bin, "inspect", out).returncode == 0
    r = sc(shardcast_bin, "convert", fp8, out)
    assert r.returncode == 2 and "exists; pass --overwrite" in r.stderr, r.stderr


# Regression (issue 20): convert's swap renamed the old output to DST.old-<pid>, then the new one into
# place; a kill between the two left no DST and an .old- directory that the leftover scan never
# reported. The commit is now save's (an atomic exchange, the parent fsynced), and the scan reports
# .old- debris of earlier versions as well as .tmp- ones.
def test_convert_commits_atomically_and_reports_old_debris(shardcast_bin, tmp_path):
    fp8, out = tmp_path / "fp8", tmp_path / "bf16"
    assert sc(shardcast_bin, "synth", "--config", ROOT / "configs" / "tiny-moe.json", "--out", fp8, "--layers", "1",
              "--max-shard-size", "8M").returncode == 0
    # A fresh DST beside an .old- directory that a killed convert left: named, exit 2, nothing written.
    (tmp_path / "bf16.old-777").mkdir()
    r = sc(shardcast_bin, "convert", fp8, out)
    assert r.returncode == 2 and f"{tmp_path}/bf16.old-777" in r.stderr and "did not finish" in r.stderr, r.stderr
    assert not out.exists()
    # --overwrite removes the debris; an existing DST is replaced in one step, with nothing left beside it.
    out.mkdir()
    (out / "stale.txt").write_text("from before")
    r = sc(shardcast_bin, "convert", fp8, out, "--overwrite")
    assert r.returncode == 0, r.stderr
    assert not (out / "stale.txt").exists() and (out / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bf16", "fp8"], "no .old- or .tmp- left"


def test_convert_writes_a_checkpoint_every_reader_opens_and_never_over_its_input(shardcast_bin, tmp_path):
    """One output file was "model-00001-of-00001" with no index: no reader (shardcast, transformers) opened
    it. SRC as DST with --overwrite replaced the input with that; "DST/" failed to move aside."""
    src = tmp_path / "src"
    assert sc(shardcast_bin, "synth", "--config", ROOT / "configs" / "tiny-moe.json", "--out", src, "--layers", "1",
              "--max-shard-size", "16M").returncode == 0
    before = sorted(p.name for p in src.iterdir())
    r = sc(shardcast_bin, "convert", src, src, "--overwrite")
    assert r.returncode == 2 and "is SRC itself" in r.stderr, r.stderr
    r = sc(shardcast_bin, "convert", src, tmp_path, "--overwrite")  # the folder holding SRC
    assert r.returncode == 2 and "holds SRC" in r.stderr, r.stderr
    assert sorted(p.name for p in src.iterdir()) == before
    out = tmp_path / "out"
    r = sc(shardcast_bin, "convert", src, f"{out}/")
    assert r.returncode == 0, r.stderr
    assert {"model-00001-of-00001.safetensors", "model.safetensors.index.json"} <= {p.name for p in out.iterdir()}
    assert sc(shardcast_bin, "inspect", out).returncode == 0
    r = sc(shardcast_bin, "convert", src, f"{out}/", "--overwrite")
    assert r.returncode == 0, r.stderr


def test_synth_into_an_earlier_checkpoint_leaves_only_the_new_one(shardcast_bin, tmp_path):
    """A second synth (one file) beside an earlier one's index and shards: shardcast read the old index,
    transformers the new model.safetensors. With --overwrite the old model's files are removed (only
    those: a file of the user's stays), without it they are refused; and a directory holding both (left by
    another tool) loads model.safetensors, as transformers does."""
    out = tmp_path / "ckpt"
    tiny = ROOT / "configs" / "tiny-moe.json"
    assert sc(shardcast_bin, "synth", "--config", tiny, "--out", out, "--layers", "1", "--max-shard-size", "16M",
              "--seed", "1").returncode == 0
    (out / "adapter_model.safetensors").write_bytes(b"not the model's")  # the user's: stays
    r = sc(shardcast_bin, "synth", "--config", tiny, "--out", out, "--layers", "1", "--seed", "7")
    assert r.returncode == 2 and "pass --overwrite" in r.stderr, r.stderr  # a model there: not without asking
    r = sc(shardcast_bin, "synth", "--config", tiny, "--out", out, "--layers", "1", "--seed", "7", "--overwrite")
    assert r.returncode == 0 and "removed" in r.stdout, r.stdout
    assert sorted(p.name for p in out.iterdir()) == ["adapter_model.safetensors", "config.json", "model.safetensors"]
    (out / "adapter_model.safetensors").unlink()
    fresh = tmp_path / "fresh"
    assert sc(shardcast_bin, "synth", "--config", tiny, "--out", fresh, "--layers", "1", "--seed", "7").returncode == 0
    assert (out / "model.safetensors").read_bytes() == (fresh / "model.safetensors").read_bytes()
    # both beside each other (another tool's output): model.safetensors decides
    old = tmp_path / "old"
    assert sc(shardcast_bin, "synth", "--config", tiny, "--out", old, "--layers", "1", "--max-shard-size", "16M",
              "--seed", "1").returncode == 0
    for f in old.iterdir():
        if f.name != "config.json":
            (out / f.name).write_bytes(f.read_bytes())
    digests = {}
    for name, where in (("both", out), ("fresh", fresh)):
        report = tmp_path / f"{name}.json"
        r = sc(shardcast_bin, "load", "--checkpoint", where, "--nproc", 2, "--checksum-only", "--quiet", "--json", report)
        assert r.returncode == 0, r.stderr[-2000:]
        digests[name] = [x["digest"] for x in json.loads(report.read_text())["ranks"]]
    assert digests["both"] == digests["fresh"], digests


def test_synth_of_a_checkpoint_larger_than_the_disk_writes_nothing(shardcast_bin, tmp_path):
    """A config of absurd sizes (hidden_size 10^12) filled the disk with one file until killed."""
    cfg = tmp_path / "huge.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 10 ** 12, "intermediate_size": 1000,
                               "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 8,
                               "vocab_size": 100}))
    r = sc(shardcast_bin, "synth", "--config", cfg, "--out", tmp_path / "huge", "--layers", "1")
    assert r.returncode == 2 and "more than an exabyte" in r.stderr and "free" in r.stderr, r.stderr
    assert not (tmp_path / "huge").exists()
