"""Shared helpers for the aioxfer test suite.

- ``transport`` parametrizes a test over every transport of the conformance
  suite ("shm": automatic selection between same-host agents, which must pick
  shm; "tcp": forced with ``transports=("tcp",)`` on both agents; "verbs":
  forced with ``transports=("verbs",)``, over the software verbs provider
  (native/tests/softverbs/, compiled once per session, loaded through
  AIOXFER_VERBS_PROVIDER, which spawned agents inherit)).
- ``make_agent`` starts agents on the running loop; at teardown it closes them
  and fails the test if any loop exception handler call happened, or if an
  agent leaks a native op, a native region or a pinned buffer.
- ``RemoteAgent`` runs an agent in a separate process (multiprocessing spawn)
  and drives it through a pipe.
- Every wait is bounded: ``within()`` and ``wait_until()``.
- A test during which an S3 server of tests/s3server.py logged rclone's
  "Dir.Rename error" fails, naming ``S3Server.bucket(dir)`` (see
  RCLONE_DIR_RENAME).
- Event loops: every async test of the suites in ``BOTH_LOOPS`` runs on the
  stdlib asyncio loop *and* on uvloop (test ids ``[asyncio]`` / ``[uvloop]``,
  through pytest-asyncio's ``pytest_asyncio_loop_factories`` hook); the other
  suites on asyncio. ``AIOXFER_TEST_LOOPS=all`` runs every suite on both,
  ``AIOXFER_TEST_LOOPS=asyncio`` (or ``uvloop``) every suite on that one only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import email.utils
import hashlib
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

T = TypeVar("T")

# --------------------------------------------------------------- event loops

try:
    import uvloop
except ImportError:  # not a hard test dependency: the suite then runs on asyncio only
    uvloop = None

# The suites that exercise the agent's whole surface run on both loops by
# default; the rest (long soaks, benches, CLI, subprocess-driven suites whose
# child processes pick their own loop) only on asyncio, so that CI time stays
# near the single-loop suite's.
BOTH_LOOPS = frozenset({
    "test_conformance.py", "test_api.py", "test_hardening.py", "test_backends.py",
    "test_discovery.py", "test_liveness.py", "test_rails.py", "test_scheduling.py",
    "test_progress.py",
})
LOOP_FACTORIES: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
}
if uvloop is not None:
    LOOP_FACTORIES["uvloop"] = uvloop.new_event_loop


def _loops_for(path_name: str) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    choice = os.environ.get("AIOXFER_TEST_LOOPS", "default")
    if choice == "all" or (choice == "default" and path_name in BOTH_LOOPS):
        return dict(LOOP_FACTORIES)
    if choice == "uvloop":
        if uvloop is None:
            raise pytest.UsageError("AIOXFER_TEST_LOOPS=uvloop, but uvloop is not installed")
        return {"uvloop": uvloop.new_event_loop}
    if choice not in ("default", "asyncio", "all"):
        raise pytest.UsageError(
            f"AIOXFER_TEST_LOOPS={choice!r}: expected default, all, asyncio or uvloop"
        )
    return {"asyncio": asyncio.new_event_loop}


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    return _loops_for(item.path.name)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failing test's report carries the logs of the S3 servers running
    (tests/s3server.py): the client sees only the error code."""
    report = yield
    if report.failed:
        s3server = sys.modules.get("s3server")
        for srv in list(getattr(s3server, "LIVE", ())):
            report.sections.append((f"rclone log ({srv.log.name})", srv.log_tail()))
    return report


# rclone serve s3 1.75 answers some of several PUTs that create one new
# directory at once with 500 (its log: "Dir.Rename error: file does not
# exist") and may leave an acknowledged key unreadable. Every object test
# makes its directories first (S3Server.bucket(*dirs)); one that forgets
# would pass while the client's resend hides the 500, and flake once in
# 100+ runs. Whatever a test (or its teardown) made rclone log is checked:
# such a line fails it, naming the remedy.
RCLONE_DIR_RENAME = "Dir.Rename error"
_S3_LOG_SEEN = pytest.StashKey[dict[Path, int]]()


def _s3_logs() -> list[Path]:
    s3server = sys.modules.get("s3server")
    return [srv.log for srv in list(getattr(s3server, "LIVE", ()))]


def _s3_dir_rename_lines(item: pytest.Item, logs: list[Path]) -> list[str]:
    """The "Dir.Rename error" lines the logs gained since the item last
    looked (from their start for a server started since)."""
    seen = item.stash.setdefault(_S3_LOG_SEEN, {})
    found: list[str] = []
    for log in logs:
        try:
            with open(log, "rb") as f:
                f.seek(seen.get(log, 0))
                new = f.read()
        except OSError:
            continue
        seen[log] = seen.get(log, 0) + len(new)
        found += [ln for ln in new.decode(errors="replace").splitlines()
                  if RCLONE_DIR_RENAME in ln]
    return found


