"""Prometheus export of the counters aioxfer keeps anyway (needs the optional
dependency ``prometheus_client``: ``pip install aioxfer[metrics]``).

Nothing here runs per transfer: the collector reads ``agent.statistics()``,
``peer.statistics()`` (with its rails) and the local backends' statistics
when Prometheus scrapes, and at no other time. Unused, it costs nothing.

Either add a collector to the application's registry::

    from prometheus_client import REGISTRY
    REGISTRY.register(aioxfer.metrics.AgentCollector(agent))

or let the agent serve its own endpoint (on its event loop, so that every
read of the counters happens on the thread that changes them)::

    server = await agent.serve_metrics(9100)     # http://127.0.0.1:9100/metrics
    server.port                                  # the port (0 picks one)

Metric names start with ``aioxfer_``; labels: ``agent``; ``peer`` and
``path`` per peer; ``rail`` (its address) per rail; ``backend`` and ``kind``
per local backend, ``type`` (exception class) for backend errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from aioxfer.backends import registry as _backends
from aioxfer.backends.host import host_of

if TYPE_CHECKING:
    from aioxfer.agent import Agent

__all__ = ["AgentCollector", "MetricsServer", "serve_metrics"]

_AGENT_COUNTERS = (
    ("transfers_posted", "transfers_posted", "Transfers posted by the agent (all peers)"),
    ("transfers_completed", "transfers_completed", "Transfers completed"),
    ("transfers_failed", "transfers_failed", "Transfers failed or cancelled"),
    ("bytes", "bytes", "Bytes moved by completed transfers"),
    ("native_bytes", "native_bytes", "Bytes the engine moved"),
    ("frames_rejected", "frames_rejected", "Malformed or unauthorised frames the engine dropped"),
    ("records_lost", "records_lost", "Completion records lost: the ring full and out of memory"),
    ("replies_read_by_waiter", "replies_read_by_waiter",
     "tcp replies the awaiting thread read off the socket itself"),
)
_AGENT_GAUGES = (
    ("in_flight", "in_flight", "Transfers posted and not yet finished"),
    ("regions", "regions", "Registered regions"),
    ("peers", "peers", "Connected peers"),
    ("native_ops", "native_ops", "Operations the engine holds"),
    ("native_regions", "native_regions", "Regions the engine holds"),
    ("native_endpoints", "native_endpoints", "Endpoints the engine holds"),
    ("native_conns", "native_conns", "Connections the engine holds"),
    ("pinned_regions", "pinned_regions", "Buffers pinned until the engine releases them"),
)
_PEER_COUNTERS = (
    ("transfers_posted", "peer_transfers_posted", "Transfers posted to the peer"),
    ("transfers_completed", "peer_transfers_completed", "Transfers to the peer completed"),
    ("transfers_failed", "peer_transfers_failed", "Transfers to the peer failed or cancelled"),
    ("bytes", "peer_bytes", "Bytes moved to or from the peer"),
    ("reroutes", "peer_reroutes", "Request groups moved to another rail"),
)
_PEER_GAUGES = (
    ("in_flight", "peer_in_flight", "Transfers to the peer in the engine"),
    ("in_flight_bytes", "peer_in_flight_bytes", "Bytes of the transfers in flight"),
    ("queued", "peer_queued", "Transfers waiting for the peer's limits"),
    ("queued_bytes", "peer_queued_bytes", "Bytes of the queued transfers"),
    ("bandwidth", "peer_bandwidth_bytes_per_second", "Moving average of large transfers"),
    ("latency", "peer_latency_seconds", "Moving average of small transfers"),
    ("lost", "peer_lost", "1 once the peer is lost"),
)
_RAIL_COUNTERS = (
    ("bytes", "rail_bytes", "Bytes moved on the rail"),
    ("reroutes", "rail_reroutes", "Request groups moved off the rail"),
)
_RAIL_GAUGES = (
    ("up", "rail_up", "1 while a connection of the rail lives"),
    ("connections", "rail_connections", "Live connections of the rail"),
    ("rate", "rail_rate_bytes_per_second", "Measured rate of the rail"),
)
_BACKEND_COUNTERS = (
    ("transfers_posted", "backend_transfers_posted", "Requests posted to the local backend"),
    ("transfers_completed", "backend_transfers_completed", "Requests completed"),
    ("transfers_failed", "backend_transfers_failed", "Requests failed or cancelled"),
    ("ops", "backend_ops", "Pairs (objects, blobs) moved"),
    ("bytes", "backend_bytes", "Bytes moved by completed requests"),
    ("retries", "backend_retries", "Retries of transient failures"),
)
_BACKEND_GAUGES = (
    ("in_flight", "backend_in_flight", "Requests whose I/O has not stopped"),
    ("in_flight_bytes", "backend_in_flight_bytes", "Bytes of the requests in flight"),
    ("regions", "backend_regions", "Regions of the backend"),
)



class _Named(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def closed(self) -> bool: ...


def add_named(held: weakref.WeakSet[Any], item: _Named, kind: str) -> None:
    """Adds ``item`` (an agent, a store) to a collector's set, where its name
    labels its samples: a second open one of the same name is refused
    (ValueError: the same series twice, and Prometheus rejects the whole
    scrape), a closed one of that name is replaced."""
    for other in list(held):
        if other is not item and other.name == item.name:
            if not other.closed:
                raise ValueError(f"this collector already exports an open {kind} named "
                                 f"{item.name!r}: give each {kind} its own name")
            held.discard(other)
    held.add(item)

class AgentCollector(Collector):
    """A prometheus_client collector of one or more agents' counters (held
    weakly: a closed, dropped agent disappears from the output)."""

    def __init__(self, *agents: Agent) -> None:
        self._agents: weakref.WeakSet[Agent] = weakref.WeakSet()
        for agent in agents:
            self.add(agent)

    def add(self, agent: Agent) -> None:
        """Adds ``agent``. Its name labels its samples: a second open agent of
        the same name is refused (ValueError; the same series twice, and
        Prometheus rejects the whole scrape), a closed one of that name is
        replaced."""
        add_named(self._agents, agent, "agent")

    def remove(self, agent: Agent) -> None:
        self._agents.discard(agent)

    def describe(self) -> Iterable[Metric]:
        # The families are fixed; describing them runs no collection at
        # registration (prometheus_client would otherwise call collect()).
        yield from self._families().values()

    def collect(self) -> Iterable[Metric]:
        fams = self._families()
        for agent in sorted(self._agents, key=lambda a: a.name):
            self._collect_agent(agent, fams)
        yield from fams.values()

    @staticmethod
    def _families() -> dict[str, Metric]:
        fams: dict[str, Metric] = {}
        for table, labels, counter in (
            (_AGENT_COUNTERS, ["agent"], True),
            (_AGENT_GAUGES, ["agent"], False),
            (_PEER_COUNTERS, ["agent", "peer", "path"], True),
            (_PEER_GAUGES, ["agent", "peer", "path"], False),
            (_RAIL_COUNTERS, ["agent", "peer", "rail"], True),
            (_RAIL_GAUGES, ["agent", "peer", "rail"], False),
            (_BACKEND_COUNTERS, ["agent", "backend", "kind"], True),
            (_BACKEND_GAUGES, ["agent", "backend", "kind"], False),
        ):
            for _field, metric, doc in table:
                cls = CounterMetricFamily if counter else GaugeMetricFamily
                fams[metric] = cls(f"aioxfer_{metric}", doc, labels=labels)
        fams["backend_errors"] = CounterMetricFamily(
            "aioxfer_backend_errors",
            "Failed requests of the local backend, by exception class",
            labels=["agent", "backend", "kind", "type"],
        )
        return fams

    @staticmethod
    def _collect_agent(agent: Agent, fams: dict[str, Metric]) -> None:
        name = agent.name
        stats = agent.statistics()
        for field, metric, _ in (*_AGENT_COUNTERS, *_AGENT_GAUGES):
            _add(fams[metric], [name], getattr(stats, field))
        if agent.closed:
            return
        for peer in agent.peers:
            ps = peer.statistics()
            labels = [name, ps.name, ps.path]
            for field, metric, _ in (*_PEER_COUNTERS, *_PEER_GAUGES):
                _add(fams[metric], labels, getattr(ps, field))
            for rail in ps.rails:
                for field, metric, _ in (*_RAIL_COUNTERS, *_RAIL_GAUGES):
                    _add(fams[metric], [name, ps.name, rail.address], getattr(rail, field))
        for backend in _backends.backends_of(agent):
            bs = backend.statistics()
            labels = [name, bs.name, bs.kind]
            for field, metric, _ in (*_BACKEND_COUNTERS, *_BACKEND_GAUGES):
                _add(fams[metric], labels, getattr(bs, field))
            for kind, count in sorted(bs.errors.items()):
                _add(fams["backend_errors"], [*labels, kind], count)


def _add(fam: Metric, labels: list[str], value: float | bool) -> None:
    fam.add_metric(labels, float(value))  # type: ignore[attr-defined]


class MetricsServer:
    """What ``agent.serve_metrics(port)`` returns: an HTTP endpoint on the
    agent's event loop (``/metrics``), closed with the agent or ``aclose()``."""

    def __init__(self, server: asyncio.Server, registry: CollectorRegistry) -> None:
        self._server = server
        self.registry = registry
        sock = next(iter(server.sockets))
        self.host, self.port = sock.getsockname()[:2]
        self._conns: set[asyncio.Task[None]] = set()
        self._closing = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    async def aclose(self) -> None:
        """Stops serving. Idempotent."""
        self._closing = True
        self._server.close()
        for task in list(self._conns):
            task.cancel()
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # (The task is never kept in a local here: a CancelledError raised
        # through this frame holds it in its traceback and the task holds
        # the error, a cycle keeping the task, its reader, writer and socket
        # until the next garbage collection: close18.)
        self._conns.add(_this_task())
        try:
            async with asyncio.timeout(10.0):  # a client that sends nothing is dropped
                head = await reader.readuntil(b"\r\n\r\n")
            method, _, rest = head.partition(b" ")
            target = rest.split(b" ", 1)[0].split(b"?", 1)[0]
            if method not in (b"GET", b"HEAD"):
                status, ctype, body = b"405 Method Not Allowed", b"text/plain", b"GET only\n"
            elif target not in (b"/metrics", b"/"):
                status, ctype, body = b"404 Not Found", b"text/plain", b"see /metrics\n"
            else:
                status, ctype = b"200 OK", CONTENT_TYPE_LATEST.encode()
                body = generate_latest(self.registry)
            writer.write(
                b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype
                + b"\r\nContent-Length: " + str(len(body)).encode()
                + b"\r\nConnection: close\r\n\r\n"
                + (b"" if method == b"HEAD" else body)
            )
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError,
                ConnectionError):
            pass
        except asyncio.CancelledError:
            # Ours (aclose): the scrape just ends. A task ending cancelled
            # here makes asyncio's start_server callback (3.11) call its
            # exception(), which raises, logged as "Exception in callback".
            if not self._closing:
                raise
        finally:
            self._conns.discard(_this_task())
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


def _this_task() -> asyncio.Task[None]:
    """The running handler's task, asked for in a frame of its own (see
    MetricsServer._handle)."""
    task = asyncio.current_task()
    assert task is not None
    return task


async def serve_metrics(agent: Agent, port: int, host: str = "127.0.0.1") -> MetricsServer:
    """``agent.serve_metrics``: serves the agent's counters at
    http://host:port/metrics (port 0: any free one; read ``.port``)."""
    host_of(agent).check_open()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(agent))
    box: list[MetricsServer] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await box[0]._handle(reader, writer)

    server = await asyncio.start_server(handle, host, port, limit=16384)
    ms = MetricsServer(server, registry)
    box.append(ms)
    _backends.on_close(agent, ms.aclose)
    return ms

