"""shardcast.from_pretrained against transformers' own from_pretrained + fully_shard, bit for bit.

Real transformers models (llama with tied embeddings, qwen3_moe, deepseek_v3) with dims that do not
divide by the world size, saved by save_pretrained in several files, loaded at world sizes 1-3 over
c10d Gloo on a CPU mesh by real rank processes, each with a deadline. A repo id resolves from a fake
local Hugging Face cache laid out as the hub lays it out (snapshots/<rev>/ symlinks into blobs/).
"""
import hashlib
import json
import os

import pytest

import torch
import transformers  # noqa: F401

import ranks
import shardcast

HERE = os.path.dirname(os.path.abspath(__file__))
DEADLINE_S = 300


@pytest.fixture(scope="session")
def pretrained(tiny_checkpoints):
    return tiny_checkpoints("tied", models=("deepseek_v3", "llama", "qwen3_moe"))


def forward_unsupported(r):
    """torch 2.6's FSDP2 cannot run a forward on a CPU mesh (no stream events): logits are then not compared."""
    return r["logits_equal"] is None and "not supported by torch 2.6" in r["note"]


@pytest.fixture(scope="module")
def hub(pretrained, tmp_path_factory):
    """(cache, snapshot): a fake local Hugging Face cache holding the llama as tiny-org/tiny-llama."""
    cache = tmp_path_factory.mktemp("hub")
    return cache, fake_hub_cache(cache, "tiny-org/tiny-llama", pretrained / "llama")


@pytest.fixture(scope="module")
def run(pretrained, hub, tmp_path_factory):
    """run(scenario, world): its per-rank results, from one launch of pretrained_worker.py per world size
    (rank start-up dominates). The launches see the fake cache (offline); compare and accelerate name
    local directories, which the cache does not serve."""
    cache, _ = hub
    env = {"HF_HUB_CACHE": str(cache), "HF_HOME": str(cache.parent / "hf-home"), "HF_HUB_OFFLINE": "1"}
    return ranks.Scenarios("pretrained_worker.py", tmp_path_factory, {
        1: ["compare"], 2: ["compare", "accelerate", ("repo", "tiny-org/tiny-llama")], 3: ["compare", "accelerate"]},
        root=pretrained, env=env)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_from_pretrained_equals_transformers_then_fully_shard(run, world):
    results = run("compare", world)
    for rank, result in enumerate(results):
        assert set(result) == {"llama", "qwen3_moe", "deepseek_v3"}
        for name, r in result.items():
            assert r["bad"] == [], f"rank {rank} {name}: {r['bad']}"
            assert (r["logits_equal"] and r["finite"]) or forward_unsupported(r), (rank, name, r)
            assert r["checked"] > 10 and r["units"] == 2 and r["verify"] == "ok", (rank, name, r)
            assert r["dtype"] == "torch.bfloat16" and r["fsdp_module"].startswith("FSDP"), r


