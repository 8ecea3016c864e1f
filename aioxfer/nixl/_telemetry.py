"""NIXL's agent telemetry: the switches, the events, the ring-buffer file.

What a NIXL user sees, as NIXL 1.5.1 does it (and its docs/telemetry.md):

- Telemetry is on with ``captureTelemetry`` (``capture_telemetry=True``) or
  ``NIXL_TELEMETRY_ENABLE`` (y/yes/on/true/enable/1, n/no/off/false/disable/0,
  any case; anything else refuses the agent); a negative
  ``NIXL_TELEMETRY_ENABLE`` wins over the config.
- Per request, ``getXferTelemetry``: start (µs of the steady clock, as NIXL's
  ``std::chrono::steady_clock``), post and transfer durations (µs), bytes,
  descriptors. Those come from the request; the events below are the agent's.
- Events (type, value), one per operation: memory registered / deregistered
  (bytes per call); per finished request its post time, transfer time, bytes
  and a count of 1 (``agent_tx_*`` for WRITE, ``agent_rx_*`` for READ); one
  ``agent_err_*`` per failure NIXL counts. ``NIXL_TELEMETRY_ENABLED_METRICS``
  (comma-separated globs) keeps only the named ones.
- Sink: ``NIXL_TELEMETRY_EXPORTER``, else "BUFFER" when ``NIXL_TELEMETRY_DIR``
  is set, else none ("NOP": collected for getXferTelemetry, written nowhere).
  "BUFFER" is the file ``$NIXL_TELEMETRY_DIR/<agent name>``: NIXL's shared
  ring (version 4) that its telemetry readers (examples/python/
  telemetry_reader.py, examples/cpp/telemetry_reader) open: a 40-byte header
  (write_pos, read_pos: size_t; version, expected_version: int; capacity,
  mask: size_t) and ``NIXL_TELEMETRY_BUFFER_SIZE`` (a power of two, 4096)
  16-byte events (uint32 type, 4 bytes padding, uint64 value). Events are
  staged (up to the buffer size; more are dropped and counted in an
  ``agent_telemetry_events_dropped`` event) and written every
  ``NIXL_TELEMETRY_RUN_INTERVAL`` ms (100), on the loop thread; a full ring
  loses them, as NIXL's. The file stays after the agent (NIXL's does).
"""

from __future__ import annotations

import asyncio
import collections
import fnmatch
import mmap
import os
import stat
import struct
from collections.abc import Callable

import numpy as np

__all__ = ["TELEMETRY_VERSION", "EVENT_NAMES", "Telemetry", "requested"]

TELEMETRY_VERSION = 4

# nixl_telemetry_event_type_t, by value.
EVENT_NAMES = (
    "agent_tx_bytes",
    "agent_rx_bytes",
    "agent_tx_requests_num",
    "agent_rx_requests_num",
    "agent_memory_registered",
    "agent_memory_deregistered",
    "agent_xfer_time",
    "agent_xfer_post_time",
    "agent_err_not_posted",
    "agent_err_invalid_param",
    "agent_err_backend",
    "agent_err_not_found",
    "agent_err_mismatch",
    "agent_err_not_allowed",
    "agent_err_repost_active",
    "agent_err_unknown",
    "agent_err_not_supported",
    "agent_err_remote_disconnect",
    "agent_err_canceled",
    "agent_err_no_telemetry",
    "agent_telemetry_events_dropped",
)
TX_BYTES, RX_BYTES, TX_REQUESTS, RX_REQUESTS = 0, 1, 2, 3
MEMORY_REGISTERED, MEMORY_DEREGISTERED = 4, 5
XFER_TIME, XFER_POST_TIME = 6, 7
EVENTS_DROPPED = 20
_ERR_FIRST = 8  # agent_err_not_posted: NIXL status -1; -n maps to 7 + n
_XFER_RECORD = -1  # a staged finished request (four events)

_HEADER = struct.Struct("<QQiiQQ")
_EVENT = np.dtype([("type", "<u4"), ("pad", "V4"), ("value", "<u8")])
assert _HEADER.size == 40 and _EVENT.itemsize == 16

_TRUE = ("y", "yes", "on", "1", "true", "enable")
_FALSE = ("n", "no", "off", "0", "false", "disable")

Log = Callable[[str, str], None]


def _env_bool(name: str) -> bool | None:
    value = os.environ.get(name)
    if value is None:
        return None
    low = value.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise RuntimeError(f"Conversion to bool failed for string '{value}' known are "
                       f"{', '.join(_TRUE)} as positive and {', '.join(_FALSE)} as negative "
                       f"(case insensitive)")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        out = int(value, 16) if value[:2] in ("0x", "0X") else int(value, 10)
    except ValueError:
        raise RuntimeError(f"Invalid integer string '{value}' for {name}") from None
    if not 0 <= out < 1 << 64:  # NIXL's size_t
        raise RuntimeError(f"Integer string '{value}' out of range for {name}")
    return out


