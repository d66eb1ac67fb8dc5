"""shardcast's layouts against DTensor's own arithmetic, over random layouts: mesh dims 1-3, sizes 1-8,
Shard on every dim, _StridedShard, Replicate, uneven dims and empty pieces. The reference applies
torch's own placement `_split_tensor` (what `distribute_tensor` scatters) left to right over the mesh
dims to a tensor of global indices, and for layouts without _StridedShard also checks DTensor's
`compute_local_shape_and_global_offset`."""
import random

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import shardcast  # noqa: F401
from dtensor_ref import split_reference
from shardcast import _shardcast


def _reference(shape, mesh_shape, placements, coord):
    numel = 1
    for d in shape:
        numel *= d
    return split_reference(torch.arange(numel).reshape(shape), mesh_shape, placements, coord)


def _ours(shape, mesh_shape, ranks, placements, rank):
    kinds = []
    for p in placements:
        if isinstance(p, _StridedShard):
            kinds.append((2, p.dim, int(p.split_factor)))
        elif isinstance(p, Shard):
            kinds.append((1, p.dim, 1))
        else:
            kinds.append((0, 0, 1))
    held, dims = _shardcast.layout_piece(list(shape), [(list(mesh_shape), list(ranks), kinds)], rank)
    assert held
    index = [torch.cat([torch.arange(b, e) for b, e in spans]) if spans else torch.empty(0, dtype=torch.long)
             for spans in dims]
    strides = torch.tensor(shape + (1,)).flip(0).cumprod(0).flip(0)[1:].tolist() if shape else []
    out = torch.zeros([len(i) for i in index], dtype=torch.long)
    for d, idx in enumerate(index):
        view = [1] * len(shape)
        view[d] = len(idx)
        out = out + (idx * strides[d]).reshape(view)
    return out


def _random_case(rng):
    world = rng.randint(1, 8)
    nd = rng.randint(1, 3)
    shape = tuple(rng.randint(0, 9) for _ in range(nd))
    dims, left = [], world
    for d in range(rng.randint(1, 3)):
        divisors = [k for k in range(1, left + 1) if left % k == 0]
        size = rng.choice(divisors)
        dims.append(size)
        left //= size
    dims[-1] *= left
    placements = []
    for _ in dims:
        kind = rng.randint(0, 2)
        d = rng.randrange(nd)
        placements.append(Replicate() if kind == 0 else Shard(d) if kind == 1 else _StridedShard(d, split_factor=rng.randint(1, 3)))
    ranks = list(range(world))
    rng.shuffle(ranks)
    return shape, tuple(dims), ranks, placements


@pytest.mark.parametrize("seed", range(4))
def test_every_rank_holds_what_dtensor_splits_to_it(seed):
    rng = random.Random(seed)
    for _ in range(150):
        shape, mesh_shape, ranks, placements = _random_case(rng)
        for flat, rank in enumerate(ranks):
            coord, rest = [], flat
            for size in reversed(mesh_shape):
                coord.insert(0, rest % size)
                rest //= size
            want = _reference(shape, mesh_shape, placements, coord)
            got = _ours(shape, mesh_shape, ranks, placements, rank)
            assert tuple(got.shape) == tuple(want.shape), (shape, mesh_shape, placements, coord)
            if want.numel():
                assert torch.equal(got, want), (shape, mesh_shape, placements, coord)


def test_local_shape_and_offset_match_dtensors_own_helper():
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    rng = random.Random(7)
    checked = 0
    for _ in range(300):
        shape, mesh_shape, ranks, placements = _random_case(rng)
        if any(isinstance(p, _StridedShard) for p in placements):
            continue
        for flat, rank in enumerate(ranks):
            coord, rest = [], flat
            for size in reversed(mesh_shape):
                coord.insert(0, rest % size)
                rest //= size
            try:
                local_shape, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, coord, placements)
            except TypeError:  # another torch's signature
                pytest.skip("this torch's _compute_local_shape_and_global_offset takes other arguments")
            kinds = [(1, p.dim, 1) if isinstance(p, Shard) else (0, 0, 1) for p in placements]
            _, dims = _shardcast.layout_piece(list(shape), [(list(mesh_shape), ranks, kinds)], rank)
            assert tuple(sum(e - b for b, e in spans) for spans in dims) == tuple(local_shape)
            for d, spans in enumerate(dims):
                if spans and local_shape[d]:
                    assert spans[0][0] == offset[d], (shape, mesh_shape, placements, coord)
            checked += 1
    assert checked > 100


