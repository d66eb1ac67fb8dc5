"""One rank of test_pretrained_stream: `python pretrained_stream_worker.py MODE ROOT OUT` with torchrun's
variables, ROOT holding one checkpoint per model (save_pretrained).

MODE phases:   shardcast.from_pretrained of every model; its report's per-rank phases, as the typed report
               and as its dict.
MODE stream:   every model twice: from_pretrained as it is (the stream beside the build) and with the load's
               group given (process_group=WORLD: a layout it does not predict, so loaded after the build);
               every local shard and buffer compared bit for bit, and where each local shard lives.
               (stream:kept: a model class that keeps a parameter in float32, loaded after the build.)
MODE stream_dc: the same through distributed_config=DistributedConfig(fsdp_size=W), transformers' own FSDP
               layout, which the stream predicts as well; its second call is loaded after the build by
               asking (stream_beside_build=False).
MODE stream_cuda: stream on a GPU machine (cuda:LOCAL_RANK current, "cpu:gloo,cuda:nccl"): from_pretrained's
               default target is then cuda, and the stream lands in GPU buffers.
MODE decide:   from_pretrained left to decide whether it streams beside the build (run with
               SHARDCAST_STREAM_BESIDE_BUILD empty, or set on some ranks), on TEST_CPUS CPUs (this
               thread's affinity, when set), or with stream_beside_build=TEST_BESIDE_KEYWORD (0 or 1) where
               set; whether it did, why not (DEBUG), or what each rank raised.
               (decide_dc: the same through distributed_config=DistributedConfig(fsdp_size=W).)
MODE mismatch: ROOT is one checkpoint whose config.json no longer matches its tensors; what each rank raised.
MODE fail_one: from_pretrained whose build fails on rank 1 alone (its buffer_init raises there, while the
               stream runs); what each rank raised.
MODE fail_start: from_pretrained whose stream cannot start its thread on rank 1 alone (as where a process is
               out of threads); what each rank raised.
MODE scenarios: several modes in turn, in these processes (ranks.each_scenario).
"""
import datetime
import logging
import os
import sys

import torch
import torch.distributed as dist

import ranks
import shardcast

DTYPE = torch.bfloat16


def phases(root):
    out = {}
    for name in sorted(os.listdir(root)):
        model = shardcast.from_pretrained(os.path.join(root, name), dtype=DTYPE, timeout=120)
        report = model.shardcast_report
        out[name] = {"typed": [{"rank": r.rank, "phases": dict(r.phases), "total": r.pretrained_seconds,
                                "cpu": r.pretrained_cpu_seconds, "load_seconds": r.seconds} for r in report.ranks],
                     "dict": report.to_dict()["ranks"], "beside": report.stream_beside_build}
    return out


def bits(t):
    t = t.detach().contiguous()
    return t.view(torch.uint8) if t.numel() else t


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def in_padded_buffer(model):
    """Parameters whose local shard is not the first rows of FSDP2's padded sharded buffer (a copy)."""
    from shardcast._materialize import _fsdp_params
    fsdp = _fsdp_params(model)
    copied = []
    for name, p in model.named_parameters():
        padded = getattr(fsdp.get(id(p)), "_sharded_param_data", None)
        if padded is None or local(p).untyped_storage().data_ptr() != padded.untyped_storage().data_ptr():
            copied.append(name)
    return copied


