"""Real network namespaces for the rails tests and the reroute benchmark.

Not a test module: ``tests/test_rails_netns.py`` and
``benchmarks/rails_reroute.py`` import it.

- :class:`Rails`: two network namespaces ("a", "b"), created under unique
  names (``axf-<pid>-<n>-a``/``-b``), joined by ``n`` veth pairs, one per rail
  (rail ``i`` is 10.77.i.0/24 by default: ``.1`` in a, ``.2`` in b). The veths
  are created inside the namespaces (``ip -n NS link add``): no host interface
  is ever made, moved or touched, and traffic stays inside. It takes links
  down and up, blackholes a rail with nft (or iptables) drop rules inside one
  namespace, shapes one with ``tc tbf``, and runs processes inside a namespace
  (they get SIGKILL when the process that started them dies). ``close()``
  kills those processes and deletes both namespaces (which removes the veths),
  whatever state they are in; :func:`rails` is the context manager.
- :func:`unavailable`: why namespaces cannot be used here (not root, no ``ip
  netns``, creating one fails as in an unprivileged container), or None.
- :class:`NsAgent`: an aioxfer agent in a process inside a namespace, driven
  over a pipe (concurrent commands: a stream of writes runs while the caller
  reads statistics and takes links down). Every call is bounded.

The worker side (:func:`worker_main`) runs in that process: it configures
structlog to capture aioxfer's events (``rail.down``, ``rail.up``, ...) before
importing aioxfer, and serves the commands of :class:`_Worker`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import os
import pickle
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
CMD_TIMEOUT = 10.0  # bound of one ip/nft/tc command
_counter = itertools.count()


# ------------------------------------------------------------------ host side


def _run(*argv: str, check: bool = True,
         input: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, input=input,
                          timeout=CMD_TIMEOUT)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()}")
    return proc


@functools.cache
def unavailable() -> str | None:
    """None when network namespaces can be made here, else why not (probed
    once per process: it makes a namespace and a veth pair)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not installed"
    try:
        probe = _run("ip", "netns", "list", check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"'ip netns' is unavailable: {exc}"
    if probe.returncode != 0:
        return f"'ip netns' is unavailable: {probe.stderr.strip()}"
    name = f"axf-{os.getpid()}-probe{next(_counter)}"
    try:
        made = _run("ip", "netns", "add", name, check=False)
        if made.returncode != 0:
            return f"cannot create a network namespace (unprivileged container?): " \
                   f"{made.stderr.strip()}"
        veth = _run("ip", "-n", name, "link", "add", "p0", "type", "veth", "peer", "name",
                    "p1", check=False)
        if veth.returncode != 0:
            return f"cannot create a veth pair in a namespace: {veth.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", name, check=False)
    return None


def firewall() -> str | None:
    """"nft" or "iptables" (whichever can blackhole a rail; nft first, or
    as AXF_FIREWALL says), or None."""
    forced = os.environ.get("AXF_FIREWALL")
    if forced:
        return forced if shutil.which(forced) else None
    if shutil.which("nft"):
        return "nft"
    if shutil.which("iptables"):
        return "iptables"
    return None


@dataclasses.dataclass(frozen=True)
class Rail:
    index: int  # 1-based
    dev_a: str  # veth end in namespace a
    dev_b: str  # veth end in namespace b
    addr_a: str  # "10.77.i.1"
    addr_b: str
    subnet: str  # "10.77.i.0/24"


