"""The training-state scenario of dcp_torchtitan_worker.py (MODE state): torchtitan's own CheckpointManager
and shardcast's (shardcast.integrations.torchtitan) over torchtitan's model, OptimizersContainer and
LRSchedulersContainer; the worker's models, layouts and shims are dcp_torchtitan_worker's."""
import os

import torch
import torch.distributed as dist

from dcp_torchtitan_worker import _built, _crc, _titan_setup


STATE_MODEL = "qwen3_moe"


class _Loader:
    """A dataloader's state as torchtitan's ParallelAwareDataloader keeps it: this rank's own position,
    pickled, under "dp_rank_<r>", and the data-parallel world size."""

    def __init__(self, rank, world, position):
        self.rank, self.world, self.position = rank, world, position

    def state_dict(self):
        import pickle
        return {f"dp_rank_{self.rank}": pickle.dumps({"position": self.position}), "world_size": self.world}

    def load_state_dict(self, state):
        import pickle
        assert state["world_size"] == self.world, state
        self.position = pickle.loads(state[f"dp_rank_{self.rank}"])["position"]


def _training(world, layout, rank, steps):
    """torchtitan's own model, OptimizersContainer (AdamW) and LRSchedulersContainer (warm-up) in `layout`,
    after `steps` optimizer steps on gradients made from the weights (no forward: the same on every run)."""
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig
    torch.manual_seed(0)
    model, config, adapter_cls, _ = _built(STATE_MODEL, layout, world, nan=steps == 0)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1})],
        implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=3).build(optimizers=optimizers, training_steps=10)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = p.detach() * 0.5 + 0.25
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
    return model, config, adapter_cls, optimizers, schedulers, _Loader(rank, world, 100 * steps + rank)


class _Custom:
    """A state of the user's own (CheckpointManager's `states`) holding a value that is not plain data."""

    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def _manager(cls, root, folder, trained, states=None, **config):
    model, model_config, adapter_cls, optimizers, schedulers, loader = trained
    # hf_assets_path: the adapter reads the HF checkpoint's file for each key (fqn_to_index_mapping) from it
    adapter = adapter_cls(model_config, os.path.join(root, STATE_MODEL))
    return cls.Config(enable=True, folder=folder, interval=1, keep_latest_k=0, **config).build(
        dataloader=loader, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states=states or {}, sd_adapter=adapter, base_folder=root)


def _state_crcs(model, optimizers, schedulers, loader):
    """({key: CRC of this rank's local piece}, {key: CRC of the whole value}) of every tensor a resume
    restores (DTensors gathered: a collective, in the same order on every rank), and the other values'
    reprs in both."""
    local, whole = {}, {}
    tensors = {**{f"model.{k}": v for k, v in model.state_dict().items()},
               **{f"optim.{k}": v for k, v in optimizers.state_dict().items()}}
    for key, v in tensors.items():
        if not isinstance(v, torch.Tensor):
            local[key] = whole[key] = repr(v)
            continue
        local[key] = _crc(v.to_local() if hasattr(v, "to_local") else v)
        whole[key] = _crc(v.full_tensor() if hasattr(v, "full_tensor") else v)
    local["lr_scheduler"] = whole["lr_scheduler"] = repr(schedulers.state_dict())
    local["dataloader"] = whole["dataloader"] = repr(loader.position)
    return local, whole


