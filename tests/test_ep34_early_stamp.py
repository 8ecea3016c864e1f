"""The client's early proof begun ahead (ep34): a Hello made ahead keeps
the HMAC of its early proof begun over the context and every field but the
time and the server's address (protocol.early_mac_head); finished at send
time (copy, update, digest) it is byte for byte the one-shot the server
verifies (protocol.early_proof), for every kind of Hello that carries one,
and there is none for the kinds that may not. Its frame, filled in at send
time (protocol.EarlyAhead.stamp), is byte for byte encode_frame's."""

from __future__ import annotations

import sys
import time
from typing import Any

import msgspec
import pytest

from aioxfer import auth, metadata, protocol

KEY = auth.hmac_key(b"ep34-early-stamp-token")


def _hello(**kw: Any) -> metadata.Hello:
    kw.setdefault("purpose", "data")
    kw.setdefault("name", "ep34")
    kw.setdefault("incarnation", 3)
    return metadata.Hello(version=metadata.PROTOCOL_VERSION,
                          nonce=b"\x07" * protocol.NONCE_BYTES, byteorder=sys.byteorder, **kw)


@pytest.mark.parametrize("kw", [
    {},
    {"meta": True},
    {"meta": True, "joins": 3},
    {"purpose": "meta", "accept_only": True},
    {"purpose": "meta", "accept_only": True, "joins": metadata.MAX_JOINS},
    {"name": "n" * 64, "incarnation": (1 << 64) - 1},
    {"name": "x", "incarnation": 0},
])
@pytest.mark.parametrize("here", [
    "127.0.0.1:1", "[::1]:65535", "::1:40000", "/tmp/aioxfer-ep34.sock", b"\0abstract-ep34",
    b"", "",
])
def test_a_proof_begun_ahead_is_the_one_shot(kw: dict[str, Any], here: str | bytes) -> None:
    h = _hello(**kw)
    mac = protocol.early_mac_head(KEY, h)
    assert mac is not None
    for ts in (1, 1 << 31, 1 << 32, time.time_ns(), (1 << 64) - 1):
        proof = protocol._early_finish(mac, ts, here)
        stamped = msgspec.structs.replace(h, early_ts=ts, early_proof=proof)
        assert proof == protocol.early_proof(KEY, stamped, here)
        assert proof == protocol._early_mac(KEY, h, ts, here)
    # (finished once more, the same: each finish works on a copy)
    ts = time.time_ns()
    assert protocol._early_finish(mac, ts, here) == protocol._early_finish(mac, ts, here)
    # Another key, time, address or field: another proof.
    other = protocol.early_mac_head(KEY + b"x", h)
    assert other is not None and protocol._early_finish(other, ts, here) != proof
    assert protocol._early_finish(mac, ts + 1, here) != protocol._early_finish(mac, ts, here)
    assert protocol._early_finish(mac, ts, "127.0.0.1:2") != protocol._early_finish(mac, ts, here)
    h2 = msgspec.structs.replace(h, incarnation=h.incarnation ^ 1)
    mac2 = protocol.early_mac_head(KEY, h2)
    assert mac2 is not None
    assert protocol._early_finish(mac2, ts, here) != protocol._early_finish(mac, ts, here)


@pytest.mark.parametrize("kw", [
    {"join": b"\x01" * protocol.NONCE_BYTES, "join_index": 1,
     "join_proof": b"\x02" * protocol.NONCE_BYTES},
    {"purpose": "verbs"},
    {"purpose": "meta"},
])
def test_none_begun_for_a_hello_that_carries_no_early_proof(kw: dict[str, Any]) -> None:
    assert protocol.early_mac_head(KEY, _hello(**kw)) is None
    assert protocol.early_mac_head(None, _hello()) is None


