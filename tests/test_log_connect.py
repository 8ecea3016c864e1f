"""peer.connected: logged once per connect, a moment after it returned (so
that rendering it does not delay the caller's first transfer), with what the
connect made."""

from __future__ import annotations

import asyncio

from conftest import within

MiB = 1 << 20


async def _until_logged(capsys, n: int) -> list[str]:
    """The peer.connected lines on stderr once there are n of them."""
    lines: list[str] = []
    while len(lines) < n:
        await asyncio.sleep(0.001)
        lines += [ln for ln in capsys.readouterr().err.splitlines() if "peer.connected" in ln]
    return lines


async def test_peer_connected_logged_after_connect(make_agent, capsys) -> None:
    target = await make_agent("target", transports=("tcp",))
    dst = target.alloc(MiB, name="dst")
    other = await make_agent("other", transports=("tcp",))
    init = await make_agent("init", transports=("tcp",), tcp_connections=3)
    capsys.readouterr()
    peer = await within(init.connect(target.address))
    src = init.alloc(MiB, name="src")
    src.numpy()[:] = 4
    await within(init.write(src[0:MiB], peer.region("dst")[0:MiB]))
    assert (dst.numpy() == 4).all()
    # Connecting again to the live peer returns it (nothing to log); then
    # another peer, whose line comes after any the first connect made.
    assert await within(init.connect(target.address)) is peer
    await within(init.connect(other.address))
    lines = await within(_until_logged(capsys, 2))
    assert len(lines) == 2, lines
    assert f"address={target.address}" in lines[0] and f"address={other.address}" in lines[1]
    for field in ("agent=init", "peer=target", "path=tcp", "conns=3", "rails=1", "regions=1"):
        assert field in lines[0], (field, lines[0])
