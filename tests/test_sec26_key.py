"""The stretched key (auth.hmac_key, scrypt ~45 ms) off the event loop: an
agent made inside a running loop has it derived on a thread, awaited by
start() and connect(), still once per token per process; and a short token
is warned about (its length only), not refused."""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import threading
import time
from typing import Any

import pytest
from conftest import within

import aioxfer
from aioxfer import auth


@pytest.fixture
def scrypt_threads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The thread of every derivation from now on (the real scrypt runs)."""
    threads: list[int] = []
    real = auth._scrypt

    def counted(token: bytes) -> bytes:
        threads.append(threading.get_ident())
        return real(token)

    monkeypatch.setattr(auth, "_scrypt", counted)
    return threads


async def test_an_agent_made_in_a_running_loop_derives_off_the_loop(
        scrypt_threads: list[int]) -> None:
    """Two agents of a new token, made inside the loop: one derivation, on
    another thread than the loop's (on main: on the loop's, blocking it
    ~45 ms in the first Agent()); the key is in place before they serve
    (they connect, and a write goes through)."""
    token = secrets.token_hex(32)
    loop_thread = threading.get_ident()
    stalls: list[float] = []
    ticking = True

    async def ticker() -> None:
        last = time.perf_counter()
        while ticking:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            stalls.append(now - last)
            last = now

    tick = asyncio.get_running_loop().create_task(ticker())
    await asyncio.sleep(0.01)
    a = aioxfer.Agent("sec26-a", token=token, transports=("tcp",))
    b = aioxfer.Agent("sec26-b", token=token, transports=("tcp",))
    try:
        await within(a.start())
        await within(b.start())
        ticking = False
        await tick
        dst = b.alloc(4096, name="dst")
        peer = await within(a.connect(b.address))
        src = a.alloc(4096)
        src.numpy()[:] = 7
        await within(a.write(src[:], peer.region("dst")[:]))
        assert bytes(dst.numpy()[:8]) == b"\7" * 8
    finally:
        await within(a.aclose(), 30)
        await within(b.aclose(), 30)
    assert len(scrypt_threads) == 1, scrypt_threads
    assert scrypt_threads[0] != loop_thread, "the key was derived on the loop's thread"
    print(f"longest loop stall while the agents were made and started: "
          f"{max(stalls) * 1e3:.1f} ms")


async def test_an_agent_made_outside_a_loop_derives_at_once(scrypt_threads: list[int]) -> None:
    """No loop runs on the thread that makes it (aioxfer.nixl's caller
    thread): derived there, before Agent() returns, as before."""
    token = secrets.token_hex(32)
    made: list[Any] = []
    t = threading.Thread(target=lambda: made.append(
        (aioxfer.Agent("sec26-c", token=token, transports=("tcp",)), threading.get_ident())))
    t.start()
    t.join()
    agent, thread = made[0]
    try:
        assert scrypt_threads == [thread]
        assert agent._token == auth.hmac_key(token.encode())
    finally:
        await within(agent.aclose(), 30)


def test_one_derivation_shared_by_every_caller(scrypt_threads: list[int]) -> None:
    """key_soon started on a thread, hmac_key asked meanwhile and after,
    key_if_derived: one scrypt, the same key (scrypt's own)."""
    token = secrets.token_hex(32).encode()
    assert auth.key_if_derived(token) is None
    fut = auth.key_soon(token)
    keys = [auth.hmac_key(token), fut.result(timeout=30), auth.key_soon(token).result(),
            auth.key_if_derived(token)]
    want = hashlib.scrypt(token, salt=auth.KDF_SALT, n=auth.KDF_N, r=auth.KDF_R, p=auth.KDF_P,
                          maxmem=1 << 26, dklen=32)
    assert keys == [want] * 4
    assert len(scrypt_threads) == 1
    with pytest.raises(ValueError):
        auth.key_soon(b"")


def test_a_short_token_is_warned_about_once(capfd: Any) -> None:
    """Under SHORT_TOKEN bytes: one warning per process naming its length
    (never the token); a long one: none. (On main: no warning.)"""
    short = ("s" + secrets.token_hex(4)).encode()  # 9 bytes
    capfd.readouterr()
    auth.hmac_key(short)
    auth.hmac_key(short)
    auth.key_soon(short).result()
    auth.hmac_key(secrets.token_hex(16).encode())
    err = capfd.readouterr().err + capfd.readouterr().out
    lines = [ln for ln in err.splitlines() if "auth.short_token" in ln]
    assert len(lines) == 1, err
    assert "length=9" in lines[0] and short.decode() not in err, lines
