"""A goodbye (native FL_BYE on a ping) heard on one connection ends the
whole endpoint: the peer's engine is shutting down. Handled per connection
(rev17b), a target saying it on one connection while staying up left that
rail one connection short for good (a closed connection is not re-dialled)
and a later real loss of the others was reported as a clean close."""
from __future__ import annotations

import asyncio
import os
import re
import socket
import struct
from pathlib import Path
from typing import Any

from conftest import wait_until, within

from aioxfer.discovery import PeerLeft

_INTERNAL = Path(__file__).resolve().parents[1] / "native" / "src" / "internal.h"


def _wire_constants() -> tuple[int, int, int]:
    """FR_PING, FL_BYE and AXF_MAGIC as the engine defines them."""
    src = _INTERNAL.read_text()
    frames = src[src.index("FR_WRITE = 1"):]
    names = re.findall(r"\b(FR_[A-Z_]+)\b", frames[:frames.index("}")])
    ping = 1 + names.index("FR_PING")
    bye = int(re.search(r"FL_BYE = (\d+)", src).group(1))  # type: ignore[union-attr]
    magic = int(re.search(r"#define AXF_MAGIC (0x[0-9a-fA-F]+)u", src).group(1), 16)  # type: ignore[union-attr]
    return ping, bye, magic


def _accepted(port: int) -> list[int]:
    """This process's tcp sockets whose local port is port (the target's
    accepted connections: both agents live in this process)."""
    out = []
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.family == socket.AF_INET:
                s.getpeername()
                if s.getsockname()[1] == port:
                    out.append(fd)
        except OSError:
            pass
        finally:
            s.close()
    return out


async def test_one_goodbye_ends_the_endpoint(make_agent: Any) -> None:
    ping, bye, magic = _wire_constants()
    target = await make_agent("tgt", transports=("tcp",))
    init = await make_agent("ini", transports=("tcp",), tcp_connections=4, rail_probe=0.02)
    members = init.membership()
    peer = await within(init.connect(target.address))
    await wait_until(lambda: init._rails.live(peer).get(0) == 4, 10, what="every connection up")
    await wait_until(lambda: not init._probes, 10, what="the joins ended")
    port = int(target.address.rsplit(":", 1)[1])
    fds = _accepted(port)
    assert len(fds) == 4, fds
    hdr = struct.pack("<IHHiIQQQQQQ", magic, ping, bye, 0, 0, 0, 0, 0, 0, 0, 0)
    s = socket.socket(fileno=os.dup(fds[-1]))
    try:
        s.send(hdr)  # a whole header, at a frame boundary (nothing else sent)
    finally:
        s.close()
    # Before: {0: 3} for good (never re-dialled) and the peer not lost.
    await wait_until(lambda: peer.lost, 5, what="the endpoint ended by the goodbye")
    async with asyncio.timeout(5):
        async for ev in members:
            if isinstance(ev, PeerLeft):
                assert ev.reason == "closed"
                break
    assert sum(init._rails.live(peer).values()) == 0
