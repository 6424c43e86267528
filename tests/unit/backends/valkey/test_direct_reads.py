"""Loads of the Valkey tier land straight in the host buffers (direct_reads.py).

On a real server and on a real 3-primary cluster (loopback), the bytes of each loaded value
are received by the socket into the caller's host buffer itself, not into a client buffer
that is then copied (redis-py's pipeline received them into hiredis' 64 KiB buffer, built a
``bytes`` and copied it again). And the reply reader: RESP2 and RESP3 replies of ``STRLEN`` +
``GETRANGE``, errors kept as the pipeline keeps them, a redirection or a push message left
to redis-py.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch

from helpers.servers import unique_name
from helpers.tier_helpers import random_bytes, read, write

redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install -e '.[dev]')")

from kv_offload.backends.common.deadline import DeadlineSocket  # noqa: E402 (after the skip)
from kv_offload.backends.valkey import ValkeyTier  # noqa: E402
from kv_offload.backends.valkey.direct_reads import (  # noqa: E402
    InPlace,
    ProtocolError,
    ReadItem,
    Unparsed,
    read_sized,
    redirected,
)
from kv_offload.backends.valkey.local_cluster import LocalCluster, cli_binary  # noqa: E402
from kv_offload.backends.valkey.local_server import LocalServer, server_binary  # noqa: E402

FINGERPRINT = "llama|LBHNC|page=4096|tp1|rank0"
VALUE = 1 << 20
needs_server = pytest.mark.skipif(server_binary() is None or cli_binary() is None,
                                  reason="no redis-server + redis-cli on PATH (apt-get "
                                         "install -y redis-server)")


def _address(buffer) -> int:
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


@pytest.fixture()
def received_into(monkeypatch):
    """Every ``recv_into`` of the tier's sockets: (address of the buffer, bytes received)."""
    calls: list[tuple[int, int]] = []
    original = DeadlineSocket.recv_into

    def spy(self, buffer, *args):
        n = original(self, buffer, *args)
        calls.append((_address(buffer), n))
        return n
    monkeypatch.setattr(DeadlineSocket, "recv_into", spy)
    return calls


def _bytes_received_into(calls: list[tuple[int, int]], buffers: list[torch.Tensor]) -> int:
    ranges = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in buffers]
    return sum(n for at, n in calls if any(lo <= at < hi for lo, hi in ranges))


@needs_server
@pytest.mark.parametrize("mode", ["server", "cluster"])
def test_a_loaded_value_is_received_by_the_socket_into_the_host_buffer(mode, received_into):
    with (LocalCluster(primaries=3, maxmemory="128mb") if mode == "cluster"
          else LocalServer(maxmemory="128mb")) as server:
        tier = ValkeyTier.from_options({"url": server.url, "key_prefix": unique_name("d") + ":",
                                        "refresh_interval_s": 0, "connections": 2},
                                       FINGERPRINT)
        keys = [f"direct-{i}".encode() for i in range(6)]  # (spread over every primary)
        data = [random_bytes(VALUE, i) for i in range(len(keys))]
        assert write(tier, keys, data).ok
        out = [torch.zeros(VALUE, dtype=torch.uint8) for _ in keys]
        received_into.clear()
        assert read(tier, keys, out).ok
        assert all(torch.equal(o, d) for o, d in zip(out, data))
        # All but what arrived in the same segment as the reply's header went from the
        # socket straight into the host buffers (the pipeline: none did).
        assert _bytes_received_into(received_into, out) >= 0.9 * VALUE * len(keys)
        tier.close()


@needs_server
def test_a_read_redirected_by_moved_is_served_through_the_cluster_client():
    with LocalCluster(primaries=3, maxmemory="128mb") as cluster:
        tier = ValkeyTier.from_options({"url": cluster.url, "key_prefix": unique_name("m") + ":",
                                        "refresh_interval_s": 0}, FINGERPRINT)
        keys, data = [b"moved-0"], [random_bytes(VALUE, 7)]
        assert write(tier, keys, data).ok
        client = tier._conn.client
        name = tier._name(keys[0])
        right = client.get_node_from_key(name)
        wrong = next(n for n in client.get_primaries() if n.name != right.name)
        slot = client.keyslot(name)
        client.nodes_manager.slots_cache[slot] = [wrong]  # (as if the slot moved away)
        out = [torch.zeros(VALUE, dtype=torch.uint8)]
        assert read(tier, keys, out).ok  # MOVED: redis-py followed it
        assert torch.equal(out[0], data[0])
        assert client.get_node_from_key(name).name == right.name  # its slot table mended
        tier.close()