def _s3_dir_rename_check(item: pytest.Item, logs: list[Path], failed: BaseException | None
                         ) -> None:
    lines = _s3_dir_rename_lines(item, logs)
    if not lines:
        return
    msg = (f"the S3 server (rclone) logged {len(lines)} '{RCLONE_DIR_RENAME}' line(s) during "
           f"this test: rclone 1.75's bug with concurrent PUTs that create one new directory "
           f"(answered 500, sometimes an acknowledged key left unreadable). Make the "
           f"directories the test's PUTs write into first: S3Server.bucket(dir, ...) "
           f"(tests/s3server.py; s3server.tier_dir names a kv.ObjectTier's). First line: "
           f"{lines[0]}")
    if failed is not None:
        failed.add_note(msg)  # the test's own failure stays the report's error
        return
    pytest.fail(msg, pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    # Servers already running start from here; one the setup starts, from
    # its log's beginning.
    item.stash[_S3_LOG_SEEN] = {log: log.stat().st_size for log in _s3_logs()
                                if log.exists()}
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    try:
        result = yield
    except BaseException as exc:
        _s3_dir_rename_check(item, _s3_logs(), exc)
        raise
    _s3_dir_rename_check(item, _s3_logs(), None)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    logs = _s3_logs()  # before the teardown stops a server (it leaves LIVE)
    try:
        result = yield
    except BaseException as exc:
        _s3_dir_rename_check(item, logs + _s3_logs(), exc)
        raise
    _s3_dir_rename_check(item, logs + _s3_logs(), None)
    return result


def pytest_report_header(config: pytest.Config) -> str:
    both = "every suite" if os.environ.get("AIOXFER_TEST_LOOPS") == "all" else (
        ", ".join(sorted(BOTH_LOOPS)))
    if uvloop is None:
        return "event loops: asyncio only (uvloop is not installed)"
    return f"event loops: asyncio and uvloop {uvloop.__version__} for {both}"


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOFTVERBS_SRC = os.path.join(REPO, "native", "tests", "softverbs", "softverbs.c")


def _cuda_available() -> bool:
    from aioxfer import cuda

    return cuda.status()[0]


# "cuda" (same-host peers, both with CUDA: host memory moves as shm over the
# CUDA endpoint) where a CUDA driver is found, e.g. the software one of
# native/tests/fakecuda.c through AIOXFER_CUDA_DRIVER.
CUDA = _cuda_available()
TRANSPORTS = ["shm", "tcp", "verbs"] + (["cuda"] if CUDA else [])
# The path two same-host agents with default arguments pick: "cuda" where
# both have CUDA (host memory then moves over the CUDA endpoint), else "shm".
SAME_HOST = "cuda" if CUDA else "shm"

# Bounds for waits; generous so a slow 2-core CI box passes, small enough that
# a hang fails the test rather than the whole suite.
STEP = 10.0


def transport_kwargs(transport: str) -> dict[str, Any]:
    if transport == "tcp":
        return {"transports": ("tcp",)}
    if transport == "shm":
        # automatic selection: two same-host agents must pick shm (cuda when
        # both have CUDA, so it is left out then)
        return {"transports": ("shm", "tcp")} if CUDA else {}
    if transport == "verbs":
        return {"transports": ("verbs",)}
    if transport == "cuda":
        return {}  # automatic selection: same host, both with CUDA
    raise ValueError(transport)


@pytest.fixture(scope="session")
def softverbs_provider(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The software verbs provider, compiled once (the command is the one at
    the top of softverbs.c). Skips where verbs was not built (no libibverbs
    headers at build time) or no C compiler is there."""
    from aioxfer import _cyx

    n, _, why = _cyx.verbs_probe(None)
    if n < 0 and "not built" in why:
        pytest.skip(f"verbs: {why}")
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None or not os.path.exists(SOFTVERBS_SRC):
        pytest.skip("verbs: no C compiler or no softverbs source to build the software provider")
    out = str(tmp_path_factory.mktemp("softverbs") / "libaxf_softverbs.so")
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-pthread", SOFTVERBS_SRC, "-o", out],
                   check=True, capture_output=True, timeout=120)
    return out


FAKECUDA_SRC = os.path.join(REPO, "native", "tests", "fakecuda.c")


@pytest.fixture(scope="session")
def fakecuda(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The software CUDA driver of native/tests/fakecuda.c (device memory =
    shared memfd mappings, streams = threads, IPC through /proc), compiled
    once per session: AIOXFER_CUDA_DRIVER=<it> in a child's environment runs
    the engine's CUDA path without a GPU. Skips where no C compiler is."""
    cc = next((c for c in (os.environ.get("CC"), "cc", "gcc", "clang")
               if c and shutil.which(c)), None)
    if cc is None:
        pytest.skip("no C compiler to build the software CUDA driver")
    lib = tmp_path_factory.mktemp("fakecuda") / "libfakecuda.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), FAKECUDA_SRC, "-lpthread"],
                   check=True, timeout=120)
    return lib


@pytest.fixture
def verbs_provider(softverbs_provider: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Agents made while this is active (and processes spawned meanwhile) load
    the software verbs provider instead of libibverbs."""
    monkeypatch.setenv("AIOXFER_VERBS_PROVIDER", softverbs_provider)
    return softverbs_provider


@contextlib.contextmanager
def mounted_tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's spelling: "1m", "16m") mounted at ``mnt``
    (made here) for the block; skips the test where none can be mounted
    (not root, no mount(8), a container that refuses)."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (root only): writes past its capacity fail with ENOSPC."""
    with mounted_tmpfs(tmp_path / "full", "1m") as mnt:
        yield mnt


@pytest.fixture
def disk_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs (root only) for a kv.DiskTier that is then filled to
    its last page (fill_fs): a segment file is sparse, so a header sector
    written into a hole then fails with ENOSPC."""
    with mounted_tmpfs(tmp_path / "mnt", "16m") as mnt:
        yield mnt


def fill_fs(path: Path) -> None:
    """Writes ``path`` until its filesystem has no page left."""
    chunk = b"\xff" * 4096
    with open(path, "wb", buffering=0) as fh:
        with contextlib.suppress(OSError):
            while True:
                fh.write(chunk)


@pytest.fixture
def agents() -> Iterator[Any]:
    """aioxfer.nixl's nixl_agent(**config) under a fresh name, for the nixl
    tests; every agent made is closed after the test."""
    import uuid

    from aioxfer.nixl import nixl_agent, nixl_agent_config

    made: list[Any] = []

    def make(**conf: Any) -> Any:
        a = nixl_agent(str(uuid.uuid4()), nixl_agent_config(**conf))
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    if request.param == "verbs":
        request.getfixturevalue("verbs_provider")
    return str(request.param)


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """Deterministic, seed-dependent bytes (uint8 array)."""
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint8).copy()


def digest(buf: Any) -> str:
    return hashlib.blake2b(memoryview(buf).cast("B"), digest_size=16).hexdigest()


async def within(aw: Awaitable[T], seconds: float = STEP) -> T:
    """Awaits ``aw`` under a deadline, so a hang fails instead of blocking the suite."""
    async with asyncio.timeout(seconds):
        return await aw


async def cancel_after(aw: Awaitable[Any], steps: int) -> bool:
    """Runs ``aw`` as a task, cancels it after ``steps`` loop steps and waits
    for it to end (under a deadline): True if it finished before the cancel
    took, False if it ended cancelled. The cancellation sweeps' step."""
    task = asyncio.ensure_future(aw)
    for _ in range(steps):
        await asyncio.sleep(0)
    task.cancel()
    try:
        await within(task)
        return True
    except asyncio.CancelledError:
        return False


async def wait_until(
    pred: Callable[[], bool], seconds: float = STEP, what: str = "condition"
) -> None:
    deadline = time.monotonic() + seconds
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {seconds} s")
        await asyncio.sleep(0.01)


async def pair_64k(make_agent: Callable[..., Awaitable[Any]]) -> tuple[Any, Any, Any, Any]:
    """An initiator connected to a target (make_agent's): (initiator, peer,
    its 64 KiB local region "l", the target's 64 KiB region "r")."""
    target = await make_agent("target")
    init = await make_agent("init")
    peer = await init.connect(target.address)
    target.alloc(1 << 16, name="r")
    await peer.refresh()
    return init, peer, init.alloc(1 << 16, name="l"), peer.region("r")


def stats_dict(agent: Any) -> dict[str, Any]:
    s = agent.statistics()
    return dataclasses.asdict(s) if dataclasses.is_dataclass(s) else dict(vars(s))


def assert_no_leaks(agent: Any) -> None:
    s = agent.statistics()
    leaks = {k: getattr(s, k) for k in ("in_flight", "native_ops", "native_regions",
                                        "pinned_regions")}
    assert all(v == 0 for v in leaks.values()), f"{agent.name} leaks after close: {leaks}"


# How far ahead make_agent's teardown still waits for a timer (what the fixed
# 0.05 s sleep it replaces let run; a timer due later was missed then too).
SETTLE_TIMERS = 0.05


async def settle(loop: asyncio.AbstractEventLoop) -> None:
    """Returns once the loop has run every callback queued so far, those they
    queued in turn, and every timer due within SETTLE_TIMERS: what an agent's
    close leaves behind (futures it failed wake their tasks, a task that then
    ends in an exception nobody retrieves is reported when it is freed)
    reaches the loop's exception handler before make_agent judges it. Was a
    fixed 0.05 s sleep per test (~41 s over the suite's 819 asyncio ones); it returns after a
    few loop steps when nothing is left.

    The stdlib loop's queues are read (``_ready``, ``_scheduled``); uvloop
    shows neither, so there the fixed sleep stays."""
    ready = getattr(loop, "_ready", None)
    if ready is None or not hasattr(loop, "_scheduled"):
        await asyncio.sleep(SETTLE_TIMERS)
        return
    horizon = loop.time() + SETTLE_TIMERS
    while True:
        # Our own wake-up is queued behind what is ready now: at our return
        # all of that ran. Nothing queued behind us: no callback is left.
        await asyncio.sleep(0)
        if loop.time() > horizon:
            return  # something keeps the loop busy (a spinning poll): as long as the sleep
        if ready:
            continue
        # Read afresh: the loop rebuilds this list when it sheds cancelled timers.
        due = [h.when() for h in loop._scheduled  # type: ignore[attr-defined]
               if not h.cancelled() and h.when() <= horizon]
        if not due:
            return
        await asyncio.sleep(max(0.0, min(due) - loop.time()))


class LoopErrors:
    """Collects calls of the loop's exception handler (they fail the test)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        self.calls.append(context)
        loop.default_exception_handler(context)


@pytest.fixture
async def make_agent() -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    import aioxfer

    loop = asyncio.get_running_loop()
    errors = LoopErrors()
    old = loop.get_exception_handler()
    loop.set_exception_handler(errors)
    agents: list[Any] = []

    async def factory(name: str = "agent", **kwargs: Any) -> Any:
        agent = aioxfer.Agent(f"{name}-{len(agents)}", **kwargs)
        await within(agent.__aenter__())
        agents.append(agent)
        return agent

    try:
        yield factory
    finally:
        for agent in reversed(agents):
            await within(agent.aclose(), 30)
        # Closing callbacks may still be queued: let them run before judging.
        await settle(loop)
        loop.set_exception_handler(old)
    for agent in agents:
        assert_no_leaks(agent)
    assert not errors.calls, f"loop exception handler called: {errors.calls!r}"


@dataclasses.dataclass
class Pair:
    transport: str
    init: Any  # initiator agent
    target: Any  # target agent
    peer: Any  # init's Peer for target

    @property
    def result_path(self) -> str:
        """The path a transfer of host memory reports: the transport's, except
        over "cuda", where host memory moves as shm copies (and says so)."""
        return "shm" if self.transport == "cuda" else self.transport

    async def remote(self, name: str) -> Any:
        """The target's region ``name`` as init sees it (metadata refreshed first:
        the region may have been registered after the connect)."""
        await within(self.peer.refresh())
        return self.peer.region(name)


@pytest.fixture
async def pair(make_agent: Callable[..., Awaitable[Any]], transport: str) -> Pair:
    """Two agents in this process, the first connected to the second."""
    kw = transport_kwargs(transport)
    target = await make_agent("target", **kw)
    init = await make_agent("init", **kw)
    peer = await within(init.connect(target.address))
    assert peer.path == transport, f"expected path {transport}, got {peer.path}"
    return Pair(transport, init, target, peer)


# --------------------------------------------------------------- remote agents


def _region_bytes(regions: dict[str, Any], name: str) -> memoryview:
    return regions[name].memoryview.cast("B")


async def _serve(conn: Any, opts: dict[str, Any]) -> None:
    import aioxfer

    loop = asyncio.get_running_loop()
    size = opts.get("size", 1 << 20)
    if "as_uid" in opts:  # another user on this host (root drops to it, e.g. nobody)
        # What this process will need from a Python installation the other
        # user may not be able to read (e.g. under /root): loaded first.
        import concurrent.futures.thread  # noqa: F401
        import encodings.idna  # noqa: F401
        import socket

        socket.getaddrinfo("127.0.0.1", 0)
        os.setgroups([])
        os.setresgid(opts["as_uid"], opts["as_uid"], opts["as_uid"])
        os.setresuid(opts["as_uid"], opts["as_uid"], opts["as_uid"])
    kwargs = {k: opts[k] for k in ("transports", "token", "peer_timeout", "keepalive",
                                   "tcp_connections", "insecure_no_auth") if k in opts}
    agent = aioxfer.Agent(opts.get("name", "remote"), **kwargs)
    if "lie" in opts:
        _lie(agent, opts["lie"])
    async with agent:
        regions: dict[str, Any] = {
            "pool": agent.alloc(size, name="pool"),  # memfd-backed
            "user": agent.register(bytearray(size), name="user"),  # plain user memory
        }
        peers: dict[str, Any] = {"floods": {}}
        conn.send({"address": agent.address, "pid": os.getpid()})
        while True:
            cmd, args = await loop.run_in_executor(None, conn.recv)
            if cmd == "quit":
                break
            try:
                result = await _command(agent, regions, peers, cmd, args)
                conn.send(("ok", result))
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    conn.send(("ok", stats_dict(agent)))


async def _command(agent: Any, regions: dict[str, Any], peers: dict[str, Any],
                   cmd: str, args: tuple[Any, ...]) -> Any:
    import aioxfer

    if cmd == "fill":
        name, off, n, seed = args
        _region_bytes(regions, name)[off:off + n] = pattern(n, seed).tobytes()
        return None
    if cmd == "zero":
        (name,) = args
        mv = _region_bytes(regions, name)
        mv[:] = bytes(len(mv))
        return None
    if cmd == "get":
        name, off, n = args
        return bytes(_region_bytes(regions, name)[off:off + n])
    if cmd == "digest":
        name, off, n = args
        return digest(_region_bytes(regions, name)[off:off + n])
    if cmd == "stats":
        return stats_dict(agent)
    if cmd == "notes":
        # Receives n notifications; for each whose payload names a check, the
        # bytes are hashed at once: data bound to a notification must be in
        # memory when the notification is received.
        n, seconds, checks = args
        out = []
        async with asyncio.timeout(seconds):
            for _ in range(n):
                note = await agent.notifications.receive()
                ok = None
                if note.payload in checks:
                    name, off, length, want = checks[note.payload]
                    ok = digest(_region_bytes(regions, name)[off:off + length]) == want
                out.append((note.peer_name, note.payload, ok))
        return out
    if cmd == "connect":
        (address,) = args
        async with asyncio.timeout(STEP):
            peer = await agent.connect(address)
        peers[address] = peer
        return peer.path
    if cmd == "write":
        # This process as initiator: write local [loff, loff+n) to the peer's region.
        address, local, loff, remote, roff, n, notify = args
        peer = peers[address]
        src = regions[local][loff:loff + n]
        dst = peer.region(remote)[roff:roff + n]
        async with asyncio.timeout(STEP * 3):
            res = await agent.write(src, dst, notify=notify)
        return res.nbytes
    if cmd == "flood":
        # Writes local -> the peer's region in a loop in the background until
        # "flood_stop"; counts what completed and what failed (by type).
        address, local, remote, n = args
        peer = peers[address]
        src = regions[local][0:n]
        dst = peer.region(remote)[0:n]
        counts: dict[str, int] = {"ok": 0}

        async def loop_writes() -> None:
            while True:
                try:
                    await agent.write(src, dst)
                    counts["ok"] += 1
                except aioxfer.XferError as exc:
                    counts[type(exc).__name__] = counts.get(type(exc).__name__, 0) + 1
                    await asyncio.sleep(0.01)

        peers["floods"][address] = (asyncio.get_running_loop().create_task(loop_writes()),
                                    counts)
        await asyncio.sleep(0.05)
        return counts["ok"]
    if cmd == "flood_stop":
        (address,) = args
        task, counts = peers["floods"].pop(address)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return counts
    if cmd == "sleep":
        await asyncio.sleep(args[0])
        return None
    if cmd == "raise":
        raise aioxfer.XferError("requested")
    raise ValueError(f"unknown command {cmd!r}")


def _lie(agent: Any, lie: dict[str, Any]) -> None:
    """Makes agent a hostile peer: the metadata it serves claims another
    process's pid and uid, and regions at another process's addresses (what a
    confused-deputy attack would advertise)."""
    import msgspec

    real = agent._localmeta.meta_with

    def lying(memfd: Any) -> Any:
        meta = real(memfd)
        regions = [msgspec.structs.replace(r, addr=lie["addr"], nbytes=lie["nbytes"])
                   for r in meta.regions]
        return msgspec.structs.replace(meta, pid=lie["pid"], uid=lie.get("uid", meta.uid),
                                       regions=regions)

    agent._localmeta.meta_with = lying


def remote_agent_main(conn: Any, opts: dict[str, Any]) -> None:
    run_child(_serve, conn, opts)


class PipeChild:
    """A spawned child process driven over a pipe: ``main(conn, *args)`` sends
    a hello first (kept as ``hello``), then answers each message sent by
    ``call``; ``close`` asks it to quit, and kills it if it does not."""

    def __init__(self, main: Callable[..., None], *args: Any, seconds: float = 30.0) -> None:
        self.seconds = seconds
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=main, args=(child, *args), daemon=True)
        self.proc.start()
        child.close()
        self.hello: Any = self.recv()

    def recv(self, seconds: float | None = None) -> Any:
        wait = self.seconds if seconds is None else seconds
        if not self.conn.poll(wait):
            raise TimeoutError(f"the child process did not answer within {wait} s")
        return self.conn.recv()

    def call(self, msg: Any) -> Any:
        self.conn.send(msg)
        return self.recv()

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("quit")
            except (OSError, EOFError, TimeoutError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


def run_child(serve: Callable[[Any, dict[str, Any]], Awaitable[None]], conn: Any,
              opts: dict[str, Any]) -> None:
    """A spawned child's body: runs serve(conn, opts); a failure is sent to the
    parent (which raises it as RemoteError) before the child dies of it."""
    try:
        asyncio.run(serve(conn, opts))  # type: ignore[arg-type]
    except BaseException as exc:
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        except Exception:
            pass
        raise


class RemoteError(AssertionError):
    pass


class RemoteAgent:
    """An agent in a spawned process with two regions, "pool" (agent.alloc) and
    "user" (a registered bytearray), each ``size`` bytes."""

    def __init__(self, **opts: Any) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=remote_agent_main, args=(child, opts), daemon=True)
        self.proc.start()
        child.close()
        hello = self._recv(60.0)
        if not isinstance(hello, dict):
            raise RemoteError(f"remote agent failed to start: {hello!r}")
        self.address: str = hello["address"]
        self.pid: int = hello["pid"]
        self.closed = False

    def _recv(self, seconds: float) -> Any:
        if not self._conn.poll(seconds):
            raise RemoteError(f"remote agent did not answer within {seconds} s")
        return self._conn.recv()

    async def call(self, cmd: str, *args: Any, seconds: float = STEP * 3) -> Any:
        """Runs one command in the remote agent without blocking this loop."""
        loop = asyncio.get_running_loop()
        self._conn.send((cmd, args))
        reply = await loop.run_in_executor(None, self._recv, seconds)
        if reply[0] != "ok":
            raise RemoteError(f"remote {cmd} failed: {reply[1]}\n{reply[2]}")
        return reply[1]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        os.kill(self.pid, sig)

    async def close(self) -> dict[str, Any] | None:
        """Closes the remote agent and returns its final statistics."""
        if self.closed:
            return None
        self.closed = True
        stats = None
        if self.proc.is_alive():
            try:
                stats = await self.call("quit")
            except (RemoteError, OSError, EOFError):
                stats = None
        await asyncio.get_running_loop().run_in_executor(None, self.proc.join, 10)
        self.terminate()
        return stats

    def terminate(self) -> None:
        self.closed = True
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self._conn.close()


@pytest.fixture
async def remote_agent() -> AsyncIterator[Callable[..., Awaitable[RemoteAgent]]]:
    """Factory: ``await remote_agent(size=..., transports=...)``; closed at teardown,
    where a remote agent that still runs must close without leaks."""
    started: list[RemoteAgent] = []

    async def factory(**opts: Any) -> RemoteAgent:
        loop = asyncio.get_running_loop()
        ra = await loop.run_in_executor(None, lambda: RemoteAgent(**opts))
        started.append(ra)
        return ra

    try:
        yield factory
    finally:
        finals = []
        for ra in started:
            finals.append(await ra.close())
    for stats in finals:
        if stats is not None:
            leaks = {k: stats.get(k) for k in ("in_flight", "native_ops", "native_regions",
                                               "pinned_regions")}
            assert all(v == 0 for v in leaks.values()), f"remote agent leaks: {leaks}"



def pipe_names() -> set[str]:
    """Pipes open in this process, by their "pipe:[inode]" names: the one-copy
    send makes one per connection on its first spliced frame. Compared as
    sets, not counts: an earlier test's agent, freed meanwhile by the
    collector, may close its own pipes during a write (tcp26's count read
    32 -> 28 in CI)."""
    names = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("pipe:"):
            names.add(link)
    return names

def sigstop(pid: int) -> None:
    """SIGSTOP, and wait until every thread of pid is stopped (kill() returns
    before that; a thread on another core may still run for a moment)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rpartition(")")[2].split()[0])
        if all(st in "Tt" for st in states):
            return
        assert time.monotonic() < deadline, f"pid {pid} not stopped: {states}"
        time.sleep(0.001)