def fake_hub_cache(cache, repo_id, src):
    """Lays out `src` as the hub does: blobs/<sha256>, snapshots/<rev>/<file> -> ../../blobs/<sha256>."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    rev = hashlib.sha1(repo_id.encode()).hexdigest()
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    for f in sorted(os.listdir(src)):
        data = (src / f).read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        os.symlink(os.path.join("..", "..", "blobs", blob), snap / f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    return snap


def run_srun_tasks(root, world, out, master):
    """`world` processes as srun starts them: SLURM_* variables, no RANK/WORLD_SIZE, no process group."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                             "MASTER_ADDR", "MASTER_PORT")}
    env.update(SLURM_NTASKS=str(world), SLURM_NTASKS_PER_NODE=f"{world}(x1)", TORCH_CPP_LOG_LEVEL="ERROR",
               PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", SHARDCAST_STREAM_BESIDE_BUILD="1",  # as ranks.py
               **({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(ranks.free_port())} if master else {}))
    procs = ranks.start(os.path.join(HERE, "pretrained_worker.py"), ["launched", str(root), str(out)],
                        [dict(env, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)) for r in range(world)])
    try:
        logs = [p.communicate(timeout=DEADLINE_S)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"task {r} failed:\n{logs[r][-4000:]}"
    return [json.loads(open(f"{out}.{r}").read()) for r in range(world)]


def test_srun_tasks_are_one_world_never_a_world_of_one_each(pretrained, tmp_path):
    """Under srun with no process group, from_pretrained makes srun's world (each task its own rows);
    without a rendezvous address it refuses, naming what to export, instead of a full model per task."""
    got = run_srun_tasks(pretrained, 2, tmp_path / "with", master=True)
    for rank, r in enumerate(got):
        assert r.get("world") == 2 and r["rank"] == rank and r["report_world"] == 2, r
    assert sum(r["rows"] for r in got) == got[0]["global_rows"] and all(r["rows"] < r["global_rows"] for r in got)
    refused = run_srun_tasks(pretrained, 2, tmp_path / "without", master=False)
    for rank, r in enumerate(refused):
        assert r.get("error") == "InvalidArgument", r
        assert f"rank {rank} of 2 (slurm's variables)" in r["message"] and "MASTER_ADDR" in r["message"], r


def test_repo_id_resolves_from_local_hf_cache(run, hub):
    _, snap = hub
    results = run("repo", 2)  # symlinks into ../../blobs
    for rank, result in enumerate(results):
        r = result["tiny-org/tiny-llama"]
        assert os.path.realpath(r["resolved"]) == os.path.realpath(snap), r
        assert r["bad"] == [] and (r["logits_equal"] or forward_unsupported(r)), (rank, r)


def test_repo_id_not_in_cache_is_a_checkpoint_error(tmp_path, monkeypatch):
    import huggingface_hub.constants as hc
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(shardcast.CheckpointError) as e:
        shardcast._pretrained.resolve_checkpoint("no-such-org/no-such-model")
    msg = str(e.value)
    assert "no-such-org/no-such-model" in msg and "local Hugging Face cache" in msg and "does not download" in msg, msg
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")
    with pytest.raises(shardcast.InvalidArgument):
        shardcast._pretrained.resolve_checkpoint(f)
    # a path that is not there is not looked up as a repo id (the cache's advice would be noise)
    for missing in (str(tmp_path / "nonexistent"), "./nonexistent", "runs/step-100/hf"):
        with pytest.raises(shardcast.CheckpointError, match="no such directory") as e:
            shardcast._pretrained.resolve_checkpoint(missing)
        assert "hf download" not in str(e.value)
    # a directory of weights without config.json: said so (it was an InternalError wrapping transformers'
    # "Should have a `model_type` key")
    with pytest.raises(shardcast.CheckpointError, match="holds no config.json"):
        shardcast._pretrained.resolve_checkpoint(tmp_path)


def test_shard_units_follow_no_split_modules():
    from transformers import AutoModelForCausalLM, LlamaConfig
    cfg = LlamaConfig(hidden_size=16, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                      vocab_size=11, intermediate_size=8)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    units = shardcast._pretrained.shard_units(model)
    assert [type(u).__name__ for u in units] == ["LlamaDecoderLayer"] * 3
    assert shardcast._pretrained.shard_units(model, ("layers", "model.embed_tokens"))[0] is model.model.embed_tokens
    assert shardcast._pretrained.shard_units(model, ()) == []


def test_a_module_kept_in_float32_gets_a_unit_of_its_own_and_the_model_runs(tmp_path):
    """ERNIE-4.5-MoE keeps its router gate in float32 (_keep_in_fp32_modules_strict) inside bf16 decoder
    layers: one fully_shard over a layer held two dtypes, and the loaded model failed its first forward
    ("FSDP expects uniform original parameter dtype"). The gate gets a unit of its own, before its layer's;
    in a process of its own (a world of one), the model's logits equal transformers'."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model("ernie4_5_moe", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=37, intermediate_size=40, moe_num_experts=5, moe_k=2,
                               moe_intermediate_size=16, moe_num_shared_experts=1, max_position_embeddings=128)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    names = {m: n for n, m in meta.named_modules()}
    units = shardcast._pretrained.shard_units(meta)
    gates = [names[u] for u in units if {p.dtype for p in u.parameters()} == {torch.float32}]
    assert gates and all(g.endswith("mlp.gate") for g in gates), [names[u] for u in units]
    assert units.index(next(u for u in units if names[u].endswith("mlp.gate"))) < len(gates), "before the layers"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(tmp_path / "ernie")
    code = (
        "import sys, torch, shardcast\n"
        "from transformers import AutoModelForCausalLM\n"
        "ids = torch.tensor([[1, 5, 9, 3]])\n"
        "ours = shardcast.from_pretrained(sys.argv[1], dtype=torch.bfloat16)\n"
        "theirs = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)\n"
        "with torch.no_grad():\n"
        "    a, b = ours(ids).logits, theirs(ids).logits\n"
        "print('equal' if torch.equal(a, b) else f'differ {(a.float() - b.float()).abs().max().item()}')\n")
    assert ranks.python_out(code, tmp_path / "ernie") == "equal"


def test_units_of_another_dtype_are_the_outermost_modules_all_of_it():
    """_dtype_units' rules, each once: a float32 module in a bf16 unit gets a unit (the outermost such module,
    not its children too); a module holding a unit never does, nor one of the unit's own dtype; a module
    mixing dtypes is passed over for its children; a float32 module outside every unit is judged against
    the root's own parameters (model[1] bf16 against model[2] float32, the root's dtype the larger)."""
    from shardcast._world import _dtype_units
    lin = torch.nn.Linear

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.gate = lin(8, 8), torch.nn.Sequential(lin(2, 2), lin(2, 2))  # bf16 the larger
            self.mixed = torch.nn.Sequential(lin(2, 2), lin(2, 2))

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.ModuleList([Layer(), Layer()]), lin(4, 4), lin(2, 2)).to(torch.bfloat16)
    layers = list(model[0])
    for layer in layers:
        layer.gate.float()
        layer.mixed[1].float()
    model[2].float()
    layers[1].gate[0].weight = layers[1].gate[1].weight  # tied: one parameter under two modules
    names = {m: n for n, m in model.named_modules()}
    picked = [names[m] for m in _dtype_units(model, layers)]
    assert picked == ["0.0.gate", "0.0.mixed.1", "0.1.gate", "0.1.mixed.1", "2"], picked
    with torch.device("meta"):
        plain = torch.nn.Sequential(lin(2, 2), lin(2, 2)).to(torch.bfloat16)
    assert _dtype_units(plain, [plain[0]]) == []


@pytest.mark.parametrize("world", [2, 3])
def test_accelerate_fsdp2_preparation_then_shardcast_load(run, world):
    import accelerate  # noqa: F401  (required: a missing one fails, never skips)
    for rank, result in enumerate(run("accelerate", world)):
        for name, r in result.items():
            assert r["bad"] == [] and (r["logits_equal"] or forward_unsupported(r)), (rank, name, r)
            assert r["units"] >= 3 and r["verify"] == "ok", (rank, name, r)  # layers + accelerate's embed/tail groups


_WORLD_OF_ONE = r'''
import json, sys, tempfile, torch, torch.distributed as dist, shardcast
from transformers import AutoModel, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
root, out = sys.argv[1], {}
cfg = LlamaConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  vocab_size=11, intermediate_size=8, attention_dropout=0.5)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(cfg).save_pretrained(root + "/lm")
AutoModel.from_config(cfg).save_pretrained(root + "/base")
ids = torch.tensor([[1, 5, 9, 3]])

def same(ours, theirs):
    return all(torch.equal(p.full_tensor() if hasattr(p, "full_tensor") else p, dict(theirs.named_parameters())[n])
               for n, p in ours.named_parameters())

m = shardcast.from_pretrained(root + "/lm", dtype=torch.bfloat16, stream_beside_build=False)
ref = AutoModelForCausalLM.from_pretrained(root + "/lm", dtype=torch.bfloat16)
with torch.no_grad():
    out["eval"] = [m.training, torch.equal(m(ids).logits, m(ids).logits), torch.equal(m(ids).logits, ref(ids).logits)]
out["key"] = m.shardcast_report["stream_beside_build"]
base = shardcast.from_pretrained(root + "/base", model_cls=AutoModel, dtype=torch.bfloat16)
out["automodel"] = same(base, AutoModel.from_pretrained(root + "/base", dtype=torch.bfloat16))
built = shardcast.from_pretrained(root + "/lm", model_cls=lambda c: LlamaForCausalLM(c), dtype=torch.bfloat16)
out["callable"] = [same(built, ref), str(built.model.rotary_emb.inv_freq.dtype)]
try:
    shardcast.from_pretrained(root + "/lm", tp_size=2)
except Exception as e:
    out["mesh"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
dist.destroy_process_group()
'''


def test_the_model_comes_back_as_transformers_returns_it(tmp_path):
    """From outside trials: the model came back in training mode (transformers' from_pretrained returns it in
    eval(): with attention dropout every forward differed); report["stream_beside_build"] was a KeyError where
    it did not stream; model_cls=AutoModel failed in fully_shard (its own "layers" ModuleList taken for the
    "layers" keyword); a callable model_cls at bf16 cast RoPE's float32 inv_freq and its rule refused it; sizes
    whose mesh is not the world were transformers' RuntimeError, an InternalError. In a world of one."""
    out = json.loads(ranks.python_out(_WORLD_OF_ONE, tmp_path, timeout=300))
    assert out["eval"] == [False, True, True], out
    assert out["key"] is False, out
    assert out["automodel"] is True, out
    assert out["callable"] == [True, "torch.float32"], out
    assert out["mesh"].startswith("InvalidArgument:") and "needs 2 processes, but the world has 1" in out["mesh"], out


def test_prepare_pretrained_without_fsdp_names_what_is_missing(tmp_path):
    """ACCELERATE.md's snippet in a run where accelerate does not enable FSDP (CPU): accelerator.prepare moved
    the meta model whole and torch's bare NotImplementedError came out; now an InvalidArgument saying why."""
    code = (
        "import sys, torch\n"
        "from accelerate import Accelerator\n"
        "from accelerate.utils import FullyShardedDataParallelPlugin\n"
        "from transformers import AutoModelForCausalLM, LlamaConfig\n"
        "from shardcast import InvalidArgument\n"
        "from shardcast.integrations.accelerate import prepare_pretrained\n"
        "cfg = LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,\n"
        "                  vocab_size=11, intermediate_size=8)\n"
        "AutoModelForCausalLM.from_config(cfg).save_pretrained(sys.argv[1])\n"
        "try:\n"
        "    prepare_pretrained(Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)), sys.argv[1])\n"
        "except InvalidArgument as e:\n"
        "    print('refused:', e)\n")
    out = ranks.python_out(code, tmp_path / "llama")
    assert out.startswith("refused: accelerator.prepare did not shard the meta model"), out
    assert "FullyShardedDataParallelPlugin(fsdp_version=2)" in out, out
