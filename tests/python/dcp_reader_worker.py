"""One rank of the shardcast.dcp reader tests: `dcp.load` through torch's HF readers and through shardcast's,
into identical DTensor state dicts, compared bit for bit on every rank.

    python dcp_reader_worker.py MODE ROOT OUT

MODE "compare": every scenario below in one launch (ROOT holds the checkpoints the test wrote):
  boxes      every key of a tiny llama checkpoint (transformers' save_pretrained, several files) as a
             DTensor in a layout that cycles through Shard(0), Shard(1), Replicate on a 1-D mesh and, at
             W=4, HSDP (Replicate, Shard(0)), 2-D (Shard(0), Shard(1)) and (Shard(1), Shard(0)) on (2, 2);
             plus one key loaded into a float32 destination from its bf16 bytes; read by every rank
             (auto), and read once and sent (source rank0 and striped)
  fsdp       the llama model itself, fully_shard'ed on a CPU mesh, dcp.load(model.state_dict())
  quantized  an fp8 e4m3 checkpoint with 128x128 block scales (weights that cut a block; a scale in another
             file than its weight) through both quantized readers, to float32 and bfloat16; an MXFP4
             blocks/scales pair and an NVFP4 triple through shardcast's, against independent references
  metadata   read_metadata of both readers equal (keys, dtypes, sizes, chunks, files)
  alone      rank 0 alone (what transformers' consolidate_distributed_checkpoint and dcp's no_dist=True do
             while the group runs): read_metadata of the llama, dcp.load and dcp.save of its whole tensors;
             then the last rank's read_metadata alone (outside DCP: it reads for itself, within seconds);
             then every rank's read_metadata of another checkpoint must be that one's, and collective loads
             and saves still work (regression, review: rank 0's solo call put it one exchange ahead for good)
  per_rank   the llama's keys saved by torch's HuggingFaceStorageWriter(save_distributed=True) with no
             consolidation (one file per rank, pieces placed by DCP_SHARDING_INFO), read back by both readers
             into another layout of each key (so a rank's box spans pieces of several files); then the same
             directory missing rank 1's file (a hole in its keys), which shardcast's reader must refuse on every rank
MODE "groups" (world 3): loads over another group than the default one, with the reader not told it (as
  torch's readers are never told): dcp.load(no_dist=True) on the last rank alone, and on every rank from a
  path of its own; dcp.load and dcp.save with process_group= the subgroup of ranks 1 and 2, which holds no rank
  0; then a collective load (regression, review: the non-zero ranks waited for rank 0's headers until the
  timeout, 10 minutes by default). Before them, a reader given its own group of one on rank 0 alone, and a
  writer given one on the last rank alone, while DCP runs over every rank: each is one error on every rank
  within seconds (regression: every rank waited out the reader's or the writer's timeout)
MODE "truncated": this rank's own copy of the checkpoint (ROOT/copy-<rank>/llama, read as "llama" from
  ROOT/copy-<rank>: one path on every rank, as a checkpoint copied to each node's disk) is read; the test truncated
  rank 1's. MODE "other_values": each rank reads its own copy by its own path (ROOT/values-<rank>/llama); the
  test changed values in rank 1's, its headers kept. MODE "copies_verify": the same with rank 1's copy changed
  where the handshake's samples do not look (ROOT/unsampled-<rank>/llama), read with verify=True. MODE
  "other_size": source auto, rank 1's copy another checkpoint (its weights in float32: every file and the
  index of other sizes; ROOT/resized-<rank>/llama). MODE "unindexed": rank 1's copy (ROOT/unindexed-<rank>/llama)
  lacks its index and its last file, so that rank alone sees a directory to read file by file; source auto
  must load torch's values (rank 0 serves rank 1), each-rank must be one error on every rank. MODE "kill":
  SHARDCAST_FAULT kills a rank mid-stream. These write the exception each survivor raised.
MODE "block_size": an fp8 checkpoint quantized in 120 x 120 blocks with no config.json (ROOT/blocks120),
  through both quantized readers given block_size=120, compared bit for bit; then each rank giving another
  block_size, which must be one error on every rank. MODE "scenarios": several modes in turn, in these
  processes (ranks.each_scenario).
"""
import logging
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader as TorchReader
from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader as TorchQReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor

