"""The shardcast command line end to end: exit codes and one-line errors for bad input, and
`prepare --dump` checked against what transformers computes."""
import json
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs" / "models"


def sc(shardcast_bin, *args, env=None):
    # The launcher's free port can be taken by a concurrent test before rank 0 binds it: run again.
    for _ in range(3):
        r = subprocess.run([str(shardcast_bin), *map(str, args)], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, **(env or {})))
        if "EADDRINUSE" not in r.stderr:
            return r
    return r


@pytest.mark.parametrize("args,needle", [
    (["inspect", "/nonexistent"], "no such file or directory"),
    (["plan", "--config", CONFIGS / "llama-3.1-8b.json", "--world-size", "0"], "must be at least 1"),
    (["plan", "--config", CONFIGS / "llama-3.1-8b.json", "--world-size", "8", "--rank", "8"], "rank 8 is outside world size 8"),
    (["prepare", "--config", CONFIGS / "llama-3.1-8b.json", "--world-size", "2", "--rank", "0", "--target", "tpu"],
     "is not cpu, pinned or cuda"),
    (["load", "--checkpoint", "/nonexistent", "--config", CONFIGS / "llama-3.1-8b.json"], "no such file or directory"),
    (["synth", "--config", CONFIGS / "llama-3.1-8b.json", "--out", "/tmp/x", "--max-shard-size", "12Q"], "unknown unit"),
])
def test_bad_input_is_one_line_and_exit_2(shardcast_bin, args, needle):
    r = sc(shardcast_bin, *args)
    assert r.returncode == 2, (args, r.returncode, r.stderr)
    assert needle in r.stderr, r.stderr
    # One line, except a load's verdict, which lists each failing rank on a line of its own.
    assert len(r.stderr.strip().splitlines()) == (2 if args[0] == "load" else 1), r.stderr


@pytest.mark.parametrize("args,needle", [
    (["bench-rss", "--config", CONFIGS / "llama-3.1-8b.json", "--strategy", "zeros,meta"], "unknown strategy \"zeros\""),
    (["bench-rss", "--config", CONFIGS / "llama-3.1-8b.json", "--ranks-per-node", "100000"], "beyond what this machine can spawn"),
])
def test_bench_bad_input_is_one_line_and_exit_2(shardcast_bench_bin, args, needle):
    r = sc(shardcast_bench_bin, *args)
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)


def test_unknown_model_type_and_unreadable_probe(shardcast_bin, shardcast_bench_bin, tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"model_type": "gpt9", "num_hidden_layers": 1}))
    for exe, cmd in ((shardcast_bin, ["plan", "--config", cfg]),
                     (shardcast_bin, ["prepare", "--config", cfg, "--world-size", "1", "--rank", "0"]),
                     (shardcast_bench_bin, ["bench-rss", "--config", cfg])):
        r = sc(exe, *cmd)
        assert r.returncode == 2 and "unknown model_type \"gpt9\"" in r.stderr, (cmd, r.stderr)
    r = sc(shardcast_bench_bin, "bench-rss", "--config", CONFIGS / "llama-3.1-8b.json",
           env={"SHARDCAST_PROC_ROOT": "/nonexistent"})
    assert r.returncode == 2 and "memory probe" in r.stderr, r.stderr


# Issue 20: the shipped command holds no benchmark code; shardcast-bench has the benchmarks and the
# full-broadcast baseline, which loads the same rows as shardcast's own load.
def test_benchmarks_are_shardcast_bench_only(shardcast_bin, shardcast_bench_bin, tmp_path):
    listed = sc(shardcast_bin, "--help").stdout
    for sub in ("bench-rss", "bench-pread", "bench-scatter"):
        assert sub not in listed and sub in sc(shardcast_bench_bin, "--help").stdout, sub
        assert sc(shardcast_bin, sub).returncode == 2, sub
    ckpt = tmp_path / "ckpt"
    assert sc(shardcast_bin, "synth", "--config", ROOT / "configs" / "tiny-moe.json", "--out", ckpt, "--layers", "1",
              "--max-shard-size", "8M").returncode == 0
    r = sc(shardcast_bin, "load", "--checkpoint", ckpt, "--nproc", "2", "--quiet", "--source", "baseline")
    assert r.returncode == 2 and '"baseline" is not a source' in r.stderr, r.stderr
    report = tmp_path / "baseline.json"
    r = sc(shardcast_bench_bin, "load", "--checkpoint", ckpt, "--nproc", "2", "--quiet", "--source", "baseline",
           "--json", report)
    assert r.returncode == 0, r.stderr
    assert json.loads(report.read_text())["source"] == "baseline-broadcast"
    r = sc(shardcast_bench_bin, "bench-pread", ckpt)
    assert r.returncode == 0 and json.loads(r.stdout)["bytes"] > 0, r.stderr
    nm = subprocess.run(["nm", "-C", str(shardcast_bin)], capture_output=True, text=True)
    if nm.returncode == 0:
        assert "BaselineLoad" not in nm.stdout and "RunRssBench" not in nm.stdout


