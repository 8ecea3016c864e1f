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


# Two shim agents in one process: connecting logs aioxfer's info line
# peer.connected on stderr, one closing while still added its info line
# peer.closed (it said goodbye: not the warning peer.lost); NIXL itself
# prints nothing there at its default.
_SHIM_PAIR = (
    "import os, nixl\n"
    "assert nixl.nixl_agent is __import__('aioxfer.nixl').nixl.nixl_agent\n"
    "print('env', os.environ.get('AIOXFER_LOG_LEVEL'))\n"
    "a = nixl.nixl_agent('A'); b = nixl.nixl_agent('B')\n"
    "a.add_remote_agent(b.get_agent_metadata())\n"
    "a.send_notif('B', b'x')\n"
    "import time\n"
    "deadline = time.monotonic() + 20\n"
    "while not b.get_new_notifs() and time.monotonic() < deadline: pass\n"
    # B closes while A still has it: aioxfer logs peer.closed (info).
    "b.close()\n"
    "while time.monotonic() < deadline:\n"
    "    try:\n"
    "        a.send_notif('B', b'y')\n"
    "    except nixl.nixlRemoteDisconnectError:\n"
    "        break\n"
    "a.close()\n"
    "print('done')\n"
)


@pytest.mark.parametrize(
    ("env", "shown"),
    [
        ({}, ()),  # NIXL's default, WARN
        ({"NIXL_LOG_LEVEL": "INFO"}, ("peer.connected", "peer.closed")),
        ({"NIXL_LOG_LEVEL": "WARN"}, ()),
        ({"NIXL_LOG_LEVEL": "ERROR"}, ()),
        ({"NIXL_LOG_LEVEL": "bogus"}, ()),  # counted as the default, as NIXL does
        ({"AIOXFER_LOG_LEVEL": "info"}, ("peer.connected", "peer.closed")),  # aioxfer's wins
        ({"AIOXFER_LOG_LEVEL": "warning"}, ()),  # (no warning: a clean close)
        ({"NIXL_LOG_LEVEL": "INFO", "AIOXFER_LOG_LEVEL": "error"}, ()),
    ],
)
def test_shim_shows_aioxfer_lines_at_nixls_log_level(env: dict[str, str],
                                                     shown: tuple[str, ...]) -> None:
    """A NIXL script run through the shim prints what it prints on NIXL:
    aioxfer's structured lines follow NIXL_LOG_LEVEL, errors only at its
    default (they printed from info level: peer.connected/peer.closed lines
    in every example's output, peer.lost where a target exits first), and
    the environment the script (and its children) sees is not changed."""
    import os
    import subprocess
    import sys

    import aioxfer.nixl

    base = {k: v for k, v in os.environ.items()
            if k not in ("NIXL_LOG_LEVEL", "AIOXFER_LOG_LEVEL")}
    out = subprocess.run([sys.executable, "-c", _SHIM_PAIR], capture_output=True, text=True,
                         cwd="/", timeout=60,
                         env={**base, **env, "PYTHONPATH": aioxfer.nixl.shim_path()})
    assert out.returncode == 0 and "done" in out.stdout, out.stderr
    assert f"env {env.get('AIOXFER_LOG_LEVEL')}" in out.stdout
    for event in ("peer.connected", "peer.closed", "peer.lost"):
        assert (event in out.stderr) is (event in shown), out.stderr


@pytest.mark.parametrize("level", ["WARN", "INFO"])
def test_desc_list_print_is_nixls(capfd: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch, level: str) -> None:
    """print() of a descriptor list writes NIXL's one stdout line, the memory
    type as a number, and each descriptor as a native INFO line on stderr
    (seen at NIXL_LOG_LEVEL=INFO only), as NIXL 1.5.1 does; it printed the
    type's name and every descriptor on stdout."""
    monkeypatch.setenv("NIXL_LOG_LEVEL", level)
    _bindings.nixlXferDList(_bindings.DRAM_SEG, [(1000, 105, 0), (2000, 30, 1)]).print()
    _bindings.nixlRegDList(_bindings.VRAM_SEG, [(4096, 8, 2, b"ab")]).print()
    out, err = capfd.readouterr()
    assert out == "DescList of mem type 0\nDescList of mem type 1\n"
    descs = [ln.split("] ", 1)[1] for ln in err.splitlines() if ln.startswith("I")]
    if level == "INFO":
        assert descs == ["Desc (1000, 105) from devID 0", "Desc (2000, 30) from devID 1",
                         "Desc (4096, 8) from devID 2, Metadata: ab"]
    else:
        assert descs == [] and err == ""


def test_unknown_backend_logs_nixls_words(capfd: pytest.CaptureFixture[str]) -> None:
    a = nixl_agent(str(uuid.uuid4()), nixl_agent_config(backends=[]))
    try:
        with pytest.raises(_bindings.nixlNotFoundError, match="^NIXL_ERR_NOT_FOUND"):
            a.create_backend("UVX")
        err = capfd.readouterr().err
        assert "createBackend: unsupported backend 'UVX'" in err, err
    finally:
        a.close()
