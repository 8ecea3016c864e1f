"""release_xfer_handle of a request in flight (nixl-api.md: "releasing a
transfer in flight cancels it if the backend can, else raises and keeps the
handle"): it returns once the engine confirmed the cancel; where it cannot
confirm in time (a peer that stalls mid-READ), nixlBackendError, the handle
kept, and a later release, once the peer moves again, succeeds."""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import nixl_reader


def test_release_of_a_read_from_a_stalled_peer_raises_and_keeps_the_handle(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import aioxfer.nixl._bindings as bindings
    from aioxfer.nixl import nixlBackendError

    monkeypatch.setattr(bindings, "_STOP_TIMEOUT", 1.0, raising=False)
    with nixl_reader(monkeypatch) as r:
        agent, kv = r.agent, r.kv
        raised = 0
        for _ in range(4):
            h = r.read_handle()
            r.stop()
            if agent.transfer(h) == "DONE":
                r.cont()
                h.release()
                continue
            t0 = time.monotonic()
            try:
                agent.release_xfer_handle(h)
            except nixlBackendError:
                raised += 1
                took = time.monotonic() - t0
                assert 0.9 < took < 10, took
                # Kept: the handle is still the agent's, in its cancelled state.
                assert not h._released
                with pytest.raises(Exception, match="cancelled"):
                    agent.check_xfer_state(h)
            r.cont()
            # Once the peer moves again the engine confirms: a release works.
            agent.release_xfer_handle(h)
            assert h._released
            kv[:] = 0
            time.sleep(0.05)
            assert not np.count_nonzero(kv)
        assert raised, "no release met a stalled READ: nothing was tested"
