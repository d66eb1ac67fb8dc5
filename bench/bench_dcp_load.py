#!/usr/bin/env python3
"""`dcp.load` of a Hugging Face checkpoint the way torchtitan and DCP users call it, against shardcast: one
dense Llama checkpoint (bf16, save_pretrained; --layers 16 ~1.9 GB, 48 ~5.6 GB) loaded into an FSDP2 model
(meta -> fully_shard per layer and root -> to_empty) at world size W on CPU/Gloo by

  torch-t1         dcp.load(model.state_dict(), storage_reader=torch's HuggingFaceStorageReader(path)), its default
  torch-t4         the same with thread_count=4 (its best here: one thread per file, at most 4)
  shardcast-dcp    dcp.load(model.state_dict(), storage_reader=shardcast.dcp.HuggingFaceStorageReader(path))
  shardcast-load   shardcast.load(model, path)
  dcp-floor        dcp.load through torch's reader with its read_data moving no byte (every read item resolved
                   and committed as it is): what DCP's planning, metadata and collectives cost around any
                   reader's data phase (its shards are not compared; not a peer, a bound)

With --fp8, the same Llama with every linear weight stored as DeepSeek-V3 stores it (float8_e4m3fn with a
float32 weight_scale_inv per 128x128 block; embeddings, norms and lm_head bf16), loaded into the bf16 model:
torch-t1/torch-t4 are then torch's QuantizedHuggingFaceStorageReader(target_dtype=torch.bfloat16) and
shardcast-dcp shardcast.dcp.QuantizedHuggingFaceStorageReader (shardcast.load dequantizes it by itself).
With --device cuda (a GPU machine), the same over NCCL with one rank per GPU (W=1 on one GPU), the model
to_empty'd on cuda:LOCAL_RANK: every reader lands the bytes in CUDA DTensors (timed to a device synchronize;
the GPU's peak allocation is reported too). torch-tN: torch's reader at thread_count=N (torch-t1, torch-t4,
torch-t8, ...).
With --init, every local shard is written before the timed call, as torchtitan's trainer leaves it
(`model.to_empty(...)`, then `model.init_weights(...)`, then `checkpointer.load()`): the load then lands in
memory whose pages are already there; without it, in fresh `to_empty` memory that each reader faults in.
Each method runs in its own launch of W processes, the methods interleaved round by round (--repeat). Timed on every rank
from just before the call to the end of a barrier after it (the slowest rank's time is reported); peaks are
each rank's /proc/self/status RssAnon and RssFile above their value just before the call, sampled every 5 ms.
Correctness next to every timing: each rank's CRC32 over its local shards in sorted name order must be the
same under every method and run. Before each run the checkpoint is read into the page cache, or with --cold
evicted from it (posix_fadvise DONTNEED).

    bench/bench_dcp_load.py [--world-size 4] [--layers 16] [--fp8] [--cold] [--init] [--repeat 3] [--methods a,b]
                            [--device cpu|cuda] [--out bench/results/dcp-load.json]

A method may name shardcast's read-ahead per rank (shardcast-dcp@ra=0: none; @ra=64M), its reader threads
(shardcast-dcp@rt=1), pread or an mmap of each file (shardcast-dcp@pr=0), its chunk, the size of each staging
slot (shardcast-dcp@cs=16M) and the number of slots (@sl=8; reader threads are at most the slots); a CUDA
target page-locks slots x size (its default 8 x 8 MiB; given one of the two, the other keeps the CPU's 4 or
64 MiB); settings chain: shardcast-dcp@rt=4@sl=4@cs=64M (the CPU's defaults on a GPU).
"""
import argparse
import json
import os
import pathlib
import statistics
import sys
import time
import zlib

from _ranks import ROOT, launch
from _checkpoints import save_random_model, set_page_cache
from bench_peers import Sampler, meta_model, shard

METHODS = ("torch-t1", "torch-t4", "shardcast-dcp", "shardcast-load")
# a method's @settings: shardcast's environment variables
SETTINGS = {"ra": "SHARDCAST_READAHEAD_BYTES", "rt": "SHARDCAST_READ_THREADS", "cs": "SHARDCAST_CHUNK_BYTES",
            "pr": "SHARDCAST_PREAD", "sl": "SHARDCAST_STAGING_SLOTS"}