import ranks
import shardcast.dcp as sdcp
from dcp_reader_common import _read_all, checkpoint_keys, compare, errors_of, layouts, sentinel_like, state_dict


def boxes(root, world, problems):
    path = os.path.join(root, "llama")
    keys = checkpoint_keys(path)
    widened = sorted(k for k, (_, d) in keys.items() if d == torch.bfloat16)[:1]
    to = (lambda k, d: torch.float32 if k in widened else d)
    theirs, ours = state_dict(keys, world, to), state_dict(keys, world, to)
    dcp.load(theirs, storage_reader=TorchReader(path))
    dcp.load(ours, storage_reader=sdcp.HuggingFaceStorageReader(path))
    n = compare(theirs, ours, "boxes", problems)
    for source in ("rank0", "striped"):  # read once and sent: every replica (HSDP, Replicate) from one reader
        again = state_dict(keys, world, to)
        reader = sdcp.HuggingFaceStorageReader(path, source=source)
        dcp.load(again, storage_reader=reader)
        n += compare(theirs, again, f"boxes via {source}", problems)
        if reader.last_report[0]["source"] != source:
            problems.append(f"boxes via {source}: the load ran as {reader.last_report[0]['source']}")
    for key in widened:
        if ours[key].dtype != torch.float32:
            problems.append(f"boxes: {key} was not widened")
    return n


def fsdp(root, world, problems):
    from transformers import AutoConfig
    from dtensor_ref import sentinel_fsdp_model
    path = os.path.join(root, "llama")
    cfg = AutoConfig.from_pretrained(path)
    mesh = init_device_mesh("cpu", (world,))
    models = [sentinel_fsdp_model(cfg, mesh) for _ in range(2)]
    dcp.load(models[0].state_dict(), storage_reader=TorchReader(path))
    dcp.load(models[1].state_dict(), storage_reader=sdcp.HuggingFaceStorageReader(path))
    return compare(models[0].state_dict(), models[1].state_dict(), "fsdp", problems)


def quantized(root, world, problems):
    """fp8 and the bf16 norm against torch's quantized reader; MXFP4 and NVFP4 against independent references
    (torch's reader leaves most of an MXFP4 tensor unread through DCP, and reads no NVFP4)."""
    from nvfp4_worker import reference as nvfp4_reference
    from safetensors import safe_open
    path = os.path.join(root, "quantized")
    keys = checkpoint_keys(path)
    raw = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), framework="pt") as f:
                raw.update({k: f.get_tensor(k) for k in f.keys()})
    ls = layouts(world)
    n = 0
    for target in (torch.float32, torch.bfloat16):
        want = {k: (shape, target if dtype == torch.float8_e4m3fn else dtype) for k, (shape, dtype) in keys.items()
                if not k.endswith(("_scale_inv", "_scales", "_blocks", "_scale", "_scale_2")) and k != "layers.2.nv.weight"}
        theirs, ours = state_dict(want, world), state_dict(want, world)
        dcp.load(theirs, storage_reader=TorchQReader(path, target_dtype=target))
        dcp.load(ours, storage_reader=sdcp.QuantizedHuggingFaceStorageReader(path, target_dtype=target))
        n += compare(theirs, ours, f"quantized to {target}", problems)
        references = {"experts.down_proj_blocks": mxfp4_reference(raw["experts.down_proj_blocks"],
                                                                  raw["experts.down_proj_scales"]).to(target),
                      "layers.2.nv.weight": nvfp4_reference(raw["layers.2.nv.weight"], raw["layers.2.nv.weight_scale"],
                                                            raw["layers.2.nv.weight_scale_2"], target)}
        for i, (key, full) in enumerate(sorted(references.items())):
            mesh, placements = ls[(i + 1) % len(ls)]
            expected = {key: distribute_tensor(full, mesh, placements)}
            got = {key: sentinel_like(tuple(full.shape), target, mesh, placements)}
            dcp.load(got, storage_reader=sdcp.QuantizedHuggingFaceStorageReader(path, target_dtype=target))
            n += compare(expected, got, f"{key} to {target} on {placements}", problems)
    return n


