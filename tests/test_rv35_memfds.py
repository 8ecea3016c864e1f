"""More memfds than one message carries, served from the metadata cache (rv35).

serving.Server sends a same-host peer's memfds FDS_PER_MESSAGE at a time,
and since tgt35 META_GO rides in the last one (``b"F" + META_GO``) and the
snapshot with its memfd list is made once per registration generation and
served again. Each region a peer maps must be the one its metadata names
(memfd index i is the i-th fd passed, across messages), for the peer served
the freshly made snapshot and for the next one served the cached one, and
for a client of main's build (before tgt35), which reads each memfd message
one byte at a time and META_GO after them.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import textwrap
from typing import Any

import pytest
from conftest import within

from aioxfer.local import FDS_PER_MESSAGE

TOKEN = b"rv35-memfds-token"
N = FDS_PER_MESSAGE + 7  # two memfd messages, the second short
PAGE = 4096
OLD_PYTHON = os.environ.get("AIOXFER_MAIN_PYTHON", "/tmp/vI34b/bin/python")


def _fill(target: Any) -> None:
    """N regions, region i's first byte i % 251 + 1 (each distinct from its
    neighbours, so a memfd passed at the wrong index reads wrong)."""
    for i in range(N):
        r = target.alloc(PAGE, name=f"r{i}")
        r.numpy()[:] = i % 251 + 1


async def _check(agent: Any, address: str) -> None:
    peer = await within(agent.connect(address), 30)
    assert peer.path == "shm", peer.path
    assert len(peer.regions) == N
    dst = agent.alloc(PAGE * 8, name="dst")
    picks = [0, 1, FDS_PER_MESSAGE - 1, FDS_PER_MESSAGE, FDS_PER_MESSAGE + 1, N - 1]
    for k, i in enumerate(picks):
        await within(agent.read(dst[k * PAGE:(k + 1) * PAGE], peer.region(f"r{i}")[0:PAGE]))
        got = bytes(dst.numpy()[k * PAGE:(k + 1) * PAGE])
        assert got == bytes([i % 251 + 1]) * PAGE, f"region r{i} mapped another's memfd"


@pytest.mark.parametrize("token", [None, TOKEN])
async def test_many_memfds_made_then_cached(make_agent: Any, token: bytes | None) -> None:
    target = await make_agent("target", token=token)
    _fill(target)
    server = target._server
    await _check(await make_agent("first", token=token), target.address)
    made = server._meta_made[True]
    assert made is not None and len(made[2]) == N
    # The next peer is served the same snapshot (made once), all of it right.
    await _check(await make_agent("second", token=token), target.address)
    assert server._meta_made[True] is made, "the snapshot was made again, not cached"
    # One region replaced (its number and memfd): the next peer maps the new one.
    await target.deregister(target.region("r3"))
    r = target.alloc(PAGE, name="r3")
    r.numpy()[:] = 3 % 251 + 1
    await _check(await make_agent("third", token=token), target.address)
    assert server._meta_made[True] is not made


_OLD_CLIENT = textwrap.dedent("""
    import asyncio, sys
    import aioxfer

    async def main():
        kw = {"token": sys.argv[1].encode()} if sys.argv[1] else {}
        async with aioxfer.Agent("old-client", **kw) as a:
            peer = await a.connect(sys.argv[2])
            assert peer.path == "shm", peer.path
            n = int(sys.argv[3])
            dst = a.alloc(4096, name="dst")
            for i in (0, n - 8, n - 1):
                await a.read(dst[0:4096], peer.region(f"r{i}")[0:4096])
                assert bytes(dst.numpy()) == bytes([i % 251 + 1]) * 4096, i
            print("ok", len(peer.regions), flush=True)

    asyncio.run(main())
""")


@pytest.mark.parametrize("token", [None, TOKEN])
async def test_an_older_client_gets_many_memfds(make_agent: Any, token: bytes | None) -> None:
    if not os.access(OLD_PYTHON, os.X_OK):
        pytest.skip(f"no build of main (before tgt35) at {OLD_PYTHON}")
    target = await make_agent("target", token=token)
    _fill(target)
    loop = asyncio.get_running_loop()
    for _ in range(2):  # the snapshot made, then served from the cache
        proc = await within(loop.run_in_executor(None, lambda: subprocess.run(
            [OLD_PYTHON, "-c", _OLD_CLIENT, (token or b"").decode(), target.address, str(N)],
            capture_output=True, text=True, timeout=60, cwd="/",
            env=dict(os.environ, PYTHONPATH=""))), 70)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == f"ok {N}", proc.stdout
