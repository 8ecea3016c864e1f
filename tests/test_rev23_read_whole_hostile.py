"""rev23: read20's hostile answers (short, long, extra bytes, a death
mid-payload) to a lone 1 MiB READ, which read22 sends whole on one loopback
connection and whose response the awaiting thread copies as it comes (conn.c
help_more, up to HELP_READ_LOOP_MAX). test_read22_whole_read runs only
read21's honest pieces at that size; these are the dishonest ones, through
read20's proxy with its SIZE set to 1 MiB: each must end the request with a
typed error and a logged reason (or, a rail cut, reroute it with the right
bytes), and nothing outside the destination may be written."""
from __future__ import annotations

from typing import Any

import pytest
import test_read20_hostile_resp as r20

MiB = 1 << 20


@pytest.mark.parametrize("mode", ["short", "long", "extra-bytes", "die-mid-payload"])
async def test_hostile_response_to_a_lone_1mib_read(make_agent: Any, capsys: Any,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     mode: str) -> None:
    monkeypatch.setattr(r20, "SIZE", MiB)
    await r20.test_hostile_response_to_a_lone_64k_read(make_agent, capsys, mode)
