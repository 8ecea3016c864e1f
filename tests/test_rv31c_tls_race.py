"""rv31c: obj31's idle-close resend over https (asyncio's and uvloop's SSL
transports: the probe must see the TCP socket under the TLS layer).

rclone serve s3 over https (a private CA's certificate, trusted with
``ca_bundle``) behind obj31's TCP relay that closes a connection idle for
IDLE seconds (a FIN; TLS passes through it as bytes). The race is made as
tests/test_obj31_idle_race.py makes it: the loop held past the relay's
idle close right after the request's check of its pooled connection.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import pattern, within
from s3server import S3Server, need_rclone
from test_obj31_idle_race import IDLE, IdleRelay, hold_after_check
from test_obj31_tls import Pki, private_ca

pytest.importorskip("obstore")

MakeAgent = Callable[..., Awaitable[Any]]
MiB = 1 << 20


@pytest.fixture(scope="module")
def pki31(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return private_ca(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def https_s3(tmp_path_factory: pytest.TempPathFactory, pki31: Pki) -> Iterator[S3Server]:
    root = tmp_path_factory.mktemp("tls_s3")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AIOXFER_TEST_RCLONE_FLAGS", f"--cert {pki31.cert} --key {pki31.key}")
        srv = S3Server(root / "s3root", need_rclone())
        srv.endpoint = f"https://127.0.0.1:{srv.port}"
        srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def tls_relay(https_s3: S3Server) -> Iterator[IdleRelay]:
    r = IdleRelay(https_s3, IDLE)
    try:
        yield r
    finally:
        r.close()


async def test_https_put_racing_an_idle_close(make_agent: MakeAgent, https_s3: S3Server,
                                              tls_relay: IdleRelay, pki31: Pki,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = https_s3.bucket("t")
    agent = await make_agent("o")
    kw = {**tls_relay.kwargs(), "endpoint": f"https://127.0.0.1:{tls_relay.port}"}
    objs = agent.register_objects(f"s3://{bucket}/t", **kw, max_retries=0,
                                  part_size=16 * MiB, ca_bundle=Path(pki31.ca))
    n = 2 * MiB
    src = agent.alloc(n)
    src.numpy()[:] = pattern(n, 51)
    await within(agent.write(src[:], objs["k0"]), 30)
    armed = hold_after_check(monkeypatch)
    src.numpy()[:] = pattern(n, 52)
    armed[0] = True
    await within(agent.write(src[:], objs["k1"]), 30)
    assert not armed[0], "the hold was not reached"
    assert tls_relay.idle_closes >= 1
    assert tls_relay.connections == 2  # the first attempt's, and the resend's
    assert https_s3.file(bucket, "t/k1").read_bytes() == bytes(src.numpy())