class Rails:
    """Two namespaces joined by ``nrails`` veth pairs. Use :func:`rails`."""

    def __init__(self, nrails: int = 2, prefix: str = "10.77") -> None:
        n = next(_counter)
        self.ns_a = f"axf-{os.getpid()}-{n}-a"
        self.ns_b = f"axf-{os.getpid()}-{n}-b"
        self.rails = [
            Rail(i, f"r{i}a", f"r{i}b", f"{prefix}.{i}.1", f"{prefix}.{i}.2", f"{prefix}.{i}.0/24")
            for i in range(1, nrails + 1)
        ]
        self._procs: list[subprocess.Popen[Any]] = []
        self._created: list[str] = []
        self._fw: dict[tuple[str, int], str] = {}

    def ns(self, side: str) -> str:
        return {"a": self.ns_a, "b": self.ns_b}[side]

    def rail(self, index: int) -> Rail:
        return self.rails[index - 1]

    def ip(self, side: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``ip -n NS args...`` (only inside our namespaces)."""
        return _run("ip", "-n", self.ns(side), *args, check=check)

    def exec(self, side: str, *argv: str, check: bool = True,
             input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Runs a command inside a namespace (``ip netns exec``)."""
        return _run("ip", "netns", "exec", self.ns(side), *argv, check=check, input=input)

    def setup(self) -> None:
        for ns in (self.ns_a, self.ns_b):
            _run("ip", "netns", "add", ns)
            self._created.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        for r in self.rails:
            # Made inside a, the peer end placed straight into b.
            self.ip("a", "link", "add", r.dev_a, "type", "veth", "peer", "name", r.dev_b,
                    "netns", self.ns_b)
            self.ip("a", "addr", "add", f"{r.addr_a}/24", "dev", r.dev_a)
            self.ip("b", "addr", "add", f"{r.addr_b}/24", "dev", r.dev_b)
            self.ip("a", "link", "set", r.dev_a, "up")
            self.ip("b", "link", "set", r.dev_b, "up")

    # -------------------------------------------------------- failures

    def link_down(self, index: int, side: str = "a") -> None:
        r = self.rail(index)
        self.ip(side, "link", "set", r.dev_a if side == "a" else r.dev_b, "down")

    def link_up(self, index: int, side: str = "a") -> None:
        r = self.rail(index)
        self.ip(side, "link", "set", r.dev_a if side == "a" else r.dev_b, "up")

    def blackhole(self, index: int, side: str = "a") -> str:
        """Drops every packet of rail ``index`` in and out of namespace
        ``side`` (no RST, no ICMP: the peers just go silent on it). Returns
        the tool used ("nft" or "iptables")."""
        r = self.rail(index)
        tool = firewall()
        if tool is None:
            raise RuntimeError("neither nft nor iptables is installed")
        if tool == "nft":
            table = f"axf_bh{index}"
            self.exec(side, "nft", "-f", "-", input=(
                f"table ip {table} {{\n"
                f"  chain in {{ type filter hook input priority -10; policy accept;\n"
                f"    ip saddr {r.subnet} drop\n  }}\n"
                f"  chain out {{ type filter hook output priority -10; policy accept;\n"
                f"    ip daddr {r.subnet} drop\n  }}\n"
                f"}}\n"))
        else:
            self.exec(side, "iptables", "-w", "5", "-I", "INPUT", "-s", r.subnet, "-j", "DROP")
            self.exec(side, "iptables", "-w", "5", "-I", "OUTPUT", "-d", r.subnet, "-j", "DROP")
        self._fw[(side, index)] = tool
        return tool

    def unblackhole(self, index: int, side: str = "a") -> None:
        r = self.rail(index)
        tool = self._fw.pop((side, index))
        if tool == "nft":
            self.exec(side, "nft", "delete", "table", "ip", f"axf_bh{index}")
        else:
            self.exec(side, "iptables", "-w", "5", "-D", "INPUT", "-s", r.subnet, "-j", "DROP")
            self.exec(side, "iptables", "-w", "5", "-D", "OUTPUT", "-d", r.subnet, "-j", "DROP")

    def shape(self, index: int, rate: str, side: str = "b") -> None:
        """Limits rail ``index``'s egress from ``side`` with a token bucket
        (``rate`` as tc takes it: "2gbit", "500mbit")."""
        r = self.rail(index)
        dev = r.dev_a if side == "a" else r.dev_b
        self.exec(side, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                  "burst", "1mb", "latency", "100ms")

    # -------------------------------------------------------- processes

    def popen(self, side: str, argv: list[str], **kw: Any) -> subprocess.Popen[Any]:
        """Starts argv inside namespace ``side``; it is SIGKILLed when the
        thread that started it ends (PR_SET_PDEATHSIG), and by :meth:`close`.

        Through nsenter and setpriv, not a preexec_fn: a preexec_fn makes
        subprocess fork() (no vfork), which runs gRPC's fork handlers in a
        process where an earlier test's etcd client left gRPC threads: once
        in CI the child stalled in them and never exec'd etcd ("skipping
        fork() handlers", then an epoll_wait error, in its log)."""
        cmd = ["nsenter", f"--net=/run/netns/{self.ns(side)}", "--",
               "setpriv", "--pdeathsig", "KILL", "--", *argv]
        proc = subprocess.Popen(cmd, **kw)
        self._procs.append(proc)
        return proc

    def close(self) -> None:
        """Kills what we started, then deletes both namespaces (and with them
        the veths). Never raises; safe to call twice."""
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    proc.kill()
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        self._procs.clear()
        for ns in self._created:
            # A process we did not start ourselves but that entered our
            # namespace (a grandchild) would keep it (and its veths) alive.
            with contextlib.suppress(Exception):
                pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
                for pid in pids:
                    with contextlib.suppress(OSError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
            with contextlib.suppress(Exception):
                _run("ip", "netns", "del", ns, check=False)
        self._created.clear()


def reap_stale() -> list[str]:
    """Deletes namespaces of this naming scheme (``axf-<pid>-...``) whose
    process is gone: left by a run that was killed before its teardown."""
    out = _run("ip", "netns", "list", check=False).stdout.split("\n")
    gone = []
    for line in out:
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != "axf" or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        if pid == os.getpid() or os.path.exists(f"/proc/{pid}"):
            continue
        if _run("ip", "netns", "pids", name, check=False).stdout.strip():
            continue  # something still runs in it: not ours to kill
        _run("ip", "netns", "del", name, check=False)
        gone.append(name)
    return gone


@contextlib.contextmanager
def rails(nrails: int = 2, prefix: str = "10.77") -> Iterator[Rails]:
    """Two fresh namespaces joined by ``nrails`` rails, removed at exit
    (also on failure)."""
    reap_stale()
    r = Rails(nrails, prefix)
    try:
        r.setup()
        yield r
    finally:
        r.close()


def leftover_namespaces() -> list[str]:
    """Namespaces this process made that still exist (should be none)."""
    out = _run("ip", "netns", "list", check=False).stdout.split("\n")
    mine = f"axf-{os.getpid()}-"
    return [line.split()[0] for line in out if line.startswith(mine)]


# ------------------------------------------------------------------ pipe protocol


def _send(fd: int, obj: Any, lock: threading.Lock) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    msg = struct.pack("<Q", len(data)) + data
    with lock:
        view = memoryview(msg)
        while view:
            n = os.write(fd, view)
            view = view[n:]


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks = []
    while n:
        b = os.read(fd, min(n, 1 << 20))
        if not b:
            return None
        chunks.append(b)
        n -= len(b)
    return b"".join(chunks)


def _recv(fd: int) -> Any:
    head = _read_exact(fd, 8)
    if head is None:
        raise EOFError
    body = _read_exact(fd, struct.unpack("<Q", head)[0])
    if body is None:
        raise EOFError
    return pickle.loads(body)


class WorkerError(AssertionError):
    """A command failed in the worker (carries its traceback)."""


class NsAgent:
    """An agent process in namespace ``side`` of ``net``.

    ``await NsAgent.start(net, "a", name, listen=[...], **agent_kwargs)``; then
    ``await ag.call("cmd", *args)`` (see :class:`_Worker` for the commands).
    Several calls may be outstanding at once. Its stderr (aioxfer's log, JSON)
    goes to ``ag.log_path``."""

    def __init__(self, net: Rails, side: str, name: str) -> None:
        self.net, self.side, self.name = net, side, name
        c2w_r, self._c2w = os.pipe()
        self._w2c, w2c_w = os.pipe()
        self._logf = tempfile.NamedTemporaryFile(prefix=f"axf-{name}-", suffix=".log",
                                                 delete=False)
        self.log_path = self._logf.name
        env = dict(os.environ, AIOXFER_LOG_FORMAT="json", PYTHONUNBUFFERED="1")
        code = ("import sys; sys.path[0:1] = [sys.argv[1]]; import netns; "
                "netns.worker_main(int(sys.argv[2]), int(sys.argv[3]))")
        try:
            self.proc = net.popen(
                side, [sys.executable, "-c", code, TESTS_DIR, str(c2w_r), str(w2c_w)],
                pass_fds=(c2w_r, w2c_w), stdin=subprocess.DEVNULL, stdout=self._logf,
                stderr=self._logf, env=env, cwd="/",
            )
        finally:
            os.close(c2w_r)
            os.close(w2c_w)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._pending: dict[int, concurrent.futures.Future[Any]] = {}
        self._dead: str | None = None
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"nsagent-{name}")
        self._reader.start()
        self.addresses: list[str] = []

    @classmethod
    async def start(cls, net: Rails, side: str, name: str, **agent_kwargs: Any) -> NsAgent:
        ag = cls(net, side, name)
        try:
            ag.addresses = await ag.call("start", name, agent_kwargs, timeout=60)
        except BaseException:
            ag.kill()
            raise
        return ag

    @property
    def address(self) -> str:
        return self.addresses[0]

    def _read_loop(self) -> None:
        try:
            while True:
                rid, ok, value = _recv(self._w2c)
                fut = self._pending.pop(rid, None)
                if fut is None or fut.done():
                    continue
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(WorkerError(f"{self.name}: {value}"))
        except (EOFError, OSError):
            pass
        self._dead = f"worker {self.name} exited (rc {self.proc.wait(5)}); log tail:\n" \
                     f"{self.log_tail()}"
        for fut in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(WorkerError(self._dead))
        self._pending.clear()

    def log_tail(self, nbytes: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - nbytes))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    async def call(self, cmd: str, *args: Any, timeout: float = 30.0) -> Any:
        """Runs ``cmd`` in the worker; raises WorkerError if it failed or the
        worker died, TimeoutError if no answer within ``timeout``."""
        if self._dead:
            raise WorkerError(self._dead)
        rid = next(self._ids)
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._pending[rid] = fut
        try:
            _send(self._c2w, (rid, cmd, args), self._lock)
        except OSError as exc:
            self._pending.pop(rid, None)
            raise WorkerError(f"worker {self.name} is gone: {exc}\n{self.log_tail()}") from exc
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.wrap_future(fut)
        except TimeoutError:
            self._pending.pop(rid, None)
            raise TimeoutError(f"{self.name}: {cmd} did not answer within {timeout} s; "
                               f"log tail:\n{self.log_tail()}") from None

    async def close(self, timeout: float = 20.0) -> dict[str, Any] | None:
        """Closes the agent (returns its final statistics) and ends the
        process; kills it if that does not happen within ``timeout``."""
        stats = None
        if self.proc.poll() is None and not self._dead:
            with contextlib.suppress(Exception):
                stats = await self.call("close", timeout=timeout)
            with contextlib.suppress(OSError):
                os.close(self._c2w)  # EOF: the worker exits
            self._c2w = -1
            loop = asyncio.get_running_loop()
            with contextlib.suppress(subprocess.TimeoutExpired):
                await loop.run_in_executor(None, self.proc.wait, 5)
        self.kill()
        return stats

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
        for fd in (self._c2w, self._w2c):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._c2w = self._w2c = -1
        self._logf.close()


