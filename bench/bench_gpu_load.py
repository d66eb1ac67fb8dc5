#!/usr/bin/env python3
"""One GPU, one process: a transformers checkpoint (the Qwen3-MoE of bench_peers.py) onto the GPU by

  transformers  AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, device_map="cuda")
  shardcast     shardcast.from_pretrained(ckpt, target="cuda"): an FSDP2 model of world size 1

each in a fresh process, timed from just before transformers is imported (torch and CUDA initialized, the
process group made: the user's) to the model ready on the GPU (torch.cuda.synchronize): import, and the
rest (load). Correctness next to every timing: a CRC32 over every parameter's bytes (copied back to the
host) in sorted name order must be the same under both methods and every run. Also reported: the peak
of GPU memory allocated and the process's peak resident host memory (VmHWM). Before each run the
checkpoint is read into the page cache, or with --cold evicted from it; the bytes still resident
(mincore) are reported.

    bench/bench_gpu_load.py [--layers 40] [--cold] [--repeat 2] [--work out/bench-peers]
                            [--out bench/results/gpu-load.json]

With --fp8 the checkpoint is instead a DeepSeek-V3-shaped fp8 one (128 x 128 block scales, written by
`shardcast synth`), kept quantized by both: transformers' own FP8 path (`from_pretrained(ckpt,
device_map="cuda")` on a GPU of compute capability >= 8.9) against `shardcast.from_pretrained(ckpt,
target="cuda", keep_quantized=True)`.

Needs a CUDA device; without one it says so and exits 1.
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
import zlib

from _ranks import free_port
from _checkpoints import set_page_cache, write_checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[1]
METHODS = ("transformers", "shardcast")


# A DeepSeek-V3 of ~166 MB of fp8 per layer (every quantized dim a multiple of the 128 x 128 block).
DEEPSEEK_FP8 = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 16, "num_key_value_heads": 16,
    "q_lora_rank": 768, "kv_lora_rank": 256, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 32, "n_shared_experts": 1, "num_experts_per_tok": 4, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 1, "vocab_size": 32000, "max_position_embeddings": 4096, "rope_theta": 10000,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]},
}


def write_fp8_checkpoint(path, layers, shardcast_bin):
    """`shardcast synth` of DEEPSEEK_FP8 with `layers` layers, renamed into place once whole."""
    import shutil
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    (partial / "config.json").write_text(json.dumps({**DEEPSEEK_FP8, "num_hidden_layers": layers}))
    subprocess.run([str(shardcast_bin), "synth", "--config", str(partial / "config.json"), "--out", str(partial / "ckpt"),
                    "--max-shard-size", "500M", "--seed", "1"], check=True, capture_output=True, timeout=1800)
    (partial / "ckpt").rename(path)
    shutil.rmtree(partial)


def worker(method, ckpt, out, kind="bf16"):
    import torch
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    if method == "shardcast":
        import torch.distributed as dist
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    t0 = time.monotonic()
    from transformers import AutoModelForCausalLM  # timed: the import is part of what a user waits for
    if method == "shardcast":
        import shardcast
    t1 = time.monotonic()
    if method == "transformers":  # an fp8 checkpoint stays fp8 on a GPU of compute capability >= 8.9
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, device_map="cuda")
    else:
        model = shardcast.from_pretrained(ckpt, target="cuda", keep_quantized=kind == "fp8")
    torch.cuda.synchronize()
    t2 = time.monotonic()
    crc = 0
    params = sorted(model.named_parameters())
    for _, p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        crc = zlib.crc32(local.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes(), crc)
    hwm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    result = {"method": method, "seconds": t2 - t0, "import": t1 - t0, "load": t2 - t1, "crc": crc,
              "names_crc": zlib.crc32(" ".join(n for n, _ in params).encode()),
              "params": len(params), "gpu_peak_bytes": torch.cuda.max_memory_allocated(), "host_peak_rss": hwm}
    pathlib.Path(out).write_text(json.dumps(result))
    if method == "shardcast":
        torch.distributed.destroy_process_group()


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(*sys.argv[2:6])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--cold", action="store_true", help="evict the checkpoint from the page cache before each run")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each method, interleaved; the table: the median")
    ap.add_argument("--fp8", action="store_true", help="a DeepSeek-V3-shaped fp8 checkpoint, kept quantized by both")
    ap.add_argument("--work", default=str(ROOT / "out/bench-peers"))
    ap.add_argument("--out", default=str(ROOT / "bench/results/gpu-load.json"))
    args = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        print(f"bench_gpu_load: no CUDA device (torch {torch.__version__})", file=sys.stderr)
        return 1
    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    build = pathlib.Path(os.environ.get("SHARDCAST_BUILD_DIR", ROOT / "build"))
    kind = "fp8" if args.fp8 else "bf16"
    ckpt = work / (f"deepseek-fp8-{args.layers}L" if args.fp8 else f"qwen3-moe-{args.layers}L")
    if not ckpt.is_dir():
        if args.fp8:
            write_fp8_checkpoint(ckpt, args.layers, build / "tools" / "shardcast")
        else:
            write_checkpoint(ckpt, args.layers)
    files = sorted(ckpt.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    runs, resident = {m: [] for m in METHODS}, []
    for _ in range(args.repeat):  # interleaved: drift hits both alike
        for method in METHODS:
            resident.append(set_page_cache(files, args.cold))
            out = work / f"gpu-{method}.json"
            out.unlink(missing_ok=True)
            env = dict(os.environ, PYTHONPATH=str(build / "python"), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(free_port()), HF_HUB_DISABLE_PROGRESS_BARS="1", PYTHONWARNINGS="ignore")
            r = subprocess.run([sys.executable, __file__, "--worker", method, str(ckpt), str(out), kind], env=env,
                               capture_output=True, text=True, timeout=1800)
            if r.returncode != 0 or not out.exists():
                raise SystemExit(f"{method} failed (exit {r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
            runs[method].append(json.loads(out.read_text()))
    same = len({(x["crc"], x["names_crc"]) for rs in runs.values() for x in rs}) == 1
    print(f"{kind} checkpoint {size / 1e9:.2f} GB ({args.layers} layers), one GPU, {'cold' if args.cold else 'warm'} page "
          f"cache ({min(resident) / 1e9:.2f}-{max(resident) / 1e9:.2f} GB resident before each run), "
          f"median of {args.repeat} run(s)")
    print(f"{'method':<14} {'total s':>8} {'import':>7} {'load':>7} {'GB/s':>6} {'GPU peak':>9} {'host peak':>10}  runs")
    summary = {}
    for m, rs in runs.items():
        med = {k: statistics.median(x[k] for x in rs) for k in ("seconds", "import", "load")}
        summary[m] = {**med, "gbps": size / med["load"] / 1e9, "gpu_peak_bytes": max(x["gpu_peak_bytes"] for x in rs),
                      "host_peak_rss": max(x["host_peak_rss"] for x in rs), "all_seconds": [x["seconds"] for x in rs]}
        s = summary[m]
        print(f"{m:<14} {s['seconds']:8.2f} {s['import']:7.2f} {s['load']:7.2f} {s['gbps']:6.2f} "
              f"{s['gpu_peak_bytes'] / 1e9:8.2f}G {s['host_peak_rss'] / 1e9:9.2f}G  "
              + ", ".join(f"{t:.2f}" for t in s["all_seconds"]))
    print(f"every parameter identical across methods and runs: {same}")
    pathlib.Path(args.out).write_text(json.dumps(
        {"checkpoint": kind, "checkpoint_bytes": size, "layers": args.layers, "repeat": args.repeat, "device": torch.cuda.get_device_name(),
         "page_cache": "cold" if args.cold else "warm", "resident_bytes_before": resident, "identical": same,
         "summary": summary, "runs": runs}, indent=2) + "\n")
    if not same:
        raise SystemExit("parameters differ between methods or runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