class _Wire:
    """A redis-py connection stand-in whose server's replies are given bytes."""

    def __init__(self, replies: bytes, *, hang_up: bool = False) -> None:
        self._sock, self._peer = socket.socketpair()
        self._peer.sendall(replies)
        if hang_up:  # (the server closes after these bytes: a read past them ends, not hangs)
            self._peer.close()

    def pack_commands(self, commands):
        return commands

    def send_packed_command(self, packed):
        self.sent = packed


def _item(name: bytes, head: bytes, data_len: int) -> ReadItem:
    buf = bytearray(data_len)
    return ReadItem(name, len(head) + data_len, len(head), memoryview(buf),
                    lambda got: got == head)


def test_the_reply_reader_takes_resp2_and_resp3_replies_and_keeps_errors_per_key():
    exact, foreign = _item(b"a", b"HEAD", 8), _item(b"g", b"HEAD", 8)
    absent, other, refused, blob_error, null = (_item(n, b"HEAD", 8) for n in b"bcdef")
    wire = _Wire(b":12\r\n$12\r\nHEAD01234567\r\n"  # the expected size: in place
                 b":12\r\n$12\r\nBODY01234567\r\n"  # not its header: kept out of the buffer
                 b":0\r\n$0\r\n\r\n"  # absent
                 b":30\r\n$12\r\nHEADxxxxxxxx\r\n"  # longer than expected: its start
                 b"-WRONGTYPE no\r\n-WRONGTYPE no\r\n"
                 b":3\r\n!9\r\nNOPERM no\r\n"  # a RESP3 blob error
                 b":0\r\n_\r\n")  # a RESP3 null
    replies = read_sized(wire, [exact, foreign, absent, other, refused, blob_error, null])
    assert replies[0] == (12, InPlace(b"HEAD")) and bytes(exact.data) == b"01234567"
    assert replies[1] == (12, b"BODY01234567") and bytes(foreign.data) == bytes(8)
    assert replies[2] == (0, b"")
    assert replies[3] == (30, b"HEADxxxxxxxx") and bytes(other.data) == bytes(8)
    assert all(isinstance(r, redis.ResponseError) for r in replies[4])
    assert isinstance(replies[5][1], redis.exceptions.NoPermissionError)
    assert replies[6] == (0, b"")
    assert not redirected(replies)


def test_a_redirection_or_a_push_message_is_left_to_redis_py():
    item = _item(b"a", b"HEAD", 8)
    replies = read_sized(_Wire(b"-MOVED 5 127.0.0.1:7000\r\n-MOVED 5 127.0.0.1:7000\r\n"),
                         [item])
    assert redirected(replies)
    with pytest.raises(Unparsed):
        read_sized(_Wire(b">3\r\n$7\r\nmessage\r\n$1\r\nc\r\n$1\r\nx\r\n"), [item])


@pytest.mark.parametrize("replies", [b":99\r\n$99\r\n", b":x\r\n", b"$2\r\nab\r\n"])
def test_a_reply_these_commands_never_give_drops_the_connection(replies):
    # (larger than the range asked, not a number, another type: a ConnectionError, which
    # the tier treats as the server failing: the connection is closed, the keys are misses)
    with pytest.raises(redis.ConnectionError):
        read_sized(_Wire(replies), [_item(b"a", b"HEAD", 8)])


@pytest.mark.parametrize("replies", [b":3\r\n!-5\r\n", b":-12\r\n$12\r\n",
                                     b":12\r\n$-1\r\n"])
def test_a_negative_length_is_a_protocol_error_never_an_empty_value(replies):
    """A negative error length, STRLEN or GETRANGE length: the server is not trusted. A
    RESP2 null read as an empty value would condemn (delete) the record STRLEN measured."""
    with pytest.raises(ProtocolError, match="negative|null|error reply of"):
        read_sized(_Wire(replies, hang_up=True), [_item(b"a", b"HEAD", 8)])


def test_an_error_reply_announcing_a_huge_length_allocates_nothing_for_it():
    """A 16-byte reply announcing a 256 MiB error: refused before anything is allocated
    (before: the reader allocated what the server announced, then waited for it; four such
    connections could get the worker killed)."""
    import tracemalloc

    wire = _Wire(b":3\r\n!268435456\r\nNOPERM\r\n", hang_up=True)
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match="error reply of 268435456 bytes"):
            read_sized(wire, [_item(b"a", b"HEAD", 8)])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak
