"""An agent made inside a running loop derives its token's key on a thread
(sec26). Its key's state is one field now: derived, pending, or none
(insecure_no_auth only). Before, ``_token is None`` meant either "insecure"
or "still being derived" (a second field told them apart), and _take_key,
reached through _dialer / _connector / _start, waited for the derivation
with Future.result(): on the loop's thread, blocking it for the scrypt.
Now a read before the key is there raises _KeyPending at once; start() and
connect() await it as before.
"""

from __future__ import annotations

import asyncio
import secrets
import time

import pytest

import aioxfer
from aioxfer import agent as agent_mod

# (RuntimeError where it is absent: main's code, to show what it did.)
_KeyPending = getattr(agent_mod, "_KeyPending", RuntimeError)


def _fresh_token() -> str:
    # (Never derived in this process: the derivation runs on its thread.)
    return secrets.token_hex(32)


async def test_a_pending_key_is_never_read_as_no_auth() -> None:
    a = aioxfer.Agent("pending", token=_fresh_token(), listen="127.0.0.1:0",
                      transports=("tcp",))
    try:
        with pytest.raises(_KeyPending):
            a._token  # noqa: B018
        await a.start()
        assert isinstance(a._token, bytes) and len(a._token) == 32
    finally:
        await a.aclose()
    b = aioxfer.Agent("insecure", insecure_no_auth=True, listen="127.0.0.1:0",
                      transports=("tcp",))
    try:
        assert b._token is None
    finally:
        await b.aclose()


async def test_a_use_before_start_does_not_block_the_loop() -> None:
    """_dialer (the Dialer, made with the key) before start(): main waited
    for the derivation on the loop's thread (~45 ms of scrypt, the loop
    stalled); now a typed error at once, and the agent still starts."""
    a = aioxfer.Agent("early", token=_fresh_token(), listen="127.0.0.1:0",
                      transports=("tcp",))
    try:
        t0 = time.perf_counter()
        raised = None
        try:
            a._dialer  # noqa: B018
        except _KeyPending as exc:
            raised = exc
        took = time.perf_counter() - t0
        assert took < 0.01, f"the loop's thread was held {took * 1e3:.1f} ms"
        assert raised is not None
        await asyncio.wait_for(a.start(), 20)
        assert a._dialer is not None
    finally:
        await a.aclose()


async def test_a_sibling_shares_the_pending_key() -> None:
    """_credentials_of copies the one field: a sibling made while its
    source's key is pending gets that key once started, and connects."""
    token = _fresh_token()
    a = aioxfer.Agent("source", token=token, listen="127.0.0.1:0", transports=("tcp",))
    sib = aioxfer.Agent("sibling", _credentials_of=a, listen="127.0.0.1:0",
                        transports=("tcp",))
    b = aioxfer.Agent("other", token=token, listen="127.0.0.1:0", transports=("tcp",))
    try:
        with pytest.raises(_KeyPending):
            sib._token  # noqa: B018
        await asyncio.wait_for(sib.start(), 20)
        await asyncio.wait_for(b.start(), 20)
        assert sib._token == b._token
        peer = await asyncio.wait_for(sib.connect(b.address), 20)
        assert peer.name == "other"
    finally:
        for x in (sib, a, b):
            await x.aclose()
