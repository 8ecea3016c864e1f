"""nixl31: a real NIXL 1.5.1 agent beside an aioxfer.nixl agent. The wire
formats are each library's own (DESIGN: compat agents talk to compat
agents), so they cannot exchange metadata; each way must fail at once with
a message or typed error that says so, never wait for a timeout that only
says "nothing came":

- metadata bytes: add_remote_agent of the other's metadata raises
  nixlMismatchError on both sides;
- the central store (etcd): each finds the other's metadata under NIXL's key
  (test_nixl31_etcd: the same key layout now) and refuses it, saying so: real
  NIXL at once (NIXL_ERR_MISMATCH), ours at its watch timeout, as a real
  NIXL agent's metadata (before: each timed out its wait under a key the
  other never wrote);
- listeners: a real NIXL agent's fetch and push reach our listener, which
  now logs them as a real NIXL agent's requests (before: "a client without
  this agent's token", or "closed after 21 of 36 bytes"); our fetch of a real
  NIXL listener, which never greets, fails at the connect timeout with an
  error naming that cause.

Each side runs in its own process (one process, one nixl); real NIXL only
where its venv (benchmarks/peers/install.sh) is installed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from test_discovery import etcd_server  # noqa: F401

import aioxfer.nixl

REAL_NIXL_PY = Path("/root/.cache/aioxfer-peers/venv-nixl/bin/python")

pytestmark = pytest.mark.skipif(not REAL_NIXL_PY.exists(),
                                reason="real NIXL's venv is not installed here")

# One script, run on either nixl. argv: role, then the role's arguments.
CHILD = r'''
import ctypes, os, sys, time
from nixl._api import nixl_agent, nixl_agent_config
role, name = sys.argv[1], sys.argv[2]
port = int(sys.argv[3]) if role in ("listen", "fetch") else 0
ag = nixl_agent(name, nixl_agent_config(True, role == "listen", port))
buf = (ctypes.c_ubyte * 64)()
ag.register_memory([(ctypes.addressof(buf), 64, 0, "")], "DRAM")
out = sys.argv[-1]


def wait_for(path):
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        assert time.monotonic() < deadline, path
        time.sleep(0.05)


if role == "listen":  # serve until told to stop
    print("@@ready", flush=True)
    wait_for(out + ".stop")
elif role == "fetch":  # of agent "T" from the listener at port, and a push of ours
    t0 = time.monotonic()
    ag.fetch_remote_metadata("T", "127.0.0.1", port)
    ag.send_local_metadata("127.0.0.1", port)
    while not ag.check_remote_metadata("T") and time.monotonic() - t0 < 8:
        time.sleep(0.05)
    print(f"@@check {ag.check_remote_metadata('T')}", flush=True)
elif role == "md":  # metadata through files: ours out, the other's in
    open(out + "." + name + ".tmp", "wb").write(ag.get_agent_metadata())
    os.rename(out + "." + name + ".tmp", out + "." + name)
    other = sys.argv[3]
    wait_for(out + "." + other)
    try:
        ag.add_remote_agent(open(out + "." + other, "rb").read())
        print("@@loaded", flush=True)
    except Exception as e:
        print(f"@@raised {type(e).__name__}", flush=True)
    open(out + "." + name + ".done", "w").close()
    wait_for(out + "." + other + ".done")
elif role == "etcd":  # publish, then fetch the other from the store
    other = sys.argv[3]
    ag.send_local_metadata()
    t0 = time.monotonic()
    ag.fetch_remote_metadata(other)
    while not ag.check_remote_metadata(other) and time.monotonic() - t0 < 8:
        time.sleep(0.05)
    print(f"@@check {ag.check_remote_metadata(other)}", flush=True)
os._exit(0)  # (real NIXL can crash in its destructors at exit on some hosts)
'''


def _env(real: bool, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NIXL_", "PYTHONPATH", "AIOXFER_NIXL"))}
    env.update(UCX_NET_DEVICES="lo", UCX_MODULES="^ib", **extra)
    if not real:
        env["PYTHONPATH"] = aioxfer.nixl.shim_path()
    return env


def _start(tmp_path: Path, real: bool, *args: str, **env: str) -> subprocess.Popen[str]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    py = str(REAL_NIXL_PY) if real else sys.executable
    return subprocess.Popen([py, str(script), *args], cwd="/", env=_env(real, **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _done(proc: subprocess.Popen[str], timeout: float = 60) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(
            f"a child did not finish in {timeout} s:\n{out}\n{err[-3000:]}") from None
    assert proc.returncode == 0, f"rc={proc.returncode}\n{out}\n{err[-3000:]}"
    return out, err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_metadata_bytes_refused_both_ways(tmp_path: Path) -> None:
    out = str(tmp_path / "md")
    real = _start(tmp_path, True, "md", "real", "ours", out)
    ours = _start(tmp_path, False, "md", "ours", "real", out)
    (real_out, real_err), (our_out, our_err) = _done(real), _done(ours)
    assert "@@raised nixlMismatchError" in real_out, real_err[-2000:]
    assert "@@raised nixlMismatchError" in our_out, our_err[-2000:]
    assert "not aioxfer.nixl agent metadata (from real NIXL" in our_err


def test_central_store_refused_at_once_both_ways(tmp_path: Path,
                                                  etcd_server: str) -> None:  # noqa: F811
    ns = f"/nixl31-{uuid.uuid4().hex[:8]}/agents/"
    env = {"NIXL_ETCD_ENDPOINTS": f"http://{etcd_server}", "NIXL_ETCD_NAMESPACE": ns}
    t0 = time.monotonic()
    real = _start(tmp_path, True, "etcd", "real", "ours", "-", **env)
    ours = _start(tmp_path, False, "etcd", "ours", "real", "-", **env)
    (real_out, real_err), (our_out, our_err) = _done(real), _done(ours)
    assert "@@check False" in real_out and "@@check False" in our_out
    # Each found the other's metadata and refused it, saying what it found
    # (ours after its watch timeout, 5 s: our agent of that name might have
    # been about to replace a real NIXL agent's stale metadata), not that
    # nothing came.
    assert "fetchRemoteMD failed: not aioxfer.nixl agent metadata (from real NIXL" in our_err
    assert f"(under {ns}/real/metadata, for 5 s)" in our_err, our_err
    assert "no metadata under" not in our_err
    assert "NIXL_ERR_MISMATCH" in real_err and "Watch timed out" not in real_err, real_err
    assert time.monotonic() - t0 < 60


def test_real_nixl_client_at_our_listener_is_named(tmp_path: Path) -> None:
    port = _free_port()
    out = str(tmp_path / "lsn")
    ours = _start(tmp_path, False, "listen", "T", str(port), out)
    try:
        assert ours.stdout is not None
        for line in ours.stdout:  # (after nixl.logging's lines)
            if line.strip() == "@@ready":
                break
        real_out, real_err = _done(_start(tmp_path, True, "fetch", "I", str(port), out))
        assert "@@check False" in real_out
    finally:
        Path(out + ".stop").touch()
    _, our_err = _done(ours)
    # Its fetch and push (one connection: NIXL keeps one per listener, and
    # hangs up on our greeting, which it reads as a length over its cap), named.
    assert "a real NIXL agent's request (NIXLCOMM:SEND)" in our_err, our_err
    assert "NIXL and aioxfer.nixl metadata listeners do not interoperate" in our_err


def test_our_fetch_of_a_real_nixl_listener_names_the_cause(tmp_path: Path) -> None:
    port = _free_port()
    out = str(tmp_path / "lsn")
    real = _start(tmp_path, True, "listen", "T", str(port), out, NIXL_LOG_LEVEL="DEBUG")
    try:
        # (Real NIXL's listener comes up a few seconds after its agent: its
        # log says when.)
        assert real.stderr is not None
        deadline = time.monotonic() + 60
        for line in real.stderr:
            if "MD listener is listening on port" in line:
                break
            assert time.monotonic() < deadline
        our_out, our_err = _done(_start(tmp_path, False, "fetch", "I", str(port), out,
                                        AIOXFER_NIXL_CONNECT_TIMEOUT="2"))
    finally:
        Path(out + ".stop").touch()
    _done(real)
    assert "@@check False" in our_out
    assert "fetchRemoteMD failed: metadata listener 127.0.0.1:" in our_err, our_err
    assert "no nonce within 2 s (not an aioxfer.nixl metadata listener?" in our_err, our_err