def worker(method, ckpt, out):
    method, *settings = method.split("@")  # shardcast-dcp@ra=0: with SHARDCAST_READAHEAD_BYTES=0
    for setting in settings:
        name, _, value = setting.partition("=")
        os.environ[SETTINGS[name]] = value
    import torch
    import torch.distributed as dist
    device = os.environ.get("BENCH_DEVICE", "cpu")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    world = dist.get_world_size()
    model = meta_model(ckpt)
    shard(model, world, device)
    model.to_empty(device=device)
    if os.environ.get("BENCH_INIT") == "1":  # torchtitan's order: to_empty, init_weights, then the load
        with torch.no_grad():
            for t in model.state_dict().values():
                (t.to_local() if hasattr(t, "to_local") else t).fill_(0.01)
    import shardcast
    import shardcast.dcp
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    load = shardcast.load  # imported here (the package imports its submodules at first use), not in the timing
    dist.barrier()
    sampler = Sampler()
    sampler.start()
    start = time.monotonic()
    report = None  # shardcast's own report of the call: this rank's row of it, where the engine's time went
    phases = None  # a storage reader's time in each of its steps on this rank (_timed)
    if method == "shardcast-load":
        report = load(model, ckpt)
    else:
        if "fp8" in pathlib.Path(ckpt).name:
            from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader
            base, kw = QuantizedHuggingFaceStorageReader, {"target_dtype": torch.bfloat16}
            ours = shardcast.dcp.QuantizedHuggingFaceStorageReader
        else:
            base, kw = HuggingFaceStorageReader, {}
            ours = shardcast.dcp.HuggingFaceStorageReader
        if method == "shardcast-dcp":
            reader = _timed(ours)(ckpt, **kw)
        elif method == "dcp-floor":
            reader = _timed(_floor_reader(base))(ckpt, **kw)
        elif method.startswith("torch-t"):  # torch-tN: thread_count=N
            reader = _timed(base)(ckpt, thread_count=int(method[len("torch-t"):]), **kw)
        else:
            raise SystemExit(f"unknown method {method}")
        dcp.load(model.state_dict(), storage_reader=reader)
        phases = reader.phases
        if method == "shardcast-dcp":
            report = reader.last_report[0]
    if device == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    seconds = time.monotonic() - start
    if phases is not None:  # the rest of the call: DCP's planning and collectives, and the closing barrier
        phases["dcp"] = seconds - sum(phases.values())
    sampler.stop = True
    sampler.join()
    crc, nbytes = 0, 0
    for name, p in sorted(model.state_dict().items()):
        local = p.to_local() if hasattr(p, "to_local") else p
        data = local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        crc, nbytes = zlib.crc32(data, zlib.crc32(name.encode(), crc)), nbytes + len(data)
    result = {"rank": dist.get_rank(), "seconds": seconds, "crc": crc, "local_bytes": nbytes,
              "peak_rss_anon": sampler.peak["RssAnon"] - sampler.base["RssAnon"],
              "peak_rss_file": sampler.peak["RssFile"] - sampler.base["RssFile"],
              "gpu_peak": torch.cuda.max_memory_allocated() if device == "cuda" else 0,
              "engine": _engine_row(report, dist.get_rank()), "phases": phases}
    pathlib.Path(f"{out}.{dist.get_rank()}").write_text(json.dumps(result))
    dist.destroy_process_group()