# ---- real layouts, multi-process, against transformers' own loading on the same layout ----------------

import json  # noqa: E402
import shutil  # noqa: E402

import ranks  # noqa: E402


def _arch_configs():
    import transformers as t
    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=37,
                  max_position_embeddings=512, tie_word_embeddings=False)
    return {
        "llama": t.LlamaConfig(intermediate_size=42, **common),
        "qwen3_moe": t.Qwen3MoeConfig(intermediate_size=42, moe_intermediate_size=18, num_experts=6,
                                      num_experts_per_tok=2, head_dim=8, **common),
        "deepseek_v3": t.DeepseekV3Config(intermediate_size=42, moe_intermediate_size=18, n_routed_experts=6,
                                          num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                                          q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                          v_head_dim=8, n_shared_experts=1, **{**common, "num_key_value_heads": 4}),
    }


@pytest.fixture(scope="module")
def arch_checkpoints(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    root = tmp_path_factory.mktemp("layout-arch")
    torch.manual_seed(0)
    for name, cfg in _arch_configs().items():
        AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(root / name, max_shard_size="60KB")
    return root


# The layouts transformers' DistributedConfig gives a world of 4: FSDP, TP x FSDP (_StridedShard), EP x FSDP
# (experts on their own mesh), TP x EP x FSDP, HSDP x FSDP, HSDP x TP.
LAYOUTS_W4 = [{"fsdp_size": 4}, {"tp_size": 2, "fsdp_size": 2}, {"ep_size": 2, "fsdp_size": 4},
              {"tp_size": 2, "ep_size": 2, "fsdp_size": 2}, {"dp_replicate_size": 2, "fsdp_size": 2},
              {"dp_replicate_size": 2, "tp_size": 2}]


@pytest.fixture(scope="module")
def w4(arch_checkpoints, tmp_path_factory):
    """run(scenario): its per-rank results at world 4, where one launch runs every layout in both sources and
    the hand-built TP x FSDP mesh (rank start-up dominates)."""
    llama_only = tmp_path_factory.mktemp("llama-only")
    shutil.copytree(arch_checkpoints / "llama", llama_only / "llama")
    launch = ranks.Scenarios("layout_worker.py", tmp_path_factory, {4: [
        ("native", arch_checkpoints, {"LAYOUTS": json.dumps(LAYOUTS_W4), "SOURCES": "rank0,each-rank"}),
        ("manual", llama_only, {"SAVE_ROOT": str(tmp_path_factory.mktemp("llama-saved")), "SOURCE": "rank0"})]})
    return lambda name: launch(name, 4)


# rank0 and each-rank here; striped and node-leader on the same kinds of layout (TP x FSDP, HSDP x TP x
# FSDP, experts on their own mesh) run in the C++ multi-process tests (LayoutExact), which cost seconds.
@pytest.mark.parametrize("source", ["rank0", "each-rank"])
def test_from_pretrained_distributed_config_equals_transformers_on_every_layout(w4, source):
    results = w4("native")  # each (model, layout) through both sources against one transformers reference
    native, split = set(), set()
    for rank, result in enumerate(results):
        mine = {k[: -len(f" @{source}")]: r for k, r in result.items() if k.endswith(f" @{source}")}
        assert len(mine) * 2 == len(result), sorted(result)
        for key, r in mine.items():
            if key.startswith("llama") and "ep_size" in key:  # a dense model has no ep_plan: both refuse it
                assert "no `ep_plan`" in r.get("skipped", "") and "shardcast: InvalidArgument" in r["skipped"], (key, r)
                continue
            assert "skipped" not in r, f"rank {rank} {key}: {r['skipped']}"
            assert r["bad"] == [], f"rank {rank} {key}: {r['bad']}"
            assert r["checked"] > 5 and r["verify"] == "ok" and r["source"] == source, (key, r)
            (split if r.get("native") else native).add(key)
    # Bit for bit against transformers' own loading on every layout, for every model; where transformers'
    # own loading fails (6 experts over 4 FSDP ranks: its conversion breaks on the empty rank), shardcast
    # still loads, checked against DTensor's own split of the full tensors.
    for spec in LAYOUTS_W4:
        assert "ep_size" in spec or f"llama {spec}" in native, (spec, sorted(native))
        for moe in ("qwen3_moe", "deepseek_v3"):
            assert f"{moe} {spec}" in native | split, (moe, spec)
    assert len(native) >= 14, sorted(native)


def _bit_exact_everywhere(results):
    """Asserts every rank's every model x layout loaded bit for bit (auto chose each-rank, verify ok); returns
    the keys compared against transformers' own loading (the rest against DTensor's split)."""
    native = set()
    for rank, result in enumerate(results):
        for key, r in result.items():
            assert "skipped" not in r, f"rank {rank} {key}: {r['skipped']}"
            assert r["bad"] == [], f"rank {rank} {key}: {r['bad']}"
            assert r["checked"] > 5 and r["verify"] == "ok" and r["source"] == "each-rank", (key, r)
            if not r.get("native"):
                native.add(key)
    return native


# Odd and larger world sizes: FSDP over 3 ranks (every dim uneven), TP x FSDP over 8 (4 x 2) and
# HSDP x FSDP over 6 (3 x 2), source left to auto.
@pytest.mark.parametrize("world,spec", [(3, {"fsdp_size": 3}), (6, {"dp_replicate_size": 3, "fsdp_size": 2}),
                                        (8, {"tp_size": 2, "fsdp_size": 4})])
def test_from_pretrained_equals_transformers_at_world_sizes_3_6_8(arch_checkpoints, tmp_path, world, spec):
    results = ranks.run("layout_worker.py", "native", arch_checkpoints, world, tmp_path, timeout=600,
                        env={"LAYOUTS": json.dumps([spec])})
    native = _bit_exact_everywhere(results)
    assert f"llama {spec}" in native, sorted(native)


def _more_arch_configs():
    import transformers as t
    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=37,
                  max_position_embeddings=512, tie_word_embeddings=False)
    return {
        "mixtral": t.MixtralConfig(intermediate_size=42, num_local_experts=6, num_experts_per_tok=2, **common),
        "gpt_oss": t.GptOssConfig(intermediate_size=18, num_local_experts=6, num_experts_per_tok=2, head_dim=8,
                                  sliding_window=16, **common),
        # Tied embeddings under a TP plan that names lm_head.weight (regression, an outside trial: the meta
        # model was built tied, so transformers' TP found no such parameter; transformers builds it untied)
        "qwen3_moe_tied": t.Qwen3MoeConfig(intermediate_size=42, moe_intermediate_size=18, num_experts=6,
                                           num_experts_per_tok=2, head_dim=8,
                                           **{**common, "tie_word_embeddings": True}),
    }


