"""The exchanges before the handshake (_exchange.py) over a real TCPStore: a rank whose value never comes
is named in the CommTimeout every waiting rank raises."""
import datetime

import pytest
import torch.distributed as dist

from shardcast import _exchange
from shardcast._shardcast import CommTimeout


def _channel(name):
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    return store, (store, name, "the test's store", {})


# Ranks 0 and 1 of 4 come (rank 1's value and its word are set as gathered would set them); ranks 2
# and 3 never do, so rank 0's wait names exactly them. A channel's first exchange is number 0.
def test_a_gather_names_the_ranks_whose_values_never_came():
    store, ch = _channel("names-missing")
    store.set(_exchange._key(0, 1), "null")
    store.append(_exchange._key(0, "who"), "1 ")
    with pytest.raises(CommTimeout, match=r"did not arrive from ranks 2, 3 \(died, frozen"):
        _exchange.gathered(ch, 0, 4, {"mine": 1}, 1.0)


# Every rank came: the gather returns every value in rank order (the names are only for the timeout).
def test_a_gather_where_every_rank_came_returns_every_value():
    store, ch = _channel("all-came")
    store.set(_exchange._key(0, 1), '"one"')
    assert _exchange.gathered(ch, 0, 2, "zero", 5.0) == ["zero", "one"]
