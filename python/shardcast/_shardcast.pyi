"""Types of the `_shardcast` extension (python/binding.cc and the parts it binds): shardcast's C++ core.

Private: the package's modules are its only callers. tests/python/test_packaging.py checks that this
stub and the built extension name the same functions and classes.
"""
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed import Store

# ---- exceptions: one class per kind of failure, all under ShardcastError ------------------------------

class ShardcastError(RuntimeError):
    """Base of every shardcast error."""

class InvalidArgument(ShardcastError): ...
class ConfigError(ShardcastError): ...
class CheckpointError(ShardcastError): ...
class IoError(ShardcastError): ...
class ManifestMismatch(ShardcastError): ...
class CommTimeout(ShardcastError): ...
class CommError(ShardcastError): ...
class Unsupported(ShardcastError): ...
class InternalError(ShardcastError): ...

# ---- argument shapes ------------------------------------------------------------------------------------

# (kind, dim, split factor); kind 0 Replicate, 1 Shard, 2 _StridedShard.
_Placement = Tuple[int, int, int]
# (mesh shape, ranks of the group, placements[, explicit boxes: [(offset, size)], one per rank]).
_Layout = Tuple[Any, ...]
# (key, local tensor, global shape, "parameter" | "persistent_buffer", layout index, composed keys or None).
_LoadEntry = Tuple[str, torch.Tensor, List[int], str, int, Optional[List[str]]]
# (kind name, message): a failure this rank already had, agreed so that every rank raises it.
_Problem = Tuple[str, str]
# callable(done_bytes, total_bytes), called on this rank at most every 100 ms and at the end.
_Progress = Callable[[int, int], None]

# ---- functions ------------------------------------------------------------------------------------------

def prefetch_file_range(path: str, offset: int, length: int) -> bool: ...
def fault_point(point: str, rank: int) -> None: ...
def store_resolve(addr: str, port: int) -> List[str]: ...  # addr's numeric addresses, resolved once
def store_refuses(addr: str, port: int, numeric: List[str] = ...) -> bool: ...  # refused: the store is gone
def verdict_text(failed: Sequence[int], messages: Sequence[str], world: int) -> str: ...
def forget_gloo_groups() -> None: ...
def lazy_zero_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor: ...
def launch_environment() -> Tuple[str, int, int, int, int]: ...  # (launcher, rank, world, local rank, local world)
def cpu_quota(root: bytes, proc: bytes) -> Tuple[str, Optional[float]]: ...  # (cgroup, CPUs or None)
def has_buffer_rule(arg0: str, /) -> bool: ...
def init_buffer(config_json: str, source: str, key: str, out: torch.Tensor) -> str: ...
def open_checkpoint_name(dir: str, name: str) -> Optional[int]: ...
def checkpoint_tensors(path: str) -> List[Tuple[str, str, List[int], str]]: ...
def quantization_of(tensors: Sequence[Tuple[str, Any, Sequence[int]]]) -> List[Optional[Dict[str, Any]]]: ...
def safetensors_header(dir: str, name: str) -> Tuple[Dict[str, str], List[Tuple[str, str, List[int], int, int]]]: ...
def safetensors_header_of(fd: int, where: str) -> Tuple[Dict[str, str], List[Tuple[str, str, List[int], int, int]]]: ...
def layout_piece(shape: Sequence[int], layouts: List[_Layout], rank: int) -> Tuple[bool, List[List[Tuple[int, int]]]]: ...
def load_target(options: Dict[str, str]) -> str: ...
def load_timeout_seconds(options: Dict[str, str]) -> float: ...
def load_entries(
    entries: List[_LoadEntry],
    layouts: List[_Layout],
    checkpoint: str,
    options: Dict[str, str],
    tied: Dict[str, str],
    store: Optional[Store],
    rank: int,
    world_size: int,
    progress: Optional[_Progress] = None,
    problem: Optional[_Problem] = None,
    store_host: str = "the process group's store",
) -> Dict[str, Any]: ...
def save_entries(
    entries: List[Tuple[Any, ...]],
    layouts: List[_Layout],
    out_dir: str,
    options: Dict[str, str],
    dtype: Optional[str],
    max_shard_size: str,
    overwrite: bool,
    config_json: str,
    generation_config_json: str,
    store: Optional[Store],
    rank: int,
    world_size: int,
    progress: Optional[_Progress] = None,
    problem: Optional[_Problem] = None,
    store_host: str = "the process group's store",
    file_numbers: Dict[str, int] = ...,
    keep_other_files: bool = False,
    numbered_files: bool = False,
) -> Dict[str, Any]: ...