def training_state(root, rank, world):
    """torchtitan's CheckpointManager, its own and shardcast's (shardcast.integrations.torchtitan), over
    torchtitan's model, optimizers and schedulers at FSDP 4 after two steps: each saves the training state
    at step 2 (shardcast's also through async_save at step 3), then a fresh TP 2 x FSDP 2 job resumes from
    each folder's latest step (shardcast's manager from torchtitan's folder too); a fresh FSDP 4 job's
    initial_load_in_hf through shardcast's manager; then each writes the last step in HF format
    (last_save_in_hf)."""
    from torchtitan.components.checkpointer.dcp import CheckpointManager as TitanManager
    from shardcast.integrations.torchtitan import CheckpointManager as ShardcastManager
    _titan_setup()
    managers = {"torch": TitanManager, "shardcast": ShardcastManager}
    trained = _training(world, "fsdp", rank, steps=2)
    out = {"saved": _state_crcs(trained[0], *trained[3:])[1], "local": {}, "whole": {}, "steps": {}, "files": {},
           "hf": {}}
    for name, cls in managers.items():
        _manager(cls, root, f"state-{name}", trained).save(curr_step=2)
    step3 = _manager(ShardcastManager, root, "state-shardcast-async", trained, async_mode="async")
    step3.save(curr_step=3)
    step3.maybe_wait_for_saving()
    step3.close()
    # shardcast-on-torch: shardcast's manager resuming a step torchtitan's own wrote (torch's format)
    for name, folder in (("torch", "state-torch"), ("shardcast", "state-shardcast"),
                         ("shardcast-async", "state-shardcast-async"), ("shardcast-on-torch", "state-torch")):
        fresh = _training(world, "tp2fsdp2", rank, steps=0)
        manager = _manager(managers[name.split("-")[0]], root, folder, fresh)
        out["steps"][name] = manager._find_load_step()
        assert manager.load(), folder
        out["local"][name], out["whole"][name] = _state_crcs(fresh[0], *fresh[3:])
        out["files"][name] = sorted(os.listdir(os.path.join(root, folder, f"step-{out['steps'][name]}")))
    # a state of the user's with a value that is not plain data: kept as torch.save bytes where the manager's
    # config allows pickles
    from fractions import Fraction
    custom = _Custom(Fraction(1, 3))  # one value for every rank: DCP keeps one copy of a key's bytes
    _manager(ShardcastManager, root, "state-pickled", trained, states={"custom": custom}, allow_pickle=True).save(
        curr_step=2)
    custom.value = None
    fresh = _training(world, "fsdp", rank, steps=0)
    assert _manager(ShardcastManager, root, "state-pickled", fresh, states={"custom": custom}, allow_pickle=True).load()
    out["pickled"] = {"value": repr(custom.value), "model": _state_crcs(fresh[0], *fresh[3:])[1] == out["saved"]}
    out["odd_folders"] = _odd_folders(root, rank, world, trained, managers)
    # initial_load_in_hf through shardcast's manager: a fresh FSDP 4 job with an empty folder loads the HF
    # checkpoint (the adapter's torch reader swapped for shardcast's)
    from safetensors.torch import load_file
    fresh = _training(world, "fsdp", rank, steps=0)
    assert _manager(ShardcastManager, root, "initial-hf", fresh, initial_load_path=os.path.join(root, STATE_MODEL),
                    initial_load_in_hf=True).load()
    expected = load_file(os.path.join(root, f"{STATE_MODEL}.expected.safetensors"))
    whole = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in fresh[0].state_dict().items()}
    out["initial_hf"] = {"checked": sorted(set(whole) & set(expected)),
                         "wrong": sorted(k for k in set(whole) & set(expected)
                                         if not torch.equal(whole[k].view(torch.uint8), expected[k].view(torch.uint8)))}
    for name, cls in managers.items():
        folder = f"hf-{name}"
        _manager(cls, root, folder, trained, last_save_in_hf=True, export_dtype="bfloat16").save(
            curr_step=4, last_step=True)
        dist.barrier()
        step = os.path.join(root, folder, "step-4")
        if rank == 0:
            from safetensors import safe_open
            tensors = {}
            for f in sorted(os.listdir(step)):
                if f.endswith(".safetensors"):
                    with safe_open(os.path.join(step, f), "pt") as st:
                        tensors.update({k: [f, _crc(st.get_tensor(k))] for k in st.keys()})
            out["hf"][name] = {"tensors": tensors, "listing": sorted(os.listdir(step))}
    return out


def _failure(call):
    """The text of what call() raised ("" where it returned)."""
    try:
        call()
    except BaseException as e:  # noqa: BLE001 -- DCP's CheckpointException is a BaseException
        return f"{type(e).__name__}: {e}"
    return ""


def _odd_folders(root, rank, world, trained, managers):
    """Folders a user's run can leave (found by an outside trial of shardcast's manager): a remote URL as the
    folder (it was written to a local directory named "file:"), a step holding both managers' saves (the
    stale shardcast one resumed), and load_step naming an unfinished step (torch's words about a .metadata
    the user never had)."""
    import warnings
    shardcast_cls = managers["shardcast"]
    out = {}
    remote = os.path.join(root, "state-remote")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _manager(shardcast_cls, root, "file://" + remote, trained).save(curr_step=2)
    dist.barrier()
    out["remote_files"] = sorted(os.listdir(os.path.join(remote, "step-2"))) if os.path.isdir(remote) else []
    out["remote_warned"] = any("remote URL" in str(w.message) for w in caught)
    out["remote_local_dir"] = os.path.exists(os.path.join(os.getcwd(), "file:"))
    fresh = _training(world, "fsdp", rank, steps=0)
    out["remote_resumed"] = _manager(shardcast_cls, root, "file://" + remote, fresh).load()
    out["remote_equal"] = _state_crcs(fresh[0], *fresh[3:])[1] == _state_crcs(trained[0], *trained[3:])[1]
    # torchtitan's own manager saves step 2 over shardcast's step 2
    _manager(shardcast_cls, root, "state-mixed", trained).save(curr_step=2)
    _manager(managers["torch"], root, "state-mixed", trained).save(curr_step=2)
    dist.barrier()
    fresh = _training(world, "fsdp", rank, steps=0)
    out["mixed"] = _failure(lambda: _manager(shardcast_cls, root, "state-mixed", fresh).load())
    # a save killed before its metadata: step 2 without .metadata.json, asked for by load_step
    _manager(shardcast_cls, root, "state-partial", trained).save(curr_step=2)
    dist.barrier()
    if rank == 0:
        os.remove(os.path.join(root, "state-partial", "step-2", ".metadata.json"))
    dist.barrier()
    out["partial"] = _failure(lambda: _manager(shardcast_cls, root, "state-partial", fresh).load(step=2))
    dist.barrier()
    return out