def mxfp4_reference(blocks, scales):
    """The published MXFP4 rule, independently: low nibble first, each E2M1 value times 2^(scale - 127),
    in the stored [..., out, in] order."""
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    *prefix, groups, block = blocks.shape
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(*prefix, groups, block * 2).long()
    return (e2m1[codes] * torch.pow(2.0, scales.float() - 127).unsqueeze(-1)).reshape(*prefix, groups * block * 2)


def metadata(root, problems):
    for name, make_t, make_s in (("llama", TorchReader, sdcp.HuggingFaceStorageReader),
                                 ("quantized", TorchQReader, sdcp.QuantizedHuggingFaceStorageReader)):
        path = os.path.join(root, name)
        a, b = make_t(path).read_metadata(), make_s(path).read_metadata()
        for fqn in ("experts.down_proj_blocks", "layers.2.nv.weight"):  # dequantized here: size and chunk
            if fqn in b.state_dict_metadata:
                md = b.state_dict_metadata[fqn]
                if len(md.chunks) != 1 or md.chunks[0].sizes != md.size:
                    problems.append(f"metadata of {name}: {fqn}'s chunk is not its dequantized size {md.size}")
                a.state_dict_metadata.pop(fqn)
                b.state_dict_metadata.pop(fqn)
        if a.state_dict_metadata != b.state_dict_metadata:
            problems.append(f"metadata of {name}: state_dict_metadata differs")
        if {k: (v.relative_path, v.shape, v.dtype) for k, v in a.storage_data.items()} != \
                {k: (v.relative_path, v.shape, v.dtype) for k, v in b.storage_data.items()}:
            problems.append(f"metadata of {name}: storage_data differs")
    return 2


def per_rank(root, world, problems):
    import shutil
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    keys = checkpoint_keys(os.path.join(root, "llama"))
    saved = state_dict(keys, world)  # the llama's values in the first layout of each key
    dcp.load(saved, storage_reader=TorchReader(os.path.join(root, "llama")))
    path = os.path.join(root, f"per-rank-{world}")
    dcp.save(saved, storage_writer=HuggingFaceStorageWriter(path, save_distributed=True, enable_consolidation=False))
    # shardcast's writer asked for per-rank files (torchtitan's sharded save) writes torch's, which torch's
    # consolidation then turns into the finished checkpoint, as torchtitan does next
    ours_path = os.path.join(root, f"per-rank-{world}-shardcast-writer")
    dcp.save(saved, storage_writer=sdcp.HuggingFaceStorageWriter(ours_path, save_distributed=True,
                                                                 enable_consolidation=False))
    dist.barrier()
    if dist.get_rank() == 0:
        from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files
        if sorted(os.listdir(ours_path)) != sorted(os.listdir(path)):
            problems.append(f"per-rank files: shardcast's writer wrote {sorted(os.listdir(ours_path))}")
        os.makedirs(ours_path + "-consolidated")
        consolidate_safetensors_files(ours_path, ours_path + "-consolidated", dict.fromkeys(keys, 1))
        whole = checkpoint_keys(ours_path + "-consolidated")
        if sorted(whole) != sorted(keys):
            problems.append(f"per-rank files: torch's consolidation of shardcast's writer's files gave {sorted(whole)}")
    theirs, ours = state_dict(keys, world, shift=1), state_dict(keys, world, shift=1)
    dcp.load(theirs, storage_reader=TorchReader(path))
    dcp.load(ours, storage_reader=sdcp.HuggingFaceStorageReader(path))
    n = compare(theirs, ours, "per-rank files", problems)
    for key in saved:
        if not torch.equal(saved[key].full_tensor(), ours[key].full_tensor()):
            problems.append(f"per-rank files: {key} read back differs from what was saved")
    a, b = TorchReader(path).read_metadata(), sdcp.HuggingFaceStorageReader(path).read_metadata()
    for key, md in a.state_dict_metadata.items():
        mine = b.state_dict_metadata.get(key)
        if mine is None or mine.size != md.size or mine.properties.dtype != md.properties.dtype or \
                sorted(map(str, mine.chunks)) != sorted(map(str, md.chunks)):
            problems.append(f"per-rank files: metadata of {key} differs ({mine} vs {md})")
    broken = path + "-missing"
    if dist.get_rank() == 0:
        shutil.copytree(path, broken)
        os.remove(os.path.join(broken, sorted(n for n in os.listdir(broken) if n.endswith(".safetensors"))[1]))
    dist.barrier()
    try:
        dcp.load(state_dict(keys, world), storage_reader=sdcp.HuggingFaceStorageReader(broken, timeout=20))
        problems.append("per-rank files: a directory missing one rank's file loaded")
    except BaseException as e:  # noqa: BLE001 -- DCP's CheckpointException is a BaseException
        failures = getattr(e, "failures", None) or {}
        text = " ".join(f"{type(x[0]).__name__}: {x[0]}" for x in failures.values()) or str(e)
        # DCP re-raises a read_metadata failure as its own AssertionError carrying the message
        if "do not fill its shape" not in text or "shard-00001" not in text:
            problems.append(f"per-rank files: a missing file raised {type(e).__name__}: {text[:400]}")
    return n


