"""from_pretrained streams the checkpoint while it builds the model, and says where its time went.

Real transformers checkpoints (llama with tied embeddings, qwen3_moe with fused experts, deepseek_v3 with a
persistent buffer; dims that do not divide by the world size) saved by save_pretrained in several files,
loaded by real rank processes over c10d Gloo, each launch with a deadline: every local shard and buffer of
the stream beside the build is bit for bit the one the sequential path loads (which test_from_pretrained
compares with transformers' own loading), each in FSDP2's padded buffer (no copy); a built model that
differs from the stream's plan, or a build that fails on one rank, is the same error on every rank.
"""
import json
import os
import shutil

import pytest

import ranks

PHASES = {"import", "config", "build", "layout", "stream", "wait"}
MODELS = ("deepseek_v3", "llama", "qwen3_moe")


@pytest.fixture(scope="module")
def run(tiny_checkpoints, tmp_path_factory):
    root = tiny_checkpoints("tied", models=MODELS)
    # llama's config.json says 44 intermediate rows where its tensors have 40: the plan (from the header)
    # and the built model (from the config) differ.
    bad = tmp_path_factory.mktemp("mismatch") / "llama"
    shutil.copytree(root / "llama", bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] + 4}))
    both = ["stream", ("mismatch", bad), ("fail_one", root / "llama"), ("fail_start", root / "llama")]
    llama = root / "llama"
    decide = [("decide:one_cpu", llama, {"SHARDCAST_STREAM_BESIDE_BUILD": "", "TEST_CPUS": "1"}),
              ("decide:two_cpus", llama, {"SHARDCAST_STREAM_BESIDE_BUILD": "", "TEST_CPUS": "2"})]
    by_rank = [("decide:one_says_no", llama, lambda r: {"SHARDCAST_STREAM_BESIDE_BUILD": "0" if r == 1 else "1"}),
               ("decide:one_unreadable", llama, lambda r: {"SHARDCAST_STREAM_BESIDE_BUILD": "yes" if r == 1 else "1"}),
               ("decide_dc:one_unreadable", llama,
                lambda r: {"SHARDCAST_STREAM_BESIDE_BUILD": "yes" if r == 1 else "1"}),
               ("decide:one_keyword_no", llama, lambda r: {"TEST_BESIDE_KEYWORD": "0" if r == 1 else "1"})]
    two_ranks = [("decide:two_cpus", llama, {"SHARDCAST_STREAM_BESIDE_BUILD": "", "TEST_CPUS": "2"})]
    return ranks.Scenarios("pretrained_stream_worker.py", tmp_path_factory,
                           {3: ["phases", ("stream:kept", kept_dtype(tmp_path_factory)), "stream_dc"] + both + by_rank,
                            4: ["stream"], 1: ["stream", "stream_dc"] + decide, 2: two_ranks},
                           root=root, timeout=400)


def kept_dtype(tmp_path_factory):
    """A checkpoint of a model class that keeps a parameter in float32 at any dtype (transformers' beam:
    `_keep_in_fp32_modules_strict` = its router's `mlp.gate.weight`), which the header cannot foresee."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    root = tmp_path_factory.mktemp("kept")
    config = AutoConfig.for_model("beam", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8, vocab_size=37, intermediate_size=40,
                                  moe_intermediate_size=16, num_experts=5, num_experts_per_tok=2,
                                  mlp_layer_types=["dense", "sparse"], tie_word_embeddings=False)
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "beam", max_shard_size="40KB")
    return root


def test_every_rank_reports_every_rank_phases_adding_up_to_its_total(run):
    results = run("phases", 3)
    for name in MODELS:
        every = [r[name] for r in results]
        assert every[0]["beside"], name
        assert all(e["dict"] == every[0]["dict"] for e in every), f"{name}: the ranks' reports differ"
        for rank, row in enumerate(every[0]["typed"]):
            assert row["rank"] == rank and set(row["phases"]) == PHASES, (name, row)
            assert all(s >= 0 for s in row["phases"].values()), (name, row)
            # A stream beside build and layout overlaps them: only the rank's wait for it adds up.
            added = sum(s for p, s in row["phases"].items() if p != "stream" or not every[0]["beside"])
            assert row["total"] > 0 and abs(added - row["total"]) <= 0.01 * row["total"] + 0.01, (name, row)
            # The load is the stream phase, seen from inside: it cannot take longer than the phase around it.
            assert row["phases"]["stream"] >= row["load_seconds"] > 0, (name, row)
            assert every[0]["dict"][rank]["phases"] == row["phases"], (name, rank)
            # The process's CPU time over the call: some, and no more than its threads could use in its wall time.
            assert 0 < row["cpu"] <= row["total"] * (os.cpu_count() or 1) + 0.05, (name, row)


@pytest.mark.parametrize("world", [3, 4])
def test_stream_beside_build_lands_the_sequential_paths_bits_in_fsdp2s_padded_buffers(run, world):
    results = run("stream", world)
    for rank, result in enumerate(results):
        for name in MODELS:
            r = result[name]
            assert r["beside"] == [True, False], (rank, name, r)
            assert r["differ"] == [] and r["params"] > 10, (rank, name, r)
            assert r["copied"] == [], (rank, name, r)
            assert r["bytes"] > 0, (rank, name, r)
        # The sequential path's reason, at DEBUG level.
        assert len(result["debug"]) == len(MODELS), result["debug"]
        assert all("process_group" in line for line in result["debug"]), result["debug"]
    if world == 4:  # 5 experts over 4 ranks: 2, 2, 1 and none, so rank 3 holds an empty piece
        assert results[3]["qwen3_moe"]["nonempty"] < results[3]["qwen3_moe"]["params"], results[3]["qwen3_moe"]


def test_transformers_fsdp_layout_streams_beside_the_build_too(run):
    """distributed_config with FSDP alone lays every parameter out as the stream predicts: it streams, and
    lands the bits of the same call loaded after the build, each in FSDP2's padded buffer."""
    results = run("stream_dc", 3)
    for rank, result in enumerate(results):
        for name in MODELS:
            r = result[name]
            assert r["beside"] == [True, False], (rank, name, r)
            assert r["differ"] == [] and r["copied"] == [] and r["params"] > 10, (rank, name, r)
        # llama's tied lm_head: transformers' FSDP unties it, its from_pretrained ties it again; so does ours
        assert result["llama"]["tied"] == [True, True], (rank, result["llama"])
        # The second call asked for the load after the build, and says so at DEBUG level.
        assert len(result["debug"]) == len(MODELS), result["debug"]
        assert all("stream_beside_build=False" in line for line in result["debug"]), result["debug"]