def requested(captured: bool, log: Log) -> bool:
    """Whether an agent built with ``captureTelemetry=captured`` has telemetry
    (RuntimeError for an NIXL_TELEMETRY_ENABLE that is no boolean)."""
    env = _env_bool("NIXL_TELEMETRY_ENABLE")
    if env is None:
        return captured
    if not env and captured:
        log("W", "NIXL telemetry is disabled; ignoring telemetry requested through agent config")
    return env


def _enabled_metrics(log: Log) -> list[bool]:
    spec = os.environ.get("NIXL_TELEMETRY_ENABLED_METRICS", "")
    tokens = {t.strip() for t in spec.split(",") if t.strip()}
    if not tokens:
        return [True] * len(EVENT_NAMES)
    on = [any(fnmatch.fnmatchcase(name, t) for t in tokens) for name in EVENT_NAMES]
    for t in sorted(tokens):
        if not any(fnmatch.fnmatchcase(name, t) for name in EVENT_NAMES):
            log("W", f"Ignoring NIXL_TELEMETRY_ENABLED_METRICS entry '{t}': no telemetry "
                     f"metric matches")
    return on


class _Ring:
    """NIXL's shared ring-buffer file (sharedRingBuffer<nixlTelemetryEvent>),
    written by this process only; readers advance read_pos."""

    def __init__(self, path: str, capacity: int) -> None:
        self.path = path
        self.capacity = capacity
        self.mask = capacity - 1
        size = _HEADER.size + _EVENT.itemsize * capacity
        # NIXL_TELEMETRY_DIR is often shared (/tmp) and the agent's name
        # predictable: a link planted there must not be followed (we would
        # truncate and write whatever it names), nor a file another user made
        # (or anything but a file) be taken over. Readers advance read_pos, so
        # they open the file for writing: they are this user, hence 0600.
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise OSError(f"{path} is not a file of this user")
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        _HEADER.pack_into(self._mm, 0, 0, 0, TELEMETRY_VERSION, TELEMETRY_VERSION, capacity,
                          self.mask)
        # Aligned 8-byte fields: each store is one machine store, as the C++
        # atomics' (the positions are written after the events they cover).
        self._pos: np.ndarray = np.ndarray((2,), dtype=np.uint64, buffer=self._mm)
        self._events: np.ndarray = np.ndarray((capacity,), dtype=_EVENT, buffer=self._mm,
                                              offset=_HEADER.size)

    def push(self, types: list[int], values: list[int]) -> None:
        # The header is in a shared file any reader may write: a position
        # out of range (a buggy or hostile reader, another writer) is taken
        # modulo the capacity, never used as an index as it is.
        w = int(self._pos[0]) & self.mask
        free = (int(self._pos[1]) - w - 1) & self.mask
        n = min(free, len(types))  # the rest is lost, as in NIXL (a full ring)
        done = 0
        while done < n:
            k = min(n - done, self.capacity - w)
            self._events["type"][w:w + k] = types[done:done + k]
            self._events["value"][w:w + k] = values[done:done + k]
            done += k
            w = (w + k) & self.mask
        if n:
            self._pos[0] = w

    def close(self) -> None:
        del self._pos, self._events
        self._mm.flush()
        self._mm.close()


