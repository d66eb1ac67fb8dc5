"""The shardcast command line end to end: exit codes and one-line errors for bad input, the option table
and the environment, inspect and plan, and `prepare --dump` checked against what transformers computes.
Loads across ranks are in test_cli_load.py, convert and synth in test_cli_convert.py."""
import json
import subprocess

import pytest

from cli_run import CONFIGS, ROOT, sc


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