def queued_conns(port: int, min_bytes: int) -> int:
    """Established IPv4 connections whose local port is ``port`` with at
    least ``min_bytes`` unread in their receive queue (/proc/net/tcp): what
    a SIGSTOPped peer has not read of the requests sent to it."""
    n = 0
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            cols = line.split()
            lport = int(cols[1].rsplit(":", 1)[1], 16)
            rxq = int(cols[4].split(":")[1], 16)
            n += cols[3] == "01" and lport == port and rxq >= min_bytes
    return n


@dataclasses.dataclass
class TcpVictim:
    """A remote agent over tcp (``ra``, listening on ``port``) and this
    process's initiator ``init`` connected to it (``peer``, every connection
    joined), with ``buf`` registered as "src" before the connect (``fds0``
    and ``regions0``: this process's fds and init's native regions then)."""
    ra: RemoteAgent
    port: int
    init: Any
    buf: Any
    peer: Any
    fds0: int
    regions0: int

    async def kill_under(self, post: Callable[[], Any], queued: Callable[[], bool],
                         what: str, then: Callable[[], None] | None = None) -> None:
        """Stops the peer (SIGSTOP), posts a request (``post()``), waits
        until ``queued()`` (what reached the stopped peer; ``then()`` checks
        it further), and SIGKILLs the peer: the request must fail with
        PeerLost within 10 s of its post, and nothing stay in flight."""
        from aioxfer import PeerLost

        sigstop(self.ra.pid)
        try:
            t0 = time.monotonic()
            t = post()
            await wait_until(queued, 10, what=what)
            if then is not None:
                then()
            assert not t.done()
            self.ra.kill(signal.SIGKILL)
            with pytest.raises(PeerLost):
                await within(t, 10)
            assert time.monotonic() - t0 < 10
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.ra.pid, signal.SIGCONT)
        await wait_until(lambda: self.init.statistics().in_flight == 0
                         and self.init.statistics().native_ops == 0, 10,
                         what="nothing in flight")