def alone(root, world, problems):
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    llama, other = os.path.join(root, "llama"), os.path.join(root, "quantized")
    keys = checkpoint_keys(llama)
    if dist.get_rank() == 0:
        solo = sdcp.HuggingFaceStorageReader(llama).read_metadata()
        if sorted(solo.state_dict_metadata) != sorted(keys):
            problems.append("alone: rank 0's own read_metadata is not the llama's")
        whole = {k: torch.full(shape, -7, dtype=dtype) for k, (shape, dtype) in keys.items()}
        dcp.load(whole, storage_reader=sdcp.HuggingFaceStorageReader(llama), no_dist=True)
        truth = {k: torch.full(shape, -7, dtype=dtype) for k, (shape, dtype) in keys.items()}
        dcp.load(truth, storage_reader=TorchReader(llama), no_dist=True)
        compare(truth, whole, "alone: no_dist load", problems)
        out = os.path.join(root, f"alone-{world}")
        dcp.save(whole, storage_writer=sdcp.HuggingFaceStorageWriter(out), no_dist=True)
        compare(whole, {k: v for k, v in _read_all(out).items()}, "alone: no_dist save", problems)
        torch_out = os.path.join(root, f"alone-{world}-torch")
        dcp.save(whole, storage_writer=HuggingFaceStorageWriter(torch_out), no_dist=True)
    if dist.get_rank() == world - 1:  # a script inspecting the keys on another rank than 0, as torch's reader allows
        import time
        named = os.path.join(root, f"alone-solo-{world}")  # a path rank 0 never asks about
        if not os.path.islink(named):
            os.symlink(llama, named)
        t0 = time.monotonic()
        try:
            solo = sdcp.HuggingFaceStorageReader(named, timeout=30).read_metadata()
            if sorted(solo.state_dict_metadata) != sorted(keys):
                problems.append(f"alone: rank {world - 1}'s own read_metadata is not the llama's")
        except Exception as e:  # noqa: BLE001
            problems.append(f"alone: rank {world - 1}'s own read_metadata raised {type(e).__name__}: {e}")
        if time.monotonic() - t0 > 10:
            problems.append(f"alone: rank {world - 1}'s own read_metadata took {time.monotonic() - t0:.1f} s "
                            f"(it waited for rank 0, which does not answer it)")
    dist.barrier()
    together = sdcp.HuggingFaceStorageReader(other).read_metadata()
    if sorted(together.state_dict_metadata) != sorted(checkpoint_keys(other)):
        problems.append(f"alone: after rank 0's solo calls, rank {dist.get_rank()} read another checkpoint's "
                        f"metadata: {sorted(together.state_dict_metadata)[:3]}")
    theirs, ours = state_dict(keys, world), state_dict(keys, world)
    dcp.load(theirs, storage_reader=TorchReader(llama))
    dcp.load(ours, storage_reader=sdcp.HuggingFaceStorageReader(llama))
    n = compare(theirs, ours, "alone: a collective load after them", problems)
    dcp.save(ours, storage_writer=sdcp.HuggingFaceStorageWriter(os.path.join(root, f"alone-{world}-after")))
    return n


