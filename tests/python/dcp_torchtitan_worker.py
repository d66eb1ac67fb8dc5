"""One rank of tests/python/test_dcp_torchtitan.py: torchtitan 0.3.0's own models, its own parallelize_*
functions and its own initial_load_in_hf code path (CheckpointManager.dcp_load: adapter.to_hf, dcp.load,
adapter.from_hf, model.load_state_dict), once through torch's HF storage reader and once through
shardcast's, into identical fresh sharded models on a CPU mesh over Gloo.

`python dcp_torchtitan_worker.py MODE ROOT OUT` with torchrun's variables set:

MODE write:    (one rank) for every scenario, a tiny torchtitan model built and initialised by torchtitan
               itself, converted by its StateDictAdapter.to_hf (the offline path) and saved under
               ROOT/<scenario>/ as two safetensors files + model.safetensors.index.json: bf16, or for
               deepseek_v3_fp8 fp8 e4m3 with float32 `weight_scale_inv` per 128x128 block (DeepSeek-V3's
               own format). ROOT/<scenario>.expected.safetensors: what a load must give, under
               torchtitan's names (fp32; the fp8 weights dequantized block by block).
MODE fsdp:     world 4, FSDP over all 4 ranks.
MODE tp2fsdp2: world 4, TP 2 x FSDP 2.
MODE state:    world 4, the training state through torchtitan's CheckpointManager and shardcast's
               (dcp_torchtitan_state.py).
MODE scenarios: layouts in turn, in these processes (ranks.each_scenario).
               For every scenario and reader (torch, then shardcast when importable): a fresh model on the
               meta device, torchtitan's parallelize_fn, to_empty + init_weights, then torchtitan's
               dcp_load. Reports per scenario and reader the CRC32 of every local shard (parameters and
               persistent buffers) and the keys whose full tensor differs from the expected one.
"""
import datetime
import json
import os
import sys
import types
import zlib

import torch
import torch.distributed as dist

import ranks

SCENARIOS = ("qwen3_moe", "qwen3_moe_e3", "deepseek_v3", "deepseek_v3_fp8")
# qwen3_moe_e3: 3 experts, fewer than the FSDP degree 4, so torchtitan's apply_fsdp_to_decoder shards the
# experts on dim 1 instead of 0. Not in TP 2 x FSDP 2: FSDP 2 would shard them on dim 0, and torchtitan's
# MoE adapter refuses an expert count its shard degree does not divide.
LAYOUT_SCENARIOS = {"fsdp": SCENARIOS, "tp2fsdp2": ("qwen3_moe", "deepseek_v3", "deepseek_v3_fp8")}
BLOCK = 128
SPMD_BACKEND = "partial_dtensor"


def _configs(name, tp_ok=True):
    """The tiny model config of a scenario, built with torchtitan's own config builders."""
    if name.startswith("qwen3_moe"):
        from torchtitan.models.common import CosSinRoPE, Embedding, Linear
        from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_moe_layers, _qwen3_norm
        from torchtitan.models.qwen3 import _EMBEDDING_INIT, _LINEAR_INIT
        dim, head_dim, vocab = 36, 8, 37  # dim and vocab divide by neither 2 nor 4
        return Qwen3Model.Config(
            vocab_size=vocab, dim=dim, norm=_qwen3_norm(dim),
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
            lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
            layers=_build_qwen3_moe_layers(
                n_layers=2, dim=dim, n_heads=4, n_kv_heads=2, head_dim=head_dim, moe_hidden_dim=20,
                num_experts=3 if name == "qwen3_moe_e3" else 4, top_k=2, attn_backend="flex", moe_comm_backend="standard",
                rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=64, theta=1000000.0)))
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, _EMBEDDING_INIT, _NORM_INIT
    from torchtitan.models.deepseek_v3 import _build_dsv3_layers, _output_linear_init
    # dim 136 and the dense FFN's 202 cut a 128-wide scale block; 202 rows over 4 ranks (51, 51, 51, 49)
    # put rank 2's rows 102-152 across the first block's end.
    dim, vocab, rope_dim = 136, 37, 4
    layers = _build_dsv3_layers(
        n_layers=2, n_dense_layers=1, dim=dim, n_heads=4, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=rope_dim, v_head_dim=8, mscale=0.70, dense_hidden_dim=202,
        moe_hidden_dim=24, num_experts=4, num_shared_experts=1, router_top_k=2, router_score_func="softmax",
        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=64, theta=10000.0, scaling="yarn", rope_factor=40.0,
                                beta_fast=32.0, beta_slow=1.0, original_seq_len=16))
    return DeepSeekV3Model.Config(
        vocab_size=vocab, dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=layers, mtp_layers=[])