def test_a_stamp_from_the_proof_begun_ahead_is_taken() -> None:
    """with_early_hello with the HMAC begun ahead: the server's EarlyProofs
    takes the Hello it sends (at the socketpair's address), once."""
    import socket

    a, b = socket.socketpair()
    with a, b:
        here = protocol.sock_endpoint(b.getsockname())
        h = _hello(meta=True)
        frame = protocol.with_early_hello(h, protocol.encode_frame(h), a, KEY,
                                          protocol.early_ahead(KEY, h))
        sent = protocol.decode_body(memoryview(frame)[4:])
        assert isinstance(sent, metadata.Hello) and sent.early_proof
        early = protocol.EarlyProofs(start_ns=time.time_ns() - 10**9)
        assert early.take(sent, KEY, here)
        assert not early.take(sent, KEY, here)  # (replayed)


@pytest.mark.parametrize("kw", [
    {}, {"meta": True, "joins": 3}, {"purpose": "meta", "accept_only": True},
    {"name": "\u00a8early_ts\u03c0", "incarnation": 1 << 63},
    {"name": "\u00abearly_proof\u0104 ", "incarnation": 7},
])
def test_a_frame_filled_in_is_the_encoded_one(kw: dict[str, Any]) -> None:
    """EarlyAhead.stamp: encode_frame of the Hello with that time and that
    proof, byte for byte (names made of the keys' own bytes included), its
    proof the one the server computes."""
    h = _hello(**kw)
    ahead = protocol.early_ahead(KEY, h)
    assert ahead is not None
    for here in ("127.0.0.1:9", "/tmp/x", b"\0abstract"):
        before = time.time_ns()
        frame = ahead.stamp(here)
        got = protocol.decode_body(memoryview(frame)[4:])
        assert isinstance(got, metadata.Hello)
        assert before <= got.early_ts <= time.time_ns()
        want = msgspec.structs.replace(h, early_ts=got.early_ts,
                                       early_proof=protocol.early_proof(
                                           KEY, msgspec.structs.replace(h, early_ts=got.early_ts),
                                           here))
        assert got == want
        assert frame == protocol.encode_frame(want)
    assert protocol.early_ahead(None, h) is None
    assert protocol.early_ahead(KEY, _hello(purpose="verbs")) is None


def test_the_servers_macs_begun_ahead_are_the_one_shots() -> None:
    """EarlyProofs begins the early proof's and the Accept's HMACs with its
    token once: each check and proof is the one-shot's, for that token and
    for another one take() is given (begun again for it)."""
    early = protocol.EarlyProofs(token=KEY)
    other = auth.hmac_key(b"ep34-another-token")
    for key in (KEY, other, KEY):
        for kw in ({}, {"meta": True, "joins": 2}, {"purpose": "meta", "accept_only": True}):
            h = msgspec.structs.replace(_hello(**kw), early_ts=time.time_ns())
            for here in ("127.0.0.1:5", b"\0x", "/tmp/y"):
                assert early.proof_of(h, key, here) == protocol.early_proof(key, h, here)
        cn, sn = b"\x01" * protocol.NONCE_BYTES, b"\x02" * protocol.NONCE_BYTES
        assert early.server_proof(key, cn, sn) == protocol.server_proof(key, cn, sn)
        assert early.server_proof(key, sn, cn) != early.server_proof(key, cn, sn)
    assert protocol.EarlyProofs().server_proof(KEY, cn, sn) == protocol.server_proof(KEY, cn, sn)


def test_the_clients_accept_check_begun_ahead_is_server_proof() -> None:
    """_client_handshake begins the Accept's HMAC before it waits for the
    answer (server_proof_begun), finished with the server's nonce."""
    import secrets

    for _ in range(8):
        cn, sn = secrets.token_bytes(protocol.NONCE_BYTES), secrets.token_bytes(
            protocol.NONCE_BYTES)
        mac = protocol.server_proof_begun(KEY, cn)
        mac.update(sn)
        assert mac.digest() == protocol.server_proof(KEY, cn, sn)
        other = protocol.server_proof_begun(KEY, sn)
        other.update(cn)
        assert other.digest() != protocol.server_proof(KEY, cn, sn)
