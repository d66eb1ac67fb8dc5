"""The real user flow, with real transformers model classes and checkpoints written by transformers'
own save_pretrained (several files), at world sizes 1-4 over c10d Gloo on a CPU mesh."""
import json
import os
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    from transformers import (AutoModelForCausalLM, DeepseekV3Config, LlamaConfig, MixtralConfig, Qwen3MoeConfig)
    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=37,
                  max_position_embeddings=512, tie_word_embeddings=False)
    configs = {
        "llama": LlamaConfig(intermediate_size=40, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64}, **common),
        "qwen3_moe": Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=16, head_dim=8, num_experts=5,
                                    num_experts_per_tok=2, **common),
        "mixtral": MixtralConfig(intermediate_size=40, num_local_experts=3, num_experts_per_tok=2, **common),
        "deepseek_v3": DeepseekV3Config(intermediate_size=48, moe_intermediate_size=16, first_k_dense_replace=1,
                                        n_routed_experts=3, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
                                        topk_group=1, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
                                        qk_rope_head_dim=4, v_head_dim=8,
                                        rope_scaling={"type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 128},
                                        **{**common, "num_key_value_heads": 4}),
    }
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    for name, cfg in configs.items():
        model = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():  # persistent buffers (the routing bias) non-zero, so their load is visible
            for n, b in model.named_buffers():
                if "e_score_correction_bias" in n:
                    b.copy_(torch.randn_like(b))
        model.save_pretrained(root / name, max_shard_size="40KB")
        assert len([f for f in os.listdir(root / name) if f.endswith(".safetensors")]) > 1
    return root


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(mode, root, world, tmp_path):
    # A free port can be taken by a concurrent test before rank 0 binds it: then start over on another.
    for attempt in range(3):
        try:
            return run_once(mode, root, world, tmp_path)
        except PortTaken:
            if attempt == 2:
                raise


class PortTaken(Exception):
    pass


def run_once(mode, root, world, tmp_path):
    port, out = free_port(), tmp_path / f"{mode}-{world}"
    env_base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                    TORCH_CPP_LOG_LEVEL="ERROR", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "fsdp2_worker.py"), mode, str(root), str(out)],
                              env=dict(env_base, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            p.kill()
    if any("EADDRINUSE" in log for log in logs):
        raise PortTaken()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{logs[r][-3000:]}"
    return [json.loads((tmp_path / f"{mode}-{world}.{r}").read_text()) for r in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_meta_prepare_fully_shard_load_is_bit_exact(checkpoints, tmp_path, world):
    for rank, result in enumerate(run("flow", checkpoints, world, tmp_path)):
        assert set(result) == {"deepseek_v3", "llama", "mixtral", "qwen3_moe"}
        for model, r in result.items():
            assert r["bad"] == [], f"rank {rank} {model}: {r['bad']}"
            assert r["checked"] > 10 and r["verify"] == "ok", (model, r)
            assert "model.rotary_emb.inv_freq" in r["computed"], (model, r)


def test_explicit_mapping(checkpoints, tmp_path):
    for rank, r in enumerate(run("mapping", checkpoints, 3, tmp_path)):
        assert r["bad"] == [] and r["checked"] == 6, (rank, r)


def test_mismatch_is_the_same_exception_on_every_rank(checkpoints, tmp_path):
    results = run("mismatch", checkpoints, 3, tmp_path)
    assert {r["type"] for r in results} == {"ManifestMismatch"}, results
    assert len({r["message"] for r in results}) == 1, results
    msg = results[0]["message"]
    assert "rank 1" in msg and "mlp" in msg and "shape" in msg, msg