def test_inspect_corrupt_file_names_file_key_and_bytes(shardcast_bin, tmp_path):
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}).encode()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 12)
    r = sc(shardcast_bin, "inspect", bad)
    assert r.returncode == 2 and str(bad) in r.stderr and "tensor 'w'" in r.stderr and "bytes [0, 12)" in r.stderr


def test_prepare_dump_matches_transformers(shardcast_bin, tmp_path):
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    for name in ("llama-3.1-8b.json", "deepseek-v3.json", "minimax-m2.json"):
        out = tmp_path / name
        r = sc(shardcast_bin, "prepare", "--config", CONFIGS / name, "--world-size", "8", "--rank", "3", "--dump", out)
        assert r.returncode == 0, r.stderr
        dumped = load_file(str(out / "model.safetensors"))
        raw = json.loads((CONFIGS / name).read_text())
        raw.pop("quantization_config", None)
        config = AutoConfig.for_model(**raw)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        theirs = type(model.model.rotary_emb)(config=config).inv_freq
        ours = dumped["model.rotary_emb.inv_freq"]
        assert int((ours.view(torch.int32).long() - theirs.view(torch.int32).long()).abs().max()) <= 1, name
        biases = [k for k in dumped if k.endswith("e_score_correction_bias")]
        assert all(int(dumped[k].count_nonzero()) == 0 for k in biases)  # persistent: zero until loaded


def test_synth_then_load_across_ranks(shardcast_bin, tmp_path):
    ckpt = tmp_path / "ckpt"
    assert sc(shardcast_bin, "synth", "--config", ROOT / "configs" / "tiny-moe.json", "--out", ckpt, "--layers", "2",
              "--max-shard-size", "16M").returncode == 0
    report = tmp_path / "report.json"
    r = sc(shardcast_bin, "load", "--checkpoint", ckpt, "--nproc", "3", "--verify", "--quiet", "--json", report)
    assert r.returncode == 0, r.stderr
    j = json.loads(report.read_text())
    assert [x["verify"] for x in j["ranks"]] == ["ok"] * 3
    assert j["chunk_bytes"] == 64 << 20 and j["staging_slots"] == 4  # the documented defaults
    # The set-up's CPU (handshake and allocation) is a part of the whole load's, on every rank.
    assert all(0 < x["setup_cpu_seconds"] <= x["cpu_seconds"] for x in j["ranks"]), j["ranks"]


# --checksum-only keeps nothing; what each rank received is its report's digest, the same whichever source
# delivered it (rank0 sends over Gloo, each-rank reads in place of a send), and another seed's differs.
def test_checksum_only_digests_agree_across_sources(shardcast_bin, tmp_path):
    digests = {}
    for seed in (1, 2):
        ckpt = tmp_path / f"ckpt{seed}"
        assert sc(shardcast_bin, "synth", "--config", ROOT / "configs" / "tiny-moe.json", "--out", ckpt, "--layers",
                  "1", "--max-shard-size", "16M", "--seed", str(seed)).returncode == 0
        for source in ("rank0", "each-rank"):
            report = tmp_path / f"{seed}-{source}.json"
            r = sc(shardcast_bin, "load", "--checkpoint", ckpt, "--nproc", "3", "--checksum-only", "--source", source,
                   "--quiet", "--json", report)
            assert r.returncode == 0, r.stderr
            j = json.loads(report.read_text())
            assert j["target"] == "checksum-only" and all(x["bytes_stored"] == 0 for x in j["ranks"]), j
            digests[seed, source] = [x["digest"] for x in j["ranks"]]
    assert digests[1, "rank0"] == digests[1, "each-rank"], digests
    assert digests[2, "rank0"] == digests[2, "each-rank"], digests
    assert len(set(digests[1, "rank0"])) == 3  # the ranks hold different rows
    assert all(a != b for a, b in zip(digests[1, "rank0"], digests[2, "rank0"])), digests