def groups(root, world, problems):
    """The "groups" mode (see the module's doc): each load against torch's reader, each within seconds."""
    import time
    llama = os.path.join(root, "llama")
    keys = checkpoint_keys(llama)
    rank = dist.get_rank()

    def whole():
        return {k: torch.full(shape, -7, dtype=dtype) for k, (shape, dtype) in keys.items()}
    truth = whole()
    dcp.load(truth, storage_reader=TorchReader(llama), no_dist=True)
    seconds = {}

    def timed(what, fn):
        """Whether fn() ran without an exception (else a problem); its seconds go in `seconds`."""
        t0 = time.monotonic()
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 -- DCP's CheckpointException is a BaseException
            problems.append(f"groups: {what} on rank {rank} raised {type(e).__name__}: {str(e)[-600:]}")
            return False
        finally:
            seconds[what] = time.monotonic() - t0
        return True

    if rank == world - 1:
        solo = whole()
        if timed("no_dist on the last rank", lambda: dcp.load(
                solo, storage_reader=sdcp.HuggingFaceStorageReader(llama, timeout=30), no_dist=True)):
            compare(truth, solo, "groups: no_dist on the last rank", problems)
    dist.barrier()
    own = os.path.join(root, f"groups-own-{rank}")  # the same checkpoint under a path of this rank's own
    if not os.path.islink(own):
        os.symlink(llama, own)
    mine = whole()
    if timed("no_dist from a path of its own", lambda: dcp.load(
            mine, storage_reader=sdcp.HuggingFaceStorageReader(own, timeout=30), no_dist=True)):
        compare(truth, mine, "groups: no_dist from a path of its own", problems)
    dist.barrier()
    sub = dist.new_group([1, 2], backend="gloo")  # every rank creates it; rank 0 is not in it
    if rank in (1, 2):
        in_sub = whole()
        if timed("subgroup load", lambda: dcp.load(
                in_sub, storage_reader=sdcp.HuggingFaceStorageReader(llama, timeout=30), process_group=sub)):
            compare(truth, in_sub, "groups: subgroup load", problems)
        out = os.path.join(root, f"groups-sub-{world}")
        if timed("subgroup save", lambda: dcp.save(
                in_sub, storage_writer=sdcp.HuggingFaceStorageWriter(out, timeout=30), process_group=sub)):
            compare(truth, _read_all(out), "groups: subgroup save", problems)
    dist.barrier()
    theirs, ours = state_dict(keys, world), state_dict(keys, world)
    dcp.load(theirs, storage_reader=TorchReader(llama))
    if timed("collective load after them", lambda: dcp.load(
            ours, storage_reader=sdcp.HuggingFaceStorageReader(llama, timeout=30))):
        compare(theirs, ours, "groups: a collective load after them", problems)
    dist.barrier()
    return seconds


def unindexed(root, rank, world):
    """The "unindexed" mode (see the module's doc): the loads' results on this rank."""
    keys = checkpoint_keys(os.path.join(root, "llama"))
    path = os.path.join(root, f"unindexed-{rank}", "llama")
    problems = []
    theirs, ours = state_dict(keys, world), state_dict(keys, world)
    dcp.load(theirs, storage_reader=TorchReader(os.path.join(root, "llama")))
    start = time.monotonic()
    reader = sdcp.HuggingFaceStorageReader(path, timeout=20)
    dcp.load(ours, storage_reader=reader)
    result = {"checked": compare(theirs, ours, "unindexed copy on rank 1, source auto", problems),
              "problems": problems, "source": reader.last_report[0]["source"]}
    try:
        dcp.load(state_dict(keys, world), storage_reader=sdcp.HuggingFaceStorageReader(path, source="each-rank",
                                                                                       timeout=20))
        result["shardcast"] = []
    except BaseException as e:  # noqa: BLE001 -- DCP's CheckpointException is a BaseException
        result["shardcast"] = errors_of(e, rank)
    result["seconds"] = time.monotonic() - start
    dist.barrier()
    return result


def mismatched(root, world):
    """{"reader"/"writer": [seconds, the errors this rank was told]} of a storage layer given its own group of
    one on a single rank (rank 0's reader, the last rank's writer) while DCP runs over the default group."""
    llama = os.path.join(root, "llama")
    keys = checkpoint_keys(llama)
    rank = dist.get_rank()
    own = [dist.new_group([r], backend="gloo") for r in range(world)]  # every rank makes each, in one order
    out = {}
    for what, who in (("reader", 0), ("writer", world - 1)):
        pg = own[rank] if rank == who else None
        start, errors = time.monotonic(), []
        try:
            if what == "reader":
                dcp.load(state_dict(keys, world),
                         storage_reader=sdcp.HuggingFaceStorageReader(llama, process_group=pg, timeout=20))
            else:
                dcp.save(state_dict(keys, world), storage_writer=sdcp.HuggingFaceStorageWriter(
                    os.path.join(root, f"groups-mismatched-{world}"), process_group=pg, timeout=20))
        except BaseException as e:  # noqa: BLE001 -- DCP's CheckpointException is a BaseException
            errors = errors_of(e, rank)
        out[what] = [time.monotonic() - start, errors]
        dist.barrier()
    return out


