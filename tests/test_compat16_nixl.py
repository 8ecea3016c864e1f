"""aioxfer.nixl against what NIXL's own scripts do to it (compat16's re-check
after the performance work): regressions found by running NIXL 1.5.1's
examples and Python tests through the shim, each in our own words."""

from __future__ import annotations

import ctypes
import time
import uuid
from typing import Any

import pytest

from aioxfer.nixl import _bindings, nixl_agent, nixl_agent_config
from aioxfer.nixl._api import nixl_thread_sync_t  # the package's is _bindings' enum, as in NIXL

STEP = 20.0


def _wait(agent: nixl_agent, handle: Any) -> str:
    deadline = time.monotonic() + STEP
    while (st := agent.check_xfer_state(handle)) == "PROC":
        assert time.monotonic() < deadline, "transfer did not finish"
    return st


@pytest.mark.parametrize("listen", [False, True])
def test_agent_built_through_a_replaced_nixlAgent_factory(
    monkeypatch: pytest.MonkeyPatch, listen: bool
) -> None:
    """A caller may replace ``_bindings.nixlAgent`` by a plain function that
    looks at the config and builds the real agent (NIXL's API test spies on
    ``syncMode`` this way). nixl_agent must still come up and work: it once
    failed in its constructor, testing the agent against the replaced
    attribute with isinstance (TypeError: not a type)."""
    seen: list[int] = []
    real = _bindings.nixlAgent

    def factory(name: str, cfg: Any) -> Any:
        seen.append(cfg.syncMode)
        return real(name, cfg)

    monkeypatch.setattr(_bindings, "nixlAgent", factory)
    a = nixl_agent(str(uuid.uuid4()),
                   nixl_conf=nixl_agent_config(enable_listen_thread=listen, listen_port=0,
                                               sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_RW))
    try:
        assert seen == [nixl_thread_sync_t.NIXL_THREAD_SYNC_RW.value]
        # And it moves data: a loopback WRITE posted and polled through the
        # agent's transfer/check_xfer_state.
        n = 4096
        buf = (ctypes.c_char * (2 * n))()
        base = ctypes.addressof(buf)
        ctypes.memset(base, 7, n)
        a.register_memory([(base, 2 * n, 0, "")], "DRAM")
        local = a.prep_xfer_dlist("", [(base, n, 0)], "DRAM")
        far = a.prep_xfer_dlist(a.name, [(base + n, n, 0)], "DRAM")
        h = a.make_prepped_xfer("WRITE", local, [0], far, [0])
        assert a.transfer(h) in ("DONE", "PROC")
        assert _wait(a, h) == "DONE"
        assert buf.raw[n:] == b"\x07" * n
        a.release_xfer_handle(h)
    finally:
        a.close()