async def close_all(agents: list[NsAgent]) -> list[Any]:
    """Closes agents, the last started first, all at once: each one's final
    statistics (None if it did not close, or what its close raised)."""
    return list(await asyncio.gather(*(a.close() for a in reversed(agents)),
                                     return_exceptions=True))


def assert_closed_clean(agents: list[NsAgent], finals: list[Any]) -> None:
    """After close_all: every agent closed with nothing in flight and no
    native op, region or pin left."""
    for ag, stats in zip(reversed(agents), finals, strict=True):
        assert isinstance(stats, dict), f"{ag.name} did not close: {stats!r}\n{ag.log_tail()}"
        leaks = {k: stats.get(k) for k in ("in_flight", "native_ops", "native_regions",
                                           "pinned_regions")}
        assert all(v == 0 for v in leaks.values()), f"{ag.name} leaks: {leaks}"


# ------------------------------------------------------------------ worker side


def pattern_bytes(nbytes: int, seed: int) -> bytes:
    import numpy as np

    return np.random.default_rng(seed).bytes(nbytes)


def _digest(views: Any) -> str:
    h = hashlib.blake2b(digest_size=16)
    for v in views:
        h.update(v)
    return h.hexdigest()


class _Stream:
    """Writes ``chunk``-byte pieces of a source region into the ``nslots``
    slots of a remote region, ``window`` in flight, slot after slot, pass
    after pass; pass p puts source chunk (slot + p) mod (nslots + 1) into a
    slot, so every pass leaves different bytes behind and a chunk of an older
    pass landing late would show in the digest. A slot's next write is posted
    only after its previous one completed (window < nslots), so the final
    content is known: :meth:`expected_digest`."""

    def __init__(self, agent: Any, peer: Any, src: Any, dst: Any, chunk: int, nslots: int,
                 window: int, max_bytes: int | None, stop_on_error: bool) -> None:
        assert window < nslots
        self.agent, self.peer, self.src, self.dst = agent, peer, src, dst
        self.chunk, self.nslots, self.window = chunk, nslots, window
        self.max_bytes, self.stop_on_error = max_bytes, stop_on_error
        self.last_src: list[int | None] = [None] * nslots
        self.completions: list[tuple[float, int]] = []  # (monotonic, nbytes)
        self.errors: list[tuple[float, str, str]] = []  # (monotonic, type, message)
        self.ok = 0
        self.posted = 0
        self.bytes = 0
        self.paths: dict[str, int] = {}
        self.stopping = False
        self.started = time.monotonic()
        self.task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        inflight: list[tuple[asyncio.Future[Any], int, int]] = []
        i = 0
        try:
            while True:
                if (not self.stopping and len(inflight) < self.window
                        and (self.max_bytes is None or self.posted * self.chunk < self.max_bytes)):
                    slot = i % self.nslots
                    sidx = (slot + i // self.nslots) % (self.nslots + 1)
                    so, do = sidx * self.chunk, slot * self.chunk
                    try:
                        t = self.agent.write(self.src[so:so + self.chunk],
                                             self.dst[do:do + self.chunk])
                    except Exception as exc:  # e.g. PeerLost at once
                        self._failed(exc)
                        if self.stop_on_error:
                            self.stopping = True
                        continue
                    inflight.append((t, slot, sidx))
                    self.posted += 1
                    i += 1
                    continue
                if not inflight:
                    break
                t, slot, sidx = inflight.pop(0)
                try:
                    res = await t
                except Exception as exc:
                    self._failed(exc)
                    if self.stop_on_error:
                        self.stopping = True
                    self.last_src[slot] = -1  # unknown content
                    continue
                self.ok += 1
                self.bytes += res.nbytes
                self.last_src[slot] = sidx
                self.paths[str(getattr(res, "path", "?"))] = \
                    self.paths.get(str(getattr(res, "path", "?")), 0) + 1
                self.completions.append((time.monotonic(), res.nbytes))
        finally:
            for t, _, _ in inflight:
                t.cancel()

    def _failed(self, exc: BaseException) -> None:
        self.errors.append((time.monotonic(), type(exc).__name__, str(exc)[:300]))

    def progress(self) -> dict[str, Any]:
        return {"ok": self.ok, "bytes": self.bytes, "posted": self.posted,
                "errors": len(self.errors), "done": self.task is not None and self.task.done()}

    def expected_digest(self, dst_size: int) -> str | None:
        """Digest of the whole remote region as the completed writes left it
        (None when a failed write left a slot unknown)."""
        if any(s == -1 for s in self.last_src):
            return None
        views = []
        srcmv = self.src.memoryview.cast("B")
        for s in self.last_src:
            views.append(bytes(self.chunk) if s is None
                         else srcmv[s * self.chunk:(s + 1) * self.chunk])
        rest = dst_size - self.nslots * self.chunk
        if rest:
            views.append(bytes(rest))
        return _digest(views)


class _Worker:
    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = events
        self.agent: Any = None
        self.regions: dict[str, Any] = {}
        self.peers: dict[str, Any] = {}
        self.streams: dict[int, _Stream] = {}
        self._sids = itertools.count()

    async def cmd_start(self, name: str, kwargs: dict[str, Any]) -> list[str]:
        import aioxfer

        self.agent = aioxfer.Agent(name, **kwargs)
        await self.agent.__aenter__()
        return list(getattr(self.agent, "addresses", [self.agent.address]))

    async def cmd_alloc(self, name: str, size: int, seed: int | None = None) -> str:
        """A region of ``size`` bytes (agent.alloc), zero or filled with
        pattern(seed); returns its digest."""
        region = self.agent.alloc(size, name=name)
        mv = region.memoryview.cast("B")
        if seed is not None:
            mv[:] = pattern_bytes(size, seed)
        else:
            mv[:] = bytes(size)
        self.regions[name] = region
        return _digest([mv])

    async def cmd_digest(self, name: str, off: int = 0, n: int | None = None) -> str:
        mv = self.regions[name].memoryview.cast("B")
        return _digest([mv[off:len(mv) if n is None else off + n]])

    async def cmd_connect(self, address: str) -> dict[str, Any]:
        peer = await self.agent.connect(address)
        self.peers[address] = peer
        return {"name": peer.name, "path": peer.path}

    async def cmd_peer_stats(self, address: str) -> dict[str, Any]:
        return dataclasses.asdict(self.peers[address].statistics())

    async def cmd_peer_lost(self, address: str) -> bool:
        return bool(self.peers[address].lost)

    async def cmd_stats(self) -> dict[str, Any]:
        return dataclasses.asdict(self.agent.statistics())

    async def cmd_write(self, address: str, src: str, soff: int, dst: str, doff: int,
                        n: int) -> tuple[str, str]:
        """One write; returns ("ok", path) or (error type, message)."""
        try:
            res = await self.agent.write(self.regions[src][soff:soff + n],
                                         self.peers[address].region(dst)[doff:doff + n])
        except Exception as exc:
            return type(exc).__name__, str(exc)
        return "ok", str(res.path)

    async def cmd_notify(self, address: str, payload: bytes) -> tuple[str, str]:
        """One notification (peer.notify); ("ok", "") or (error type, message)."""
        try:
            await self.peers[address].notify(payload)
        except Exception as exc:
            return type(exc).__name__, str(exc)
        return "ok", ""

    async def cmd_notes(self, quiet: float) -> list[tuple[str, bytes]]:
        """The notifications received until none came for ``quiet`` seconds."""
        got: list[tuple[str, bytes]] = []
        while True:
            try:
                async with asyncio.timeout(quiet):
                    n = await self.agent.notifications.receive()
            except TimeoutError:
                return got
            got.append((n.peer_name, n.payload))

    async def cmd_stream_start(self, address: str, src: str, dst: str, chunk: int,
                               nslots: int, window: int, max_bytes: int | None = None,
                               stop_on_error: bool = True) -> int:
        peer = self.peers[address]
        st = _Stream(self.agent, peer, self.regions[src], peer.region(dst), chunk, nslots,
                     window, max_bytes, stop_on_error)
        sid = next(self._sids)
        st.task = asyncio.get_running_loop().create_task(st.run())
        self.streams[sid] = st
        return sid

    async def cmd_stream_progress(self, sid: int) -> dict[str, Any]:
        return self.streams[sid].progress()

    async def cmd_stream_stop(self, sid: int, dst_size: int, wait: float = 30.0) -> dict[str, Any]:
        """Stops posting, waits for what is in flight (at most ``wait`` s:
        then a "hung" count), and returns the stream's record."""
        st = self.streams.pop(sid)
        st.stopping = True
        assert st.task is not None
        hung = False
        try:
            async with asyncio.timeout(wait):
                await asyncio.shield(st.task)
        except TimeoutError:
            hung = True
            st.task.cancel()
            with contextlib.suppress(BaseException):
                await st.task
        return {
            "ok": st.ok, "posted": st.posted, "bytes": st.bytes, "hung": hung,
            "errors": st.errors, "completions": st.completions, "paths": st.paths,
            "started": st.started, "expected": st.expected_digest(dst_size),
        }

    async def cmd_events(self, *names: str) -> list[dict[str, Any]]:
        return [e for e in self.events if not names or e.get("event") in names]

    async def cmd_close(self) -> dict[str, Any]:
        for st in self.streams.values():
            st.stopping = True
            if st.task is not None:
                st.task.cancel()
        agent, self.agent = self.agent, None
        await agent.aclose()
        return dataclasses.asdict(agent.statistics())


def _configure_logging(events: list[dict[str, Any]]) -> None:
    """Captures every structlog event (and renders it as JSON to stderr);
    done before aioxfer is imported so its loggers use it."""
    import structlog

    def capture(logger: Any, method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        rec = {k: v for k, v in event_dict.items()
               if isinstance(v, str | int | float | bool | type(None))}
        rec["t"] = time.monotonic()
        events.append(rec)
        return event_dict

    structlog.configure(
        processors=[structlog.processors.add_log_level, capture,
                    structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.JSONRenderer()],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )


def worker_main(rfd: int, wfd: int) -> None:
    """Entry point of the process inside the namespace: serves commands
    (id, name, args) from rfd, answers (id, ok, value) on wfd, until EOF."""
    events: list[dict[str, Any]] = []
    _configure_logging(events)
    worker = _Worker(events)
    lock = threading.Lock()

    async def handle(rid: int, cmd: str, args: tuple[Any, ...]) -> None:
        try:
            value = await getattr(worker, f"cmd_{cmd}")(*args)
            reply = (rid, True, value)
        except BaseException as exc:
            reply = (rid, False, f"{cmd}: {type(exc).__name__}: {exc}\n"
                                 f"{traceback.format_exc()}")
            if not isinstance(exc, Exception):
                _send(wfd, reply, lock)
                raise
        _send(wfd, reply, lock)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        def reader() -> None:
            try:
                while True:
                    loop.call_soon_threadsafe(queue.put_nowait, _recv(rfd))
            except (EOFError, OSError):
                loop.call_soon_threadsafe(queue.put_nowait, None)

        threading.Thread(target=reader, daemon=True).start()
        tasks: set[asyncio.Task[None]] = set()
        while (msg := await queue.get()) is not None:
            t = loop.create_task(handle(*msg))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        for t in list(tasks):
            t.cancel()
        if worker.agent is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(10):
                    await worker.agent.aclose()

    asyncio.run(main())
