"""shardcast.save against transformers' own save_pretrained: checkpoints of tiny real models (MoE experts
fused in the model, Mixtral's renamed modules, Llama's tied embeddings, DeepSeek-V3's fp32 routing bias)
are loaded with shardcast into FSDP2 at world sizes 1-4, saved back with shardcast in both modes, and
must equal the originals bit for bit: same keys, per-expert layout, shapes and dtypes as save_pretrained
writes, read by from_pretrained, the safetensors package and `shardcast inspect`. Then the failures:
an existing out_dir, a leftover tmp dir, an unsupported placement, a full disk, a rank killed mid-write."""
import hashlib
import json
import os
import shutil
import subprocess

import pytest

import ranks

import torch
import transformers  # noqa: F401

MODELS = ["qwen3_moe", "mixtral", "llama", "deepseek_v3"]
MODES = ["each-rank", "rank0"]


@pytest.fixture(scope="session")
def checkpoints(tiny_checkpoints):
    root = tiny_checkpoints("tied", seed=2)
    shutil.copytree(root / "qwen3_moe", root / "earlier")  # the out_dir a killed save must leave intact
    return root


@pytest.fixture(scope="module")
def run(checkpoints, tmp_path_factory):
    """One set of 4 ranks for everything (Python start-up dominates): the round trips at world sizes 1-4
    (sub-groups), then the failure scenarios, then a kill. Returns (per-rank results, saved dir, earlier
    out_dir's digest before the run)."""
    tmp = tmp_path_factory.mktemp("save-run")
    before = _tree(checkpoints / "earlier")
    per_rank = ranks.run("save_worker.py", "all", checkpoints, 4, tmp, allow_fail=True)
    return per_rank, tmp / "all-4-saved", before


def tensors(d):
    """{key: tensor} of every safetensors file in d, read with the safetensors package."""
    from safetensors import safe_open
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(d, f), framework="pt") as st:
                for k in st.keys():
                    out[k] = st.get_tensor(k)
    return out


_originals = {}


def original(checkpoints, name):
    if name not in _originals:
        from transformers import AutoModelForCausalLM
        ckpt = checkpoints / name
        _originals[name] = (tensors(ckpt), AutoModelForCausalLM.from_pretrained(ckpt).state_dict(),
                            json.loads((ckpt / "config.json").read_text()))
    return _originals[name]


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8),
                                                                     b.view(-1).view(torch.uint8))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("name", MODELS)
def test_saved_checkpoint_equals_save_pretrained_bit_for_bit(run, checkpoints, name, world):
    from transformers import AutoModelForCausalLM
    per_rank, saved, _ = run
    want_files, want_state, want_config = original(checkpoints, name)
    for mode in MODES:
        out = saved / f"w{world}" / f"{name}-{mode}"
        got = tensors(out)
        # the keys, per-expert layout, shapes and dtypes save_pretrained writes, and the same bytes
        assert sorted(got) == sorted(want_files), (mode, set(got) ^ set(want_files))
        bad = [k for k in want_files if not same_bits(got[k], want_files[k])]
        assert bad == [], (mode, bad)
        state = AutoModelForCausalLM.from_pretrained(out).state_dict()
        assert sorted(state) == sorted(want_state)
        bad = [k for k in want_state if not same_bits(state[k], want_state[k])]
        assert bad == [], (mode, bad)
        config = json.loads((out / "config.json").read_text())
        assert config["dtype"] == want_config["dtype"] and config["architectures"] == want_config["architectures"]
        assert (out / "generation_config.json").exists() == (checkpoints / name / "generation_config.json").exists()
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert sorted(index["weight_map"]) == sorted(want_files)
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
        want_index = json.loads((checkpoints / name / "model.safetensors.index.json").read_text())
        assert index["metadata"]["total_parameters"] == want_index["metadata"]["total_parameters"]
        assert not [n for n in os.listdir(out.parent) if ".tmp-" in n]
        for rank, r in enumerate(per_rank[:world]):
            s = r["roundtrip"][f"w{world}/{name}-{mode}"]
            assert s["written_by_all"] == s["total_bytes"], (rank, s)  # every byte written once: 1.0x
            if mode == "rank0" and rank > 0:
                assert s["written"] == 0 and s["received"] == 0, (rank, s)


@pytest.mark.parametrize("mode", MODES)
def test_output_passes_shardcast_inspect(run, shardcast_bin, mode):
    _, saved, _ = run
    for name in MODELS:
        r = subprocess.run([str(shardcast_bin), "inspect", str(saved / "w3" / f"{name}-{mode}")], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr


def errors(run):
    per_rank, saved, _ = run
    return {k: [r["errors"][k] for r in per_rank] for k in per_rank[0]["errors"]}, saved


def same(rs, kind, *parts):
    """Every rank raised `kind` with one message containing every part."""
    assert {r["type"] for r in rs} == {kind}, rs
    assert len({r["message"] for r in rs}) == 1, rs
    for p in parts:
        assert p in rs[0]["message"], rs[0]["message"]


def test_an_existing_out_dir_needs_overwrite(run):
    rs, _ = errors(run)
    same(rs["exists"], "InvalidArgument", "save layout", "w4/qwen3_moe-each-rank", "exists (pass overwrite=True")


def test_a_leftover_tmp_dir_is_named_then_removed_with_overwrite(run, checkpoints):
    rs, saved = errors(run)
    same(rs["leftover"], "InvalidArgument", "fresh.tmp-1234-dead", "did not finish", "overwrite=True")
    assert {r["type"] for r in rs["overwrite_f32"]} == {None}, rs["overwrite_f32"]
    assert not any(rs["leftover_exists"])
    # dtype=float32 on the way out: every floating tensor upcast, exactly as torch's .to()
    want, _, _ = original(checkpoints, "qwen3_moe")
    got = tensors(saved / "fresh")
    assert sorted(got) == sorted(want)
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], want[k].float()) for k in want)
    assert json.loads((saved / "fresh" / "config.json").read_text())["dtype"] == "float32"