class Telemetry:
    """One agent's telemetry: what getXferTelemetry needs is on the request;
    this stages the agent's events and writes them to the sink. ``add`` and
    ``xfer`` are called from any thread (deque appends are atomic); the
    flush runs on ``loop``."""

    def __init__(self, agent_name: str, loop: asyncio.AbstractEventLoop, log: Log) -> None:
        self._log = log
        self._loop = loop
        self.capacity = _env_int("NIXL_TELEMETRY_BUFFER_SIZE", 4096)
        if self.capacity == 0:
            raise ValueError("Telemetry buffer size cannot be 0")
        self.interval = _env_int("NIXL_TELEMETRY_RUN_INTERVAL", 100) / 1000.0
        self.on = _enabled_metrics(log)
        exporter = os.environ.get("NIXL_TELEMETRY_EXPORTER", "")
        if not exporter:
            exporter = "BUFFER" if "NIXL_TELEMETRY_DIR" in os.environ else "NOP"
        self.exporter = exporter
        self.ring: _Ring | None = None
        if exporter == "BUFFER":
            self.ring = self._open_ring(agent_name)
        elif exporter in ("prometheus", "prometheus_mp", "doca"):
            # NIXL's optional exporter plugins; aioxfer's own Prometheus
            # export (aioxfer.metrics) covers these transfers.
            log("W", f"telemetry exporter '{exporter}' is not part of aioxfer.nixl (aioxfer's "
                     f"metrics: aioxfer.metrics); telemetry is collected in-process only")
            self.exporter = "NOP"
        elif exporter != "NOP":
            log("W", f"Plugin file does not exist: libtelemetry_exporter_{exporter}.so")
            raise RuntimeError(f"Failed to load telemetry plugin: {exporter}")
        # Staged events: (event, value, 0, 0, 0), or a finished request
        # (_XFER_RECORD, write, bytes, post µs, transfer µs). Producers on any
        # thread append; the counts are updated without a lock, so under
        # concurrent producers the bound and the drop count are approximate.
        self._pending: collections.deque[tuple[int, int, int, int, int]] = collections.deque()
        self._staged = 0
        self._dropped = 0
        self._per_xfer = tuple(  # events per finished request: READ, WRITE
            sum(self.on[e] for e in (XFER_POST_TIME, XFER_TIME, b, r))
            for b, r in ((RX_BYTES, RX_REQUESTS), (TX_BYTES, TX_REQUESTS)))
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        if self.ring is not None:
            loop.call_soon_threadsafe(self._arm)

    def _open_ring(self, agent_name: str) -> _Ring:
        directory = os.environ.get("NIXL_TELEMETRY_DIR")
        path = os.path.join(directory or "", agent_name)
        try:
            if directory is None:
                raise ValueError("Missing config entry 'NIXL_TELEMETRY_DIR'")
            if self.capacity & (self.capacity - 1):
                raise ValueError("Telemetry buffer size must be a power of 2")
            ring = _Ring(path, self.capacity)
        except (OSError, ValueError, OverflowError) as exc:
            # (OverflowError: a capacity whose file is past off_t)
            self._log("E", f"Failed to create exporter: {exc}")
            raise RuntimeError("Failed to create telemetry exporter: BUFFER") from None
        self._log("I", f"Telemetry enabled, using buffer path: {path} with size: "
                       f"{self.capacity}")
        return ring

    # ------------------------------------------------------------ producers (any thread)

    def add(self, event: int, value: int) -> None:
        if not self.on[event] or self.ring is None:
            return
        if self._staged >= self.capacity:
            self._dropped += 1
            return
        self._staged += 1
        self._pending.append((event, value, 0, 0, 0))

    def error(self, status: int) -> None:
        """One failure of NIXL status ``status`` (negative)."""
        if status < 0:
            self.add(_ERR_FIRST - 1 - status, 1)

    def xfer(self, write: bool, nbytes: int, post_us: int, xfer_us: int) -> None:
        """A finished request: NIXL's four events, all or none (staged as
        one record, expanded when written)."""
        if self.ring is None:
            return
        n = self._per_xfer[write]
        if not n:
            return
        if self._staged + n > self.capacity:
            self._dropped += n
            return
        self._staged += n
        self._pending.append((_XFER_RECORD, write, nbytes, post_us, xfer_us))

    # ------------------------------------------------------------ the sink (loop thread)

    def _arm(self) -> None:
        if not self._closed:
            self._timer = self._loop.call_later(self.interval, self._tick)

    def _tick(self) -> None:
        try:
            self.flush()
        except Exception as exc:  # (the sink fails, the agent does not)
            self._log("E", f"telemetry: writing events failed: {exc!r}")
        finally:
            self._arm()

    def flush(self) -> None:
        ring = self.ring
        if ring is None:
            return
        types: list[int] = []
        values: list[int] = []
        pending = self._pending
        on = self.on
        taken = 0
        while pending:
            try:
                e, v, nbytes, post_us, xfer_us = pending.popleft()
            except IndexError:
                break
            if e != _XFER_RECORD:
                types.append(e)
                values.append(v)
                taken += 1
                continue
            for ev, val in ((XFER_POST_TIME, post_us), (XFER_TIME, xfer_us),
                            (TX_BYTES if v else RX_BYTES, nbytes),
                            (TX_REQUESTS if v else RX_REQUESTS, 1)):
                if on[ev]:
                    types.append(ev)
                    values.append(val)
                    taken += 1
        self._staged -= taken
        dropped, self._dropped = self._dropped, 0
        if dropped and self.on[EVENTS_DROPPED]:
            types.append(EVENTS_DROPPED)
            values.append(dropped)
        if types:
            ring.push(types, values)

    def close(self) -> None:
        """Writes what is staged and closes the file (loop thread)."""
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self.ring is not None:
            self.flush()
            self.ring.close()
            self.ring = None
