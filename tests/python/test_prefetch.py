"""from_pretrained's read-ahead while the model is built: each local rank's share of the files, and the
kernel really bringing a cold file's pages in (checked with mincore, bench/_pagecache.py)."""
import os
import pathlib
import sys
import time

import pytest

from shardcast import _prefetch
from shardcast._stream_rules import Verdict

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
from _pagecache import resident  # noqa: E402 -- bench/ is not a package


def test_shares_cover_the_budget_once_in_file_order():
    files = [("a", 10), ("b", 0), ("c", 7), ("d", 25)]
    for budget in (0, 5, 17, 42, 1000):
        for world in (1, 3, 4, 8):
            got = []
            for r in range(world):
                got += [(p, o, n) for p, o, n in _prefetch.share(files, r, world, budget)]
            assert all(n > 0 for _, _, n in got)
            covered = [(p, o + i) for p, o, n in got for i in range(n)]
            want = [(p, i) for p, size in files for i in range(size)][:budget]
            assert covered == want, (budget, world)


def _verdict(spare_cores: bool, nodes: int = 1) -> Verdict:
    return Verdict(stream=False, spare_cores=spare_cores, local_rank=0, local_world=4, nodes=nodes)


def test_it_goes_by_the_agreed_node_verdict_on_one_node_only():
    """The read-ahead goes by from_pretrained's first exchange (its node's CPUs, the ranks' masks together:
    the stream beside the build's rule), never on several nodes, and prefetch= overrides the CPUs only."""
    assert _prefetch.wanted(None, _verdict(spare_cores=True))
    assert not _prefetch.wanted(None, _verdict(spare_cores=False))
    assert _prefetch.wanted(True, _verdict(spare_cores=False))
    assert not _prefetch.wanted(False, _verdict(spare_cores=True))
    for prefetch in (None, True, False):
        assert not _prefetch.wanted(prefetch, _verdict(spare_cores=True, nodes=2))


def test_nothing_to_read_starts_nothing(tmp_path):
    assert _prefetch.start(str(tmp_path), 0, 1) is None
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 4096)
    ahead = _prefetch.start(str(tmp_path), 3, 4)
    assert ahead is not None
    ahead.stop()


def _resident(path) -> float:
    """Fraction of the file's pages in the page cache (mincore; the benchmarks' own counter)."""
    res, size = resident([path])
    return res / size


def test_a_cold_file_comes_into_the_page_cache(tmp_path):
    path = tmp_path / "model-00001-of-00001.safetensors"
    with open(path, "wb") as f:
        f.write(os.urandom(16 << 20))
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    if _resident(path) > 0.5:
        pytest.skip(f"{tmp_path}'s filesystem keeps evicted pages (tmpfs?): nothing to measure")
    ahead = _prefetch.start(str(tmp_path), 0, 1)
    assert ahead is not None
    ahead._thread.join(timeout=30)
    deadline = time.monotonic() + 30  # the advice queues reads; they complete in the background
    while _resident(path) < 0.99 and time.monotonic() < deadline:
        time.sleep(0.05)
    ahead.stop()
    assert _resident(path) >= 0.99
    assert ahead.requested == 16 << 20