def test_saving_over_a_folder_keeps_the_users_other_files(run, checkpoints):
    """overwrite=True replaced the whole folder: a tokenizer, a README or a folder of the user's beside the
    model was lost (saving back where the model was loaded from is the usual case). The model's own files
    are replaced (30 KB shards become one file); everything else stays, as save_pretrained leaves it."""
    rs, saved = errors(run)
    assert {r["type"] for r in rs["overwrite_kept"]} == {None}, rs["overwrite_kept"]
    for listing in rs["listing_after_overwrite"]:
        assert listing == ["config.json", "generation_config.json", "model.safetensors", "notes",
                           "tokenizer.json"] or listing == ["config.json", "model.safetensors", "notes",
                                                            "tokenizer.json"], listing
    assert (saved / "fresh" / "notes" / "run.txt").read_text() == "kept"
    want, _, _ = original(checkpoints, "qwen3_moe")
    got = tensors(saved / "fresh")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k].float()) for k in want)


def test_a_shard1_weight_is_saved_in_place_and_a_partial_one_is_refused(run):
    rs, _ = errors(run)
    assert {r["type"] for r in rs["shard1"]} == {None}, rs["shard1"]
    assert all(rs["shard1_back"])
    same(rs["placement"], "Unsupported", "save layout", "'weight': placement", "Partial", "no checkpoint value")
    assert not any(rs["placement_left"])


def test_a_full_disk_is_one_io_error_and_leaves_nothing(run):
    rs, _ = errors(run)
    same(rs["disk_full"], "IoError", "save stream", "[rank 1] writing", "File too large")
    assert rs["disk_full_left"] == [[]] * 4


def test_a_rank_killed_mid_write_leaves_the_earlier_out_dir_intact(run, checkpoints):
    per_rank, _, before = run
    assert "kill" not in per_rank[1], per_rank[1].get("kill")  # killed mid-save
    for rank in (0, 2, 3):
        assert per_rank[rank]["kill"]["type"] in ("CommError", "CommTimeout"), per_rank[rank]["kill"]
    assert len({per_rank[r]["kill"]["message"] for r in (0, 2, 3)}) == 1, [per_rank[r]["kill"] for r in (0, 2, 3)]
    assert _tree(checkpoints / "earlier") == before
    assert not [n for n in os.listdir(checkpoints) if n.startswith("earlier.tmp-")]


def _tree(d):
    h = hashlib.sha256()
    for f in sorted(os.listdir(d)):
        h.update(f.encode() + (d / f).read_bytes())
    return h.hexdigest()


# Regression (issue 20): source="striped" or "node-leader" ran as rank0 and reported the source asked for.
@pytest.mark.parametrize("source", ["striped", "node-leader"])
def test_a_source_save_does_not_have_is_invalid_argument(tmp_path, source):
    import shardcast
    model = torch.nn.Linear(4, 3)
    with pytest.raises(shardcast.InvalidArgument, match=f'source "{source}" is not a save source'):
        shardcast.save(model, tmp_path / "out", source=source)
    assert not (tmp_path / "out").exists()
    assert shardcast.save(model, tmp_path / "out", source="rank0")["mode"] == "rank0"


# A float max_shard_size was read as text ("1.5": one byte, a file per tensor); transformers refuses it too.
@pytest.mark.parametrize("size", [1.5, True, None])
def test_a_max_shard_size_neither_int_nor_text_is_invalid_argument(tmp_path, size):
    import shardcast
    model = torch.nn.Linear(4, 3)
    with pytest.raises(shardcast.InvalidArgument, match=f"max_shard_size={size!r}: takes bytes as an int"):
        shardcast.save(model, tmp_path / "out", max_shard_size=size)
    assert not (tmp_path / "out").exists()
    shardcast.save(model, tmp_path / "out", max_shard_size=1000)
    assert (tmp_path / "out" / "model.safetensors").exists()


_NEOX = r'''
import os, sys, tempfile, torch, torch.distributed as dist, shardcast
from transformers import AutoConfig, AutoModelForCausalLM
from safetensors import safe_open
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
root = sys.argv[1]
cfg = AutoConfig.for_model("gpt_neox", hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                           intermediate_size=40, vocab_size=37, rotary_pct=0.5)
AutoModelForCausalLM.from_config(cfg).save_pretrained(root + "/src")
shardcast.save(shardcast.from_pretrained(root + "/src", dtype=torch.float32), root + "/out")
with safe_open(os.path.join(root, "out", "model.safetensors"), "pt") as h:
    print(" ".join(sorted(k for k in h.keys() if "layers" not in k)))
dist.destroy_process_group()
'''


def test_a_class_keyed_rename_is_reverted_on_save(tmp_path):
    """Outside trial: GPT-NeoX's head, loaded as lm_head (transformers' rename keyed by the class name
    GPTNeoXForCausalLM), was saved as lm_head: transformers looks the rename up by type(model).__name__,
    which fully_shard made FSDPGPTNeoXForCausalLM. Saved as embed_out, as save_pretrained writes it."""
    keys = ranks.python_out(_NEOX, tmp_path).split()
    assert "embed_out.weight" in keys and "lm_head.weight" not in keys, keys