def stream(root, dc=False):
    log, records = logging.getLogger("shardcast"), Records()
    log.addHandler(records)
    log.setLevel(logging.DEBUG)
    out = {}
    layout = {}
    if dc:  # transformers' own FSDP layout: fsdp_size over the whole world, nothing else
        from transformers.distributed import DistributedConfig
        layout = {"distributed_config": DistributedConfig(fsdp_size=dist.get_world_size())}
    try:
        for name in sorted(os.listdir(root)):
            path = os.path.join(root, name)
            ours = shardcast.from_pretrained(path, dtype=DTYPE, timeout=120, **layout)
            after = {"stream_beside_build": False} if dc else {"process_group": dist.group.WORLD}
            seq = shardcast.from_pretrained(path, dtype=DTYPE, timeout=120, **after, **layout)
            a = dict(ours.named_parameters())
            b = dict(seq.named_parameters())
            differ = sorted(set(a) ^ set(b)) + [n for n in sorted(set(a) & set(b))
                                                 if a[n].dtype != b[n].dtype or a[n].shape != b[n].shape
                                                 or not torch.equal(bits(local(a[n])), bits(local(b[n])))]
            ab, bb = dict(ours.named_buffers()), dict(seq.named_buffers())
            differ += [f"buffer {n}" for n in sorted(bb) if n not in ab or not torch.equal(bits(ab[n]), bits(bb[n]))]
            out[name] = {"beside": [ours.shardcast_report.stream_beside_build, seq.shardcast_report.stream_beside_build],
                         "differ": differ, "params": len(a), "nonempty": sum(1 for p in a.values() if local(p).numel()),
                         "copied": in_padded_buffer(ours), "bytes": ours.shardcast_report.total_bytes,
                         "devices": sorted({local(p).device.type for m in (ours, seq) for p in m.parameters()}),
                         "kept": sorted(n for n, p in a.items() if p.dtype != DTYPE),
                         "tied": [m.config.tie_word_embeddings and m.lm_head.weight is m.model.embed_tokens.weight
                                  for m in (ours, seq)]}
    finally:
        log.removeHandler(records)
    out["debug"] = [line for line in records.lines if "not beside it" in line]
    return out


def decide(path, dc=False):
    log, records = logging.getLogger("shardcast"), Records()
    log.addHandler(records)
    log.setLevel(logging.DEBUG)
    every = os.sched_getaffinity(0)
    cpus = int(os.environ.get("TEST_CPUS") or 0)
    out = {}
    try:
        if cpus:
            os.sched_setaffinity(0, sorted(every)[:cpus])

        def call():
            layout = {}
            if dc:
                from transformers.distributed import DistributedConfig
                layout = {"distributed_config": DistributedConfig(fsdp_size=dist.get_world_size())}
            keyword = os.environ.get("TEST_BESIDE_KEYWORD")  # "0"/"1": stream_beside_build=False/True
            if keyword:
                layout["stream_beside_build"] = keyword == "1"
            model = shardcast.from_pretrained(path, dtype=DTYPE, timeout=60, **layout)
            out["beside"] = model.shardcast_report.stream_beside_build
        out.update(raised(call))
    finally:
        os.sched_setaffinity(0, every)
        log.removeHandler(records)
    out["debug"] = [line for line in records.lines if "not beside it" in line]
    return out


def raised(call):
    return ranks.shardcast_error(call, key="error")


def mismatch(path):
    return raised(lambda: shardcast.from_pretrained(path, dtype=DTYPE, timeout=60))


def fail_one(path):
    def init(name, meta):
        if dist.get_rank() == 1:
            raise RuntimeError("rank 1 cannot compute it")
        return torch.ones(meta.shape, dtype=meta.dtype)
    return raised(lambda: shardcast.from_pretrained(path, dtype=DTYPE, timeout=60, buffer_init={"*inv_freq": init}))


def fail_start(path):
    import threading
    start = threading.Thread.start

    def refused(thread):
        if thread.name == "shardcast-stream" and dist.get_rank() == 1:
            raise RuntimeError("can't start new thread")
        return start(thread)
    threading.Thread.start = refused
    try:
        return raised(lambda: shardcast.from_pretrained(path, dtype=DTYPE, timeout=60))
    finally:
        threading.Thread.start = start


def main():
    mode, root, out_path = sys.argv[1:4]
    backend = "gloo"
    if mode == "stream_cuda":  # a GPU machine: from_pretrained's default target there is cuda:LOCAL_RANK
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    modes = {"phases": phases, "stream": stream, "mismatch": mismatch, "fail_one": fail_one, "fail_start": fail_start,
             "decide": decide,
             "decide_dc": lambda path: decide(path, dc=True),
             "stream_dc": lambda root: stream(root, dc=True), "stream_cuda": stream}
    ranks.each_scenario(mode, root, lambda name, where: modes[name](where), f"{out_path}.{dist.get_rank()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
