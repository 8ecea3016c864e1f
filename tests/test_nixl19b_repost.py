"""A repost of a handle whose cancelled post the engine still moves (rev19
#1's repost case): handle.future().cancel() (or a cancelled ``await
handle``) settles the handle's future at once, while the cancelled READ's
bytes may still land until the engine confirms the cancel; a repost then
accepted would let the old data land over the new. It is refused
(nixlRepostActiveError) until the old post's transfers are settled, on the
compiled repost path and on the Python one (a post with a notification)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import nixl_pattern, nixl_reader

STEP = 30.0


@pytest.mark.parametrize("notif", [b"", b"again"])
def test_repost_of_a_cancelled_read_still_moving_is_refused(
        notif: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    from aioxfer.nixl import nixlRepostActiveError

    with nixl_reader(monkeypatch, seconds=STEP) as r:
        agent, kv = r.agent, r.kv
        h = r.read_handle()
        refused = 0
        for _ in range(3):
            r.stop()
            if agent.transfer(h) == "DONE":
                r.cont()
                continue
            h.future().cancel()
            # The peer is stopped: the engine cannot have confirmed the
            # cancel (the READ's answer may still come): refused.
            with pytest.raises(nixlRepostActiveError):
                agent.transfer(h, notif)
            refused += 1
            r.cont()
            # Once the engine confirms, the repost is accepted and completes.
            deadline = time.monotonic() + STEP
            while True:
                try:
                    state = agent.transfer(h, notif)
                    break
                except nixlRepostActiveError:
                    assert time.monotonic() < deadline, "the repost stays refused"
                    time.sleep(0.001)
            while state == "PROC":
                assert time.monotonic() < deadline
                state = agent.check_xfer_state(h)
            assert state == "DONE"
            assert np.array_equal(kv[:4096], nixl_pattern(4096))
            kv[:] = 0
        assert refused, "no cancel met a READ in flight: nothing was tested"
        agent.release_xfer_handle(h)
