"""aioxfer.metrics: the agent's, its peers' (and rails') and its local
backends' counters through prometheus_client, scraped from the real HTTP
endpoint ``agent.serve_metrics`` serves on loopback, and through a collector
added to an application's own registry."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import s3server
from conftest import within
from s3server import S3Server

import aioxfer
from aioxfer.errors import ObjectNotFound

prometheus_client = pytest.importorskip("prometheus_client")
from scrape import samples, value  # noqa: E402

from aioxfer.metrics import AgentCollector  # noqa: E402

s3 = s3server.s3
MakeAgent = Callable[..., Awaitable[Any]]


async def scrape(url: str) -> tuple[int, str, str]:
    """GET with a plain socket client: (status, content type, body)."""
    host, _, rest = url.removeprefix("http://").partition("/")
    h, _, p = host.rpartition(":")
    reader, writer = await asyncio.open_connection(h, int(p))
    writer.write(f"GET /{rest} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = dict(line.split(": ", 1) for line in lines[1:])
    assert int(headers["Content-Length"]) == len(body)
    return status, headers["Content-Type"], body.decode()


async def test_serve_metrics_scraped_over_http(
    make_agent: MakeAgent, s3: S3Server
) -> None:
    a = await make_agent("m-a")
    b = await make_agent("m-b")
    pool = b.register(bytearray(1 << 20), name="pool")
    src = a.register(bytearray(b"x" * (1 << 20)))
    peer = await a.connect(b.address)
    remote = peer.region("pool")
    for i in range(10):
        await within(a.write(src[i * 4096 : (i + 1) * 4096], remote[i * 4096 : (i + 1) * 4096]))
    await within(a.read(src[0 : 1 << 16], remote[0 : 1 << 16]))
    del pool

    objs = a.register_objects(f"s3://{s3.bucket()}", **s3.kwargs())
    await within(a.write(src[0:1000], objs["k"]))
    with pytest.raises(ObjectNotFound):
        await within(a.read(src[0:10], objs["missing"]))

    server = await a.serve_metrics(0)
    assert server.port > 0
    status, ctype, text = await within(scrape(server.url))
    assert status == 200 and ctype.startswith("text/plain")
    got = samples(text)
    st = a.statistics()
    ps = peer.statistics()
    assert value(got, "aioxfer_transfers_posted_total", agent=a.name) == st.transfers_posted == 11
    assert value(got, "aioxfer_bytes_total", agent=a.name) == st.bytes == 10 * 4096 + (1 << 16)
    assert value(got, "aioxfer_in_flight", agent=a.name) == 0
    assert value(got, "aioxfer_pinned_regions", agent=a.name) == st.pinned_regions
    labels = {"agent": a.name, "peer": b.name, "path": ps.path}
    assert value(got, "aioxfer_peer_bytes_total", **labels) == ps.bytes
    assert value(got, "aioxfer_peer_transfers_completed_total", **labels) == 11
    assert value(got, "aioxfer_peer_lost", **labels) == 0
    be = {"agent": a.name, "backend": "object", "kind": "object"}
    assert value(got, "aioxfer_backend_transfers_posted_total", **be) == 2
    assert value(got, "aioxfer_backend_transfers_completed_total", **be) == 1
    assert value(got, "aioxfer_backend_bytes_total", **be) == 1000
    assert value(got, "aioxfer_backend_errors_total", **be, type="ObjectNotFound") == 1
    assert value(got, "aioxfer_backend_regions", **be) == 1

    # Counters move between scrapes.
    await within(a.write(src[0:4096], remote[0:4096]))
    got = samples((await within(scrape(server.url)))[2])
    assert value(got, "aioxfer_transfers_posted_total", agent=a.name) == 12
    assert (await within(scrape(server.url.replace("/metrics", "/nope"))))[0] == 404

    # Closed with the agent: nothing listens any more.
    await a.aclose()
    with pytest.raises(OSError):
        await within(scrape(server.url))


async def test_collector_in_an_application_registry(make_agent: MakeAgent) -> None:
    a = await make_agent("m-c")
    b = await make_agent("m-d")
    b.register(bytearray(8192), name="pool")
    src = a.register(bytearray(8192))
    peer = await a.connect(b.address)
    await within(a.write(src[:], peer.region("pool")[:]))
    registry = prometheus_client.CollectorRegistry()
    collector = AgentCollector(a, b)
    registry.register(collector)
    got = samples(prometheus_client.generate_latest(registry).decode())
    assert value(got, "aioxfer_transfers_completed_total", agent=a.name) == 1
    assert value(got, "aioxfer_transfers_completed_total", agent=b.name) == 0
    assert value(got, "aioxfer_peers", agent=a.name) == 1
    rails = [k for k in got if k[0] == "aioxfer_rail_up"]
    assert len(rails) == len(peer.statistics().rails)
    collector.remove(b)
    got = samples(prometheus_client.generate_latest(registry).decode())
    assert ("aioxfer_peers", (("agent", b.name),)) not in got


def test_unused_metrics_are_not_loaded() -> None:
    """No per-transfer cost when unused, by construction: an agent moving data
    (peers, files, object storage) never imports the metrics module nor
    prometheus_client; the collector only reads counters when scraped."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import asyncio, sys, tempfile, os
        import aioxfer
        async def main():
            async with aioxfer.Agent("a") as a, aioxfer.Agent("b") as b:
                b.register(bytearray(65536), name="pool")
                src = a.register(bytearray(65536))
                peer = await a.connect(b.address)
                for _ in range(100):
                    await a.write(src[0:4096], peer.region("pool")[0:4096])
                f = a.register_file(os.path.join(tempfile.mkdtemp(), "f"), size=65536)
                await a.write([src[0:4096]], [f[0:4096]])
        asyncio.run(main())
        assert "aioxfer.metrics" not in sys.modules
        assert "prometheus_client" not in sys.modules
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


async def test_two_agents_of_one_name_are_not_exported_twice() -> None:
    """As for stores: a second open agent of a name already exported is
    refused (its series would be exported twice); a closed one makes way.
    (Before: both were taken, every agent sample doubled.)"""
    async with aioxfer.Agent("twin") as a, aioxfer.Agent("twin") as b:
        with pytest.raises(ValueError, match="'twin'"):
            AgentCollector(a, b)
        collector = AgentCollector(a)
        with pytest.raises(ValueError, match="'twin'"):
            collector.add(b)
        await a.aclose()
        collector.add(b)
        registry = prometheus_client.CollectorRegistry(auto_describe=True)
        registry.register(collector)
        text = prometheus_client.generate_latest(registry).decode()
        series = [ln.rsplit(" ", 1)[0] for ln in text.splitlines() if ln and ln[0] != "#"]
        assert series and len(series) == len(set(series)), "a series exported twice"