def _spec(name):
    """(config, parallelize_fn, adapter class, from_quantized) of a scenario."""
    if name.startswith("qwen3_moe"):
        from torchtitan.models.qwen3 import Qwen3StateDictAdapter, parallelize_qwen3
        return _configs(name), parallelize_qwen3, Qwen3StateDictAdapter, False
    from torchtitan.models.deepseek_v3 import DeepSeekV3StateDictAdapter, parallelize_deepseekv3
    return _configs(name), parallelize_deepseekv3, DeepSeekV3StateDictAdapter, name.endswith("_fp8")


def _quantize(w):
    """fp8 e4m3 per 128x128 block, with DeepSeek-V3's float32 weight_scale_inv (dequant = q * scale_inv);
    returns (q, scale_inv, dequantized fp32 exactly as a reader computes it)."""
    rows, cols = w.shape
    nr, nc = -(-rows // BLOCK), -(-cols // BLOCK)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(nr, nc, dtype=torch.float32)
    deq = torch.empty(rows, cols, dtype=torch.float32)
    for i in range(nr):
        for j in range(nc):
            blk = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].float()
            s = (blk.abs().max().clamp(min=1e-12) / 448.0).float()
            qb = (blk / s).to(torch.float8_e4m3fn)
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = qb
            scale[i, j] = s
            deq[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = qb.to(torch.float32) * s
    return q, scale, deq


def _is_quantized(key, t):
    return t.dim() == 2 and ".layers." in f".{key}" and key.endswith("proj.weight") and "layernorm" not in key


def write(root):
    from safetensors.torch import save_file
    os.makedirs(root, exist_ok=True)
    for name in SCENARIOS:
        config, _, adapter_cls, quantized = _spec(name)
        torch.manual_seed(0)
        model = config.build()
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        adapter = adapter_cls(config, None)
        hf = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in adapter.to_hf(model.state_dict()).items()}
        expected_hf = {k: v.float() for k, v in hf.items()}
        if quantized:
            for k in sorted(hf):
                if _is_quantized(k, hf[k]):
                    q, s, deq = _quantize(hf[k])
                    hf[k], hf[k.replace(".weight", ".weight_scale_inv")], expected_hf[k] = q, s, deq
        expected = {k: v.contiguous() for k, v in adapter.from_hf(expected_hf).items()}
        d = os.path.join(root, name)
        os.makedirs(d, exist_ok=True)
        keys = sorted(hf)
        files = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
                 "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
        weight_map = {}
        for fname, ks in files.items():
            save_file({k: hf[k] for k in ks}, os.path.join(d, fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in ks})
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
        save_file(expected, os.path.join(root, f"{name}.expected.safetensors"))
    return {"scenarios": list(SCENARIOS)}