async def tcp_victim(make_agent: Callable[..., Awaitable[Any]],
                     remote_agent: Callable[..., Awaitable[RemoteAgent]],
                     src: Any, size: int = 2 << 20, warm: int = 1 << 20) -> TcpVictim:
    """A TcpVictim: the remote agent's regions ``size`` bytes, ``src`` (a
    writable buffer) registered as init's "src", and its first ``warm``
    bytes written once to the peer's "user" (warm). init's keepalive is
    30 s, so no ping lands in a stopped peer's queues while a test looks."""
    ra = await remote_agent(size=size, transports=("tcp",))
    port = int(ra.address.rsplit(":", 1)[1])
    init = await make_agent("init", transports=("tcp",), keepalive=30.0, peer_timeout=120.0)
    buf = init.register(src, name="src")
    fds0, regions0 = len(os.listdir("/proc/self/fd")), init.statistics().native_regions
    peer = await within(init.connect(ra.address))
    assert peer.path == "tcp"
    # The connections join once connect returned (Connector._join_rest).
    await wait_until(lambda: peer.statistics().rails[0].connections == 4, 10, what="the joins")
    await within(init.write(buf[0:warm], peer.region("user")[0:warm]))  # warm
    return TcpVictim(ra, port, init, buf, peer, fds0, regions0)