def _timed(base):
    """`base` (a storage reader class) timing its own steps on this rank, in `phases` (seconds): read_metadata,
    the plans (set_up_storage_reader, prepare_local_plan, and the coordinator's prepare_global_plan) and
    read_data. What the call takes beyond them (the worker adds it as "dcp") is DCP's own work and waits, the
    reader's construction and model.state_dict(), the closing barrier and, on a GPU, the synchronize; rank 0's
    split adds up to rank 0's time, where the run's time is the slowest rank's."""

    class Timed(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.phases = {"metadata": 0.0, "plan": 0.0, "data": 0.0}

        def _time(self, phase, step, *args, **kwargs):
            t = time.monotonic()
            try:
                return step(*args, **kwargs)
            finally:
                self.phases[phase] += time.monotonic() - t

        def read_metadata(self):  # no keyword arguments, as the readers' own: DCP retries with rank= where it sees some
            return self._time("metadata", super().read_metadata)

        def set_up_storage_reader(self, *args, **kwargs):
            return self._time("plan", super().set_up_storage_reader, *args, **kwargs)

        def prepare_local_plan(self, *args, **kwargs):
            return self._time("plan", super().prepare_local_plan, *args, **kwargs)

        def prepare_global_plan(self, *args, **kwargs):
            return self._time("plan", super().prepare_global_plan, *args, **kwargs)

        def read_data(self, *args, **kwargs):
            return self._time("data", super().read_data, *args, **kwargs)

    return Timed


def _floor_reader(base):
    """`base` (torch's HF reader class) with a read_data that moves no byte: every read item's destination
    resolved and committed as it stands, as a reader does after filling it."""
    import torch

    class Floor(base):
        def read_data(self, plan, planner):
            for req in plan.items:
                planner.commit_tensor(req, planner.resolve_tensor(req))
            done = torch.futures.Future()
            done.set_result(None)
            return done

    return Floor


def _engine_row(report, rank):
    """{seconds, handshake, stream, read threads, pinned bytes} of this rank in shardcast's report, or None."""
    if report is None:
        return None
    row = dict(report["ranks"][rank])
    return {k: row.get(k) for k in ("seconds", "handshake_seconds", "allocate_seconds", "stream_seconds",
                                    "read_threads", "commit_threads", "commit_threads_let_go", "pinned_staging_bytes",
                                    "pin_seconds")}


def _engine_text(e):
    """Rank 0's split inside shardcast: its whole call, the handshake (agreement), the commit of its shards
    (allocate), the stream and its readers."""
    pinned = (f", {e['pinned_staging_bytes'] / 2**20:.0f} MiB pinned in {e.get('pin_seconds') or 0:.3f} s"
              if e.get("pinned_staging_bytes") else "")
    return (f" | engine {e['seconds']:.3f} s: handshake {e['handshake_seconds']:.3f}, allocate "
            f"{e['allocate_seconds']:.3f}, stream {e['stream_seconds']:.3f} ({e['read_threads']} readers, "
            f"{e.get('commit_threads') or 0} committing{_let_go(e)}{pinned})")


def _let_go(e):
    """The threads let go at the stream's end, where the process could not lift them (unprivileged)."""
    return f", {e['commit_threads_let_go']} let go" if e.get("commit_threads_let_go") else ""


def _phases_text(p):
    """Rank 0's split of a dcp.load call by its storage reader's steps (see _timed), or nothing."""
    if not p:
        return ""
    return " | " + ", ".join(f"{k} {p[k]:.3f}" for k in ("metadata", "plan", "data", "dcp"))


def write_checkpoint(path, layers):
    """A dense Llama (hidden 2048, intermediate 5632, vocab 32000, untied)."""
    from transformers import LlamaConfig
    save_random_model(LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                                  num_attention_heads=16, num_key_value_heads=16, vocab_size=32000,
                                  tie_word_embeddings=False), path)


