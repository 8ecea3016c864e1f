"""A lone 1 MiB READ over loopback goes whole on one connection and its
response is copied by the awaiting thread as it comes (read22: tcp.c
tcp_chunk, conn.c help_resp up to HELP_READ_LOOP_MAX), so read21's hostile
cases run again at that size: the response held back by a proxy and sent in
pieces (header and first bytes, a pause long enough for the spinner to hand
the socket back mid-frame or not, the rest), or cut between two pieces.
Every byte must land at its own offset, nothing outside the destination may
be written, a cut must fail the request with a typed error or reroute it
with the right bytes. Before read22 the READ went in two 512 KiB halves: the
proxy never saw a 1 MiB response to split (the test failed so).
"""
from __future__ import annotations

from typing import Any

import pytest
import test_read20_hostile_resp as r20
import test_read21_pieces as r21

MiB = 1 << 20
KiB = 1 << 10


@pytest.fixture
def one_mib(monkeypatch: pytest.MonkeyPatch) -> None:
    # read20's proxy and read21's run both size the response they split by SIZE.
    monkeypatch.setattr(r20, "SIZE", MiB)
    monkeypatch.setattr(r21, "SIZE", MiB)


@pytest.mark.parametrize("first", [1, 64 * KiB + 3, MiB // 2, MiB - 1])
@pytest.mark.parametrize("pause", [0.0, 0.02])
async def test_1mib_response_in_pieces_lands_in_place(make_agent: Any, capsys: Any, one_mib: None,
                                                      first: int, pause: float) -> None:
    await r21._run(make_agent, capsys, first, pause, die=False)


@pytest.mark.parametrize("first", [0, 64 * KiB + 3, MiB - 1])
async def test_peer_dies_between_pieces_of_1mib(make_agent: Any, capsys: Any, one_mib: None,
                                                first: int) -> None:
    await r21._run(make_agent, capsys, first, 0.02, die=True)
