"""Every HMAC over the token keys on a stretched key (sec24, protocol 5).

With the server-first order whoever a client dials gets its proof, and the
same-host socket names are HMACs of the token in /proc/net/unix for any
user to read: each is an offline check of token guesses. Keyed on the token
itself a guess cost one HMAC (~350 k/s in Python); keyed on
auth.hmac_key(token) = scrypt(token, fixed salt, N=2**14, r=8, p=1) a guess
costs a derivation (~40 ms, 16 MiB). Against real agents over loopback:
a proof made with the raw token is refused and one made with the key (here
derived by hashlib itself, with the parameters written out) gets in, the
same for the same-host socket name and the NIXL listener's MACs; the key is
derived once per token per process, not per agent or connection.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import re
import secrets
import socket
import sys
import time
from typing import Any

from conftest import within
from test_security import raw_connect

from aioxfer import auth, local, metadata, protocol
from aioxfer.nixl import _wire

TOKEN = b"sec24-a-chosen-password"
# Written out here, not read from auth: a change of the KDF (which changes
# every key: peers of the old one no longer meet) fails this test, as a
# reminder that it goes with a PROTOCOL_VERSION bump.
SALT = b"aioxfer token key, scrypt v1"


def stretched(token: bytes) -> bytes:
    return hashlib.scrypt(token, salt=SALT, n=1 << 14, r=8, p=1, dklen=32)


def test_the_key_is_scrypt_of_the_token_with_these_parameters() -> None:
    assert auth.hmac_key(TOKEN) == stretched(TOKEN)
    assert len(auth.hmac_key(TOKEN)) == 32 and auth.hmac_key(TOKEN) != TOKEN
    assert metadata.PROTOCOL_VERSION == 5


def _hello(name: str) -> metadata.Hello:
    return metadata.Hello(version=metadata.PROTOCOL_VERSION, name=name, incarnation=7,
                          purpose="data", nonce=os.urandom(protocol.NONCE_BYTES),
                          byteorder=sys.byteorder)


async def _prove(address: str, key: bytes) -> metadata.Frame:
    """Hello and a Proof keyed on ``key``; the server's answer."""
    loop = asyncio.get_running_loop()
    sock = await raw_connect(address)
    with sock:
        chal = await within(protocol.recv_frame(loop, sock))
        assert isinstance(chal, metadata.Challenge) and len(chal.nonce) == protocol.NONCE_BYTES
        h = _hello("sec24-raw")
        proof = hmac.new(key, b"aioxfer-client-v2\x00" + chal.nonce + h.nonce + h.name.encode(),
                         hashlib.sha256).digest()
        await loop.sock_sendall(sock, protocol.encode_frame(h)
                                + protocol.encode_frame(metadata.Proof(proof=proof)))
        answer = await within(protocol.recv_frame(loop, sock))
        if isinstance(answer, metadata.Accept):
            # The server's proof is keyed on the stretched key too.
            want = hmac.new(key, b"aioxfer-server-v2\x00" + h.nonce + chal.nonce,
                            hashlib.sha256).digest()
            assert answer.proof == want
        return answer


async def test_a_proof_keyed_on_the_raw_token_is_refused(make_agent) -> None:
    """Before (protocol 4): HMAC(token, ...) got in, so a server a client
    dialled by mistake could test guesses at HMAC speed. Now only the
    stretched key's proof does."""
    target = await make_agent("target", token=TOKEN, transports=("tcp",))
    raw = await _prove(target.address, TOKEN)
    assert isinstance(raw, metadata.Reject) and "bad token" in raw.reason, raw
    ok = await _prove(target.address, stretched(TOKEN))
    assert isinstance(ok, metadata.Accept) and ok.name == target.name, ok


async def test_the_same_host_socket_name_keys_on_the_stretched_token(make_agent) -> None:
    """The abstract name an agent listens on beside its tcp address is
    public (/proc/net/unix): HMAC(token, address) there was an offline
    check of guesses for any user of the host, with no connection at all."""
    target = await make_agent("target", token=TOKEN)
    assert target._local_sock is not None
    with open("/proc/net/unix") as f:
        names = set(re.findall(r"@(aioxfer-\d+-[0-9a-f]{24})\b", f.read()))
    uid = os.geteuid()
    assert local.local_name_for(stretched(TOKEN), target.address, uid) in names
    assert local.local_name_for(TOKEN, target.address, uid) not in names


async def test_agents_of_one_token_derive_the_key_once(make_agent, monkeypatch) -> None:
    """A derivation costs tens of ms: made once per token per process (an
    agent derives it when it is made), never per agent or connection."""
    token = secrets.token_hex(8).encode()  # new to this process
    # (Counted at the derivation: an agent made inside a running loop has
    # it derived on a thread, auth.key_soon, not through hmac_key's cache.)
    derived: list[bytes] = []
    real = auth._scrypt
    monkeypatch.setattr(auth, "_scrypt", lambda t: derived.append(t) or real(t))
    t0 = time.perf_counter()
    a = await make_agent("a", token=token, transports=("tcp",))
    first = time.perf_counter() - t0
    agents = [await make_agent(f"b{i}", token=token.decode(), transports=("tcp",))
              for i in range(8)]
    for b in agents[:3]:
        await within(b.connect(a.address))
    assert derived == [token], derived
    print(f"first agent of a new token made in {first * 1e3:.1f} ms")


def _listen_request(key: bytes, nonce: bytes, body: bytes) -> bytes:
    """A NIXL listener request with its MACs keyed on ``key`` (by hand)."""
    head = len(body).to_bytes(4, "big")
    mac1 = hmac.new(key, b"aioxfer-nixl-listen-len-v2\x00" + nonce + head,
                    hashlib.sha256).digest()
    mac2 = hmac.new(key, b"aioxfer-nixl-listen-body-v2\x00" + nonce + body,
                    hashlib.sha256).digest()
    return head + mac1 + body + mac2


def _ask(port: int, key: bytes, req: Any) -> _wire.Reply | None:
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        try:
            nonce = s.recv(_wire.LISTEN_NONCE, socket.MSG_WAITALL)
            s.sendall(_listen_request(key, nonce, _wire.encoder.encode(req)))
            head = s.recv(4, socket.MSG_WAITALL)
            if len(head) != 4:
                return None
            reply: _wire.Reply = _wire.reply_decoder.decode(
                s.recv(int.from_bytes(head, "big"), socket.MSG_WAITALL))
        except (BrokenPipeError, ConnectionResetError):
            return None
        return reply


def test_the_nixl_listener_keys_on_the_stretched_token(agents: Any, monkeypatch) -> None:
    """The compat listener's MACs go wherever a client dials too: a request
    MACed with the raw token is refused (closed unanswered), one MACed with
    the stretched key is served."""
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN.decode())
    nixl = agents(enable_listen_thread=True, listen_port=0)
    port = nixl.agent.listen_port
    fetch = _wire.Fetch(name=nixl.name)
    assert _ask(port, TOKEN, fetch) is None
    reply = _ask(port, stretched(TOKEN), fetch)
    assert reply is not None and reply.ok and _wire.decode_md(reply.md).name == nixl.name
