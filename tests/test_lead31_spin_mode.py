"""An agent in progress mode "sleep" polls nothing, its connects' handshakes
included (cx31: a handshake with a same-host peer polls its socket for the
peer's next frame for up to 1 ms before it waits in the loop)."""

from __future__ import annotations

import pytest

import aioxfer


@pytest.mark.parametrize("mode,spins", [("sleep", False), ("adaptive", True), ("poll", True)])
async def test_handshake_polling_follows_the_progress_mode(mode: str, spins: bool) -> None:
    async with aioxfer.Agent(f"lead31-{mode}", progress=mode) as a, \
            aioxfer.Agent(f"lead31-{mode}-t", progress=mode) as b:
        assert a._dialer._spin is spins
        assert a._server._spin is spins
        src = a.register(bytearray(b"x" * 4096))
        dst = b.register(bytearray(4096))
        peer = await a.connect(b.address)  # and a connect still works either way
        await a.write(src[0:4096], peer.regions[dst.name][0:4096])
        assert bytes(dst.memoryview) == b"x" * 4096