# Two more MoE families (Mixtral's per-expert w1/w2/w3 fused on load, gpt-oss' checkpoint-fused experts
# with biases) at another world size, with the source left to auto. 6 experts: transformers shards experts
# over EP ranks only evenly; the vocabulary (37) and the MLP widths stay odd.
LAYOUTS_W2 = [{"fsdp_size": 2}, {"tp_size": 2}, {"ep_size": 2, "fsdp_size": 2}]


def test_mixtral_gpt_oss_and_a_tied_moe_equal_transformers_at_world_size_2(tmp_path):
    from transformers import AutoModelForCausalLM
    root = tmp_path / "more-arch"
    torch.manual_seed(1)
    for name, cfg in _more_arch_configs().items():
        AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(root / name, max_shard_size="60KB")
    results = ranks.run("layout_worker.py", "native", root, 2, tmp_path, timeout=600,
                        env={"LAYOUTS": json.dumps(LAYOUTS_W2)})
    native = _bit_exact_everywhere(results)
    assert len(native) == 9, sorted(native)


def test_hand_built_tp_x_fsdp_mesh_loads_and_saves_bit_exact(w4):
    results = w4("manual")
    for rank, result in enumerate(results):
        r = result["llama"]
        assert r["bad"] == [] and r["saved_bad"] == [], f"rank {rank}: {r}"
        assert r["checked"] > 10 and r["verify"] == "ok"
        assert any("_StridedShard" in lay for lay in r["layouts"]), r["layouts"]
