"""The training state's rank files (shardcast.dcp._state): the safetensors layout, written with pwrite and
read with pread, their headers validated as hostile input."""
from __future__ import annotations

import json
import math
import os
import stat
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import _shardcast
from .._shardcast import CheckpointError, IoError
from ._state_codec import _BY_CODE, DEFAULT_BLOCK_BYTES, StoredItem, _rank

# ---------------------------------------------------------------------------------------------------------
# Rank files: the safetensors layout, written streamed and read with pread.

def _header_bytes(entries: List[Tuple[str, str, List[int], int]], meta: Dict[str, str]) -> bytes:
    """The header of a file holding entries [(key, code, shape, length)] back to back, in order."""
    header: Dict[str, Any] = {"__metadata__": meta}
    at = 0
    for key, code, shape, length in entries:
        header[key] = {"dtype": code, "shape": shape, "data_offsets": [at, at + length]}
        at += length
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def _write_all(fd: int, buf, at: int, path: str, what: str) -> None:
    """buf's bytes at file offset `at` (pwrite: threads write their own items side by side)."""
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        try:
            done += os.pwrite(fd, view[done:done + DEFAULT_BLOCK_BYTES], at + done)
        except OSError as e:
            raise IoError(f"rank {_rank()}: cannot write {what} to {path}: {e.strerror or e}") from e


def _write_tensor(fd: int, t: torch.Tensor, at: int, block_bytes: int, path: str, key: str) -> None:
    """t's elements, row-major, at file offset `at`, in pieces of at most block_bytes (a device tensor is
    staged piece by piece)."""
    t = t.detach()
    if t.numel() == 0:
        return
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    for start in range(0, flat.numel(), block_bytes):
        piece = flat[start:start + block_bytes]
        if piece.device.type != "cpu":
            piece = piece.cpu()
        _write_all(fd, piece.numpy(), at + start, path, f"tensor '{key}'")


def _bins(sizes: List[int], n: int) -> List[List[int]]:
    """Indices of `sizes` in n bins of about equal sums, largest first (each bin one writer thread)."""
    bins: List[List[int]] = [[] for _ in range(n)]
    sums = [0] * n
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        j = sums.index(min(sums))
        bins[j].append(i)
        sums[j] += sizes[i]
    return [sorted(b) for b in bins if b]


