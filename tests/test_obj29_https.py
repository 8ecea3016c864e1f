"""obj29: a single PUT over https to a store reading its body slowly.

A body's write ends once all but ``min_rate * read_timeout / 2`` of its
bytes have left the client for the server (objects._Body), so that
aiohttp's per-read ``read_timeout``, started as the write ends, does not
run while megabytes are still queued. Over https the queue has more
layers than a plain socket's: the TLS transport's own buffer (plaintext,
and records not yet handed down), the TCP transport's buffer beneath it
(records the kernel had no room for) and the kernel's send queue. Only
the first and the last were counted: the records in the TCP transport's
buffer were not, and a store reading at ``min_rate`` or a little better
timed out.

Against rclone serve s3 over TLS (a self-signed certificate made here, that
the client is made to trust), through test_obj26's Relay, which reads from
the client at a set rate (it relays the TLS records as they are).
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import pattern, within
from s3server import S3Server, need_rclone
from test_obj26_puts import Relay

pytest.importorskip("obstore")
aiohttp_connector = pytest.importorskip("aiohttp.connector")
x509 = pytest.importorskip("cryptography.x509")

MakeAgent = Callable[..., Awaitable[Any]]
MiB = 1 << 20


def self_signed(where: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (and its key), signed by itself."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "aioxfer test store")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = where / "cert.pem", where / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture
def tls_s3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    """rclone serve s3 over https, its certificate trusted by aiohttp's
    default context (for this test only: the context is replaced, not
    changed)."""
    cert, key = self_signed(tmp_path)
    monkeypatch.setenv("AIOXFER_TEST_RCLONE_FLAGS", f"--cert {cert} --key {key}")
    monkeypatch.setattr(aiohttp_connector, "_SSL_CONTEXT_VERIFIED",
                        ssl.create_default_context(cafile=str(cert)))
    srv = S3Server(tmp_path / "s3root", need_rclone())
    srv.endpoint = f"https://127.0.0.1:{srv.port}"
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def small_send_buffer(monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    """The client's sockets get a send buffer of ``nbytes`` (Linux doubles
    it), as the kernel's autotuning keeps it on a slow path (about the
    congestion window's bytes): on loopback it grows to 4 MiB at once,
    and would hold the whole body."""

    def make(addr: Any) -> socket.socket:
        family, type_, proto, _, _ = addr
        sock = socket.socket(family=family, type=type_, proto=proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, nbytes)
        return sock

    class Connector(aiohttp.TCPConnector):
        def __init__(self, **kw: Any) -> None:
            super().__init__(socket_factory=make, **kw)

    monkeypatch.setattr(aiohttp, "TCPConnector", Connector)


class TlsRelay(Relay):
    def kwargs(self) -> dict[str, str]:
        return {**self.target.kwargs(), "endpoint": f"https://127.0.0.1:{self.port}"}


async def test_https_put_read_at_min_rate(make_agent: MakeAgent, tls_s3: S3Server,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # failed before: TransportError "... the PUT's outcome is unknown
    # (Timeout on reading data from socket)": the body read at 1.25x
    # min_rate; when its write ended, the TLS records in the TCP
    # transport's buffer (uncounted) and the counted slack were more than
    # the 2 s answer wait lets through at that rate.
    small_send_buffer(monkeypatch, 128 << 10)
    relay = TlsRelay(tls_s3, rate=640 << 10)
    await relay.start()
    try:
        bucket = tls_s3.bucket("t")
        agent = await make_agent("o")
        objs = agent.register_objects(f"s3://{bucket}/t", **relay.kwargs(), part_size=8 * MiB,
                                      read_timeout=2.0, min_rate=512 << 10, max_retries=0)
        n = 5 * MiB
        src = agent.alloc(n)
        src.numpy()[:] = pattern(n, 29)
        t0 = time.monotonic()
        await within(agent.write(src[:], objs["k"]), 60)
        print(f"took {time.monotonic() - t0:.1f} s")
        assert tls_s3.file(bucket, "t/k").read_bytes() == bytes(src.numpy())
    finally:
        await relay.aclose()