# --------------------------------------------------------------- aioxfer.nixl peers

NIXL_BIG = 64 << 20


def nixl_pattern(nbytes: int) -> np.ndarray:
    """The producer's bytes: a pattern with no zero byte (so a zeroed
    destination shows every byte that landed)."""
    return (np.arange(nbytes) % 251 + 1).astype(np.uint8)


def nixl_producer_main(conn: Any, nbytes: int = NIXL_BIG) -> None:
    """A PipeChild: a remote aioxfer.nixl agent over tcp with ``nbytes`` of
    nixl_pattern registered; its hello is (name, metadata, address)."""
    os.environ["AIOXFER_NIXL_TRANSPORTS"] = "tcp"
    from aioxfer.nixl import nixl_agent, nixl_agent_config

    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config())
    pool = nixl_pattern(nbytes)
    agent.register_memory(agent.get_reg_descs([(pool.ctypes.data, nbytes, 0, "")], "DRAM"))
    conn.send((agent.name, agent.get_agent_metadata(), pool.ctypes.data))
    while conn.recv() != "quit":
        pass
    agent.close()
    conn.send("bye")


@dataclasses.dataclass
class NixlReader:
    """This process's aioxfer.nixl ``agent`` (tcp) with ``kv`` (zeroed,
    registered) and the producer child (``producer``, its agent ``name``,
    its pattern at ``raddr``) added as a remote agent."""
    agent: Any
    producer: PipeChild
    name: str
    raddr: int
    kv: np.ndarray
    stopped: bool = False

    def read_handle(self) -> Any:
        """A handle that READs the producer's whole pattern into kv."""
        a, n = self.agent, len(self.kv)
        return a.initialize_xfer("READ", a.get_xfer_descs([(self.kv.ctypes.data, n, 0)], "DRAM"),
                                 a.get_xfer_descs([(self.raddr, n, 0)], "DRAM"), self.name)

    def stop(self) -> None:
        """SIGSTOPs the producer (its answers stall; no wait for its threads)."""
        os.kill(self.producer.proc.pid, signal.SIGSTOP)
        self.stopped = True

    def cont(self) -> None:
        os.kill(self.producer.proc.pid, signal.SIGCONT)
        self.stopped = False


