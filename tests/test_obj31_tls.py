"""obj31: an https store whose certificate a private CA signed.

``register_objects(..., ca_bundle=path)`` trusts that PEM bundle's CAs beside the system's,
for every request: obstore's (its small PUTs) and ours (GET, HEAD, DELETE,
larger PUTs, multipart uploads). ``ssl_context=`` gives our client a
context as is (pinning, client certificates, or no verification for a
test), and every request is then ours. Before, a private CA was trusted
only through SSL_CERT_FILE set before aiohttp's import (tests/
test_obj29_https.py replaces aiohttp's default context instead).

Against rclone serve s3 --cert/--key, its certificate signed by a CA made
here (not self-signed: the client trusts the CA, not the leaf).
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import pattern, within
from s3server import S3Server, need_rclone

from aioxfer.errors import RegistrationError, TransportError

pytest.importorskip("obstore")
x509 = pytest.importorskip("cryptography.x509")

MakeAgent = Callable[..., Awaitable[Any]]
MiB = 1 << 20


@dataclass
class Pki:
    ca: Path  # the CA's certificate (PEM): what the client is given
    cert: Path  # the server's, signed by the CA
    key: Path


def private_ca(where: Path) -> Pki:
    """A CA (self-signed) and a certificate for 127.0.0.1 it signed."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "aioxfer test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
            encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                       critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pki = Pki(where / "ca.pem", where / "cert.pem", where / "key.pem")
    pki.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pki.cert.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    pki.key.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return private_ca(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_s3(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[S3Server]:
    """rclone serve s3 over https with the private CA's certificate; the
    test process's trust store is left as it is (nothing trusts the CA
    unless a test says so)."""
    root = tmp_path_factory.mktemp("tls_s3")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AIOXFER_TEST_RCLONE_FLAGS", f"--cert {pki.cert} --key {pki.key}")
        srv = S3Server(root / "s3root", need_rclone())
        srv.endpoint = f"https://127.0.0.1:{srv.port}"
        srv.start()
    try:
        yield srv
    finally:
        srv.stop()


async def round_trip(agent: Any, objs: Any, srv: S3Server, bucket: str) -> None:
    """Every kind of request: obstore's PUT (64 KiB), ours (2 MiB), a
    multipart upload (11 MiB: parts of 5 MiB, its HEAD check), GETs (whole,
    ranged, a batch), a stat, a delete."""
    sizes = {"small": 64 << 10, "single": 2 * MiB, "multi": 11 * MiB}
    for i, (k, n) in enumerate(sizes.items()):
        src = agent.alloc(n)
        src.numpy()[:] = pattern(n, 310 + i)
        await within(agent.write(src[:], objs[k]), 60)
        assert srv.file(bucket, f"t/{k}").read_bytes() == bytes(src.numpy()), k
        dst = agent.alloc(n)
        await within(agent.read(dst[:], objs[k]), 60)
        assert bytes(dst.numpy()) == bytes(src.numpy()), k
        part = agent.alloc(4096)
        await within(agent.read(part[:], objs[k][n - 4096:n]), 30)
        assert bytes(part.numpy()) == bytes(src.numpy()[n - 4096:]), k
    st = await within(objs.stat(list(sizes)), 30)
    assert [s.size for s in st] == list(sizes.values())
    await within(objs.delete("small"), 30)
    assert not (await within(objs.stat("small"), 30)).exists


def opts(srv: S3Server) -> dict[str, Any]:
    return {**srv.kwargs(), "part_size": 5 * MiB, "max_retries": 1, "retry_timeout": 2.0}


async def test_ca_bundle(make_agent: MakeAgent, tls_s3: S3Server, pki: Pki) -> None:
    # failed before: TypeError (register got an unexpected keyword 'ca_bundle')
    bucket = tls_s3.bucket("t")
    agent = await make_agent("o")
    objs = agent.register_objects(f"s3://{bucket}/t", **opts(tls_s3), ca_bundle=pki.ca)
    await round_trip(agent, objs, tls_s3, bucket)


async def test_ssl_context(make_agent: MakeAgent, tls_s3: S3Server, pki: Pki) -> None:
    # failed before: TypeError (unexpected keyword 'ssl_context')
    bucket = tls_s3.bucket("t")
    agent = await make_agent("o")
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    objs = agent.register_objects(f"s3://{bucket}/t", **opts(tls_s3), ssl_context=ctx)
    await round_trip(agent, objs, tls_s3, bucket)


async def test_ssl_context_without_verification(make_agent: MakeAgent, tls_s3: S3Server) -> None:
    # the explicit opt-out (for tests): a context that verifies nothing,
    # used by every request (obstore's client, which cannot take it, sends none)
    bucket = tls_s3.bucket("t")
    agent = await make_agent("o")
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    objs = agent.register_objects(f"s3://{bucket}/t", **opts(tls_s3), ssl_context=ctx)
    await round_trip(agent, objs, tls_s3, bucket)


def handshakes_refused(srv: S3Server) -> int:
    """How many TLS handshakes the server saw fail (rustls refuses with an
    unknown-CA alert, Python's ssl closes: rclone logs either)."""
    return srv.log.read_text(errors="replace").count("TLS handshake error")


@pytest.mark.parametrize("size", [64 << 10, 2 * MiB], ids=["obstore-put", "own-put"])
async def test_untrusted_fails_at_once(make_agent: MakeAgent, tls_s3: S3Server,
                                       size: int) -> None:
    # Without the CA: a TransportError naming the certificate, after one
    # attempt (failed before: 5 attempts each, max_retries=4, for a failure
    # that no later attempt changes; obstore's error did not say why)
    bucket = tls_s3.bucket("t")
    agent = await make_agent("o")
    objs = agent.register_objects(f"s3://{bucket}/t", **tls_s3.kwargs(), max_retries=4,
                                  retry_timeout=30.0)
    src = agent.alloc(size)
    before = handshakes_refused(tls_s3)
    with pytest.raises(TransportError, match="certificate is not trusted"):
        await within(agent.write(src[:], objs["k"]), 60)
    with pytest.raises(TransportError, match="certificate is not trusted"):
        await within(agent.read(src[:], objs["k"]), 60)
    with pytest.raises(TransportError, match="certificate is not trusted"):
        await within(objs.stat("k"), 60)
    # (rclone logs a refused handshake as it happens: wait for the lines)
    for _ in range(100):
        if handshakes_refused(tls_s3) - before >= 3:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)
    assert handshakes_refused(tls_s3) - before == 3
    assert not tls_s3.file(bucket, "t/k").exists()


async def test_bad_options(make_agent: MakeAgent, tmp_path: Path, pki: Pki,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var, raising=False)
    agent = await make_agent("o")
    kw: dict[str, Any] = {"endpoint": "https://127.0.0.1:9", "access_key_id": "a",
                          "secret_access_key": "b", "region": "us-east-1"}
    with pytest.raises(RegistrationError, match="ca_bundle"):
        agent.register_objects("s3://b", **kw, ca_bundle=tmp_path / "missing.pem")
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(RegistrationError, match="ca_bundle"):
        agent.register_objects("s3://b", **kw, ca_bundle=tmp_path / "junk.pem")
    with pytest.raises(RegistrationError, match="either"):
        agent.register_objects("s3://b", **kw, ca_bundle=pki.ca,
                               ssl_context=ssl.create_default_context())
    with pytest.raises(RegistrationError, match="ssl_context"):
        agent.register_objects("s3://b", **kw, ssl_context="yes")
    # every request is ours with a context: credentials we can sign with
    with pytest.raises(RegistrationError, match="ssl_context"):
        agent.register_objects("s3://b", endpoint="https://127.0.0.1:9", region="us-east-1",
                               ssl_context=ssl.create_default_context())
