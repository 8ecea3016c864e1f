"""A metadata maker put in the Server's place is never served from the cache (rv35).

tgt35 made serving.Server keep its metadata per ``meta_version()`` (the
region table's generation and LocalMeta.meta_with). The security tests
serve a stale snapshot by putting a maker in the place of the Server's own
(``server._local_meta``: tests/test_rev29_refresh,
tests/test_rev31_refresh_concurrent): on 15f46d2e the first snapshot it
made was kept under the version's current value and served again to every
later fetch of that version, the refresh's own check included (which must
see the table as it is), and those tests failed (a write landed in memory
its owner had got back). Such a maker is asked on every connect, and what
it made is not served once the Server's own is back.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from conftest import within

MiB = 1 << 20


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_a_maker_put_in_place_is_asked_every_time(make_agent: Any, transport: str) -> None:
    kw: dict[str, Any] = {"transports": ("tcp",)} if transport == "tcp" else {}
    target = await make_agent("target", **kw)
    target.alloc(MiB, name="buf")
    first = await make_agent("first", **kw)
    p = await within(first.connect(target.address))
    assert p.path == transport
    server = target._server
    attr = "_local_meta" if transport == "shm" else "_meta"
    real = getattr(server, attr)
    asked: list[int] = []

    def renamed() -> Any:
        asked.append(1)
        got = real()
        snap, fds = got if transport == "shm" else (got, None)
        snap = msgspec.structs.replace(snap, regions=[
            msgspec.structs.replace(r, name="renamed") for r in snap.regions])
        return (snap, fds) if transport == "shm" else snap

    setattr(server, attr, renamed)
    try:
        for k in range(2):
            peer = await within((await make_agent(f"swapped{k}", **kw)).connect(target.address))
            assert set(peer.regions) == {"renamed"}, "the cache served in the maker's place"
            assert len(asked) == k + 1, "the maker put in place was not asked"
    finally:
        setattr(server, attr, real)
    # The Server's own maker back, the table unchanged: what the other one
    # made is not served.
    peer = await within((await make_agent("after", **kw)).connect(target.address))
    assert set(peer.regions) == {"buf"}, "a snapshot of the maker put in place was kept"
