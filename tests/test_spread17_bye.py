"""compat16's "a clean close looks like a loss": a remote agent that closes
cleanly says goodbye on the connections it accepted (native FL_BYE on a
ping), so the survivor can tell a close from a crash."""
from __future__ import annotations

import asyncio
from typing import Any

from conftest import wait_until, within

from aioxfer.discovery import PeerLeft

MiB = 1 << 20


async def _connected(make_agent: Any, remote_agent: Any) -> tuple[Any, Any, Any]:
    ra = await remote_agent(size=MiB, transports=("tcp",))
    init = await make_agent("init", transports=("tcp",), tcp_connections=4, rail_probe=0.02)
    peer = await within(init.connect(ra.address))
    await wait_until(lambda: init._rails.live(peer).get(0) == 4, 10, what="every connection up")
    await wait_until(lambda: not init._probes, 10, what="the joins ended")
    return ra, init, peer


async def test_clean_close_is_no_rail_failure(make_agent, remote_agent, capsys) -> None:
    """The remote agent closes: its connections end one after another, those
    that end while others live each reported as a rail going down. Before
    the goodbye those read as failures: rail.down warnings (in about two
    closes of three here, as the connections' ends interleave: four rounds),
    and the rails re-dialled at an agent that is gone."""
    async def once() -> None:
        ra, init, peer = await _connected(make_agent, remote_agent)
        capsys.readouterr()
        await ra.close()
        await wait_until(lambda: peer.lost, 10, what="the peer gone")
        await asyncio.sleep(0.1)  # (a re-dial would start within 0.02 s)
        err = capsys.readouterr().err
        print(err)
        assert "rail.down" not in err and "rail.rerouted" not in err
        assert "engine.log" not in err
        assert not init._probes, "a closed peer's rail is re-dialled"

    for _ in range(4):
        await once()


async def test_killed_peer_is_still_lost(make_agent, remote_agent, capsys) -> None:
    """The same connections ended by a kill: no goodbye, a loss as before."""
    ra, init, peer = await _connected(make_agent, remote_agent)
    members = init.membership()
    capsys.readouterr()
    ra.kill()
    await wait_until(lambda: peer.lost, 10, what="the peer lost")
    await asyncio.sleep(0.05)
    assert "peer.lost" in capsys.readouterr().err
    async with asyncio.timeout(5):
        async for ev in members:
            if isinstance(ev, PeerLeft):
                assert ev.reason == "lost"
                break


async def test_clean_close_reported_as_closed(make_agent, remote_agent, capsys) -> None:
    """The survivor reports a peer that closed cleanly as closed (an info
    line, PeerLeft reason "closed"), not lost (a peer.lost warning)."""
    ra, init, peer = await _connected(make_agent, remote_agent)
    members = init.membership()
    capsys.readouterr()
    await ra.close()
    await wait_until(lambda: peer.lost, 10, what="the peer gone")
    await asyncio.sleep(0.05)
    err = capsys.readouterr().err
    async with asyncio.timeout(5):
        async for ev in members:
            if isinstance(ev, PeerLeft):
                left = ev
                break
    assert "peer.lost" not in err and "peer.closed" in err, err
    assert left.reason == "closed"
