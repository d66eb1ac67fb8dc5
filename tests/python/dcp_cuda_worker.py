"""One rank of the GPU checks of shardcast.dcp (test_cuda.py): `dcp.load` and `dcp.save` of DTensors on a
device mesh through shardcast's readers and writers, against torch's, bit for bit.

    python dcp_cuda_worker.py DEVICE ROOT OUT     (DEVICE: cuda; cpu runs the same checks without a GPU)

ROOT holds llama/ (transformers' save_pretrained, several files) and quantized/ (test_dcp_reader's fp8
checkpoint: 128 x 128 block scales, weights that cut a block, a scale in another file). Over NCCL on cuda
(Gloo on cpu), every rank's tensors on DEVICE:
  fsdp       the llama fully_shard'ed; dcp.load through torch's HuggingFaceStorageReader and through shardcast's
  quantized  every fp8 weight and the norm as a Shard(0) DTensor of bfloat16 and float32, through torch's
             QuantizedHuggingFaceStorageReader and through shardcast's
  save       dcp.save of that loaded model through shardcast's HuggingFaceStorageWriter: every tensor in the
             files equal to the model's full tensor
  state      the model with AdamW after one step on DEVICE, saved by shardcast's StorageWriter, read back by
             its StorageReader into a fresh model and optimizer on DEVICE: every value equal
Writes OUT.<rank>: {"checked": {scenario: values compared}, "problems": [...], "devices": [...]}.
"""
import json
import os
import sys
import traceback
import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader as TorchReader
from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader as TorchQReader
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import shardcast.dcp as sdcp
from shardcast.dcp._state import StorageReader, StorageWriter


def crc(t: torch.Tensor) -> int:
    t = t.detach().cpu().contiguous().reshape(-1)
    return zlib.crc32(t.view(torch.uint8).numpy().tobytes()) if t.numel() else 0


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def compare(a, b, what, problems, devices):
    for key in a:
        la, lb = local(a[key]), local(b[key])
        devices.add(lb.device.type)
        if la.dtype != lb.dtype or la.shape != lb.shape or crc(la) != crc(lb):
            problems.append(f"{what}: {key} differs ({la.dtype} {tuple(la.shape)} vs {lb.dtype} {tuple(lb.shape)})")
    return len(a)


def sentinel_model(config, mesh, device):
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    with torch.no_grad():
        for t in model.state_dict().values():
            local(t).fill_(-7)
    return model


def fsdp(root, mesh, device, problems, devices):
    from transformers import AutoConfig
    path = os.path.join(root, "llama")
    cfg = AutoConfig.from_pretrained(path)
    theirs, ours = sentinel_model(cfg, mesh, device), sentinel_model(cfg, mesh, device)
    dcp.load(theirs.state_dict(), storage_reader=TorchReader(path))
    reader = sdcp.HuggingFaceStorageReader(path)
    dcp.load(ours.state_dict(), storage_reader=reader)
    staging = {k: reader.last_report[0][k] for k in ("chunk_bytes", "staging_slots")}
    want = {"chunk_bytes": 8 << 20, "staging_slots": 8} if device == "cuda" else {"chunk_bytes": 64 << 20,
                                                                                   "staging_slots": 4}
    if staging != want:  # a GPU target's staging defaults (load_options.h), a host's elsewhere
        problems.append(f"fsdp on {device}: staging {staging}, expected {want}")
    return compare(theirs.state_dict(), ours.state_dict(), "fsdp", problems, devices), ours


def quantized(root, mesh, device, problems, devices):
    from safetensors import safe_open
    path = os.path.join(root, "quantized")
    keys = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), framework="pt") as f:
                for k in f.keys():
                    if k.endswith("q_proj.weight") or k.endswith("o_proj.weight") or k.endswith("norm.weight"):
                        keys[k] = tuple(f.get_slice(k).get_shape())
    n = 0
    for target in (torch.bfloat16, torch.float32):
        def fresh():
            return {k: distribute_tensor(torch.full(s, -7.0, dtype=target, device=device), mesh, [Shard(0)])
                    for k, s in sorted(keys.items())}
        theirs, ours = fresh(), fresh()
        dcp.load(theirs, storage_reader=TorchQReader(path, target_dtype=target))
        dcp.load(ours, storage_reader=sdcp.QuantizedHuggingFaceStorageReader(path, target_dtype=target))
        n += compare(theirs, ours, f"quantized to {target}", problems, devices)
    return n


def save(root, model, problems):
    from safetensors import safe_open
    out = os.path.join(root, f"saved-{dist.get_world_size()}")
    sd = model.state_dict()
    dcp.save(sd, storage_writer=sdcp.HuggingFaceStorageWriter(out))
    dist.barrier()
    files = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(out, name), framework="pt") as f:
                files.update({k: f.get_tensor(k) for k in f.keys()})
    n = 0
    for key, value in sd.items():
        whole = value.full_tensor() if isinstance(value, DTensor) else value
        got = files.get(key)
        if got is None or got.dtype != whole.dtype or crc(got) != crc(whole):
            problems.append(f"save: {key} in the files differs from the model's")
        n += 1
    return n


def state(root, config_path, mesh, device, problems, devices):
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(config_path)

    def trained(seed):
        torch.manual_seed(seed)
        model = sentinel_model(cfg, mesh, device)
        with torch.no_grad():
            for t in model.parameters():
                local(t).normal_(0, 0.02)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, cfg.vocab_size, (2, 8), device=device)
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        return model, optim

    def flat(model, optim):
        msd, osd = get_state_dict(model, optim)
        out = {f"model.{k}": v for k, v in msd.items()}
        for pk, ps in osd["state"].items():
            out.update({f"optim.{pk}.{name}": v for name, v in ps.items()})
        return out

    model, optim = trained(1)
    msd, osd = get_state_dict(model, optim)
    path = os.path.join(root, f"state-{dist.get_world_size()}")
    dcp.save({"model": msd, "optim": osd}, storage_writer=StorageWriter(path))
    again, again_optim = trained(2)
    msd2, osd2 = get_state_dict(again, again_optim)
    loaded = {"model": msd2, "optim": osd2}
    dcp.load(loaded, storage_reader=StorageReader(path))
    set_state_dict(again, again_optim, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    return compare(flat(model, optim), flat(again, again_optim), "state", problems, set())  # AdamW's step: CPU


def main():
    device, root, out = sys.argv[1], sys.argv[2], sys.argv[3]
    rank = int(os.environ["RANK"])
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    problems, devices, checked = [], set(), {}
    result = {"checked": checked, "problems": problems}
    try:
        checked["fsdp"], model = fsdp(root, mesh, device, problems, devices)
        checked["quantized"] = quantized(root, mesh, device, problems, devices)
        checked["save"] = save(root, model, problems)
        checked["state"] = state(root, os.path.join(root, "llama"), mesh, device, problems, devices)
    except Exception:  # noqa: BLE001 -- reported to the test, which fails naming it
        result["crash"] = traceback.format_exc()
    result["devices"] = sorted(devices)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    os._exit(0)  # no teardown: a failed peer must not hang this rank's exit


if __name__ == "__main__":
    main()
