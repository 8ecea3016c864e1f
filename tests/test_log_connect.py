"""peer.connected: logged once per connect, after it returned (from the
loop's next iteration, so that rendering it does not delay the caller's
first transfer), with what the connect made."""

from __future__ import annotations

import asyncio

from conftest import within

MiB = 1 << 20


async def test_peer_connected_logged_after_connect(make_agent, capsys) -> None:
    target = await make_agent("target", transports=("tcp",))
    dst = target.alloc(MiB, name="dst")
    init = await make_agent("init", transports=("tcp",), tcp_connections=3)
    capsys.readouterr()
    peer = await within(init.connect(target.address))
    # The caller's first transfer goes before the line is rendered.
    src = init.alloc(MiB, name="src")
    src.numpy()[:] = 4
    await within(init.write(src[0:MiB], peer.region("dst")[0:MiB]))
    for _ in range(3):
        await asyncio.sleep(0)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "peer.connected" in ln]
    assert len(lines) == 1, lines
    for field in ("agent=init", "peer=target", f"address={target.address}", "path=tcp",
                  "conns=3", "rails=1", "regions=1"):
        assert field in lines[0], (field, lines[0])
    assert (dst.numpy() == 4).all()
    # Connecting again to the live peer returns it: nothing more is logged.
    assert await within(init.connect(target.address)) is peer
    for _ in range(3):
        await asyncio.sleep(0)
    assert "peer.connected" not in capsys.readouterr().err
