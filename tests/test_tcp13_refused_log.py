"""A tcp target that refuses a peer's access (a revoked or unknown region:
AccessDenied answered, the connection kept) says so in the agent's log,
naming the region and why, at most once a window (1 s) for the engine: a
peer probing keys cannot flood the log, and the next line counts what was
refused quietly meanwhile. It said nothing before (dereg11's note). The
window is AIOXFER_REFUSED_LOG_MS at the engine's creation: 300 ms here, not a
1.1 s sleep past 1 s."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from conftest import within
from test_dereg_revoke import _raw_peer, _raw_read, _raw_write

import aioxfer
from aioxfer import _cyx

KiB = 1 << 10
WINDOW = 0.3  # s: the engine's AIOXFER_REFUSED_LOG_MS


async def _refused_lines(capsys: Any, want: int) -> list[str]:
    """The engine.log lines about refused frames once there are want of them."""
    lines: list[str] = []
    while len(lines) < want:
        await asyncio.sleep(0.005)
        lines += [
            ln
            for ln in capsys.readouterr().err.splitlines()
            if "engine.log" in ln and "refused a" in ln
        ]
    return lines


async def test_refused_accesses_are_logged_rate_limited(make_agent: Any, capsys: Any,
                                                        monkeypatch: Any) -> None:
    monkeypatch.setenv("AIOXFER_REFUSED_LOG_MS", str(int(WINDOW * 1000)))
    owner = await make_agent(
        "owner", transports=("tcp",), limits=aioxfer.Limits(revoke_timeout=30.0)
    )
    region = owner.register(bytearray(8 * KiB), name="r")
    other = owner.register(bytearray(8 * KiB), name="other")
    raw = await _raw_peer(owner.address)
    try:
        assert await _raw_write(raw, 1, region.rid, region.key, b"GOOD") == _cyx.OK
        released = owner.deregister(region)  # revoked: the raw peer never acknowledges
        capsys.readouterr()

        t0 = time.monotonic()
        assert await _raw_write(raw, 2, region.rid, region.key, b"EVIL") == _cyx.E_ACCESS
        # Then, within the same window: refused and answered, not logged.
        burst = 20
        for i in range(burst):
            assert await _raw_read(raw, 10 + i, region.rid + 1000 + i, 1, 4) == _cyx.E_ACCESS
        quiet = time.monotonic() - t0 < WINDOW * 0.8  # else a second line was due: not checked
        first = await within(_refused_lines(capsys, 1))
        assert f"refused a WRITE frame for region {region.rid} " in first[0], first
        assert "unknown or revoked region" in first[0] and "peer=raw" in first[0], first
        if quiet:
            await asyncio.sleep(WINDOW / 10)
            assert len(first) == 1 and not await _lines_now(capsys), first

        await asyncio.sleep(WINDOW * 1.1)
        assert await _raw_read(raw, 99, other.rid, other.key ^ 1, 4) == _cyx.E_ACCESS
        second = (await within(_refused_lines(capsys, 1)))[-1]
        assert f"refused a READ frame for region {other.rid} " in second, second
        assert "wrong key" in second, second
        if quiet:
            assert f"({burst} more frames refused" in second, second
        # The connection was kept and serves what it may.
        assert await _raw_write(raw, 100, other.rid, other.key, b"SAFE") == _cyx.OK
    finally:
        raw.close()
    await within(released, 10)


async def _lines_now(capsys: Any) -> list[str]:
    return [ln for ln in capsys.readouterr().err.splitlines() if "refused a" in ln]
