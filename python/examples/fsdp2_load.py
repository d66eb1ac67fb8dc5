#!/usr/bin/env python3
"""The FSDP2 flow with shardcast, end to end, on CPU/Gloo (or CUDA with --target cuda):

    torchrun --standalone --nproc-per-node 4 python/examples/fsdp2_load.py [--checkpoint DIR]

Without --checkpoint, rank 0 first writes a small Qwen3-MoE checkpoint with transformers'
save_pretrained (several files), so the example needs nothing but the packages tools/setup.sh installs.
Run with PYTHONPATH=build/python after tools/build.sh.
"""
import argparse
import datetime
import gc
import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3MoeConfig

import shardcast


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", help="an HF checkpoint directory (config.json + safetensors)")
    ap.add_argument("--target", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    backend = "cpu:gloo,cuda:nccl" if args.target == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.target == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))

    ckpt = args.checkpoint
    if ckpt is None:  # a small checkpoint, written once by rank 0
        ckpt = os.path.join(tempfile.gettempdir(), "shardcast-example-qwen3-moe")
        if rank == 0 and not os.path.exists(os.path.join(ckpt, "config.json")):
            cfg = Qwen3MoeConfig(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
                                 num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_experts=9,
                                 num_experts_per_tok=2, vocab_size=5003, tie_word_embeddings=False)
            AutoModelForCausalLM.from_config(cfg).save_pretrained(ckpt, max_shard_size="5MB")
        dist.barrier()

    config = AutoConfig.from_pretrained(ckpt)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)      # nothing allocated
    prep = shardcast.prepare(model, config=config, target=args.target)  # params meta; RoPE computed here
    mesh = init_device_mesh(args.target, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    report = shardcast.load(model, ckpt, target=args.target, verify=True)  # each rank gets only its rows
    if rank == 0:
        print(f"prepare: computed {sorted(prep['computed_buffers'])}, {prep['meta_parameters']} parameters left on meta")
        print(f"load: {report['entries']} entries, {report['total_bytes'] / 1e6:.1f} MB over {report['backend']}")
        for r in report["ranks"]:
            print(f"  rank {r['rank']}: stored {r['bytes_stored'] / 1e6:.1f} MB in {r['seconds']:.3f} s, "
                  f"peak RssAnon +{r['peak_rss_anon_above_baseline'] / 1e6:.1f} MB, verify {r['verify']}")
    with torch.no_grad():  # the model works: one forward step on every rank
        ids = torch.randint(0, config.vocab_size, (1, 8), device=args.target)
        logits = model(ids).logits
    if rank == 0:
        print(f"forward: logits {tuple(logits.shape)}, finite: {bool(torch.isfinite(logits).all())}")
    # Release the model before the process group: otherwise a gloo worker thread can drop the forward's
    # last all-gather (and a Python tensor with it) while Python is finalizing, which aborts the process
    # ("terminate called without an active exception"; a torch/gloo race at exit, seen under load).
    del model, logits
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
