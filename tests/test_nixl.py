"""aioxfer.nixl: NIXL's Python API on aioxfer, in one process.

Each behaviour here is one NIXL 1.5.1 shows (see the shared NIXL API notes):
names and exceptions, descriptor-list shapes, errors of preparation and of
requests, notifications (once each, after the data, empty and large),
telemetry (switches, the ring-buffer file NIXL's readers read, its events),
loopback, requests over many region pairs, the metadata listener with partial metadata,
several threads on one agent, the opt-in ``import nixl`` shim.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

# The real S3 server (rclone) of the object tests, and the real etcd of the
# discovery tests (each skips where its binary is absent).
from s3server import ACCESS_KEY, SECRET_KEY, S3Server, s3  # noqa: F401
from test_discovery import etcd_server  # noqa: F401

import aioxfer.nixl as nixl
from aioxfer import progress as aioxfer_progress
from aioxfer.nixl import _api, _bindings, _telemetry, _utils, nixl_agent, nixl_agent_config
from aioxfer.nixl import logging as nixl_logging

STEP = 20.0


def _name() -> str:
    return str(uuid.uuid4())



class Buf:
    """A host buffer at a fixed address, with a numpy view."""

    def __init__(self, n: int, fill: int = 0) -> None:
        self.raw = (ctypes.c_char * n)()
        self.addr = ctypes.addressof(self.raw)
        self.np = np.frombuffer(self.raw, dtype=np.uint8)
        self.np[:] = fill
        self.n = n


def _wait(agent: nixl_agent, handle: Any) -> str:
    deadline = time.monotonic() + STEP
    while (st := agent.check_xfer_state(handle)) == "PROC":
        assert time.monotonic() < deadline, "transfer did not finish"
    return st


def _pair(agents: Any, n: int = 1 << 16, **conf: Any) -> tuple[Any, Any, Buf, Buf, Any, Any]:
    a, b = agents(**conf), agents(**conf)
    x, y = Buf(n, 1), Buf(n, 2)
    ra = a.register_memory([(x.addr, n, 0, "")], "DRAM")
    rb = b.register_memory([(y.addr, n, 0, "")], "DRAM")
    assert a.add_remote_agent(b.get_agent_metadata()) == b.name.encode()
    return a, b, x, y, ra, rb


# ---------------------------------------------------------------- names


def test_package_reexports_every_public_name_of_its_submodules() -> None:
    for mod in (_api, _bindings, _utils, nixl_logging):
        for name in mod.__all__:
            assert hasattr(nixl, name), name
    assert nixl.nixlNotFoundError is _bindings.nixlNotFoundError
    assert nixl.DRAM_SEG == 0 and nixl.FILE_SEG == 4 and nixl.NIXL_WRITE == 1
    assert nixl.NIXL_INIT_AGENT == "" and nixl.DEFAULT_COMM_PORT == 8888
    assert nixl.HAVE_UCX_GPU_DEVICE_API is False


def test_errors_are_plain_exceptions_named_by_status() -> None:
    classes = [getattr(_bindings, n) for n in _bindings.__all__ if n.endswith("Error")]
    assert len(classes) == 12
    for cls in classes:
        assert cls.__bases__ == (Exception,)
    with pytest.raises(nixl.nixlNotFoundError, match="^NIXL_ERR_NOT_FOUND"):
        nixl_agent(_name(), nixl_agent_config(backends=[])).create_backend("UVX")


def test_shim_makes_import_nixl_this_package() -> None:
    code = (
        "import nixl, nixl._api, nixl._bindings as b, nixl._utils, nixl.logging\n"
        "import aioxfer.nixl as impl\n"
        "assert nixl is impl and nixl._bindings is impl._bindings\n"
        "from nixl._api import nixl_agent\n"
        "assert nixl_agent is impl.nixl_agent and nixl.nixlNotFoundError is b.nixlNotFoundError\n"
        "print('shim ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=nixl.shim_path())
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd="/",
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "shim ok" in out.stdout
    # In-process opt-in; a real nixl imported first is refused.
    code2 = ("import aioxfer.nixl as n; n.install(); import nixl._api as a; "
             "assert a is n._api; print('install ok')")
    out = subprocess.run([sys.executable, "-c", code2], capture_output=True, text=True,
                         cwd="/",
                         timeout=60)
    assert out.returncode == 0 and "install ok" in out.stdout, out.stderr
    path = subprocess.run([sys.executable, "-m", "aioxfer.nixl"], capture_output=True, text=True,
                         cwd="/",
                          timeout=60).stdout.strip()
    assert path == nixl.shim_path() and os.path.isfile(os.path.join(path, "nixl", "__init__.py"))


def test_agents_dropped_before_exit_close_cleanly() -> None:
    # As prep_xfer_perf: ``del agent`` just before the interpreter exits.
    code = (
        "import numpy as np\n"
        "from aioxfer.nixl import nixl_agent\n"
        "for k in range(3):\n"
        "    a = nixl_agent(f'a{k}')\n"
        "    buf = np.zeros(1 << 16, np.uint8)\n"
        "    a.register_memory([(buf.ctypes.data + i * 256, 256, 0, '') for i in range(256)],\n"
        "                      'DRAM')\n"
        "    l = a.prep_xfer_dlist('', [(buf.ctypes.data, 256, 0)], 'DRAM')\n"
        "    r = a.prep_xfer_dlist(a.name, [(buf.ctypes.data + 256, 256, 0)], 'DRAM')\n"
        "    h = a.make_prepped_xfer('WRITE', l, [0], r, [0])\n"
        "    del a, l, r, h  # a loopback peer connected: its close takes a while\n"
        "print('exit')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                         timeout=60)
    assert out.returncode == 0 and "exit" in out.stdout, out.stderr
    for bad in ("destroyed but it is pending", "Exception ignored", "Traceback"):
        assert bad not in out.stderr, out.stderr


def test_logger_writes_nixl_lines_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    log = nixl_logging.get_logger("__example")
    assert log.name == "nixl.example"
    log.info("hello %d", 5)
    out = capsys.readouterr().out
    assert " NIXL INFO    test_nixl.py:" in out and out.rstrip().endswith("hello 5")


# ---------------------------------------------------------------- descriptor lists


def test_descriptor_lists() -> None:
    descs = [(1000, 105, 0), (2000, 30, 0), (1010, 20, 0)]
    xl = _bindings.nixlXferDList(nixl.DRAM_SEG, descs)
    assert xl.descCount() == 3 and xl[0] == descs[0] and xl.getType() == nixl.DRAM_SEG
    assert pickle.loads(pickle.dumps(xl)) == xl
    xl.remDesc(1)
    assert xl.descCount() == 2 and xl[1] == descs[2]
    assert xl.index(descs[2]) == 1
    with pytest.raises(nixl.nixlNotFoundError):
        xl.index((5, 5, 5))
    xl.clear()
    assert xl.isEmpty() and bool(xl)  # no __len__: always truthy, as NIXL's
    xl.addDesc((2000, 100, 0))
    assert xl[0] == (2000, 100, 0)

    arr = np.array([[1, 2, 0], [3, 4, 0]], dtype=np.int64)
    assert _bindings.nixlXferDList(nixl.VRAM_SEG, arr)[1] == (3, 4, 0)
    with pytest.raises(ValueError):
        _bindings.nixlXferDList(nixl.DRAM_SEG, arr.astype(np.float64))
    with pytest.raises(ValueError):
        _bindings.nixlXferDList(nixl.DRAM_SEG, np.zeros((4, 3), np.uint64)[::2])
    with pytest.raises(ValueError):
        _bindings.nixlXferDList(nixl.DRAM_SEG, [(1, 2)])

    rl = _bindings.nixlRegDList(nixl.DRAM_SEG, [(10, 20, 0, "meta"), (40, 8, 1, b"\x00b")])
    assert rl[0] == (10, 20, 0, b"meta") and rl[1][3] == b"\x00b"
    assert rl.trim() == _bindings.nixlXferDList(nixl.DRAM_SEG, [(10, 20, 0), (40, 8, 1)])
    assert pickle.loads(pickle.dumps(rl)) == rl
    assert _bindings.nixlRegDList(nixl.DRAM_SEG, np.array([[1, 2, 3]], np.uint64))[0] == (
        1, 2, 3, b"")


def test_get_descs_shapes(agents: Any) -> None:
    a = agents(backends=[])
    assert a.get_xfer_descs([(1, 2, 3, 4)], "DRAM") is None
    assert a.get_xfer_descs([(1, 2, 3)]) is None
    with pytest.raises(KeyError):
        a.get_xfer_descs([(1, 2, 3)], mem_type="V-RAM")
    assert a.get_xfer_descs(_bindings.nixlRegDList(nixl.DRAM_SEG)) is None
    assert a.get_reg_descs([(1, 2, 3)], "DRAM") is None
    assert a.get_reg_descs([(1, 2, 3, 4)]) is None
    assert a.get_reg_descs(_bindings.nixlXferDList(nixl.DRAM_SEG)) is None
    with pytest.raises(IndexError):
        a.get_reg_descs([], "DRAM")
    rows = np.array([[5, 6, 0]], dtype=np.uint64)
    assert a.get_xfer_descs(rows, "cpu")[0] == (5, 6, 0)  # deprecated alias of DRAM
    blob = a.get_serialized_descs(a.get_reg_descs([(1, 2, 0, "m")], "DRAM"))
    assert not blob.startswith(b"\x80")  # not a pickle
    assert a.deserialize_descs(blob)[0] == (1, 2, 0, b"m")
    with pytest.raises(nixl.nixlInvalidParamError):
        a.deserialize_descs(pickle.dumps([1]))


def test_config_and_agent_arguments() -> None:
    with pytest.raises(TypeError, match="sync_mode must be a nixl_thread_sync_t"):
        nixl_agent_config(sync_mode=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        nixl_agent("")
    a = nixl_agent(_name(), nixl_agent_config(backends=["UCX", "NOPE"]))
    try:
        assert list(a.backends) == ["UCX"]
        # OBJ where aioxfer's object backend can run (its extra installed).
        objects = _bindings._objects_available()
        assert a.get_plugin_list() == (["OBJ", "POSIX", "UCX"] if objects else ["POSIX", "UCX"])
        with pytest.raises(nixl.nixlBackendError if objects else nixl.nixlNotFoundError):
            a.create_backend("OBJ")  # no bucket, as NIXL's OBJ without one
        assert a.get_backend_mem_types("UCX") == ["DRAM_SEG", "VRAM_SEG"]
        assert a.get_plugin_params("UVX") == {} and a.get_backend_mem_types("UVX") == []
        with pytest.raises(nixl.nixlInvalidParamError):
            a.create_backend("UCX")
        with pytest.raises(KeyError):  # the operation is checked first
            a.make_prepped_xfer("RD", 0, [], 0, [])  # type: ignore[arg-type]
        with pytest.raises(KeyError):
            a.register_memory([(1, 2, 0, "")], "DRAM", backends=["GDS"])
    finally:
        a.close()


# ---------------------------------------------------------------- transfers


def test_write_with_notification_after_data(agents: Any) -> None:
    a, b, x, y, _, _ = _pair(agents, capture_telemetry=True)
    x.np[:4096] = np.arange(4096, dtype=np.uint64).astype(np.uint8)
    local = a.get_xfer_descs([(x.addr, 2048, 0), (x.addr + 2048, 2048, 0)], "DRAM")
    remote = a.get_xfer_descs([(y.addr + 8192, 2048, 0), (y.addr + 10240, 2048, 0)], "DRAM")
    h = a.initialize_xfer("WRITE", local, remote, b.name, b"w-1")
    assert repr(h).startswith("nixl_xfer_handle(0x") and h
    assert a.transfer(h) in ("DONE", "PROC")
    # The target looks at its memory the moment the notification is there.
    deadline = time.monotonic() + STEP
    while not b.check_remote_xfer_done(a.name, b"w-"):
        assert time.monotonic() < deadline
    assert np.array_equal(y.np[8192:12288], x.np[:4096])
    assert _wait(a, h) == "DONE" and a.check_xfer_state(h) == "DONE"
    t = a.get_xfer_telemetry(h)
    assert (t.descCount, t.totalBytes) == (2, 4096)
    assert t.startTime > 0 and 0 < t.postDuration <= t.xferDuration
    assert a.query_xfer_backend(h) == "UCX"
    assert a.estimate_xfer_cost(h)[2] == "UNKNOWN"
    h.release()
    h.release()  # idempotent


def test_notifications_once_each_empty_and_large(agents: Any) -> None:
    a, b, *_ = _pair(agents)
    big = bytes(range(256)) * 100  # 25.6 KB: more than one aioxfer notification
    a.send_notif(b.name, b"")
    a.send_notif(b.name.encode(), "text")  # str message, bytes name
    a.send_notif(b.name, big)
    got: list[bytes] = []
    deadline = time.monotonic() + STEP
    while len(got) < 3:
        assert time.monotonic() < deadline
        for name, msgs in b.get_new_notifs().items():
            assert isinstance(name, str) and name == a.name
            got += msgs
    assert got == [b"", b"text", big]
    assert b.get_new_notifs() == {}
    # check_remote_xfer_done consumes only the first match; b"" matches anything.
    for m in (b"tag-1 x", b"other", b"tag-2"):
        a.send_notif(b.name, m)
    deadline = time.monotonic() + STEP
    while len(b.update_notifs().get(a.name, [])) < 3:
        assert time.monotonic() < deadline
    assert not b.check_remote_xfer_done(a.name, b"x")  # prefix match by default
    assert b.check_remote_xfer_done(a.name, b"x", tag_is_prefix=False)
    assert b.check_remote_xfer_done(a.name, b"tag-")
    assert b.notifs[a.name] == [b"other"]
    assert b.check_remote_xfer_done(a.name, b"")
    assert not b.check_remote_xfer_done(a.name, b"")
    with pytest.raises(nixl.nixlNotFoundError):
        b.send_notif("nobody", b"x")


def test_prepped_requests_errors(agents: Any) -> None:
    a, b, x, y, _, _ = _pair(agents)
    remote = a.prep_xfer_dlist(b.name, [(y.addr, 64, 0), (y.addr + 64, 64, 0)], "DRAM")
    local = a.prep_xfer_dlist("", [(x.addr, 64, 0), (x.addr + 64, 128, 0)], "DRAM")
    for li, ri in (([0], [0, 1]), ([5], [0]), ([], []), ([1], [1]), ([-1], [0])):
        with pytest.raises(nixl.nixlInvalidParamError):
            a.make_prepped_xfer("READ", local, li, remote, ri)
    with pytest.raises(nixl.nixlNotFoundError):
        a.prep_xfer_dlist(b.name, [(y.addr + y.n - 8, 64, 0)], "DRAM")  # past the region
    with pytest.raises(nixl.nixlNotFoundError):
        a.prep_xfer_dlist("nobody", [(y.addr, 64, 0)], "DRAM")
    with pytest.raises(nixl.nixlInvalidParamError):
        a.add_remote_agent(a.get_agent_metadata())  # our own
    with pytest.raises(nixl.nixlMismatchError):  # NIXL 1.5.1's answer (nixl22)
        a.add_remote_agent(b"garbage")
    # int64 numpy indices (vLLM) and int lists alike.
    h = a.make_prepped_xfer("READ", local, np.array([0], np.int64), remote, [1], b"r")
    assert a.transfer(h) in ("DONE", "PROC") and _wait(a, h) == "DONE"
    assert np.array_equal(x.np[:64], y.np[64:128])
    # One without a notification (postXferReq's hot path) too.
    plain = a.make_prepped_xfer("READ", local, [0], remote, [0])
    assert a.transfer(plain) in ("DONE", "PROC") and _wait(a, plain) == "DONE"
    a.remove_remote_agent(b.name)
    with pytest.raises(nixl.nixlNotFoundError):
        a.make_prepped_xfer("READ", local, [0], remote, [0])
    # NIXL 1.5.1: a request made before remove_remote_agent is NOT_FOUND (nixl22).
    with pytest.raises(nixl.nixlNotFoundError):
        a.transfer(h)
    with pytest.raises(nixl.nixlNotFoundError):
        a.transfer(plain)
    remote.release()
    remote.release()
    # Re-adding after removal works.
    assert a.add_remote_agent(b.get_agent_metadata()) == b.name.encode()
    h2 = a.initialize_xfer("WRITE", a.get_xfer_descs([(x.addr, 16, 0)], "DRAM"),
                           a.get_xfer_descs([(y.addr, 16, 0)], "DRAM"), b.name)
    assert a.transfer(h2) in ("DONE", "PROC") and _wait(a, h2) == "DONE"


def test_repost_while_in_flight_is_refused(agents: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOXFER_NIXL_TRANSPORTS", "tcp")
    n = 64 << 20
    a, b, x, y, _, _ = _pair(agents, n=n)
    h = a.initialize_xfer("READ", a.get_xfer_descs([(x.addr, n, 0)], "DRAM"),
                          a.get_xfer_descs([(y.addr, n, 0)], "DRAM"), b.name)
    assert a.transfer(h) == "PROC"  # 64 MiB over TCP cannot finish inside the call
    with pytest.raises(nixl.nixlRepostActiveError):
        a.transfer(h)
    assert _wait(a, h) == "DONE"
    assert x.np[n - 1] == 2


def test_telemetry_switches(agents: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, x, y, _, _ = _pair(agents)
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(x.addr, 64, 0)], "DRAM"),
                          a.get_xfer_descs([(y.addr, 64, 0)], "DRAM"), b.name)
    a.transfer(h)
    _wait(a, h)
    with pytest.raises(nixl.nixlNoTelemetryError):
        a.get_xfer_telemetry(h)
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "no")  # wins over capture_telemetry=True
    c = agents(capture_telemetry=True)
    assert c.agent._telemetry is False
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "Enable")  # NIXL's words, any case
    assert agents().agent._telemetry is True



def _ring_events(path: Any) -> tuple[tuple[int, ...], list[tuple[str, int]]]:
    """NIXL's telemetry ring file as its readers see it (telemetry_reader.py's
    layout): the header and the unread (event name, value) pairs."""
    import struct

    data = path.read_bytes()
    header = struct.unpack_from("<QQiiQQ", data, 0)
    write_pos, read_pos, _, _, capacity, mask = header
    assert len(data) == 40 + 16 * capacity
    events = []
    i = read_pos
    while i != write_pos:
        etype, value = struct.unpack_from("<I4xQ", data, 40 + 16 * i)
        events.append((_telemetry.EVENT_NAMES[etype], value))
        i = (i + 1) & mask
    return header, events


def test_telemetry_file_as_nixl_writes_it(agents: Any, monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Any) -> None:
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "yes")
    monkeypatch.setenv("NIXL_TELEMETRY_DIR", str(tmp_path))
    a, b, x, y, ra, _ = _pair(agents, n=128)
    assert {p.name for p in tmp_path.iterdir()} == {a.name, b.name}  # one file per agent
    local = a.get_xfer_descs([(x.addr, 64, 0), (x.addr + 64, 64, 0)], "DRAM")
    remote = a.get_xfer_descs([(y.addr, 64, 0), (y.addr + 64, 64, 0)], "DRAM")
    times = []
    for op in ("WRITE", "READ"):
        h = a.initialize_xfer(op, local, remote, b.name)
        with pytest.raises(nixl.nixlNotPostedError):
            a.get_xfer_telemetry(h)
        a.transfer(h)
        assert _wait(a, h) == "DONE"
        t = a.get_xfer_telemetry(h)
        assert (t.descCount, t.totalBytes) == (2, 128)
        assert 0 < t.postDuration <= t.xferDuration
        # µs of the steady clock, as NIXL's
        assert 0 < t.startTime <= time.monotonic_ns() // 1000
        times.append((t.postDuration, t.xferDuration))
        h.release()
    with pytest.raises(nixl.nixlNotFoundError):
        a.prep_xfer_dlist("nobody", [(y.addr, 64, 0)], "DRAM")
    with pytest.raises(nixl.nixlInvalidParamError):
        a.initialize_xfer("WRITE", local, a.get_xfer_descs([(y.addr, 64, 0)], "DRAM"), b.name)
    a.deregister_memory(ra)
    a.close()  # writes what is staged (NIXL writes every NIXL_TELEMETRY_RUN_INTERVAL ms)
    header, events = _ring_events(tmp_path / a.name)
    assert header[2:] == (4, 4, 4096, 4095)  # version, expected version, capacity, mask
    (wp, wx), (rp, rx) = times
    assert events == [
        ("agent_memory_registered", 128),
        ("agent_xfer_post_time", wp), ("agent_xfer_time", wx),
        ("agent_tx_bytes", 128), ("agent_tx_requests_num", 1),
        ("agent_xfer_post_time", rp), ("agent_xfer_time", rx),
        ("agent_rx_bytes", 128), ("agent_rx_requests_num", 1),
        ("agent_err_not_found", 1),  # NIXL counts this one, not a size mismatch
        ("agent_memory_deregistered", 128),
    ]
    assert (tmp_path / a.name).exists()  # the file stays, as NIXL's


def test_telemetry_flushes_on_its_interval_and_filters(
        agents: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "1")
    monkeypatch.setenv("NIXL_TELEMETRY_DIR", str(tmp_path))
    monkeypatch.setenv("NIXL_TELEMETRY_RUN_INTERVAL", "5")
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLED_METRICS", "agent_tx_*, nothing_matches")
    a, b, x, y, _, _ = _pair(agents, n=4096)
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(x.addr, 4096, 0)], "DRAM"),
                          a.get_xfer_descs([(y.addr, 4096, 0)], "DRAM"), b.name)
    for _ in range(3):
        a.transfer(h)
        assert _wait(a, h) == "DONE"
    deadline = time.monotonic() + STEP
    while len(_ring_events(tmp_path / a.name)[1]) < 6:  # written by the loop, agent still open
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert _ring_events(tmp_path / a.name)[1] == [("agent_tx_bytes", 4096),
                                                  ("agent_tx_requests_num", 1)] * 3


def test_telemetry_staging_drops_are_counted(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Any) -> None:
    import asyncio

    monkeypatch.setenv("NIXL_TELEMETRY_DIR", str(tmp_path))
    monkeypatch.setenv("NIXL_TELEMETRY_BUFFER_SIZE", "8")
    loop = asyncio.new_event_loop()
    try:
        tel = _telemetry.Telemetry("t", loop, lambda level, msg: None)
        tel.add(_telemetry.MEMORY_REGISTERED, 10)
        tel.add(_telemetry.MEMORY_REGISTERED, 20)
        tel.xfer(True, 100, 1, 2)
        tel.xfer(False, 200, 3, 4)  # 6 staged + 4 > 8: the whole batch is dropped
        tel.flush()
        _, events = _ring_events(tmp_path / "t")
        assert events[-1] == ("agent_telemetry_events_dropped", 4)
        assert len(events) == 7  # a ring of 8 holds 7, as NIXL's
        tel.close()
    finally:
        loop.close()


@pytest.mark.parametrize("env, error", [
    ({"NIXL_TELEMETRY_ENABLE": "maybe"}, RuntimeError),
    ({"NIXL_TELEMETRY_ENABLE": "y", "NIXL_TELEMETRY_BUFFER_SIZE": "0"}, ValueError),
    ({"NIXL_TELEMETRY_ENABLE": "y", "NIXL_TELEMETRY_BUFFER_SIZE": "1000",
      "NIXL_TELEMETRY_DIR": "{tmp}"}, RuntimeError),
    ({"NIXL_TELEMETRY_ENABLE": "y", "NIXL_TELEMETRY_DIR": "{tmp}/absent"}, RuntimeError),
    ({"NIXL_TELEMETRY_ENABLE": "y", "NIXL_TELEMETRY_EXPORTER": "BUFFER"}, RuntimeError),
    ({"NIXL_TELEMETRY_ENABLE": "y", "NIXL_TELEMETRY_EXPORTER": "nosuch"}, RuntimeError),
])
def test_telemetry_configuration_errors_refuse_the_agent(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any, env: dict[str, str],
        error: type[Exception]) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v.format(tmp=tmp_path))
    with pytest.raises(error):
        nixl_agent(_name(), nixl_agent_config(backends=[]))
    assert not list(tmp_path.iterdir())


def test_telemetry_without_a_sink_still_answers(agents: Any, monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Any) -> None:
    # Capture only (no NIXL_TELEMETRY_DIR), or NOP: getXferTelemetry works,
    # nothing is written.
    monkeypatch.setenv("NIXL_TELEMETRY_EXPORTER", "NOP")
    monkeypatch.setenv("NIXL_TELEMETRY_DIR", str(tmp_path))
    a, b, x, y, _, _ = _pair(agents, capture_telemetry=True)
    h = a.initialize_xfer("READ", a.get_xfer_descs([(x.addr, 64, 0)], "DRAM"),
                          a.get_xfer_descs([(y.addr, 64, 0)], "DRAM"), b.name)
    a.transfer(h)
    assert _wait(a, h) == "DONE"
    assert a.get_xfer_telemetry(h).totalBytes == 64
    assert not list(tmp_path.iterdir())

def test_loopback_and_descriptors_across_regions(agents: Any) -> None:
    a = agents()
    x1, x2, y = Buf(4096, 5), Buf(4096, 6), Buf(8192, 0)
    a.register_memory([(x1.addr, 4096, 0, ""), (x2.addr, 4096, 0, "")], "DRAM")
    a.register_memory([(y.addr, 8192, 0, "")], "DRAM")
    # Own name: a loopback target, as NIXL's prep_xfer_perf uses it.
    local = a.prep_xfer_dlist("", [(x1.addr, 4096, 0), (x2.addr, 4096, 0)], "DRAM")
    far = a.prep_xfer_dlist(a.name, [(y.addr + 4096, 4096, 0), (y.addr, 4096, 0)], "DRAM")
    h = a.make_prepped_xfer("WRITE", local, [0, 1], far, [0, 1], b"loop")
    assert a.transfer(h) in ("DONE", "PROC") and _wait(a, h) == "DONE"
    assert (y.np[4096:] == 5).all() and (y.np[:4096] == 6).all()
    deadline = time.monotonic() + STEP
    while not a.check_remote_xfer_done(a.name, b"loop"):
        assert time.monotonic() < deadline



@pytest.mark.parametrize("regions", [16, 2])
def test_requests_spanning_many_region_pairs(agents: Any, regions: int) -> None:
    # 16 regions of one block each (one aioxfer request of Segment lists) or
    # 2 of 8 blocks each (a SegmentList pair per region pair): the same data
    # lands, in a scattered order, and the notification comes after all of it.
    block, nblocks = 1024, 16
    per = nblocks // regions
    a, b = agents(), agents()
    src = [Buf(per * block) for _ in range(regions)]
    for r, buf in enumerate(src):
        buf.np[:] = (np.arange(per * block) // block + r * per).astype(np.uint8) + 1
    dst = Buf(nblocks * block)
    a.register_memory([(s_.addr, per * block, 0, "") for s_ in src], "DRAM")
    b.register_memory([(dst.addr, nblocks * block, 0, "")], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    local = a.prep_xfer_dlist("", [(src[i // per].addr + (i % per) * block, block, 0)
                                   for i in range(nblocks)], "DRAM")
    far = a.prep_xfer_dlist(b.name, [(dst.addr + i * block, block, 0)
                                     for i in range(nblocks)], "DRAM")
    li = np.random.default_rng(regions).permutation(nblocks)
    ri = np.random.default_rng(regions + 1).permutation(nblocks)
    h = a.make_prepped_xfer("WRITE", local, li, far, ri.tolist(), b"spread")
    assert a.transfer(h) in ("DONE", "PROC")
    deadline = time.monotonic() + STEP
    while not b.check_remote_xfer_done(a.name, b"spread"):
        assert time.monotonic() < deadline
    for lb, rb in zip(li.tolist(), ri.tolist(), strict=True):  # all there at the notification
        assert (dst.np[rb * block:(rb + 1) * block] == lb + 1).all()
    assert _wait(a, h) == "DONE"
    for buf in src:
        buf.np[:] = 0
    back = a.make_prepped_xfer("READ", local, li, far, ri)  # each block home again
    assert a.transfer(back) in ("DONE", "PROC") and _wait(a, back) == "DONE"
    for i in range(nblocks):
        got = src[i // per].np[(i % per) * block:(i % per + 1) * block]
        assert (got == i + 1).all()

def test_dead_peer_metadata_and_deregistration(agents: Any) -> None:
    a, b, x, y, ra, rb = _pair(agents)
    md = b.get_agent_metadata()
    a.remove_remote_agent(b.name)
    b.deregister_memory(rb)
    with pytest.raises(nixl.nixlNotFoundError):
        b.deregister_memory(rb)  # twice
    b.close()
    with pytest.raises(nixl.nixlBackendError):
        a.add_remote_agent(md)  # nobody at that address any more
    a.deregister_memory(ra)


def test_listener_exchange_and_partial_metadata(agents: Any) -> None:
    t = agents(enable_listen_thread=True, listen_port=0)
    i = agents(enable_listen_thread=True, listen_port=0)
    tport, iport = t.agent.listen_port, i.agent.listen_port
    b1, b2, mine = Buf(256, 7), Buf(256, 8), Buf(512, 0)
    d1 = t.get_reg_descs([(b1.addr, 256, 0, "")], "DRAM")
    d2 = t.get_reg_descs([(b2.addr, 256, 0, "")], "DRAM")
    t.register_memory(d1)
    t.register_memory(d2)
    i.register_memory([(mine.addr, 512, 0, "")], "DRAM")
    t.send_partial_agent_metadata(d1, True, ["UCX"], "127.0.0.1", iport)
    deadline = time.monotonic() + STEP
    while not i.check_remote_metadata(t.name, d1.trim()):
        assert time.monotonic() < deadline
    assert not i.check_remote_metadata(t.name, d2.trim())
    with pytest.raises(nixl.nixlNotFoundError):  # not sent yet
        i.initialize_xfer("READ", i.get_xfer_descs([(mine.addr, 256, 0)], "DRAM"), d2.trim(),
                          t.name)
    h = i.initialize_xfer("READ", i.get_xfer_descs([(mine.addr, 256, 0)], "DRAM"), d1.trim(),
                          t.name, b"UUID1")
    assert i.transfer(h) in ("DONE", "PROC") and _wait(i, h) == "DONE"
    assert (mine.np[:256] == 7).all()
    # Full metadata by fetch and push; then invalidation removes us at the peer.
    i.fetch_remote_metadata(t.name, "127.0.0.1", tport)
    i.send_local_metadata("127.0.0.1", tport)
    deadline = time.monotonic() + STEP
    while not (i.check_remote_metadata(t.name, d2.trim())
               and t.check_remote_metadata(i.name)):
        assert time.monotonic() < deadline
    i.invalidate_local_metadata("127.0.0.1", tport)
    deadline = time.monotonic() + STEP
    while t.check_remote_metadata(i.name):
        assert time.monotonic() < deadline


def test_one_agent_from_many_threads(agents: Any) -> None:
    a, b, x, y, _, _ = _pair(agents, n=1 << 20)
    y.np[:] = np.arange(y.n, dtype=np.uint64).astype(np.uint8)
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            off = k * (128 << 10)
            h = a.initialize_xfer("READ", a.get_xfer_descs([(x.addr + off, 64 << 10, 0)], "DRAM"),
                                  a.get_xfer_descs([(y.addr + off, 64 << 10, 0)], "DRAM"),
                                  b.name, f"t{k}".encode())
            for _ in range(50):
                a.transfer(h)
                assert _wait(a, h) == "DONE"
                a.get_new_notifs()
            h.release()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(STEP * 3)
    assert not errors, errors
    for k in range(4):
        off = k * (128 << 10)
        assert np.array_equal(x.np[off:off + (64 << 10)], y.np[off:off + (64 << 10)])
    seen: set[bytes] = set()
    deadline = time.monotonic() + STEP
    while len(seen) < 4:
        assert time.monotonic() < deadline
        seen.update(b.get_new_notifs().get(a.name, []))
    assert seen == {b"t0", b"t1", b"t2", b"t3"}


@pytest.mark.parametrize("transports", ["", "tcp"])
def test_plain_reposts_from_many_threads(agents: Any, monkeypatch: pytest.MonkeyPatch,
                                         transports: str) -> None:
    """Reposts without a notification (nixl_agent.transfer's straight-line
    path) from several threads at once: each of four threads reposts its own
    request and finds its blocks in place whenever it sees DONE; two more race
    on one shared request, which may be refused (nixlRepostActiveError) but
    never fails otherwise, and still moves its data."""
    if transports:
        monkeypatch.setenv("AIOXFER_NIXL_TRANSPORTS", transports)
    blk, nblk = 16 << 10, 16
    a, b, x, y, _, _ = _pair(agents, n=blk * nblk)
    assert a.transfer.__func__ is _bindings.nixlAgent.xferTransfer  # type: ignore[attr-defined]
    y.np[:] = (np.arange(y.n) % 251).astype(np.uint8)
    local = a.prep_xfer_dlist("", [(x.addr + k * blk, blk, 0) for k in range(nblk)], "DRAM")
    remote = a.prep_xfer_dlist(b.name, [(y.addr + k * blk, blk, 0) for k in range(nblk)],
                               "DRAM")
    errors: list[BaseException] = []
    shared = a.make_prepped_xfer("READ", local, [14, 15], remote, [14, 15])

    def own(k: int) -> None:
        try:
            ids = [3 * k, 3 * k + 1, 3 * k + 2]
            h = a.make_prepped_xfer("READ", local, ids, remote, ids)
            mine, theirs = x.np[3 * k * blk:(3 * k + 3) * blk], y.np[3 * k * blk:(3 * k + 3) * blk]
            for _ in range(100):
                mine[:] = 0
                if a.transfer(h) != "DONE":
                    assert _wait(a, h) == "DONE"
                assert np.array_equal(mine, theirs)
            h.release()
        except BaseException as exc:
            errors.append(exc)

    def racing() -> None:
        try:
            for _ in range(100):
                try:
                    st = a.transfer(shared)
                except nixl.nixlRepostActiveError:
                    st = "PROC"  # the other thread's post: wait for it too
                if st != "DONE":
                    assert _wait(a, shared) == "DONE"
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=own, args=(k,)) for k in range(4)]
    threads += [threading.Thread(target=racing) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(STEP * 3)
    assert not any(th.is_alive() for th in threads)
    assert not errors, errors
    x.np[14 * blk:] = 0
    if a.transfer(shared) != "DONE":
        assert _wait(a, shared) == "DONE"
    assert np.array_equal(x.np[14 * blk:], y.np[14 * blk:])


def test_utils_buffers() -> None:
    a, b = _utils.malloc_passthru(1000), _utils.malloc_passthru(1000)
    try:
        assert a % 4096 == 0
        _utils.ba_buf(a, 1000)
        ctypes.memmove(b, a, 1000)
        _utils.verify_transfer(a, b, 1000)
        ctypes.memset(b + 999, 0, 1)
        with pytest.raises(AssertionError):
            _utils.verify_transfer(a, b, 1000)
    finally:
        _utils.free_passthru(a)
        _utils.free_passthru(b)


def test_central_store_partial_metadata_by_label(
    etcd_server: str,  # noqa: F811 (the fixture imported above)
    monkeypatch: pytest.MonkeyPatch,
    agents: Any,
) -> None:
    """NIXL_ETCD_ENDPOINTS: metadata through etcd under labels (partial_md_example --etcd)."""
    monkeypatch.setenv("NIXL_ETCD_ENDPOINTS", f"http://{etcd_server}")
    t, i = agents(), agents()
    b1, b2, mine = Buf(256, 3), Buf(256, 4), Buf(256, 0)
    d1 = t.get_reg_descs([(b1.addr, 256, 0, "")], "DRAM")
    d2 = t.get_reg_descs([(b2.addr, 256, 0, "")], "DRAM")
    t.register_memory(d1)
    t.register_memory(d2)
    i.register_memory([(mine.addr, 256, 0, "")], "DRAM")
    local = i.get_xfer_descs([(mine.addr, 256, 0)], "DRAM")
    t.send_partial_agent_metadata(d1, True, ["UCX"], label="label_1")
    i.fetch_remote_metadata(t.name, label="label_1")
    deadline = time.monotonic() + STEP
    while not i.check_remote_metadata(t.name, d1.trim()):
        assert time.monotonic() < deadline
    with pytest.raises(nixl.nixlNotFoundError):
        i.initialize_xfer("READ", local, d2.trim(), t.name)
    t.send_partial_agent_metadata(d2, True, ["UCX"], label="label_2")
    i.fetch_remote_metadata(t.name, label="label_2")
    deadline = time.monotonic() + STEP
    while True:
        try:
            h = i.initialize_xfer("READ", local, d2.trim(), t.name, b"UUID1")
            break
        except nixl.nixlNotFoundError:
            assert time.monotonic() < deadline
    assert i.transfer(h) in ("DONE", "PROC") and _wait(i, h) == "DONE"
    assert (mine.np == 4).all()
    deadline = time.monotonic() + STEP
    while not t.check_remote_xfer_done(i.name, b"UUID1"):
        assert time.monotonic() < deadline
    t.invalidate_local_metadata()
    t.send_local_metadata()
    i.fetch_remote_metadata(t.name)  # the whole, under "metadata"
    deadline = time.monotonic() + STEP
    while not i.check_remote_metadata(t.name, t.get_xfer_descs(
            [(b1.addr, 256, 0), (b2.addr, 256, 0)], "DRAM")):
        assert time.monotonic() < deadline
    t.invalidate_local_metadata()


def test_no_central_store_without_endpoints(monkeypatch: pytest.MonkeyPatch, agents: Any) -> None:
    monkeypatch.delenv("NIXL_ETCD_ENDPOINTS", raising=False)
    with pytest.raises(nixl.nixlInvalidParamError):  # NIXL 1.5.1's answer (nixl22)
        agents().send_local_metadata()
    # Set but empty: NIXL refuses to make the agent.
    monkeypatch.setenv("NIXL_ETCD_ENDPOINTS", "")
    with pytest.raises(RuntimeError, match="NIXL_ETCD_ENDPOINTS"):
        agents()


# ---------------------------------------------------------------- the runtime's fd claims


def test_claimed_fd_is_the_pollers_until_its_linger_ends_or_a_blocking_call() -> None:
    from aioxfer.nixl._runtime import runtime

    rt = runtime()
    efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    fired = threading.Event()

    def on_readable() -> None:
        os.eventfd_read(efd)
        fired.set()

    async def watch() -> None:
        rt.loop.add_reader(efd, on_readable)

    async def unwatch() -> None:
        rt.loop.remove_reader(efd)

    async def nothing() -> None:
        pass

    rt.run(watch())
    try:
        # Held: the loop thread never reads it, however long the poller waits.
        with rt.locked():
            assert rt.claim(efd)
        os.eventfd_write(efd, 1)
        assert not fired.wait(0.2)
        # Released with a linger: the loop thread takes it back when the linger ends.
        with rt.locked():
            rt.release(efd, 0.05)
        assert fired.wait(STEP)
        fired.clear()
        # A linger of an hour: a blocking call gives it back first.
        with rt.locked():
            assert rt.claim(efd)
            rt.release(efd, 3600.0)
        os.eventfd_write(efd, 1)
        rt.run(nothing())
        assert fired.wait(STEP)
    finally:
        rt.run(unwatch())
        os.close(efd)
    with rt.locked():
        assert not rt.claim(efd)  # no longer the loop's: nothing to claim


@contextlib.contextmanager
def _linger(seconds: float) -> Iterator[None]:
    """_LINGER set to ``seconds``, for the Python methods and for the
    compiled check (its copy in nixlAgent._nx_consts, read again)."""
    from aioxfer import _cyx

    consts = _bindings.nixlAgent._nx_consts
    i = consts.index(_bindings._LINGER)
    linger = _bindings._LINGER
    _bindings._LINGER = seconds
    _bindings.nixlAgent._nx_consts = (*consts[:i], seconds, *consts[i + 1:])
    _cyx.nixl_consts_reset()
    try:
        yield
    finally:
        _bindings._LINGER = linger
        _bindings.nixlAgent._nx_consts = consts
        _cyx.nixl_consts_reset()


def test_tight_poller_leaves_notifications_and_blocking_calls_working(
        agents: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # A claim that would linger for an hour after a tight polling loop.
    with _linger(3600.0):
        a, b, x, y, _, _ = _pair(agents, n=4 << 20)
        b.add_remote_agent(a.get_agent_metadata())
        y.np[:] = np.arange(y.n, dtype=np.uint64).astype(np.uint8)
        h = a.initialize_xfer("READ", a.get_xfer_descs([(x.addr, y.n, 0)], "DRAM"),
                              a.get_xfer_descs([(y.addr, y.n, 0)], "DRAM"), b.name)
        for _ in range(5):
            a.transfer(h)
            assert _wait(a, h) == "DONE"
        assert np.array_equal(x.np, y.np)
        # The poller's agent still gets what comes to it: by get_new_notifs...
        b.send_notif(a.name, b"to-the-poller")
        deadline = time.monotonic() + STEP
        got: list[bytes] = []
        while not got:
            assert time.monotonic() < deadline
            got = a.get_new_notifs().get(b.name, [])
            time.sleep(0.001)  # not a tight poller
        assert got == [b"to-the-poller"]
        # ... and a blocking call that needs the engine (connect, metadata) works.
        c = agents()
        assert a.add_remote_agent(c.get_agent_metadata()) == c.name.encode()
        assert c.add_remote_agent(a.get_agent_metadata()) == a.name.encode()
        h.release()


@pytest.mark.parametrize("progress", ["adaptive", "sleep", "poll"])
def test_tight_poller_takes_tcp_completions_on_its_own_thread(
        agents: Any, monkeypatch: pytest.MonkeyPatch, progress: str) -> None:
    # Over tcp a completion comes from an engine thread. A caller polling
    # check_xfer_state in a loop takes it itself (a bounded spin first, in
    # "adaptive" and "poll", then a sleep on the engine's fd it claimed): the
    # loop thread runs no round for it, and no callback of its completes it.
    monkeypatch.setenv("AIOXFER_NIXL_TRANSPORTS", "tcp")
    monkeypatch.setenv("AIOXFER_NIXL_PROGRESS", progress)
    from aioxfer.nixl._runtime import runtime
    from aioxfer.submission import SPIN_ALONE_MAX

    with _linger(3600.0):  # no loop round to take the fd back
        n = SPIN_ALONE_MAX + (256 << 10)  # past the latency-bound spin: poll_us only
        a, b, x, y, _, _ = _pair(agents, n=n)
        ba = a.agent
        assert ba._agent.transports == ("tcp",) and ba._agent.progress == "sleep"
        polls: list[int] = []
        spins: list[int] = []
        poll, wait_poll = ba._poll_fn, ba._wait_poll

        def counted_poll() -> None:
            polls.append(threading.get_ident())
            poll()

        def counted_wait_poll(max_us: int) -> bool:
            if max_us:
                spins.append(max_us)
            caught = wait_poll(max_us)
            if caught:  # (it polled)
                polls.append(threading.get_ident())
            return caught

        monkeypatch.setattr(ba, "_poll_fn", counted_poll)
        monkeypatch.setattr(ba, "_wait_poll", counted_wait_poll)
        monkeypatch.setattr(ba, "_ns", ba._nixl_cache())  # (xferState's resolved fields)
        rt = runtime()
        # The loop thread's wake-ups for this agent's engine fd (not its rounds:
        # the runtime is the process's, and what earlier tests left on its loop,
        # closes or retries, runs rounds of its own, more of them the longer
        # this test takes on a loaded machine: once 20 or more).
        fd, select_ = ba._fd, rt.selector.select
        woke: list[int] = []

        def counted_select(timeout: float | None = None) -> Any:
            events = select_(timeout)
            woke.extend(1 for key, _ in events if key.fd == fd)
            return events

        monkeypatch.setattr(rt.selector, "select", counted_select)
        h = a.initialize_xfer("READ", a.get_xfer_descs([(x.addr, n, 0)], "DRAM"),
                              a.get_xfer_descs([(y.addr, n, 0)], "DRAM"), b.name)
        for i in range(40):
            y.np[:] = i
            a.transfer(h)
            assert _wait(a, h) == "DONE"
            assert x.np[0] == x.np[-1] == i
        # At most for the first completions, before the first wait claimed the fd
        # (40 for "sleep", whose every completion signals the fd, if it did not;
        # a full CI run on a machine loaded by a benchmark once saw 3: a select
        # already returning as the claim came).
        assert len(woke) <= 4
        assert polls and set(polls) == {threading.get_ident()}
        poll_us = ba._agent._engine.poll_us
        expected = {"adaptive": {poll_us}, "sleep": set(),
                    "poll": {max(poll_us, aioxfer_progress.POLL_SLICE_US)}}[progress]
        assert set(spins) <= expected
        # Polling for notifications with nothing in flight only sleeps.
        spins.clear()
        for _ in range(5):
            assert a.get_new_notifs() == {}
        assert spins == []
        h.release()


def test_tight_poller_stops_spinning_for_a_request_that_outlasts_the_spin(
        agents: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # 16 MiB over tcp loopback takes milliseconds (the bytes are copied into
    # and out of the sockets), far beyond _SPIN_KEEP spins (each at most
    # 200 µs): spun for _SPIN_MISSES times, then slept for, its core left to
    # the engine's threads, but for a probe every _SPIN_PROBE-th wait.
    monkeypatch.setenv("AIOXFER_NIXL_TRANSPORTS", "tcp")
    n = 16 << 20
    a, b, x, y, _, _ = _pair(agents, n=n)
    ba = a.agent
    spins: list[int] = []
    waits: list[int] = []
    wait_poll = ba._wait_poll

    # Each wait (compiled, _cyx.nixl_state, or _wait_completion) looks at
    # the ring or spins with one wait_poll call before any sleep.
    def counted_wait_poll(max_us: int) -> bool:
        waits.append(1)
        if max_us:
            spins.append(max_us)
        return wait_poll(max_us)

    monkeypatch.setattr(ba, "_wait_poll", counted_wait_poll)
    monkeypatch.setattr(ba, "_ns", ba._nixl_cache())  # (xferState's resolved fields)
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(x.addr, n, 0)], "DRAM"),
                          a.get_xfer_descs([(y.addr, n, 0)], "DRAM"), b.name)
    for i in range(_bindings._SPIN_MISSES + _bindings._SPIN_PROBE):
        x.np[:] = i
        a.transfer(h)
        assert _wait(a, h) == "DONE"
        assert y.np[0] == y.np[-1] == i
    # (A post waited for longer than _ENGINE_WAIT is waited for again: the
    # probes count waits, not posts. A probe that happens to catch the end of
    # a post no longer counts as soon (it is not soon after the post: it once
    # started another run of _SPIN_MISSES spins, up to 20 spins for ~35 waits
    # on a loaded machine); the bound still allows that run.)
    probes = len(waits) // _bindings._SPIN_PROBE
    assert len(spins) <= _bindings._SPIN_MISSES * (1 + probes) + probes
    assert len(spins) < len(waits) // 2
    assert set(spins) == {ba._agent._engine.poll_us}
    h.release()


def _spin_states(outcomes: str) -> str:
    # A request's spin policy fed completions: "s" soon, "l" late, where the
    # poller waited; "S" where it spun for the request, "-" where it did not.
    x = _bindings._Xfer(1, None, None, 0, [((), ())], b"", 1, 0, 0, False)
    out = []
    for o in outcomes:
        out.append("S" if _bindings._spin_wanted(x) else "-")
        _bindings._spin_outcome(x, o == "s")
    return "".join(out)


def test_spin_policy_stops_after_misses_running_and_probes() -> None:
    assert (_bindings._SPIN_MISSES, _bindings._SPIN_PROBE) == (3, 16)
    # One late post (a pause, a busy machine) does not stop the spin; nor
    # two; a soon one in between starts the count again.
    assert _spin_states("lslsllsl") == "SSSSSSSS"
    # Three running do; then only every 16th wait spins, a probe ...
    late = "l" * 3 + "l" * 32
    assert _spin_states(late) == "SSS" + ("-" * 15 + "S") * 2
    # ... and a request soon again (caught by the probe, or slept for and
    # woken in time) is spun for on its next posts.
    assert _spin_states("lll" + "l" * 15 + "s" + "ll") == "SSS" + "-" * 15 + "SSS"
    assert _spin_states("lll" + "ls" + "l") == "SSS" + "--" + "S"


def test_tight_poller_spins_for_a_small_request_as_an_awaiting_coroutine_would() -> None:
    # A request up to the agent's SPIN_ALONE_MAX (as its spin_alone) is spun
    # for up to ALONE_LATENCIES (5) times its average time to completion, at most ALONE_MAX_US
    # (a tcp round trip outlasts the engine's poll_us, and a miss costs a
    # wake-up); a larger one only for poll_us (budget 0), as before.
    from aioxfer.submission import SPIN_ALONE_MAX

    def xfer(nbytes: int) -> Any:
        return _bindings._Xfer(1, None, None, 0, [((), ())], b"", 1, nbytes, 0, False)

    small = xfer(4096)
    assert small.budget == 0  # nothing known yet: poll_us
    _bindings._note_latency(small, 40e-6)
    assert small.budget == 200
    for _ in range(64):
        _bindings._note_latency(small, 100e-6)
    assert 475 <= small.budget <= 500
    # One slow post moves the average by an eighth: the spin stays bounded.
    _bindings._note_latency(small, 1.0)
    assert small.budget == aioxfer_progress.ALONE_MAX_US
    edge = xfer(SPIN_ALONE_MAX)
    _bindings._note_latency(edge, 40e-6)
    assert edge.budget == 200
    big = xfer(SPIN_ALONE_MAX + 1)
    _bindings._note_latency(big, 40e-6)
    assert big.budget == 0 and big.lat == 40e-6


def test_unknown_progress_mode_refuses_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOXFER_NIXL_PROGRESS", "spin")
    with pytest.raises(nixl.nixlBackendError, match="progress must be one of"):
        nixl_agent(_name(), nixl_agent_config())


# ---------------------------------------------------------------- POSIX: files


@pytest.mark.parametrize("backends", [[], ["UCX"]])
def test_posix_backend_moves_host_memory_to_files_and_back(
        agents: Any, tmp_path: Any, backends: list[str]) -> None:
    # As NIXL's GDS/POSIX examples: FILE registered as (offset, length, fd),
    # transfers prepared against the agent's own name.
    a = agents(backends=backends)
    a.create_backend("POSIX")
    assert set(a.backends) == {"POSIX", *backends}
    assert a.get_backend_mem_types("POSIX") == ["DRAM_SEG", "FILE_SEG"]  # NIXL's order (nixl22)
    assert a.get_backend_params("POSIX")["use_uring"] == "false"
    with pytest.raises(nixl.nixlInvalidParamError):
        a.create_backend("POSIX")
    n = 16 * 4096
    x, y = Buf(n, 0xBA), Buf(n, 0)
    reg = a.register_memory([(x.addr, n, 0, "a"), (y.addr, n, 0, "b")], "DRAM",
                            backends=["POSIX"])
    path = tmp_path / "kv.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        freg = a.register_memory([(4096, n, fd, "f")], "FILE")
        assert freg is not None
        h = a.initialize_xfer("WRITE", a.get_xfer_descs([(x.addr, n, 0)], "DRAM"), freg.trim(),
                              a.name)
        assert a.transfer(h) == "DONE" or _wait(a, h) == "DONE"
        assert a.check_xfer_state(h) == "DONE" and a.query_xfer_backend(h) == "POSIX"
        data = path.read_bytes()
        assert len(data) == 4096 + n and data[4096:] == b"\xba" * n
        # Scattered, reordered, by index: file blocks 3 and 0 of the range.
        lh = a.prep_xfer_dlist("", [(y.addr, 4096, 0), (y.addr + 8192, 4096, 0)], "DRAM")
        rh = a.prep_xfer_dlist(a.name, [(4096, 4096, fd), (4096 * 4, 4096, fd)], "FILE")
        os.pwrite(fd, b"\x01" * 4096, 4096 * 4)
        h2 = a.make_prepped_xfer("READ", lh, [0, 1], rh, [1, 0])
        assert a.transfer(h2) == "DONE" or _wait(a, h2) == "DONE"
        assert bytes(y.np[:4096]) == b"\x01" * 4096
        assert bytes(y.np[8192:12288]) == b"\xba" * 4096
        assert not y.np[4096:8192].any()
        # Outside the registered range, or no such fd: not found, as NIXL says.
        with pytest.raises(nixl.nixlNotFoundError):
            a.prep_xfer_dlist(a.name, [(0, 4096, fd)], "FILE")
        with pytest.raises(nixl.nixlNotFoundError):
            a.initialize_xfer("WRITE", a.get_xfer_descs([(x.addr, 4096, 0)], "DRAM"),
                              a.get_xfer_descs([(4096, 4096, fd + 1000)], "FILE"), a.name)
        # Local FILE memory is never in the agent's metadata.
        b = agents()
        b.add_remote_agent(a.get_agent_metadata())
        with pytest.raises(nixl.nixlNotFoundError):
            b.prep_xfer_dlist(a.name, [(4096, 4096, fd)], "FILE")
        for handle in (h, h2, lh, rh):
            handle.release()
        a.deregister_memory(freg)
        with pytest.raises(nixl.nixlNotFoundError):
            a.deregister_memory(freg)
        a.deregister_memory(reg)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- beyond NIXL: asyncio


def test_await_handle_from_an_asyncio_program(agents: Any,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    monkeypatch.setenv("AIOXFER_NIXL_TRANSPORTS", "tcp")  # slow enough to cancel midway
    a, b, x, y, _, _ = _pair(agents, n=8 << 20)
    y.np[:] = np.arange(y.n, dtype=np.uint64).astype(np.uint8)
    before = a.statistics()
    h = a.initialize_xfer("READ", a.get_xfer_descs([(x.addr, y.n, 0)], "DRAM"),
                          a.get_xfer_descs([(y.addr, y.n, 0)], "DRAM"), b.name, b"r")

    async def main() -> None:
        a.transfer(h)
        assert await h == "DONE"
        assert await h == "DONE"  # done stays done
        assert np.array_equal(x.np, y.np)
        # Reposted, awaited twice at once.
        a.transfer(h)
        assert await asyncio.gather(h, asyncio.wrap_future(h.future())) == ["DONE", "DONE"]
        # Cancelling the awaiting task cancels the transfer.
        big = a.initialize_xfer("WRITE", a.get_xfer_descs([(x.addr, y.n, 0)] * 64, "DRAM"),
                                a.get_xfer_descs([(y.addr, y.n, 0)] * 64, "DRAM"), b.name)
        a.transfer(big)
        task = asyncio.ensure_future(_awaited(big))
        await asyncio.sleep(0)
        assert a.check_xfer_state(big) == "PROC"  # 512 MiB over TCP: far from done
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(nixl.nixlCancelledError):
            a.check_xfer_state(big)
        big.release()

    asyncio.run(main())
    after = a.statistics()
    # Both READs (and their notifications) are the aioxfer agent's transfers.
    assert after.transfers_completed >= before.transfers_completed + 2
    assert after.bytes == before.bytes + 2 * y.n
    h.release()


async def _awaited(handle: Any) -> str:
    return str(await handle)


# ---------------------------------------------------------------- OBJ: object storage


def test_obj_backend_puts_and_gets_objects(agents: Any, s3: S3Server) -> None:  # noqa: F811
    # NIXL's OBJ: a bucket per backend, OBJ registered as (offset, length,
    # devId, key) (key = devId when empty), WRITE = the whole object from host
    # memory, READ = a range of it; against a real S3 server (rclone).
    pytest.importorskip("obstore")
    pytest.importorskip("aiohttp")
    srv = s3
    bucket = srv.bucket("kv")  # (made first: see S3Server.bucket)
    a = agents(backends=[])
    assert "OBJ" in a.get_plugin_list()
    a.create_backend("OBJ", {"bucket": bucket, "endpoint_override": srv.endpoint,
                             "access_key": ACCESS_KEY, "secret_key": SECRET_KEY,
                             "region": "us-east-1"})
    assert a.get_backend_mem_types("OBJ") == ["DRAM_SEG", "OBJ_SEG"]
    n = 64 << 10
    x, y = Buf(2 * n, 0), Buf(2 * n, 0)
    x.np[:] = np.arange(2 * n, dtype=np.uint64).astype(np.uint8)
    a.register_memory([(x.addr, 2 * n, 0, ""), (y.addr, 2 * n, 0, "")], "DRAM")
    oreg = a.register_memory([(0, n, 7, "kv/block-7"), (0, n, 8, "")], "OBJ")
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(x.addr, n, 0), (x.addr + n, n, 0)],
                                                    "DRAM"),
                          a.get_xfer_descs([(0, n, 7), (0, n, 8)], "OBJ"), a.name)
    assert a.transfer(h) in ("DONE", "PROC")
    assert _wait(a, h) == "DONE" and a.query_xfer_backend(h) == "OBJ"
    assert srv.file(bucket, "kv/block-7").read_bytes() == bytes(x.np[:n])
    assert srv.file(bucket, "8").read_bytes() == bytes(x.np[n:])
    # READ ranges back, by index, into other places.
    lh = a.prep_xfer_dlist("", [(y.addr, 4096, 0), (y.addr + n, 4096, 0)], "DRAM")
    rh = a.prep_xfer_dlist(a.name, [(8192, 4096, 7), (0, 4096, 8)], "OBJ")
    h2 = a.make_prepped_xfer("READ", lh, [0, 1], rh, [1, 0])
    a.transfer(h2)
    assert _wait(a, h2) == "DONE"
    assert bytes(y.np[:4096]) == bytes(x.np[n:n + 4096])
    assert bytes(y.np[n:n + 4096]) == bytes(x.np[8192:12288])
    found = a.query_memory([(0, 0, 0, "kv/block-7"), (0, 0, 0, "nowhere"), (0, 0, 0, "8")],
                           "OBJ", "OBJ")
    assert found == [{}, None, {}]
    # Writes replace whole objects: a non-zero offset is refused.
    with pytest.raises(nixl.nixlInvalidParamError):
        a.initialize_xfer("WRITE", a.get_xfer_descs([(x.addr, 4096, 0)], "DRAM"),
                          a.get_xfer_descs([(4096, 4096, 7)], "OBJ"), a.name)
    # Unregistered devId: not found; a missing object: the READ fails.
    with pytest.raises(nixl.nixlNotFoundError):
        a.prep_xfer_dlist(a.name, [(0, 4096, 9)], "OBJ")
    a.register_memory([(0, n, 9, "nowhere")], "OBJ")
    h3 = a.initialize_xfer("READ", a.get_xfer_descs([(y.addr, 4096, 0)], "DRAM"),
                           a.get_xfer_descs([(0, 4096, 9)], "OBJ"), a.name)
    with pytest.raises(nixl.nixlBackendError):  # from transfer() or from the check after
        a.transfer(h3)
        _wait(a, h3)
    for handle in (h, h2, h3, lh, rh):
        handle.release()
    a.deregister_memory(oreg)
    with pytest.raises(nixl.nixlNotFoundError):
        a.deregister_memory(oreg)
    a.close()


# ---------------------------------------------------------------- torch tensors (when installed)


def test_torch_cpu_tensors_as_descriptors(agents: Any) -> None:
    torch = pytest.importorskip("torch")
    a, b = agents(), agents()
    src = torch.arange(4096, dtype=torch.float32)
    dst = torch.zeros(2, 4096, dtype=torch.float32)
    ra = a.register_memory(src)  # a tensor: DRAM, devId 0, its data_ptr and size
    rb = b.register_memory([dst[0], dst[1]])  # a list of tensors
    assert ra is not None and ra.descCount() == 1 and rb.descCount() == 2
    assert ra[0][:3] == (src.data_ptr(), 4 * 4096, 0)
    a.add_remote_agent(b.get_agent_metadata())
    assert a.get_xfer_descs(dst.t()) is None  # not contiguous: None after logging
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([src[:2048], src[2048:]]),
                          b.get_xfer_descs([dst[1][:2048], dst[0][2048:]]), b.name)
    assert a.transfer(h) == "DONE" or _wait(a, h) == "DONE"
    assert torch.equal(dst[1][:2048], src[:2048]) and torch.equal(dst[0][2048:], src[2048:])
    assert not dst[0][:2048].any() and not dst[1][2048:].any()
    h.release()
    a.deregister_memory(ra)
    b.deregister_memory(rb)


# ---------------------------------------------------------------- Dynamo and SGLang call shapes


def test_dynamo_and_sglang_call_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    monkeypatch.setenv("AIOXFER_NIXL_TRANSPORTS", "tcp")  # slow enough to cancel midway
    # Dynamo's nixl_connect: default config, "cpu" memory, keywords everywhere.
    a, b = nixl_agent(_name()), nixl_agent(_name())
    try:
        n = 1 << 20
        x, y = Buf(n, 3), Buf(n, 0)
        ra = a.register_memory([(x.addr, n, 0, "cpu")], "cpu")
        rb = b.register_memory([(y.addr, n, 0, "cpu")], "cpu")
        name = a.add_remote_agent(b.get_agent_metadata())
        name = name.decode() if isinstance(name, bytes) else name
        local = a.get_xfer_descs(descs=[(x.addr, n, 0)], mem_type="cpu")
        remote = a.get_xfer_descs(descs=[(y.addr, n, 0)], mem_type="cpu")
        h = a.initialize_xfer(operation="WRITE", local_descs=local, remote_descs=remote,
                              remote_agent=name, notif_msg=b"key-1")

        async def dynamo_wait() -> None:  # Dynamo polls from asyncio every 0.1 s
            a.transfer(h, b"key-1")
            while a.check_xfer_state(h) != "DONE":
                await asyncio.sleep(0.01)

        asyncio.run(dynamo_wait())
        deadline = time.monotonic() + STEP
        while b"key-1" not in b.update_notifs().get(a.name, []):  # the passive side
            assert time.monotonic() < deadline
        assert y.np.all() and (y.np == 3).all()
        # Dynamo cancels by releasing an active handle.
        big = a.initialize_xfer(operation="READ",
                                local_descs=a.get_xfer_descs([(x.addr, n, 0)] * 256, "DRAM"),
                                remote_descs=a.get_xfer_descs([(y.addr, n, 0)] * 256, "DRAM"),
                                remote_agent=name)
        assert a.transfer(big) == "PROC"
        a.release_xfer_handle(big)
        # SGLang: positional, an ASCII notification, "ERR" raises, poll every handle.
        hs = [a.initialize_xfer("WRITE", a.get_xfer_descs([(x.addr + k * 4096, 4096, 0)], "DRAM"),
                                a.get_xfer_descs([(y.addr + k * 4096, 4096, 0)], "DRAM"), name,
                                f"req_{k}".encode("ascii")) for k in range(8)]
        for hk in hs:
            assert a.transfer(hk) != "ERR"
        deadline = time.monotonic() + STEP
        while not all(a.check_xfer_state(hk) == "DONE" for hk in hs):
            assert time.monotonic() < deadline
        got: set[bytes] = set()
        while len(got) < 8:
            assert time.monotonic() < deadline
            got.update(b.get_new_notifs().get(a.name, []))
        assert {m.decode("ascii").split("_")[1] for m in got} == {str(k) for k in range(8)}
        for hk in (h, *hs):
            a.release_xfer_handle(hk)
        a.remove_remote_agent(name)
        a.deregister_memory(ra)
        b.deregister_memory(rb)
    finally:
        a.close()
        b.close()


# ---------------------------------------------------------------- many regions (vLLM: per layer)


def test_requests_across_many_regions_by_index(agents: Any) -> None:
    a, b = agents(), agents()
    layers, blocks, blk = 4, 16, 1024
    xs = [Buf(blocks * blk, 0) for _ in range(layers)]
    ys = [Buf(blocks * blk, 0) for _ in range(layers)]
    rng = np.random.default_rng(3)
    for y in ys:
        y.np[:] = rng.integers(0, 256, y.n, dtype=np.uint8)
    a.register_memory([(x.addr, x.n, 0, "") for x in xs], "DRAM")
    b.register_memory([(y.addr, y.n, 0, "") for y in ys], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    # Descriptor lists over every layer's blocks, layer-major, as vLLM builds them.
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", np.array(
        [(x.addr + k * blk, blk, 0) for x in xs for k in range(blocks)], dtype=np.uint64), "DRAM")
    remote = a.prep_xfer_dlist(b.name, np.array(
        [(y.addr + k * blk, blk, 0) for y in ys for k in range(blocks)], dtype=np.uint64), "DRAM")
    n = layers * blocks
    li = rng.permutation(n)[:40].astype(np.int64)
    ri = rng.permutation(n)[:40].astype(np.int64)
    h = a.make_prepped_xfer("READ", local, li, remote, ri, b"7:1")
    assert a.transfer(h) == "DONE" or _wait(a, h) == "DONE"
    for i, j in zip(li.tolist(), ri.tolist(), strict=True):
        xl, xk = divmod(i, blocks)
        yl, yk = divmod(j, blocks)
        assert np.array_equal(xs[xl].np[xk * blk:(xk + 1) * blk],
                              ys[yl].np[yk * blk:(yk + 1) * blk])
    untouched = set(range(n)) - set(li.tolist())
    for i in untouched:
        xl, xk = divmod(i, blocks)
        assert not xs[xl].np[xk * blk:(xk + 1) * blk].any()
    deadline = time.monotonic() + STEP
    while not b.check_remote_xfer_done(a.name, b"7:1"):  # after all of the data
        assert time.monotonic() < deadline
    h.release()


def test_segment_lists_built_from_checked_ranges_match_the_public_ones() -> None:
    # aioxfer.nixl builds SegmentLists of prepared (already checked) ranges
    # without SegmentList's own checks: they must equal what it would build,
    # and a change of SegmentList's fields must show here.
    from aioxfer import SegmentList

    assert SegmentList.__slots__ == ("region", "offsets", "lengths", "nbytes")
    a = nixl_agent(_name())
    try:
        x = Buf(1 << 16)
        a.register_memory([(x.addr, x.n, 0, "")], "DRAM")
        region = a.agent._regs[0].region
        offs = np.array([0, 4096, 8192], dtype=np.uint64)
        lens = np.array([16, 32, 64], dtype=np.uint64)
        fast = _bindings._segments(region, offs[[2, 0]], lens[[2, 0]], 80)
        ref = SegmentList(region, offs[[2, 0]], lens[[2, 0]])
        assert fast.region is ref.region and fast.nbytes == ref.nbytes
        for f, r in ((fast.offsets, ref.offsets), (fast.lengths, ref.lengths)):
            assert f.dtype == r.dtype and f.flags.c_contiguous and np.array_equal(f, r)
    finally:
        a.close()


@pytest.mark.parametrize("mode", ["adaptive", "poll", "sleep"])
def test_engine_follows_the_progress_mode_and_the_loop_only_sleeps(
        agents: Any, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    # The tcp target's poll for a peer's next request is the engine's, set
    # from the mode (a compat agent built in "sleep" never polled as a
    # target: its tcp 4 KiB rows ran at a third of the native API's); the
    # loop thread gets no Poller (the callers' threads spin).
    from aioxfer import _cyx
    from aioxfer import agent as agent_mod
    from aioxfer import progress as progress_mod

    built: list[dict[str, Any]] = []
    real = _cyx.Engine

    def spy(**kw: Any) -> Any:
        built.append(kw)
        return real(**kw)

    monkeypatch.setattr(agent_mod._cyx, "Engine", spy)
    monkeypatch.setenv("AIOXFER_NIXL_PROGRESS", mode)
    a = agents()
    assert len(built) == 1
    assert built[0]["target_poll_us"] == progress_mod.target_poll_us(mode)
    assert a.agent._agent.progress == "sleep" and a.agent._agent._poller is None
