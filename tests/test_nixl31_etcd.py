"""nixl31: aioxfer.nixl's central metadata store (NIXL_ETCD_ENDPOINTS) on a
real etcd on loopback, as NIXL 1.5.1 uses it (observed on this machine,
2026-12-07, UCX on loopback):

- keys are NIXL's byte for byte: "{NIXL_ETCD_NAMESPACE}/{agent}/{label}",
  the default namespace "/nixl/agents/" with its trailing "/" (so
  "/nixl/agents//A/metadata"), an empty announce key "{ns}/{agent}/" before
  the first publish, the namespace read when the agent is made (before:
  "/nixl/agents/A/metadata", read at import);
- invalidate_local_metadata of agent "a" deletes "a"'s keys only (before,
  and in NIXL 1.5.1 itself: a delete of the prefix "{ns}/a/", which took
  agent "a/b"'s keys too);
- an agent that fetched another's metadata from the store drops it when
  that agent invalidates it (NIXL watches the agent's prefix; before: kept
  for ever), and not when agent "a/b" invalidates its own.
"""

from __future__ import annotations

import asyncio
import ctypes
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from test_discovery import etcd_server  # noqa: F401

from aioxfer.nixl import nixl_agent, nixl_agent_config

STEP = 20.0


@pytest.fixture
def store(etcd_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:  # noqa: F811
    """The store's endpoint in the environment, a namespace of this test's
    own: yields the namespace."""
    ns = f"/nixl31-{uuid.uuid4().hex[:8]}/agents/"
    monkeypatch.setenv("NIXL_ETCD_ENDPOINTS", f"http://{etcd_server}")
    monkeypatch.setenv("NIXL_ETCD_NAMESPACE", ns)
    yield ns


# Each agent's registration list (its buffer kept alive with it).
_REGS: dict[str, tuple[Any, Any]] = {}


@pytest.fixture
def make() -> Iterator[Any]:
    """nixl_agent(name) with 256 registered bytes; closed after the test."""
    made: list[Any] = []

    def agent(name: str) -> Any:
        a = nixl_agent(name, nixl_agent_config(True, False, 0))
        made.append(a)
        buf = (ctypes.c_ubyte * 256)()
        _REGS[name] = buf, a.register_memory([(ctypes.addressof(buf), 256, 0, "")], "DRAM")
        return a

    yield agent
    for a in made:
        a.close()
        _REGS.pop(a.name, None)


def _descs(agent: Any) -> Any:
    return _REGS[agent.name][1]


def _keys(endpoint: str, prefix: str) -> dict[str, int]:
    """The keys under ``prefix`` in the store, each with its value's length."""
    import aetcd  # type: ignore[import-untyped]

    async def get() -> dict[str, int]:
        host, _, port = endpoint.rpartition(":")
        async with aetcd.Client(host=host, port=int(port)) as c:
            got = await c.get_prefix(prefix.encode())
            return {bytes(kv.key).decode(): len(kv.value) for kv in got}

    return asyncio.run(get())


def _until(what: str, cond: Any) -> None:
    deadline = time.monotonic() + STEP
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _published(endpoint: str, ns: str, name: str, labels: list[str]) -> None:
    want = {f"{ns}/{name}/{label}" for label in labels}
    _until(f"{name}'s metadata in the store",
           lambda: want <= set(_keys(endpoint, f"{ns}/{name}/")))


def test_keys_are_nixls(etcd_server: str, store: str, make: Any,  # noqa: F811
                        monkeypatch: pytest.MonkeyPatch) -> None:
    u = uuid.uuid4().hex[:8]
    a = make(f"A{u}")
    a.send_local_metadata()
    a.send_partial_agent_metadata(_descs(a), True, ["UCX"], label="lab")
    _published(etcd_server, store, a.name, ["metadata", "lab"])
    got = _keys(etcd_server, store)
    # The announce key (empty), the whole metadata, the labelled part; the
    # namespace's trailing "/" kept, as NIXL keeps it.
    assert set(got) == {f"{store}/{a.name}/", f"{store}/{a.name}/metadata",
                        f"{store}/{a.name}/lab"}
    assert got[f"{store}/{a.name}/"] == 0 and store.endswith("/")
    # NIXL's default namespace, read when the agent is made.
    monkeypatch.delenv("NIXL_ETCD_NAMESPACE")
    b = make(f"B{u}")
    b.send_local_metadata()
    _published(etcd_server, "/nixl/agents/", b.name, ["metadata"])
    assert f"/nixl/agents//{b.name}/metadata" in _keys(etcd_server, "/nixl/agents//")
    b.invalidate_local_metadata()
    _until("b's keys gone", lambda: not _keys(etcd_server, f"/nixl/agents//{b.name}/"))


def test_invalidate_deletes_this_agents_keys_only(etcd_server: str, store: str,  # noqa: F811
                                                   make: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # (NIXL's default namespace, keys read with its "/" and "//" alike, so
    # that only the deletion is checked here, test_keys_are_nixls checks the
    # layout; the names are this test's own.)
    monkeypatch.delenv("NIXL_ETCD_NAMESPACE")
    ns = "/nixl/agents"

    def keys() -> set[str]:
        return {k.replace(f"{ns}//", f"{ns}/") for k in _keys(etcd_server, ns)}

    def of(ag: Any, *labels: str) -> set[str]:
        return {f"{ns}/{ag.name}/{label}" for label in labels}

    u = uuid.uuid4().hex[:8]
    a, ab, abc, other = make(f"a{u}"), make(f"a{u}/b"), make(f"a{u}/b/c"), make(f"a{u}b")
    for ag in (a, ab, abc, other):
        ag.send_local_metadata()
        ag.send_partial_agent_metadata(_descs(ag), True, ["UCX"], label="lab")
    # A label of a's holding a "/": its key looks like agent "a/x"'s.
    a.send_partial_agent_metadata(_descs(a), True, ["UCX"], label="x/metadata")
    want = of(a, "x/metadata").union(*(of(ag, "metadata", "lab") for ag in (a, ab, abc, other)))
    _until("all published", lambda: want <= keys())
    a.invalidate_local_metadata()
    _until("a's keys gone", lambda: not keys() & of(a, "metadata", "lab", "x/metadata"))
    # Agents "a/b", "a/b/c" and "ab" keep every key.
    for ag in (ab, abc, other):
        assert of(ag, "metadata", "lab") <= keys()
    assert not keys() & of(a, "")  # (the announce key, where written)
    # "a/b" invalidating leaves "a/b/c" alone too.
    ab.invalidate_local_metadata()
    _until("a/b's keys gone", lambda: not keys() & of(ab, "metadata", "lab"))
    assert of(abc, "metadata", "lab") | of(other, "metadata", "lab") <= keys()


def test_fetched_agent_dropped_when_it_invalidates(etcd_server: str, store: str,  # noqa: F811
                                                   make: Any) -> None:
    u = uuid.uuid4().hex[:8]
    t, tb, i = make(f"t{u}"), make(f"t{u}/b"), make(f"i{u}")
    for ag in (t, tb):
        ag.send_local_metadata()
        _published(etcd_server, store, ag.name, ["metadata"])
        i.fetch_remote_metadata(ag.name)
    _until("both fetched", lambda: i.check_remote_metadata(t.name)
           and i.check_remote_metadata(tb.name))
    # "t/b" invalidates: its keys are under "t"'s prefix, "t" stays.
    tb.invalidate_local_metadata()
    _until("t/b dropped", lambda: not i.check_remote_metadata(tb.name))
    time.sleep(0.5)
    assert i.check_remote_metadata(t.name)
    # "t" invalidates, publishes anew, and is fetched again: the deletion,
    # older than the fetch, does not drop what the fetch loaded.
    t.invalidate_local_metadata()
    _until("t dropped", lambda: not i.check_remote_metadata(t.name))
    t.send_local_metadata()
    _published(etcd_server, store, t.name, ["metadata"])
    i.fetch_remote_metadata(t.name)
    _until("t fetched again", lambda: i.check_remote_metadata(t.name))
    time.sleep(0.5)
    assert i.check_remote_metadata(t.name)


def test_fetch_waits_past_metadata_that_is_not_ours(etcd_server: str, store: str,  # noqa: F811
                                                    make: Any) -> None:
    """A real NIXL agent's metadata under the key (the same keys now: one
    that ran before under this name and left it) is waited past like a
    missing key, until our agent of that name replaces it; before, the
    fetch read it once, failed, and check_remote_metadata stayed False."""
    import aetcd

    u = uuid.uuid4().hex[:8]
    t, i = make(f"t{u}"), make(f"i{u}")
    key = f"{store}/{t.name}/metadata".encode()

    async def put_foreign() -> None:
        host, _, port = etcd_server.rpartition(":")
        async with aetcd.Client(host=host, port=int(port)) as c:
            await c.put(key, b"nixlSerDes|" + b"\0" * 64)

    asyncio.run(put_foreign())
    i.fetch_remote_metadata(t.name)
    time.sleep(0.5)
    assert not i.check_remote_metadata(t.name)
    t.send_local_metadata()
    _until("t fetched past the foreign value", lambda: i.check_remote_metadata(t.name))