@contextlib.contextmanager
def nixl_reader(monkeypatch: pytest.MonkeyPatch, nbytes: int = NIXL_BIG,
                seconds: float = 30.0) -> Iterator[NixlReader]:
    """A NixlReader over tcp (AIOXFER_NIXL_TRANSPORTS, set for this test)
    reading from a nixl_producer_main child; at the end the producer is let
    go on if stopped, the agent closed and the child ended."""
    from aioxfer.nixl import nixl_agent, nixl_agent_config

    monkeypatch.setenv("AIOXFER_NIXL_TRANSPORTS", "tcp")
    producer = PipeChild(nixl_producer_main, nbytes, seconds=seconds)
    try:
        name, md, raddr = producer.hello
        agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config())
        reader = NixlReader(agent, producer, name, raddr, np.zeros(nbytes, dtype=np.uint8))
        try:
            agent.register_memory(agent.get_reg_descs([(reader.kv.ctypes.data, nbytes, 0, "")],
                                                      "DRAM"))
            agent.add_remote_agent(md)
            yield reader
        finally:
            if reader.stopped:
                reader.cont()
            agent.close()
    finally:
        producer.close()


# --------------------------------------------------------------- kv helpers


def kv_block(i: int, nbytes: int) -> np.ndarray:
    """Block ``i`` of a kv writer child (KV_WRITER_HEAD's block(i))."""
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