# Regression: the environment was applied again after the flags, so SHARDCAST_* silently beat them.
def test_flags_win_over_the_environment(shardcast_bin, tmp_path):
    ckpt = tmp_path / "ckpt"
    assert sc(shardcast_bin, "synth", "--config", ROOT / "configs" / "tiny-moe.json", "--out", ckpt, "--layers", "1",
              "--max-shard-size", "16M").returncode == 0
    report = tmp_path / "report.json"
    env = {"SHARDCAST_CHUNK_BYTES": "1M", "SHARDCAST_STAGING_SLOTS": "5"}
    r = sc(shardcast_bin, "load", "--checkpoint", ckpt, "--nproc", "2", "--quiet", "--json", report,
           "--chunk-bytes", "64K", env=env)
    assert r.returncode == 0, r.stderr
    j = json.loads(report.read_text())
    assert j["chunk_bytes"] == 64 << 10, j  # the flag
    assert j["staging_slots"] == 5, j       # no flag: the environment
    assert sum(x["bytes_stored"] for x in j["ranks"]) >= j["total_bytes"]


# Regression (issue 9): one builder and one size parser. SHARDCAST_CHUNK_BYTES=64MiB used to fail while
# --chunk-bytes 64MiB worked, and a bad variable could not be repaired by a flag.
def test_the_environment_takes_the_flags_sizes_and_a_flag_repairs_a_bad_variable(shardcast_bin, tmp_path):
    ckpt = tmp_path / "ckpt"
    assert sc(shardcast_bin, "synth", "--config", ROOT / "configs" / "tiny-moe.json", "--out", ckpt, "--layers", "1",
              "--max-shard-size", "16M").returncode == 0
    report = tmp_path / "report.json"
    r = sc(shardcast_bin, "load", "--checkpoint", ckpt, "--nproc", "2", "--quiet", "--json", report,
           env={"SHARDCAST_CHUNK_BYTES": "1MiB"})
    assert r.returncode == 0, r.stderr
    assert json.loads(report.read_text())["chunk_bytes"] == 1 << 20
    bad = {"SHARDCAST_CHUNK_BYTES": "lots"}
    r = sc(shardcast_bin, "load", "--checkpoint", ckpt, "--nproc", "2", "--quiet", "--chunk-bytes", "2M", env=bad)
    assert r.returncode == 0, r.stderr
    r = sc(shardcast_bin, "load", "--checkpoint", ckpt, "--nproc", "2", "--quiet", env=bad)
    assert r.returncode == 2 and 'SHARDCAST_CHUNK_BYTES: "lots" is not a size' in r.stderr, r.stderr
    for flag, value, needle in (("--staging-slots", "1000000000", "exceeds the limit of 64"),
                                ("--staging-slots", "-1", "not a non-negative integer"),
                                ("--timeout-ms", "-5", "not a non-negative integer"),
                                ("--chunk-bytes", "1e30", "unknown unit")):
        r = sc(shardcast_bin, "load", "--checkpoint", ckpt, "--nproc", "2", "--quiet", flag, value)
        assert r.returncode == 2 and flag in r.stderr and needle in r.stderr, (flag, r.stderr)


