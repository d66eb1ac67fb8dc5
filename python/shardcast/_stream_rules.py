"""Whether from_pretrained streams beside the build, and what each node's CPUs allow: decided before any
byte moves, the same on every rank.

Three kinds of reason not to stream (each a sentence, said at DEBUG level on the "shardcast" logger):

    the call's     its arguments (`unpredictable`, stream_beside_build=False): a script may pass other ones
                   on some ranks, so they are agreed like the rest, never assumed equal
    the rank's     its target, mesh, FSDP size (`off_layout`), SHARDCAST_STREAM_BESIDE_BUILD (`beside_wanted`),
                   a failure before; after the first exchange, a header it cannot plan
    the node's     fewer than two CPUs a rank (`short_of_cores`: its ranks' affinity masks together, within
                   their cgroups' CPU quotas, `cpu_quota`), where the caller left it to the cores

One store exchange (`agree`), which every rank of from_pretrained makes whatever its reasons, turns them
into one `Verdict`, decided on rank 0 (`decide`, through `_decided.decided`): whether every rank may
stream, and for this rank's node its ranks and whether their CPUs, their affinity masks together, are two
a rank. A node is a kernel (its boot id, shared by the containers on one host and by nothing else; the
hostname where there is none), named by its hostname.
The read-ahead of a cold checkpoint (`_prefetch.py`) goes by the same node verdict. Where every rank may
stream, each plans its part from the header, and a second exchange, the same call, says whether every
plan came out.
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from . import _shardcast

logger = logging.getLogger("shardcast")

# load's keywords the stream passes on as options; any other one (process_group, progress) takes the
# sequential path, whose load handles it.
_OPTIONS = ("verify", "chunk_bytes", "staging_slots", "timeout", "strict", "strict_keys", "readahead_bytes",
            "read_threads")
# fully_shard's keywords that leave the sharded layout as planned
_FSDP_KWARGS = ("reshard_after_forward", "mp_policy")


# DistributedConfig fields that must keep their defaults for transformers' layout to be FSDP2 alone.
_DC_DEFAULTS = {"tp_size": (None, 1), "ep_size": (None, 1), "dp_replicate_size": (None, 1), "pp_size": (None, 1),
                "tp_plan": (None,), "ep_plan": (None,), "fsdp_plan": (None,), "enable_expert_parallel": (False,),
                "enable_sequence_parallel": (False,), "fsdp_cpu_offload": (False,), "fsdp_mixed_precision": (False,)}


def unpredictable(mesh, dc_given: bool, dc, keep_quantized: bool, model_cls, shard,
                  fsdp_kwargs: Optional[Dict[str, Any]], dtype, load_kwargs: Dict[str, Any]) -> Optional[str]:
    """Why the call's arguments leave its layout unpredictable from the header; None when they do not.
    Arguments only, read before anything that may fail on one rank alone; every rank then says its reason
    in the first exchange (`agree`), whatever it is. transformers' distributed_config with FSDP alone
    (fsdp_size, every other size 1 and no plan of the caller's) lays every parameter out as the default
    layout does: Shard(0) over a 1-d mesh of the whole world."""
    if dc_given:
        if dc is None:
            return "distributed_config: not read"
        if other := sorted(k for k, ok in _DC_DEFAULTS.items() if getattr(dc, k, None) not in ok):
            return f"distributed_config: transformers' plans lay it out ({', '.join(other)})"
        return _unpredictable_call(keep_quantized, model_cls, dtype, load_kwargs)
    if mesh is not None and getattr(mesh, "ndim", 1) != 1:
        return f"a {mesh.ndim}-d mesh"
    if (shard,) != ("layers",) and tuple(shard) != ("layers",):
        return "shard="
    if other := sorted(set(fsdp_kwargs or {}) - set(_FSDP_KWARGS)):
        return f"fsdp_kwargs {', '.join(other)}"
    return _unpredictable_call(keep_quantized, model_cls, dtype, load_kwargs)


def _unpredictable_call(keep_quantized: bool, model_cls, dtype, load_kwargs: Dict[str, Any]) -> Optional[str]:
    """What else of the call leaves the checkpoint's entries or the load's options unpredictable."""
    if keep_quantized:
        return "keep_quantized"
    if model_cls is not None:
        return "model_cls"
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        return f"dtype={dtype}"
    if other := sorted(set(load_kwargs) - set(_OPTIONS)):
        return f"load options {', '.join(other)}"
    if load_kwargs.get("strict") or load_kwargs.get("strict_keys"):
        return "strict (the checkpoint's keys the model does not use are streamed, not refused)"
    return None


def off_layout(mesh, target: Optional[str], world: int, dc=None) -> Optional[str]:
    """Why this rank's target, mesh or FSDP size is not a layout the stream predicts (host memory, or this
    rank's GPU for target "cuda"; a 1-d mesh of the whole world in rank order on that device); None when
    it is. The target may come from SHARDCAST_TARGET, so each rank asks it of itself."""
    if target not in (None, "cpu", "cuda"):
        return f"target {target}"
    device_type = "cuda" if target == "cuda" else "cpu"
    if dc is not None and getattr(dc, "fsdp_size", None) != world:
        return f"distributed_config's fsdp_size {getattr(dc, 'fsdp_size', None)} is not the world size {world}"
    if dc is not None and world == 1:
        return "distributed_config over a world of one: transformers leaves its parameters plain tensors"
    if dc is not None and (laid_on := torch._C._get_accelerator().type) != device_type:  # transformers' mesh
        return f"distributed_config lays out on {laid_on}, the target is {device_type}"
    if mesh is not None and (mesh.device_type != device_type or mesh.mesh.flatten().tolist() != list(range(world))):
        return f"a mesh that is not the whole world on {device_type}"
    return None


BESIDE_VAR = "SHARDCAST_STREAM_BESIDE_BUILD"


def beside_wanted(keyword: Optional[bool]) -> Optional[bool]:
    """from_pretrained's stream_beside_build: the keyword, else SHARDCAST_STREAM_BESIDE_BUILD (1 or 0; unset or
    empty: None, decided by the node's CPUs in `agree`). An InvalidArgument naming the variable for any other
    value (it is read before the call knows whether its layout could stream at all)."""
    if keyword is not None:
        return bool(keyword)
    value = os.environ.get(BESIDE_VAR, "").strip()
    if value not in ("", "0", "1"):
        raise _shardcast.InvalidArgument(f"{BESIDE_VAR}={value!r}: 1 (stream beside the build wherever the layout is "
                                         f"predicted), 0 (load after the build) or unset (where the cores allow)")
    return None if not value else value == "1"


def short_of_cores(cpus: int, ranks: int, node: str) -> Optional[str]:
    """Why a node's ranks, left to decide, load after the build rather than beside it; None where they
    stream. The stream (its readers and the threads that commit its pages) keeps about a core busy, the
    build another, so the overlap pays only where a rank has two (measured: bench/RESULTS.md, "Streaming
    beside the build only where a rank has two cores"). `cpus`: the CPUs the node's ranks may run on, their
    affinity masks together (so each rank bound to its own CPUs by srun --cpu-bind counts them once), or
    fewer where their cgroups' CPU quotas together allow fewer (a pod's CPU limit; `cpu_quota`)."""
    if cpus >= 2 * ranks:
        return None
    return (f"{cpus} CPU{'s' if cpus != 1 else ''} for {ranks} rank{'s' if ranks != 1 else ''} on {node}: "
            f"streaming beside the build needs 2 CPUs a rank (stream_beside_build=True or {BESIDE_VAR}=1 streams "
            f"anyway)")


@dataclass(frozen=True)
class Verdict:
    """What one exchange decided, the same on every rank but for the node's part.

    stream: every rank streams beside the build (none gave a reason not to).
    spare_cores: this rank's node has at least two CPUs a rank.
    local_rank, local_world: this rank's place among its node's ranks (in rank order), and their count.
    nodes: how many nodes (hostnames) the ranks are on.
    failed: the first 8 ranks that failed already, in rank order, each (rank, kind, message) as `_problem`
    gives it (a message over FAILED_MESSAGE_CHARS cut, saying so: `_cut`); failed_ranks: every rank that
    failed. Where any did, every rank raises the same error at once (`raise_failed`), none building a model
    that will not be loaded."""
    stream: bool
    spare_cores: bool
    local_rank: int
    local_world: int
    nodes: int
    failed: Tuple[Tuple[int, str, str], ...] = ()
    failed_ranks: Tuple[int, ...] = ()


FAILED_SHOWN = 8
FAILED_MESSAGE_CHARS = 1024


def _cut(message: str) -> str:
    """A failed rank's message as the exchange carries it: whole up to FAILED_MESSAGE_CHARS, else its start and
    how much was left out (the whole message is chained to that rank's own exception)."""
    if len(message) <= FAILED_MESSAGE_CHARS:
        return message
    return (f"{message[:FAILED_MESSAGE_CHARS]} [... cut: {len(message) - FAILED_MESSAGE_CHARS} more characters, "
            f"whole in that rank's own exception]")


def raise_failed(verdict: Verdict, world: int, own: Optional[BaseException]) -> None:
    """Raises the first exchange's failure on this rank, the same on every rank: the class of the lowest
    failing rank's kind, naming every failing rank and the problems of the first shown, in the words of the
    load's verdict (its one formatter, `verdict_text`); chained to this rank's own exception where it is one
    of them."""
    from . import _shardcast
    kind = verdict.failed[0][1]
    cls = getattr(_shardcast, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, _shardcast.ShardcastError)):
        cls = _shardcast.ShardcastError
    # A path decoded with surrogateescape keeps lone surrogates through the exchange's JSON; the binding takes
    # UTF-8 only, so they travel as their escapes (the same text on every rank).
    shown = [m.encode("utf-8", "backslashreplace").decode("utf-8") for _, _, m in verdict.failed]
    words = _shardcast.verdict_text(list(verdict.failed_ranks), shown, world)
    raise cls(f"from_pretrained, before the model was built: {words}") from own


def agree(pg, store, rank: int, world: int, why_not: Optional[str], timeout_s: float,
          by_cores: bool = False, failed: Optional[Tuple[str, str]] = None) -> Verdict:
    """One store exchange: each rank sends its reason not to stream (or None), whether it leaves the choice
    to the cores (`by_cores`), its hostname, its node (`node_id`), the CPUs it may run on and its CPU cgroup
    and quota (`cpu_quota`). A rank that leaves the choice to the cores has one more reason where its
    node's ranks' CPUs together are fewer than two a rank (`short_of_cores`). Rank 0 decides from every
    rank's answer (`decide`) and tells each rank the common verdict and its node's part (`_decided.decided`:
    W answers through the store, not W^2)."""
    from . import _decided, _exchange
    try:
        quota = list(cpu_quota())
    except Exception:  # noqa: BLE001 -- never a reason for this rank to miss the exchange: no bound then
        quota = ["", None]
    node = node_id()
    mine = [why_not, by_cores, socket.gethostname(), node,
            format(sum(1 << c for c in os.sched_getaffinity(0)), "x"), *quota,
            [failed[0], _cut(failed[1])] if failed else None]
    common, own = _decided.decided(_exchange.channel(pg, store), rank, world, mine, decide, timeout_s,
                                   "every rank's answer whether it can stream", part=f"node {node}")
    if common["why"]:
        more = f"; and {common['more']} ranks more" if common["more"] else ""
        logger.debug("from_pretrained loads after the build, not beside it: %s%s", "; ".join(common["why"]), more)
    return Verdict(stream=not common["why"], spare_cores=own["spare"], local_rank=own["ranks"].index(rank),
                   local_world=len(own["ranks"]), nodes=common["nodes"],
                   failed=tuple((r, kind, message) for r, kind, message in common["failed"]),
                   failed_ranks=tuple(common["failed_ranks"]))


def decide(every) -> Dict[str, Any]:
    """What `agree` tells the ranks, from every rank's answer in rank order: {"": {"why": the first 8
    ranks' reasons not to stream ("rank R: ..."), "more": how many more, "nodes": how many nodes, "failed":
    [rank, kind, message] of the first 8 ranks that failed already, "failed_ranks": every one}, and for
    each node ("node " and its `node_id`) {"spare": whether its CPUs are two a rank, "ranks": its ranks in
    rank order}}."""
    masks: Dict[str, int] = {}
    ranks: Dict[str, list] = {}
    quotas: Dict[str, Dict[str, Optional[float]]] = {}  # per node, per CPU cgroup
    names: Dict[str, str] = {}
    failed = [[r, *answer[7]] for r, answer in enumerate(every) if answer[7]]
    for r, (_, _, name, node, mask, cgroup, quota, _) in enumerate(every):
        masks[node] = masks.get(node, 0) | int(mask, 16)
        ranks.setdefault(node, []).append(r)
        quotas.setdefault(node, {})[cgroup] = quota
        names.setdefault(node, name)
    short = {}
    for node, mask in masks.items():
        cpus = bin(mask).count("1")
        if None not in quotas[node].values():  # every rank's cgroup has a quota: together, the node's bound
            cpus = min(cpus, int(sum(quotas[node].values()) + 1e-6))  # 0.7 + 0.2 + 0.1 is 1 CPU
        short[node] = short_of_cores(cpus, len(ranks[node]), names[node])
    reasons = []
    for r, (why, cores, _, node, *_) in enumerate(every):
        why = why if why is not None or not cores else short[node]
        if why is not None:
            reasons.append(f"rank {r}: {why}")
    answers: Dict[str, Any] = {"": {"why": reasons[:8], "more": max(0, len(reasons) - 8), "nodes": len(masks),
                                   "failed": failed[:FAILED_SHOWN], "failed_ranks": [f[0] for f in failed]}}
    for node in masks:
        answers[f"node {node}"] = {"spare": short[node] is None, "ranks": ranks[node]}
    return answers


def cpu_quota(root: str = "/sys/fs/cgroup", proc: str = "/proc/self/cgroup") -> Tuple[str, Optional[float]]:
    """(this process's CPU cgroup, the CPUs its quota allows; None where it has none), by the loader's own
    reader (runtime/cpu_quota.h, which also sizes a rank's reader threads): cgroup v2's cpu.max, else v1's
    cpu.cfs_quota_us over cpu.cfs_period_us, of its cgroup and of each parent up to the mount (the lowest).
    The cgroup is the one whose quota that is (so ranks in sibling cgroups under one limited parent count it
    once), named by its directory's inode (unique in its hierarchy, also across containers that each see
    their own as "/"), else its path; ("", None) where none can be read. A quota is what a Kubernetes pod's
    CPU limit sets, while its affinity mask still shows every CPU of the host. Nested limits below a lower
    one (each rank's own, and their parent's) can still count more than the parent allows."""
    return _shardcast.cpu_quota(os.fsencode(root), os.fsencode(proc))


def node_id() -> str:
    """This rank's node: its kernel's boot id (the same in every container on one host, which share its CPUs
    and page cache, and different on every other host), else its hostname."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or socket.gethostname()
    except OSError:
        return socket.gethostname()