# The start of a kv writer child's script (ScriptChild): argv is the tier's
# directory, the block size and the block count; source() fills blocks
# kv_block(i) into a region and keys them (kv.chain of 16 tokens a block);
# line() reads the next line the test sends.
KV_WRITER_HEAD = textwrap.dedent('''
    import asyncio, sys, time
    import numpy as np
    import aioxfer
    from aioxfer import kv

    PATH, BB, N = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

    def source(agent, namespace):
        src = agent.alloc(N * BB)
        for i in range(N):
            src.numpy()[i * BB:(i + 1) * BB] = np.random.default_rng(i).integers(
                0, 256, BB, dtype=np.uint8)
        return src, kv.chain(np.arange(16 * N), block_tokens=16, namespace=namespace)

    async def line():
        return (await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)).strip()
''')


async def check_kv_blocks(make_agent: Callable[..., Awaitable[Any]], name: str, tier: Any,
                          n: int, nbytes: int, namespace: bytes, context: str = "") -> None:
    """A store of this process on ``tier`` (a kv writer child's, reopened)
    holds all ``n`` blocks kv_block(i) under the writer's keys."""
    from aioxfer import kv

    agent = await make_agent(name)
    dst = agent.alloc(n * nbytes)
    keys = kv.chain(np.arange(16 * n), block_tokens=16, namespace=namespace)
    async with kv.Store.open(agent, block_bytes=nbytes, tiers=[tier]) as store:
        res = await within(store.get(keys, dst[0:n * nbytes]))
        assert res.failed == ()
        assert res.prefix == n, f"{res.prefix} of {n} blocks survived the kill {context}"
        for i in range(n):
            assert np.array_equal(dst.numpy()[i * nbytes:(i + 1) * nbytes], kv_block(i, nbytes))