def open_regular(path: str, cannot: str) -> int:
    """A read-only descriptor of `path`, which must be a regular file: a FIFO would block the open (and
    every rank with it) until some writer came, a device such as /dev/zero reads without end, and a
    directory opens but fails every read. Opened without blocking, then checked through the descriptor.
    `cannot`: the error's words before the reason (a CheckpointError)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise CheckpointError(f"{cannot}: {e.strerror or e}") from e
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
                    "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
                    else "not a file")
            raise CheckpointError(f"{cannot}: {kind}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _RankFile:
    """One rank file opened for reading: its header validated, its bytes read with pread (not mapped: a
    file that shrinks after its header was validated is then a CheckpointError naming it, where a mapping
    would kill the process with SIGBUS). The header is hostile: capped here, then parsed and checked by
    the loader's reader (_parse)."""

    def __init__(self, path: str, max_header_bytes: int, save_id: Optional[str] = None) -> None:
        self.path, self.rank = path, _rank()
        self.fd = open_regular(path, f"rank {self.rank}: cannot open rank file {path}")
        fd = self.fd
        try:
            size = os.fstat(fd).st_size
            head = self.read_bytes(0, 8, "the header's length") if size >= 8 else b""
            if len(head) < 8:
                raise CheckpointError(f"rank {self.rank}: {path} is {size} bytes, shorter than a safetensors header")
            n = int.from_bytes(head, "little")
            if n > max_header_bytes or 8 + n > size:
                raise CheckpointError(f"rank {self.rank}: {path}: header of {n} bytes exceeds the cap of "
                                      f"{max_header_bytes} or the file's {size} bytes (truncated?)")
            self.entries = self._parse(fd, save_id)
            self.data_start, self.size = 8 + n, size
        except BaseException:
            self.close()
            raise

    def _parse(self, fd: int, save_id: Optional[str]) -> Dict[str, Tuple[torch.dtype, List[int], int, int]]:
        """{key: (dtype, shape, begin, end)}, by the loader's fuzzed reader (the one every checkpoint goes
        through): every dtype known, every byte range exactly numel * itemsize, the ranges tiling the
        data area with no gap, overlap or tail. A file that names the save it belongs to must name
        `save_id` (the metadata's), where that is known: a rank file of another save (another step's,
        copied or left beside this one) holds other values under the same keys and offsets."""
        where = f"rank {self.rank}: {self.path}"
        try:
            meta, tensors = _shardcast.safetensors_header_of(fd, self.path)
        except _shardcast.ShardcastError as e:
            raise CheckpointError(f"rank {self.rank}: {e}") from None
        written_by = meta.get("save_id")
        if save_id and written_by and written_by != save_id:
            raise CheckpointError(f"{where}: written by save {written_by}, the metadata is save {save_id}'s: a "
                                  f"rank file of another save (another step's?) in this checkpoint's place")
        entries = {}
        for key, code, shape, begin, end in tensors:
            if code not in _BY_CODE:
                raise CheckpointError(f"{where}: tensor '{key}': dtype {code} is not one a training state holds")
            entries[key] = (_BY_CODE[code], list(shape), begin, end)
        return entries

    def locate(self, key: str, item: StoredItem, dtype: Optional[torch.dtype], shape: Optional[List[int]]) -> int:
        """The file offset of `key`'s bytes, after checking they are where and what the metadata says."""
        e = self.entries.get(key)
        where = f"rank {self.rank}: {self.path}: tensor '{key}'"
        if e is None:
            raise CheckpointError(f"{where}: not in the file's header")
        e_dtype, e_shape, begin, end = e
        if self.data_start + begin != item.offset or end - begin != item.length:
            raise CheckpointError(f"{where}: at file bytes [{self.data_start + begin}, {self.data_start + end}), "
                                  f"the metadata says [{item.offset}, {item.offset + item.length})")
        if dtype is not None and (e_dtype != dtype or e_shape != shape):
            raise CheckpointError(f"{where}: the file holds {list(e_shape)} of {e_dtype}, the metadata says "
                                  f"{shape} of {dtype}")
        return item.offset

    def read_into(self, offset: int, out: torch.Tensor, what: str) -> None:
        """File bytes [offset, offset + out's bytes) into `out` (contiguous, on CPU)."""
        if out.numel() == 0:
            return
        self._read(offset, memoryview(out.reshape(-1).view(torch.uint8).numpy()), what)

    def read_bytes(self, offset: int, length: int, what: str) -> bytes:
        buf = bytearray(length)
        self._read(offset, memoryview(buf), what)
        return bytes(buf)

    def _read(self, offset: int, into: memoryview, what: str) -> None:
        done = 0
        while done < len(into):
            try:
                n = os.preadv(self.fd, [into[done:]], offset + done)
            except OSError as e:
                raise IoError(f"rank {self.rank}: {self.path}: {what}: cannot read: {e.strerror or e}") from e
            if n == 0:
                raise CheckpointError(f"rank {self.rank}: {self.path}: {what}: the file ends at byte {offset + done}, "
                                      f"{len(into) - done} bytes short (it shrank after it was opened)")
            done += n

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _copy_box(f: _RankFile, base: int, dtype: torch.dtype, chunk: List[int], offsets: List[int],
              lengths: List[int], dest: torch.Tensor, block_bytes: int, what: str) -> None:
    """The box (offsets, lengths) of the stored chunk at file offset `base` into dest, row block by row
    block along dim 0: a block of whole rows is read straight into a CPU dest; otherwise it is staged
    (one buffer of at most block_bytes) and its window copied:

        stored chunk (rows of the file)      dest (the planner's tensor)
        +------------------+                 +---------+
        |     .-------.    |  block 0  --->  |         |
        |     | box   |    |  block 1  --->  |         |
        |     '-------'    |                 +---------+
        +------------------+
    """
    if math.prod(lengths) == 0:
        return
    if not chunk:  # a scalar
        stage = torch.empty([], dtype=dtype)
        f.read_into(base, stage, what)
        dest.copy_(stage)
        return
    row_bytes = math.prod(chunk[1:]) * dtype.itemsize
    rows = min(lengths[0], max(1, block_bytes // row_bytes))
    # read straight into dest only where its bytes are the file's: another dtype is converted by copy_
    whole_rows = list(lengths[1:]) == list(chunk[1:]) and dest.device.type == "cpu" and dest.dtype == dtype
    stage = None
    for r in range(0, lengths[0], rows):
        b = min(rows, lengths[0] - r)
        at = base + (offsets[0] + r) * row_bytes
        out = dest.narrow(0, r, b)
        if whole_rows and out.is_contiguous():
            f.read_into(at, out, what)
            continue
        if stage is None:
            stage = torch.empty(rows * row_bytes, dtype=torch.uint8)
        src = stage[:b * row_bytes].view(dtype).view([b] + list(chunk[1:]))
        f.read_into(at, src, what)
        for d in range(1, len(chunk)):
            src = src.narrow(d, offsets[d], lengths[d])
        out.copy_(src)