def run(mode, root, rank, world):
    """One mode's result on this rank; an unexpected exception is its "crash"."""
    result = {}
    try:
        if mode == "compare":
            problems = []
            result["checked"] = {"boxes": boxes(root, world, problems), "fsdp": fsdp(root, world, problems),
                                 "quantized": quantized(root, world, problems),
                                 "metadata": metadata(root, problems), "per_rank": per_rank(root, world, problems),
                                 "alone": alone(root, world, problems)}
            result["problems"] = problems
            dist.barrier()  # rank 0 hosts the store: it stays until every rank read its last exchange
        elif mode == "groups":
            problems = []
            result["mismatched"] = mismatched(root, world)
            result["seconds"] = groups(root, world, problems)
            result["problems"] = problems
        elif mode == "block_size":
            problems = []
            path = os.path.join(root, "blocks120")
            keys = checkpoint_keys(path)
            weights = {k: (shape, torch.float32) for k, (shape, dtype) in keys.items() if dtype == torch.float8_e4m3fn}
            theirs, ours = state_dict(weights, world), state_dict(weights, world)
            dcp.load(theirs, storage_reader=TorchQReader(path, block_size=120))
            dcp.load(ours, storage_reader=sdcp.QuantizedHuggingFaceStorageReader(path, block_size=120))
            result["checked"] = compare(theirs, ours, "block_size=120", problems)
            result["problems"] = problems
            try:
                dcp.load(state_dict(weights, world),
                         storage_reader=sdcp.QuantizedHuggingFaceStorageReader(path, block_size=120 + 8 * rank))
                result["error"] = None
            except BaseException as e:  # noqa: BLE001 -- DCP's CheckpointException is a BaseException
                result["shardcast"] = errors_of(e, rank)
            dist.barrier()
        elif mode == "unindexed":
            result = unindexed(root, rank, world)
        elif mode in ("truncated", "kill", "other_values", "copies_verify", "other_size"):
            path = os.path.join(root, "llama")
            if mode == "truncated":
                os.chdir(os.path.join(root, f"copy-{rank}"))
                path = "llama"
            if mode == "other_values":  # each rank its own copy, named by a path of its own
                path = os.path.join(root, f"values-{rank}", "llama")
            if mode == "copies_verify":
                path = os.path.join(root, f"unsampled-{rank}", "llama")
            if mode == "other_size":  # source auto: a rank seeing another checkpoint was served rank 0's
                path = os.path.join(root, f"resized-{rank}", "llama")
            start = time.monotonic()
            keys = checkpoint_keys(os.path.join(root, "llama"))
            sd = state_dict(keys, world)
            logged = logging.getLogger("shardcast")  # what the reader logs before DCP's own gather raises
            logged.addHandler(logging.Handler())
            logged.handlers[-1].emit = lambda record: result.setdefault("logged", []).append(record.getMessage())
            try:
                source = None if mode == "other_size" else "each-rank"
                dcp.load(sd, storage_reader=sdcp.HuggingFaceStorageReader(path, source=source, timeout=20,
                                                                           verify=mode == "copies_verify"))
                result["error"] = None
            except BaseException as e:  # noqa: BLE001 -- DCP's CheckpointException is a BaseException
                result["error"] = f"{type(e).__name__}: {e}"
                result["shardcast"] = errors_of(e, rank)
            result["seconds"] = time.monotonic() - start
    except Exception:  # noqa: BLE001
        result["crash"] = traceback.format_exc()
    return result


def main():
    mode, root, out = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks.each_scenario(mode, root, lambda name, where: run(name, where, rank, world), f"{out}.{rank}")
    os._exit(0)  # no teardown: a killed peer must not hang this rank's exit


if __name__ == "__main__":
    main()