def test_a_world_of_one_streams_fully_shards_layout_and_loads_transformers_plain_tensors_after_the_build(run):
    """One rank (torchrun --nproc-per-node 1): fully_shard over a mesh of one still makes Shard(0) DTensors,
    which the stream predicts; transformers' FSDP of size 1 leaves plain tensors, which it does not, so they
    load after the build. Regression: the stream predicted Shard(0) there too, and every such call failed
    with ManifestMismatch."""
    (default,) = run("stream", 1)
    (dc,) = run("stream_dc", 1)
    for name in MODELS:
        assert default[name]["beside"] == [True, False], (name, default[name])
        assert default[name]["differ"] == [] and default[name]["copied"] == [], (name, default[name])
        assert dc[name]["beside"] == [False, False] and dc[name]["differ"] == [], (name, dc[name])
        assert default[name]["params"] > 10 and dc[name]["params"] == default[name]["params"], (name, dc[name])
    assert any("world of one" in line for line in dc["debug"]), dc["debug"]


def test_left_to_decide_it_streams_beside_the_build_only_with_two_cpus_a_rank(run):
    """Unasked (no keyword, SHARDCAST_STREAM_BESIDE_BUILD empty), ranks stream beside the build where the
    CPUs their node's ranks may run on are at least two a rank, and load after it otherwise (measured: with
    fewer the overlap was slower), saying why at DEBUG level: one rank on one CPU or two ranks on the same
    two load after the build, one rank on two streams beside it."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("this machine lets the tests run on one CPU: the two-CPU cases need two")
    (one,) = run("decide:one_cpu", 1)
    assert one["error"] is None and one["beside"] is False, one
    assert len(one["debug"]) == 1 and "rank 0: 1 CPU for 1 rank on " in one["debug"][0], one
    (two,) = run("decide:two_cpus", 1)
    assert two["error"] is None and two["beside"] is True and two["debug"] == [], two
    for rank, r in enumerate(run("decide:two_cpus", 2)):
        assert r["error"] is None and r["beside"] is False, (rank, r)
        assert len(r["debug"]) == 1 and "rank 1: 2 CPUs for 2 ranks on " in r["debug"][0], (rank, r)


def test_the_variable_set_on_one_rank_is_agreed_never_a_rank_leaving_alone(run):
    """SHARDCAST_STREAM_BESIDE_BUILD is read on each rank, so it may differ: one rank's 0 (or its keyword
    False) loads every rank after the build (the reason agreed in the stream's exchange); one rank's
    unreadable value is the same InvalidArgument on every rank, naming the rank and the variable."""
    results = run("decide:one_says_no", 3)
    for rank, r in enumerate(results):
        assert r["error"] is None and r["beside"] is False, (rank, r)
        assert len(r["debug"]) == 1 and "rank 1: SHARDCAST_STREAM_BESIDE_BUILD=0" in r["debug"][0], (rank, r)
    # The keyword too, which a script may pass on one rank only (regression: a rank passing False skipped
    # the exchange, and the others waited there for their timeout).
    for rank, r in enumerate(run("decide:one_keyword_no", 3)):
        assert r["error"] is None and r["beside"] is False, (rank, r)
        assert len(r["debug"]) == 1 and "rank 1: stream_beside_build=False" in r["debug"][0], (rank, r)
    # Through distributed_config too, where transformers' meshes are made only if every rank goes on
    # (regression: the failed rank did not read its distributed_config, left the stream's exchange alone,
    # and the others waited there for their timeout).
    for scenario in ("decide:one_unreadable", "decide_dc:one_unreadable"):
        results = run(scenario, 3)
        first = results[0]
        assert first["error"] == "InvalidArgument", (scenario, first)
        assert "rank 1" in first["message"] and "SHARDCAST_STREAM_BESIDE_BUILD='yes'" in first["message"], first
        assert all({k: r[k] for k in ("error", "message")} == {k: first[k] for k in ("error", "message")}
                   for r in results), (scenario, results)


def test_a_parameter_the_model_class_keeps_in_float32_is_loaded_after_the_build_not_refused(run):
    for rank, result in enumerate(run("stream:kept", 3)):
        r = result["beam"]
        assert r["beside"] == [True, False], (rank, r)
        assert r["differ"] == [] and r["copied"] == [], (rank, r)
        assert r["kept"] == ["model.layers.1.mlp.gate.weight"], (rank, r)


@pytest.mark.parametrize("world", [3])  # 4 adds nothing for a failure: its launch checks the empty rank's stream
def test_a_built_model_other_than_the_plan_is_one_error_on_every_rank(run, world):
    results = run("mismatch", world)
    first = results[0]
    assert first["error"] == "ManifestMismatch", first
    assert "rank 0:" in first["message"] and "mlp" in first["message"] and "[44, 32]" in first["message"], first
    assert all(r == first for r in results), results


@pytest.mark.parametrize("world", [3])  # 4 adds nothing for a failure: its launch checks the empty rank's stream
def test_a_build_failing_on_one_rank_while_it_streams_is_one_error_on_every_rank(run, world):
    results = run("fail_one", world)
    first = results[0]
    assert first["error"] == "ConfigError" and "rank 1:" in first["message"], first
    assert "rank 1 cannot compute it" in first["message"], first
    assert all(r == first for r in results), results


# Rank 1 cannot start its stream's thread after every rank agreed to stream: it joins the others' stream with
# its failure, so every rank raises the same error naming it at once, not the others' timeout (60 s).
def test_a_stream_that_cannot_start_on_one_rank_is_one_error_on_every_rank(run):
    results = run("fail_start", 3)
    first = results[0]
    assert "rank 1" in first["message"] and "can't start new thread" in first["message"], first
    assert first["error"] != "CommTimeout", first
    assert all(r == first for r in results), results


def test_which_targets_and_meshes_the_stream_predicts():
    """The stream's layout question, asked of each rank's own target and mesh: the host, or this rank's GPU
    (from_pretrained's default where the job runs on GPUs), over a 1-d mesh of the whole world in rank
    order on that device; anything else loads after the build, saying why. (The GPU path itself runs in
    test_cuda.py on a GPU machine.)"""
    import torch
    from shardcast._stream_rules import off_layout

    class Mesh:
        def __init__(self, device_type, ranks):
            self.device_type, self.mesh, self.ndim = device_type, torch.tensor(ranks), 1

    assert off_layout(None, None, 4) is None and off_layout(None, "cpu", 4) is None
    assert off_layout(None, "cuda", 4) is None
    assert off_layout(Mesh("cuda", [0, 1, 2, 3]), "cuda", 4) is None
    assert off_layout(Mesh("cpu", [0, 1, 2, 3]), None, 4) is None
    assert off_layout(None, "pinned", 4) == "target pinned"
    assert off_layout(Mesh("cpu", [0, 1, 2, 3]), "cuda", 4) == "a mesh that is not the whole world on cuda"
    assert off_layout(Mesh("cuda", [0, 1, 2, 3]), "cpu", 4) == "a mesh that is not the whole world on cpu"
    assert off_layout(Mesh("cuda", [1, 0, 2, 3]), "cuda", 4) == "a mesh that is not the whole world on cuda"
    # transformers' plans lay out on torch's accelerator (the host here, where no GPU is): a target elsewhere
    # is not what the stream predicts
    here = torch._C._get_accelerator().type
    other = "cuda" if here == "cpu" else "cpu"
    assert off_layout(None, None if here == "cpu" else here, 4, dc=type("DC", (), {"fsdp_size": 4})()) is None
    assert off_layout(None, other, 4, dc=type("DC", (), {"fsdp_size": 4})()) == \
        f"distributed_config lays out on {here}, the target is {other}"


def test_from_pretrained_pauses_the_cyclic_collector_and_restores_it():
    """from_pretrained runs with Python's cyclic collector paused (its imports and meta model make about a
    million objects that each full collection would walk), and leaves it as it found it, on failure too."""
    import gc
    import shardcast
    from shardcast._pretrained import _without_cyclic_gc

    seen = []

    @_without_cyclic_gc
    def call(fail):
        seen.append(gc.isenabled())
        if fail:
            raise RuntimeError("the call failed")
        return "done"

    assert getattr(shardcast.from_pretrained, "__wrapped__", None) is not None  # from_pretrained is the paused one
    was = gc.isenabled()
    try:
        gc.enable()
        assert call(False) == "done" and gc.isenabled()
        with pytest.raises(RuntimeError):
            call(True)
        assert gc.isenabled()
        gc.disable()  # a caller that paused it already keeps it paused
        assert call(False) == "done" and not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [False, False, False]