# Regression (issue 9): with each-rank --verify, rank 0 kept every file page it hashed mapped (1.65 GiB
# of RssFile on a 2.3 GiB checkpoint). Every read now releases its pages, in every mode.
@pytest.mark.parametrize("source", ["rank0", "each-rank"])
def test_verify_keeps_file_pages_flat_on_every_rank(shardcast_bin, tmp_path, source):
    ckpt = tmp_path / "ckpt"
    assert sc(shardcast_bin, "synth", "--config", ROOT / "configs" / "tiny-moe.json", "--out", ckpt,
              "--max-shard-size", "64M").returncode == 0
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    assert size > 200 << 20
    report = tmp_path / "report.json"
    r = sc(shardcast_bin, "load", "--checkpoint", ckpt, "--nproc", "3", "--verify", "--quiet", "--json", report,
           "--source", source)
    assert r.returncode == 0, r.stderr
    for rank in json.loads(report.read_text())["ranks"]:
        assert rank["verify"] == "ok"
        assert rank["peak_rss_file_above_baseline"] < 32 << 20, rank  # of a 235 MB checkpoint


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


# Regression (issue 10): a Hugging Face hub snapshot (files are symlinks into ../../blobs) was refused
# as "outside the checkpoint directory". It is the most common layout users have.
def test_load_a_hub_snapshot_of_symlinks_into_blobs(shardcast_bin, tmp_path):
    ckpt = tmp_path / "ckpt"
    assert sc(shardcast_bin, "synth", "--config", ROOT / "configs" / "tiny-moe.json", "--out", ckpt, "--layers", "1",
              "--max-shard-size", "8M").returncode == 0
    repo = tmp_path / "hub" / "models--org--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(ckpt.iterdir())):
        blob = blobs / f"{i:040x}"
        f.rename(blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    report = tmp_path / "report.json"
    r = sc(shardcast_bin, "load", "--checkpoint", snap, "--nproc", "2", "--verify", "--quiet", "--json", report,
           "--source", "each-rank")
    assert r.returncode == 0, r.stderr
    assert [x["verify"] for x in json.loads(report.read_text())["ranks"]] == ["ok", "ok"]


# Regression (issue 20): a symlink in a checkpoint was followed wherever it pointed. One that escapes
# the root, or a loop, is bad input: exit 2, naming the file, on inspect and on a multi-rank load.
def test_a_symlink_out_of_the_checkpoint_or_a_loop_is_bad_input(shardcast_bin, tmp_path):
    ckpt = tmp_path / "ckpt"
    assert sc(shardcast_bin, "synth", "--config", ROOT / "configs" / "tiny-moe.json", "--out", ckpt, "--layers", "1",
              "--max-shard-size", "8M").returncode == 0
    shards = sorted(p for p in ckpt.iterdir() if p.name.endswith(".safetensors"))
    assert len(shards) >= 2
    moved = tmp_path / "elsewhere.safetensors"
    shards[-1].rename(moved)
    shards[-1].symlink_to(moved)
    for args in (["inspect", ckpt], ["load", "--checkpoint", ckpt, "--nproc", "2", "--quiet", "--source", "each-rank"]):
        r = sc(shardcast_bin, *args)
        assert r.returncode == 2, (args, r.returncode, r.stderr)
        assert f"{ckpt}/{shards[-1].name}: resolves outside {ckpt}" in r.stderr, r.stderr
    shards[-1].unlink()
    shards[-1].symlink_to(shards[-1].name + ".loop")
    (ckpt / (shards[-1].name + ".loop")).symlink_to(shards[-1].name)
    r = sc(shardcast_bin, "inspect", ckpt)
    assert r.returncode == 2 and f"{shards[-1]}: symlink loop" in r.stderr, r.stderr
    # The checkpoint's own config.json, which load reads when --config is not given, too.
    shards[-1].unlink()
    (ckpt / (shards[-1].name + ".loop")).unlink()
    moved.rename(shards[-1])
    (ckpt / "config.json").rename(tmp_path / "config.json")
    (ckpt / "config.json").symlink_to(tmp_path / "config.json")
    r = sc(shardcast_bin, "load", "--checkpoint", ckpt, "--nproc", "2", "--quiet")
    assert r.returncode == 2 and f"{ckpt}/config.json: resolves outside {ckpt}" in r.stderr, r.stderr


# Issue 10: a rank killed mid-stream leaves no report file, half-written or otherwise, and no rank
# running; every survivor prints the same error.
def test_a_killed_rank_leaves_no_output_and_no_process(shardcast_bin, tmp_path):
    ckpt = tmp_path / "ckpt"
    assert sc(shardcast_bin, "synth", "--config", ROOT / "configs" / "tiny-moe.json", "--out", ckpt, "--layers", "1",
              "--max-shard-size", "8M").returncode == 0
    report = tmp_path / "report.json"
    r = sc(shardcast_bin, "load", "--checkpoint", ckpt, "--nproc", "3", "--quiet", "--json", report, "--timeout-ms",
           "3000", env={"SHARDCAST_FAULT": "2:stream:kill:2", "SHARDCAST_TEST_FAULTS": "1"})
    assert r.returncode != 0
    assert not list(tmp_path.glob("report.json*")), "no report, and no temp file"
    errors = [line.split("]: ", 1)[1] for line in r.stderr.splitlines() if line.startswith("shardcast load [rank")]
    assert len(errors) == 2 and errors[0] == errors[1], r.stderr
    assert subprocess.run(["pgrep", "-f", str(ckpt)], capture_output=True).returncode == 1, "a rank is still running"


def test_one_option_table(shardcast_bin):
    """The load options come from one table: `shardcast options` prints it, the README carries exactly that
    output, `shardcast load` has a flag for every row that names one, and Python's load() a keyword for
    every row that names one (timeout_ms as timeout=, in seconds)."""
    import inspect
    import shardcast
    table = sc(shardcast_bin, "options").stdout
    rows = [[c.strip().strip("`") for c in line.split("|")[1:-1]] for line in table.splitlines()[2:]]
    assert len(rows) >= 9, table
    assert table in (ROOT / "README.md").read_text(), "the README's option table is not `shardcast options`' output"
    help_text = sc(shardcast_bin, "load", "--help").stdout
    params = inspect.signature(shardcast.load).parameters
    for keyword, flag, variable, default, _ in rows:
        assert variable.startswith("SHARDCAST_") and default, (keyword, variable, default)
        if flag:
            assert flag in help_text and variable in help_text, (flag, variable)
        if keyword:
            assert (keyword if keyword != "timeout_ms" else "timeout") in params, keyword


def test_plan_forecasts_each_targets_own_staging(shardcast_bin):
    """`plan`'s forecast stages a host load in 4 x 64 MiB and a GPU load in 8 x 8 MiB (a CUDA target's
    defaults), each from the environment's values where given: the rows differ by exactly the staging."""
    def rows(**env):
        r = sc(shardcast_bin, "plan", "--config", CONFIGS / "llama-3.1-8b.json", "--world-size", "4", "--rank", "0",
               "--json", env=env)
        assert r.returncode == 0, r.stderr
        return {f["strategy"]: f["host_bytes"] for f in json.loads(r.stdout)["ranks"][0]["forecast"]}
    mib = 1 << 20
    base = rows()
    assert base["rank0 -> cuda"] == (8 * 8 + 64) * mib, base  # staging + the constant
    assert base["rank0 -> cpu"] - base["each-rank -> cpu"] == 4 * 64 * mib - 64 * mib, base  # ring against one chunk
    given = rows(SHARDCAST_CHUNK_BYTES="16M", SHARDCAST_STAGING_SLOTS="2")
    assert given["rank0 -> cuda"] == (2 * 16 + 64) * mib, given
    assert rows(SHARDCAST_TARGET="cuda") == base  # the variable does not move either set of rows


# Regression (a newcomer's first try): `shardcast load --checkpoint` refused every architecture without a
# builder ("unknown model_type \"qwen2\" (known: deepseek_v3, llama, ...)"). Now the checkpoint's own
# tensors are the spec: transformers' save_pretrained checkpoints of three of them load and verify, at
# FSDP 3 (no dim divides) and at TP 2 x FSDP 2 (the TP rules go by key names).
def test_load_an_architecture_without_a_builder_from_its_own_tensors(shardcast_bin, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    import architectures
    configs = architectures.configs()
    torch.manual_seed(0)
    for name, nproc, extra in (("gemma2", 3, ["--replicas", "3"]), ("qwen2_moe", 4, ["--tp", "2"]), ("qwen2", 3, [])):
        AutoModelForCausalLM.from_config(configs[name]).save_pretrained(tmp_path / name, max_shard_size="40KB")
        report = tmp_path / f"{name}.json"
        r = sc(shardcast_bin, "load", "--checkpoint", tmp_path / name, "--nproc", nproc, "--verify", "--json", report,
               *extra)
        assert r.returncode == 0, (name, r.stderr[-2000:])
        assert f'model_type "{configs[name].model_type}" has no shardcast builder' in r.stderr, (name, r.stderr[-2000:])
        j = json.loads(report.read_text())
        assert [x["verify"] for x in j["ranks"]] == ["ok"] * nproc, (name, j["ranks"])
        with open(tmp_path / name / "model.safetensors.index.json") as f:
            keys = list(json.load(f)["weight_map"])
        assert j["entries"] == len(keys), name
    # --layers 1 keeps what is in no layer and layer 0
    r = sc(shardcast_bin, "load", "--checkpoint", tmp_path / "qwen2", "--nproc", 2, "--layers", 1, "--quiet", "--json",
           tmp_path / "l1.json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "l1.json").read_text())["entries"] == len([k for k in keys if ".layers.1." not in k])
    # --config naming the same file: the same (it was "unknown model_type")
    r = sc(shardcast_bin, "load", "--checkpoint", tmp_path / "qwen2", "--config", tmp_path / "qwen2" / "config.json",
           "--nproc", 2, "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]


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


def test_a_launch_of_no_ranks_and_negative_counts_are_refused(shardcast_bin):
    """--nproc 0 ran one rank in the process; plan --rank -1 and --layers -2 meant "all", unsaid."""
    for cmd in (["load", "--checkpoint", "/nonexistent"], ["convert", "/nonexistent", "/tmp/shardcast-x"]):
        r = sc(shardcast_bin, *cmd, "--nproc", "0")
        assert r.returncode != 0 and "not in range 1 to 1024" in r.stderr, (cmd, r.stderr)
    for flag in ("--rank", "--layers"):
        r = sc(shardcast_bin, "plan", "--config", CONFIGS / "llama-3.1-8b.json", "--world-size", "2", flag, "-1")
        assert r.returncode != 0 and "not in range 0 to" in r.stderr, (flag, r.stderr)


def test_inspect_and_plan_read_headers_without_mapping_the_files(shardcast_bin, tmp_path):
    """inspect and plan --checkpoint mapped every file whole: 15 GB of address space for an 8B checkpoint,
    refused under ulimit -v where load (pread) went through."""
    import resource
    ckpt = tmp_path / "l8"
    assert sc(shardcast_bin, "synth", "--config", CONFIGS / "llama-3.1-8b.json", "--out", ckpt, "--sparse",
              "--max-shard-size", "5GB").returncode == 0

    def capped():
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, resource.RLIM_INFINITY))

    for args in (["inspect", ckpt], ["plan", "--config", CONFIGS / "llama-3.1-8b.json", "--world-size", "8",
                                      "--checkpoint", ckpt, "--schedule", "--rank", "3"]):
        r = subprocess.run([str(shardcast_bin), *map(str, args)], capture_output=True, text=True, timeout=120,
                           preexec_fn=capped)
        assert r.returncode == 0, (args, r.stderr[-1500:])


def test_a_cuda_target_finds_torchs_cuda_backend(shardcast_bin):
    """The CLI links libtorch_cuda by name only, which an --as-needed linker drops: --target cuda then found
    no CUDA backend at all ("Could not run 'aten::empty.memory_format' with arguments from the 'CUDA'
    backend", with the dispatcher's dump). It loads libtorch_cuda at the first CUDA target: on a GPU host the
    prepare runs; on one without a GPU, torch's own words about the driver come back."""
    import torch
    if torch.version.cuda is None:
        pytest.skip("torch is a CPU build: it has no CUDA backend to load")
    r = sc(shardcast_bin, "prepare", "--config", ROOT / "configs" / "tiny-moe.json", "--world-size", "1", "--rank", "0",
           "--target", "cuda", "--layers", "1")
    assert "Could not run" not in r.stderr, r.stderr[-1500:]
    if torch.cuda.is_available():
        assert r.returncode == 0, r.stderr[-1500:]
    else:
        assert r.returncode != 0 and "cannot allocate on cuda:0" in r.stderr, r.stderr[-1500:]