class ScriptChild:
    """A Python script run as a child process (asyncio), talked to in lines:
    ``line()`` is its next stdout line (its death fails the test with its
    stderr), ``expect(word)`` one that must start with ``word``, ``send``
    writes one to its stdin; ``lines`` keeps what it said."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []

    async def line(self) -> str:
        assert self.proc.stdout is not None and self.proc.stderr is not None
        raw = await self.proc.stdout.readline()
        if not raw:
            err = (await self.proc.stderr.read()).decode()
            raise AssertionError(f"the child died: {self.lines} {err[-3000:]}")
        self.lines.append(raw.decode().strip())
        return self.lines[-1]

    async def expect(self, word: str) -> list[str]:
        got = (await self.line()).split()
        assert got[0] == word, self.lines
        return got[1:]

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")


@contextlib.asynccontextmanager
async def script_child(text: str, *args: str, cwd: Path) -> AsyncIterator[ScriptChild]:
    """Runs ``text`` (written to cwd/child.py; cwd outside the checkout, so
    the installed aioxfer is the one imported) with ``args``; SIGKILLed at
    the end of the block (a kill -9, never a clean exit)."""
    script = cwd / "child.py"
    script.write_text(text)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), *args, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=str(cwd))
    try:
        yield ScriptChild(proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()


# The LayerStream tests' geometry (test_kv18b_stream_cancel, test_kv19_stream):
# STREAM_N blocks of STREAM_BB in STREAM_LAYERS layers, so one layer's
# transfer moves 16 MiB (slow enough over loopback tcp to be caught in
# flight); each case repeats STREAM_TRIALS times (before the fixes a trial
# caught bytes landing late in about half the runs).
STREAM_BB = 8 << 20
STREAM_N = 8
STREAM_LAYERS = 4
STREAM_TRIALS = 6


async def kv_stream_store(make_agent: Callable[..., Awaitable[Any]], name: str, tag: str,
                          seed: int, n: int = STREAM_N, nbytes: int = STREAM_BB,
                          transports: tuple[str, ...] = ("tcp",)) -> tuple[Any, Any, list[bytes]]:
    """(agent, store, keys): an agent reaching its own HostTier over
    ``transports`` (loopback tcp by default: copies slow enough to be caught
    in flight; inline_bytes=0, so none is copied inside its post), holding
    ``n`` blocks of ``nbytes`` (pattern(seed)) under keys namespaced ``tag``."""
    from aioxfer import kv

    agent = await make_agent(name, transports=transports, inline_bytes=0)
    src = agent.alloc(n * nbytes)
    src.numpy()[:] = pattern(n * nbytes, seed)
    keys = kv.chain(np.arange(16 * n), block_tokens=16, namespace=tag.encode())
    store = await within(kv.Store.open(agent, block_bytes=nbytes, tiers=[kv.HostTier(n * nbytes)]))
    put = await within(store.put(keys, src[0:n * nbytes]))
    assert put.stored == n, put
    return agent, store, keys


async def copy_started(view: np.ndarray, at: int, fill: int = 0xA5) -> None:
    """Until the byte at ``at`` of ``view`` (filled with ``fill``; the first
    byte of a layer not awaited yet) has landed: a copy of it then runs."""
    deadline = time.monotonic() + 30
    while view[at] == fill:
        assert time.monotonic() < deadline, "the layer's copy never started"
        await asyncio.sleep(0)


async def engine_settled(agent: Any) -> None:
    """Until nothing is in flight in ``agent``'s engine, then 0.2 s more
    (for anything a late completion still writes)."""
    await within(wait_until(lambda: agent.statistics().in_flight == 0,
                            what="the engine idle"))
    await asyncio.sleep(0.2)


# --------------------------------------------------------------- fake S3 endpoints
# Hostile or scripted S3 endpoints for the object backend's tests (redirects,
# odd answers, credentials that must go nowhere): aiohttp servers on
# loopback. aiohttp is an optional dependency (the "objects" extra): it is
# imported when a server starts, and the tests that use one importorskip it.

_S3_NOW = email.utils.formatdate(usegmt=True)


# (method, query parameter or None, stage), first match wins: a DELETE or a
# POST names its stage by a query parameter; a PUT with partNumber is a part.
_S3_STAGES = (
    ("HEAD", None, "head"),
    ("GET", None, "get"),
    ("POST", "delete", "bulk_delete"),
    ("POST", "uploads", "create_mpu"),
    ("POST", "uploadId", "complete_mpu"),
    ("DELETE", "uploadId", "abort"),
    ("DELETE", None, "delete"),
    ("PUT", "partNumber", "upload_part"),
    ("PUT", None, "put"),
)


def s3_stage(req: Any) -> str:
    """Which request of an S3 operation ``req`` (an aiohttp request) is:
    head, get, put, delete, bulk_delete, create_mpu, upload_part,
    complete_mpu, abort, or "other <METHOD>"."""
    return next((stage for method, param, stage in _S3_STAGES
                 if req.method == method and (param is None or param in req.query)),
                f"other {req.method}")


async def s3_answer(req: Any, size: int = 4096) -> Any:
    """What a willing S3 server answers ``req`` (no signature checked, nothing
    stored): every object exists with ``size`` zero bytes."""
    from aiohttp import web

    await req.read()
    what = s3_stage(req)
    meta = {"ETag": '"0123456789abcdef0123456789abcdef"', "Last-Modified": _S3_NOW}
    if what == "head":
        return web.Response(headers={**meta, "Content-Length": str(size)})
    if what == "get":
        rng = req.headers.get("Range")
        if rng:
            a, b = (int(x) for x in rng.split("=")[1].split("-"))
            return web.Response(status=206, body=bytes(b - a + 1), headers={
                **meta, "Content-Range": f"bytes {a}-{b}/{size}"})
        return web.Response(body=bytes(size), headers=meta)
    if what == "bulk_delete":
        return web.Response(content_type="application/xml", text=(
            '<?xml version="1.0" encoding="UTF-8"?>'
            '<DeleteResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"></DeleteResult>'))
    if what == "create_mpu":
        return web.Response(content_type="application/xml", text=(
            '<?xml version="1.0" encoding="UTF-8"?><InitiateMultipartUploadResult>'
            "<Bucket>bkt</Bucket><Key>pre/k</Key><UploadId>UP1</UploadId>"
            "</InitiateMultipartUploadResult>"))
    if what == "complete_mpu":
        return web.Response(content_type="application/xml", text=(
            '<?xml version="1.0" encoding="UTF-8"?><CompleteMultipartUploadResult>'
            '<Bucket>bkt</Bucket><Key>pre/k</Key><ETag>"e-2"</ETag>'
            "</CompleteMultipartUploadResult>"))
    if what in ("delete", "abort"):
        return web.Response(status=204)
    return web.Response(headers=meta)  # put, upload_part


class FakeS3:
    """An aiohttp server on loopback in the place of an S3 endpoint (or of
    the host a redirect points at): ``handler(request)`` answers every
    request (it may be replaced while the server runs). Each request is
    recorded: ``hits[(method, last path segment)]`` counts them, ``seen``
    lists (s3_stage, path and query, headers) in arrival order."""

    def __init__(self, handler: Callable[[Any], Awaitable[Any]]) -> None:
        self.handler = handler
        self.hits: dict[tuple[str, str], int] = {}
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        self.runner: Any = None
        self.port = 0

    async def _handle(self, req: Any) -> Any:
        key = (req.method, req.path.rsplit("/", 1)[-1])
        self.hits[key] = self.hits.get(key, 0) + 1
        self.seen.append((s3_stage(req), req.path_qs, dict(req.headers)))
        return await self.handler(req)

    async def start(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=64 << 20)  # multipart parts
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def aclose(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def fake_s3() -> AsyncIterator[Callable[[Callable[[Any], Awaitable[Any]]],
                                              Awaitable[FakeS3]]]:
    """Factory: ``await fake_s3(handler)``, a started FakeS3; closed at teardown."""
    made: list[FakeS3] = []

    async def make(handler: Callable[[Any], Awaitable[Any]]) -> FakeS3:
        f = FakeS3(handler)
        made.append(f)
        await f.start()
        return f

    try:
        yield make
    finally:
        for f in reversed(made):
            await f.aclose()