def write_fp8_checkpoint(path, layers):
    """The Llama of write_checkpoint with its linear weights in fp8 e4m3 and a float32 weight_scale_inv per
    128 x 128 block (random weights, scaled per block as DeepSeek-V3's are), in files of ~500 MB with the
    index and config.json."""
    import shutil
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers, num_attention_heads=16,
                      num_key_value_heads=16, vocab_size=32000, tie_word_embeddings=False)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    files, current, size, weight_map = [], {}, 0, {}
    for key, shape in shapes.items():
        if key.endswith("proj.weight"):
            rows, cols = shape
            w = torch.randn(shape, generator=g) * 0.02
            scale = w.view(rows // 128, 128, cols // 128, 128).abs().amax(dim=(1, 3)) / 448.0
            q = (w.view(rows // 128, 128, cols // 128, 128) / scale[:, None, :, None]).view(shape)
            current[key], current[key + "_scale_inv"] = q.to(torch.float8_e4m3fn), scale.float()
            size += q.numel() + scale.numel() * 4
        else:
            current[key] = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
            size += current[key].numel() * 2
        if size > 500e6:
            files.append(current)
            current, size = {}, 0
    files.append(current)
    for i, tensors in enumerate(files, 1):
        name = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        save_file(tensors, str(partial / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    (partial / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = cfg.to_dict()
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (partial / "config.json").write_text(json.dumps(config))
    partial.rename(path)


def _at_least_one(text):
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return n


def _write_json(path, data):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", nargs=3)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--init", action="store_true", help="write every shard before the load (torchtitan's order)")
    ap.add_argument("--repeat", type=_at_least_one, default=3)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker)
    ckpt = ROOT / "out" / f"dcp-llama{'-fp8' if args.fp8 else ''}-{args.layers}L"
    if not ckpt.exists():
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        (write_fp8_checkpoint if args.fp8 else write_checkpoint)(ckpt, args.layers)
    files = sorted(str(p) for p in ckpt.iterdir() if p.suffix == ".safetensors")
    size = sum(os.path.getsize(f) for f in files)
    methods = args.methods.split(",")
    runs, summary = {m: [] for m in methods}, {}
    tmp = ROOT / "out" / "dcp-load-results"
    tmp.mkdir(parents=True, exist_ok=True)
    default = (f"dcp-load{'-fp8' if args.fp8 else ''}-{args.layers}L{'-cuda' if args.device == 'cuda' else ''}"
            f"{'-cold' if args.cold else ''}{'-init' if args.init else ''}.json")
    out = pathlib.Path(args.out or ROOT / "bench" / "results" / default)
    compared = [m for m in methods if m != "dcp-floor"]  # the floor moves no byte: its shards are not a load's
    for round_ in range(args.repeat):
        for m in methods:
            resident = set_page_cache(files, args.cold)
            ranks = launch(pathlib.Path(__file__), [m, ckpt, tmp / m], args.world_size, tmp / m, m, 1800,
                           env={"BENCH_DEVICE": args.device, "BENCH_INIT": "1" if args.init else "0"})
            runs[m].append({"seconds": max(r["seconds"] for r in ranks), "crcs": [r["crc"] for r in ranks],
                            "rank0_anon": ranks[0]["peak_rss_anon"], "rank0_file": ranks[0]["peak_rss_file"],
                            "max_anon": max(r["peak_rss_anon"] for r in ranks),
                            "node_anon_file": sum(r["peak_rss_anon"] + r["peak_rss_file"] for r in ranks),
                            "local_bytes": [r["local_bytes"] for r in ranks], "resident_before": resident,
                            "gpu_peak": max(r["gpu_peak"] for r in ranks), "engine": ranks[0]["engine"],
                            "phases": [r["phases"] for r in ranks]})
            e, ph = runs[m][-1]["engine"], runs[m][-1]["phases"][0]
            print(f"round {round_ + 1} {m:15s} {runs[m][-1]['seconds']:7.3f} s" + _phases_text(ph)
                  + (_engine_text(e) if e else ""), flush=True)
        reference = runs[compared[0]][0]["crcs"] if compared else None
        differ = next((f"{m}: local shards differ from {compared[0]}'s ({r['crcs']} vs {reference})"
                       for m in compared for r in runs[m] if r["crcs"] != reference), None)
        summary = {m: {"median_seconds": statistics.median(r["seconds"] for r in runs[m]),
                       "gb_per_s": size / statistics.median(r["seconds"] for r in runs[m]) / 1e9, "runs": runs[m]}
                   for m in methods}
        # The rounds so far, after every round, as <out>.partial.json until the last (a run cut short by a
        # deadline keeps them, and never replaces a finished result); each write whole or not at all.
        last = round_ + 1 == args.repeat and differ is None
        _write_json(out if last else out.with_suffix(".partial.json"),
                    {"bytes": size, "world_size": args.world_size, "cold": args.cold, "init": args.init,
                     "device": args.device, "repeat": args.repeat, "rounds_done": round_ + 1, "error": differ,
                     "methods": summary})
        if differ:
            raise SystemExit(differ)
    out.with_suffix(".partial.json").unlink(missing_ok=True)
    best_torch = min((summary[m]["median_seconds"] for m in methods if m.startswith("torch")), default=None)
    print(f"\n{size / 1e9:.2f} GB, W={args.world_size}, {args.device}, {'cold' if args.cold else 'warm'}"
          f"{', shards written before the load' if args.init else ''}, median of {args.repeat}; "
          f"shards CRC-identical across methods" + (" (dcp-floor moves no byte: not compared)" if "dcp-floor" in methods
                                                  else ""))
    print(f"{'method':15s} {'median s':>9s} {'GB/s':>6s} {'vs best torch':>13s} {'rank0 anon':>10s} "
          f"{'rank0 file':>10s} {'node peak':>10s}")
    for m in methods:
        med = summary[m]["median_seconds"]
        pick = sorted(runs[m], key=lambda r: r["seconds"])[len(runs[m]) // 2]
        ratio = f"{best_torch / med:.2f}x" if best_torch and m != "dcp-floor" else "-"  # the floor is a bound
        print(f"{m:15s} {med:9.3f} {size / med / 1e9:6.2f} {ratio:>13s} {pick['rank0_anon'] / 1e9:8.2f}GB "
              f"{pick['rank0_file'] / 1e9:8.2f}GB {pick['node_anon_file'] / 1e9:8.2f}GB"
              + (f" gpu peak {pick['gpu_peak'] / 1e9:.2f}GB" if args.device == "cuda" else "")
              + _phases_text((pick.get("phases") or [None])[0])
              + (_engine_text(pick["engine"]) if pick.get("engine") else ""))
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