def _readers():
    """(name, factory(path, from_quantized)) of the readers to compare; shardcast's when importable."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader

    # What torchtitan's DeepSeekV3StateDictAdapter.get_hf_storage_reader passes (keywords included).
    def torch_reader(path, from_quantized):
        if from_quantized:
            return QuantizedHuggingFaceStorageReader(path=path, target_dtype=torch.float32, block_size=BLOCK,
                                                     thread_count=4)
        return HuggingFaceStorageReader(path)

    out = [("torch", torch_reader)]
    try:
        import shardcast.dcp as sdcp
    except ImportError as e:
        return out, f"{type(e).__name__}: {e}"

    def shardcast_reader(path, from_quantized):
        if from_quantized:
            return sdcp.QuantizedHuggingFaceStorageReader(path=path, target_dtype=torch.float32,
                                                          block_size=BLOCK, thread_count=4)
        return sdcp.HuggingFaceStorageReader(path)

    out.append(("shardcast", shardcast_reader))
    return out, None


def _crc(t):
    t = t.detach().contiguous().reshape(-1)
    return zlib.crc32(t.view(torch.uint8).numpy().tobytes()) if t.numel() else 0


def _trainer_or_stub():
    """Decoder.Config.update_from_config imports torchtitan.trainer only for an isinstance check against
    Trainer.Config; the trainer module imports the whole training stack (torchdata, tensorboard, datasets'
    users...), which these tests do not install. When it is not importable, a stand-in whose Config
    nothing is an instance of: update_from_config then takes its documented non-trainer path."""
    try:
        import torchtitan.trainer  # noqa: F401
    except ImportError:
        stub = types.ModuleType("torchtitan.trainer")
        stub.Trainer = type("Trainer", (), {"Config": type("Config", (), {})})
        sys.modules["torchtitan.trainer"] = stub


def _titan_setup():
    """torchtitan's shims for a CPU mesh without its training stack (TORCHTITAN.md's limits)."""
    import torchtitan.distributed.parallel_dims as tt_parallel_dims
    # torchtitan.tools.utils.device_type is "cuda" whenever no accelerator is present; its mesh helper
    # would ask for a CUDA mesh on a CPU-only machine.
    tt_parallel_dims.device_type = "cpu"
    _trainer_or_stub()


def _built(name, layout, world, nan=True):
    """(model, config, adapter class, from_quantized): scenario `name` built on the meta device, laid out by
    torchtitan's parallelize_fn in `layout`, then to_empty + init_weights, and with `nan` every parameter
    then NaN (nothing of the init may survive a load unnoticed)."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    # torchtitan 0.3.0's default spmd_backend ("spmd_types") and "full_dtensor" stop in fully_shard here
    # (torch 2.15, CPU mesh): "Expected param's DTensor mesh to be the same mesh passed to fully_shard, but
    # got different mesh objects". "partial_dtensor" is its DTensor-for-TP-only path that works.
    parallelism = ParallelismConfig(tensor_parallel_degree={"fsdp": 1, "tp2fsdp2": 2}[layout], data_parallel_shard_degree=-1,
                                    spmd_backend=SPMD_BACKEND)
    config, parallelize_fn, adapter_cls, quantized = _spec(name)
    config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    parallel_dims = ParallelDims.from_config(parallelism, world)
    parallel_dims.build_mesh()
    with torch.device("meta"):
        model = config.build()
    model = parallelize_fn(model, parallel_dims=parallel_dims, training=TrainingConfig(),
                           parallelism=parallelism, compile_config=CompileConfig(), ac_config=None,
                           dump_folder="")
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
        for p in model.parameters() if nan else ():
            (p.to_local() if hasattr(p, "to_local") else p).fill_(float("nan"))
    return model, config, adapter_cls, quantized


def load_all(root, rank, world, layout):
    from safetensors.torch import load_file
    from torchtitan.components.checkpoint import MODEL, CheckpointManager, ModelWrapper

    _titan_setup()
    readers, no_shardcast = _readers()
    out = {"readers": [n for n, _ in readers], "no_shardcast": no_shardcast, "scenarios": {}}
    for name in LAYOUT_SCENARIOS[layout]:
        expected = load_file(os.path.join(root, f"{name}.expected.safetensors"))
        res = {}
        for reader_name, make_reader in readers:
            used = []
            model, config, adapter_cls, quantized = _built(name, layout, world)

            class Adapter(adapter_cls):
                def get_hf_storage_reader(self, path, from_quantized=False):
                    reader = make_reader(path, from_quantized)
                    used.append(f"{type(reader).__module__}.{type(reader).__qualname__}")
                    return reader

            # torchtitan's own initial_load_in_hf step (CheckpointManager.dcp_load), on the state it keeps.
            wrapper = ModelWrapper(model)
            manager = types.SimpleNamespace(sd_adapter=Adapter(config, None), states={MODEL: wrapper})
            CheckpointManager.dcp_load(manager, wrapper.state_dict(), checkpoint_id=os.path.join(root, name),
                                       from_hf=True, from_quantized=quantized)
            crcs, wrong, placements = {}, [], {}
            for key, value in model.state_dict().items():
                local = value.to_local() if hasattr(value, "to_local") else value
                crcs[key] = _crc(local)
                full = value.full_tensor() if hasattr(value, "full_tensor") else value
                if key in expected and not torch.equal(full.view(torch.uint8), expected[key].view(torch.uint8)):
                    wrong.append(key)
                if hasattr(value, "placements"):
                    placements[key] = str(value.placements)
            res[reader_name] = {"crc": crcs, "wrong": wrong, "missing": sorted(set(expected) - set(crcs)),
                                "placements": placements, "reader_class": used}
        out["scenarios"][name] = res
    return out


def main():
    mode, root, out = sys.argv[1], sys.argv[2], sys.argv[3]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    if mode == "write":
        result = write(root)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        def scenario(layout, where):
            if layout == "state":
                from dcp_torchtitan_state import training_state
                return training_state(where, rank, world)
            return load_all(where, rank, world, layout)

        try:  # MODE scenarios: both layouts and the training state in turn, in these processes
            ranks.each_scenario(mode, root, scenario, f"{out}.{rank}")
        finally:
            dist.destroy_process_group()
        return
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
