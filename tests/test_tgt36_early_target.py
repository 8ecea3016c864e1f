"""protocol.early_target_of: the server's address for a client's early
proof from the address its socket was connected to, known ahead (a dialer's
sockaddr), is _early_target's (getpeername's) for the addresses a dialer
connects to on this host (IPv4 and IPv6 loopback, as getaddrinfo gives
them, a unix path, an abstract name); none for another host's. A Hello
stamped with it (with_early_hello's here) is taken at the server's own
address (its getsockname, as serving does), and one stamped for another
address is not (the Proof round, never another server's proof).
"""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest

from aioxfer import auth, metadata, protocol

KEY = auth.hmac_key(b"tgt36-early-target-token")


def _tcp_pairs() -> list[tuple[int, str]]:
    out = [(socket.AF_INET, "127.0.0.1")]
    if socket.has_ipv6:
        try:
            with socket.socket(socket.AF_INET6) as s:
                s.bind(("::1", 0))
            out.append((socket.AF_INET6, "::1"))
        except OSError:
            pass
    return out


def _dialled(family: int, host: str, port: int) -> object:
    # As dialing.dial_now dials: the numeric address's getaddrinfo sockaddr.
    info = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM, 0,
                              socket.AI_NUMERICHOST)
    return info[0][4]


@pytest.mark.parametrize(("family", "host"), _tcp_pairs())
def test_the_dialled_address_is_getpeernames(family: int, host: str) -> None:
    with socket.create_server((host, 0), family=family) as srv:
        addr = _dialled(family, host, srv.getsockname()[1])
        with socket.socket(family, socket.SOCK_STREAM) as c:
            c.connect(addr)  # type: ignore[arg-type]
            s, _ = srv.accept()
            with s:
                here = protocol.early_target_of(addr)
                assert here is not None
                assert here == protocol._early_target(c)
                assert here == protocol.sock_endpoint(s.getsockname())  # (the server's)


def test_a_unix_name_is_getpeernames(tmp_path: Path) -> None:
    for name in (str(tmp_path / "l.sock"), b"\0tgt36-early-target"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
            srv.bind(name)
            srv.listen(1)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                c.connect(name)
                s, _ = srv.accept()
                with s:
                    assert protocol.early_target_of(c.getpeername()) == protocol._early_target(c)
                    assert (protocol.early_target_of(c.getpeername())
                            == protocol.sock_endpoint(s.getsockname()))


@pytest.mark.parametrize("addr", [("10.1.2.3", 5), ("192.168.0.1", 80, 0, 0), ("2001:db8::1", 1),
                                  ("::ffff:10.0.0.1", 9)])
def test_none_for_another_host(addr: object) -> None:
    assert protocol.early_target_of(addr) is None


def _hello() -> metadata.Hello:
    return metadata.Hello(version=metadata.PROTOCOL_VERSION, name="tgt36", incarnation=5,
                          purpose="data", nonce=b"\x09" * protocol.NONCE_BYTES,
                          byteorder=sys.byteorder, meta=True)


def test_a_hello_stamped_for_the_dialled_address_is_taken() -> None:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        addr = _dialled(socket.AF_INET, "127.0.0.1", srv.getsockname()[1])
        with socket.socket() as c:
            c.connect(addr)  # type: ignore[arg-type]
            s, _ = srv.accept()
            with s:
                server_here = protocol.sock_endpoint(s.getsockname())
                h = _hello()
                for here, taken in ((protocol.early_target_of(addr), True),
                                    ("127.0.0.1:1@" + protocol._NET_SCOPE, False)):
                    h = _hello()
                    frame = protocol.with_early_hello(h, protocol.encode_frame(h), c, KEY,
                                                      protocol.early_ahead(KEY, h), here=here)
                    sent = protocol.decode_body(memoryview(frame)[4:])
                    assert isinstance(sent, metadata.Hello) and sent.early_proof
                    early = protocol.EarlyProofs(start_ns=time.time_ns() - 10**9)
                    assert early.take(sent, KEY, server_here) is taken
                # Without here, the socket is asked: the same as the dialled one's.
                h = _hello()
                frame = protocol.with_early_hello(h, protocol.encode_frame(h), c, KEY,
                                                  protocol.early_ahead(KEY, h))
                sent = protocol.decode_body(memoryview(frame)[4:])
                assert isinstance(sent, metadata.Hello)
                assert protocol.EarlyProofs(start_ns=time.time_ns() - 10**9).take(
                    sent, KEY, server_here)
