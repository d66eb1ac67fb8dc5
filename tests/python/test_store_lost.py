"""A store call that got no answer in time (_exchange._through_store) on a store whose server died meanwhile:
its port refuses a connection, so the rank calls the store lost, the words a rank whose socket saw the close
uses, not stalled (the frozen server's words, tests/python/test_agree_faults.py: freeze-0-first). A real
TCPStore server, stopped by destroying it, and a call held in the exchange's body past the deadline, as a
rank's call that was already waiting, or came late, when rank 0 died."""
import datetime
import gc
import threading

import pytest
import torch.distributed as dist

from shardcast import _exchange, _shardcast
from shardcast._shardcast import CommError


def test_a_call_that_got_no_answer_from_a_server_now_gone_is_the_store_lost():
    servers = [dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))]
    port = servers[0].port
    client = dist.TCPStore("127.0.0.1", port, 1, False, timeout=datetime.timedelta(seconds=10))
    host = f"rank 0 (the store host at 127.0.0.1:{port})"
    ch = (client, "group", host, {"numeric": _exchange._resolved(client)})  # as channel() makes it
    assert ch[3]["numeric"] == ["127.0.0.1"]
    release = threading.Event()
    gone = []

    def held_call(store):
        store.set("came", b"1")  # the server answers
        servers.clear()  # and is gone (its last reference) while this call still waits
        gc.collect()
        gone.append(_shardcast.store_refuses("127.0.0.1", port))
        # the kept addresses alone are probed: a name no resolver knows still gives the verdict
        gone.append(_shardcast.store_refuses("no-such-host.invalid", port, ["127.0.0.1"]))
        release.wait(30)

    assert not _shardcast.store_refuses("127.0.0.1", port)  # served: a connect is accepted
    try:
        with pytest.raises(CommError) as e:
            _exchange._through_store(ch, held_call, 0.2, "every rank's answer")
        assert gone == [True, True], "the destroyed server's port still listens"
        assert str(e.value) == (f"every rank's answer: the store of {host} is lost: its connection closed or its "
                                "port refuses connections")
        assert e.value.store_stalled is True  # nothing left to agree through: raised at once (_carried._agreed)
        assert "stalled" not in ch[3]
    finally:
        release.set()


def test_a_late_call_probes_the_addresses_its_channel_resolved(monkeypatch):
    """_refuses connects to the channel's resolved addresses (channel() keeps them), not to the name again:
    a name no resolver knows (as once the store's host is gone, for a slow name service) still gives the
    verdict; without them the name decides, and an unknown one is never taken as lost."""
    from shardcast import _group
    servers = [dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))]
    port = servers[0].port
    servers.clear()  # the server is gone: its port refuses
    gc.collect()
    monkeypatch.setattr(_group, "_store_address", lambda store: ("no-such-host.invalid", port))
    assert _exchange._refuses((None, "group", "rank 0", {"numeric": ["127.0.0.1"]}))
    assert not _exchange._refuses((None, "group", "rank 0", {"numeric": []}))
