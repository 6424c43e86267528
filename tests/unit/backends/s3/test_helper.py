"""The S3 tier's helper process (remote_client.py, helper.py) against moto's S3 server on
loopback: botocore runs there, not in the engine's process; a helper that dies or stalls
costs misses, never wrong bytes or a hang, and a new one serves after it; it never outlives
its parent. (The whole tier contract runs through the helper too: test_tier_suite.py.)"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from helpers.servers import make_bucket
from helpers.tier_helpers import random_bytes, read, write

pytest.importorskip("boto3", reason="boto3 is not installed (pip install -e '.[dev]')")
import botocore.endpoint  # noqa: E402
from botocore.exceptions import ClientError  # noqa: E402

from kv_offload.backends.s3 import S3Tier, S3TierConfig, remote_client  # noqa: E402
from kv_offload.backends.s3.remote_client import HelperClient, HelperStartError  # noqa: E402

FINGERPRINT = "llama|LBHNC|page=65536|tp1|rank0"


def make_tier(server, **options) -> S3Tier:
    opts = {"bucket": make_bucket(server.endpoint_url), "endpoint_url": server.endpoint_url,
            "bytes_to_use": 1 << 30, "refresh_interval_s": 0, **options}
    return S3Tier.from_options(opts, FINGERPRINT)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # (a zombie is not alive)
        return f.read().split(") ")[1][0] != "Z"


def wait_until(condition, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.mark.parametrize("helper_process", [True, False])
def test_with_the_helper_no_botocore_request_runs_in_the_engines_process(
        s3_server, monkeypatch, helper_process):
    """Counted on botocore's `Endpoint.make_request` in this process: none with the helper,
    one per request without it (which shows the count sees the tier's requests)."""
    made = []
    original = botocore.endpoint.Endpoint.make_request
    monkeypatch.setattr(botocore.endpoint.Endpoint, "make_request",
                        lambda self, *a, **k: made.append(1) or original(self, *a, **k))
    tier = make_tier(s3_server, helper_process=helper_process)
    keys = [f"k{i}".encode() for i in range(10)]
    values = [random_bytes(5000, i) for i in range(10)]
    before = len(made)  # (the start-up listing)
    assert write(tier, keys, values).ok
    outs = [random_bytes(5000, 99) for _ in keys]
    assert read(tier, keys, outs).ok
    assert all(bool((o == v).all()) for o, v in zip(outs, values))
    assert len(made) - before == (0 if helper_process else 20)
    tier.close()


def test_a_store_error_comes_back_as_the_same_client_error(s3_server):
    bucket = make_bucket(s3_server.endpoint_url)
    client = HelperClient(S3TierConfig(bucket=bucket, bytes_to_use=1, layout_fingerprint="f",
                                       endpoint_url=s3_server.endpoint_url))
    try:
        with pytest.raises(ClientError) as caught:
            client.get_object(Bucket=bucket, Key="absent", Range="bytes=0-9")
        assert caught.value.response["Error"]["Code"] in ("NoSuchKey", "404")
        client.put_object(Bucket=bucket, Key="there", Body=b"0123456789abcdef")
        reply = client.get_object(Bucket=bucket, Key="there", Range="bytes=0-9")
        with reply["Body"] as body:
            assert body.read() == b"0123456789"
        assert reply["ContentRange"] == "bytes 0-9/16"
    finally:
        client.close()


def test_a_killed_helper_costs_misses_and_a_new_one_serves_after_it(s3_server):
    tier = make_tier(s3_server, retry_interval_s=0.2)
    values = [random_bytes(5000, i) for i in range(3)]
    assert write(tier, [b"a", b"b", b"c"], values).ok
    first = tier._s3.pid
    os.kill(first, signal.SIGKILL)
    assert wait_until(lambda: not alive(first), 5.0)
    out = random_bytes(5000, 50)
    assert read(tier, [b"a"], [out]).succeeded == (False,)  # a miss, at once
    assert bool((out == random_bytes(5000, 50)).all())  # untouched
    assert tier.stats()["outages"] == 1
    time.sleep(max(0.3, remote_client.RESTART_INTERVAL_S))
    assert wait_until(lambda: read(tier, [b"b"], [out]).ok, 5.0)
    assert bool((out == values[1]).all()) and tier._s3.pid not in (None, first)
    tier.close()


def test_a_stalled_helper_is_a_timeout_and_its_late_reply_answers_nothing(s3_server):
    """SIGSTOP the helper mid-request: the call ends after its deadline plus the grace; once
    the helper runs again its late reply must not be taken as the next call's."""
    bucket = make_bucket(s3_server.endpoint_url)
    client = HelperClient(S3TierConfig(bucket=bucket, bytes_to_use=1, layout_fingerprint="f",
                                       endpoint_url=s3_server.endpoint_url,
                                       request_timeout_s=0.5))
    try:
        client.put_object(Bucket=bucket, Key="one", Body=b"first object")
        client.put_object(Bucket=bucket, Key="two", Body=b"the second")
        os.kill(client.pid, signal.SIGSTOP)
        start = time.monotonic()
        try:
            with pytest.raises(TimeoutError):
                client.get_object(Bucket=bucket, Key="one")
            assert time.monotonic() - start < 0.5 + remote_client.GRACE_S + 3.0  # (bounded)
        finally:
            os.kill(client.pid, signal.SIGCONT)
        time.sleep(0.3)  # (the late reply to "one" is sent now, to a closed channel)
        with client.get_object(Bucket=bucket, Key="two")["Body"] as body:
            assert body.read() == b"the second"
    finally:
        client.close()


def outcome_within(call, seconds: float):
    """Run ``call`` on a thread: what it returned or raised, or "still waiting" after
    ``seconds`` (so a wait without a bound fails the test instead of hanging it)."""
    result = []

    def run():
        try:
            result.append(call())
        except BaseException as e:  # noqa: BLE001 - the outcome under test
            result.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return result[0] if result else "still waiting"


@pytest.mark.parametrize("what", ["a new channel's handshake", "a body past the socket buffer"])
def test_every_socket_wait_on_a_stopped_helper_is_bounded(s3_server, what):
    """A stopped helper accepts and reads nothing: opening a channel (its connect and key
    handshake) and sending a body larger than the socket's buffer must still end, as a
    timeout, within the call's bound; once it runs again the client serves as before."""
    bucket = make_bucket(s3_server.endpoint_url)
    client = HelperClient(S3TierConfig(bucket=bucket, bytes_to_use=1, layout_fingerprint="f",
                                       endpoint_url=s3_server.endpoint_url,
                                       request_timeout_s=0.5))
    big = os.urandom(16 << 20)  # (far past a Unix socket's buffer)
    try:
        if what == "a body past the socket buffer":
            client.put_object(Bucket=bucket, Key="warm", Body=b"a channel kept for reuse")
            call = lambda: client.put_object(Bucket=bucket, Key="big", Body=big)  # noqa: E731
        else:  # (no channel kept: the call must open one)
            call = lambda: client.get_object(Bucket=bucket, Key="warm")  # noqa: E731
        os.kill(client.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            outcome = outcome_within(call, 0.5 + remote_client.GRACE_S + 5.0)
            took = time.monotonic() - start
        finally:
            os.kill(client.pid, signal.SIGCONT)
        assert isinstance(outcome, TimeoutError), outcome
        assert took < 0.5 + remote_client.GRACE_S + 3.0
        client.put_object(Bucket=bucket, Key="after", Body=b"served again")
        with client.get_object(Bucket=bucket, Key="after")["Body"] as body:
            assert body.read() == b"served again"
    finally:
        client.close()


def test_the_helper_ends_with_the_tier_and_with_a_killed_parent(s3_server, tmp_path):
    tier = make_tier(s3_server)
    pid = tier._s3.pid
    tier.close()
    assert wait_until(lambda: not alive(pid), 5.0)
    script = textwrap.dedent(f"""
        import sys, time
        from kv_offload.backends.s3 import S3TierConfig
        from kv_offload.backends.s3.remote_client import HelperClient
        client = HelperClient(S3TierConfig(bucket="b", bytes_to_use=1, layout_fingerprint="f",
                                           endpoint_url={s3_server.endpoint_url!r}))
        print(client.pid, flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              text=True, cwd=tmp_path)
    try:
        helper = int(parent.stdout.readline())
        assert alive(helper)
    finally:
        parent.kill()
        parent.wait()
    assert wait_until(lambda: not alive(helper), 5.0)


def test_a_helper_that_cannot_start_is_a_clear_error(s3_server, monkeypatch, tmp_path):
    monkeypatch.setattr(remote_client, "HELPER", tmp_path / "missing.py")
    with pytest.raises(HelperStartError, match="exited with code 2 before it was ready.*"
                                               "helper_process: false"):
        make_tier(s3_server)


def test_a_reply_the_helper_cannot_pickle_is_answered_as_its_error_not_silence():
    """The helper's loop over a real pipe, with a client whose reply holds a lambda: the
    caller gets the helper's traceback at once instead of waiting out its deadline."""
    import contextlib
    from multiprocessing import Pipe

    from kv_offload.backends.s3 import helper

    class Client:
        def put_object(self, **kwargs):
            return {"ETag": lambda: "cannot pickle this"}

    ours, theirs = Pipe()
    thread = threading.Thread(target=helper.serve, daemon=True, args=(
        theirs, Client(), lambda s: contextlib.nullcontext(), (ClientError, OSError)))
    thread.start()
    ours.send_bytes(pickle.dumps(("put_object", {"Key": "k"}, 1.0, True)))
    ours.send_bytes(b"body")
    assert ours.poll(5.0)
    outcome, value, has_body = pickle.loads(ours.recv_bytes())
    assert (outcome, has_body) == ("bug", False) and "pickle" in value.lower()
    with pytest.raises(RuntimeError, match="raised running put_object"):
        remote_client._result("put_object", outcome, value, None)
    ours.close()
    thread.join(5.0)
    assert not thread.is_alive()  # (the channel closed: the loop ended)


def test_helper_nice_lowers_the_helpers_priority_and_bad_values_are_refused(s3_server):
    """The helper (and so every thread it starts) runs at the engine's nice value plus
    `helper_nice`; 0 leaves it at the engine's; a value outside 0..19 is a ConfigError
    naming the option."""
    from kv_offload.errors import ConfigError

    ours = os.getpriority(os.PRIO_PROCESS, 0)
    for nice in (0, 7):
        tier = make_tier(s3_server, helper_nice=nice)
        try:
            assert write(tier, [b"n"], [random_bytes(100, 1)]).ok  # (its threads are up)
            pid = tier._s3.pid
            tids = os.listdir(f"/proc/{pid}/task")
            assert len(tids) > 1
            assert {os.getpriority(os.PRIO_PROCESS, int(t)) for t in tids} == {
                min(19, ours + nice)}
        finally:
            tier.close()
    for bad in (-1, 20, True, "5"):
        with pytest.raises(ConfigError, match="storage_options.helper_nice must be an int "
                                              "from 0 to 19"):
            make_tier(s3_server, helper_nice=bad)
