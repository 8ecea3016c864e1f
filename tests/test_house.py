"""The house's seams (issue 10, item 8): Peer reaches its agent only through the
PeerHost Protocol (the peer table implements it), Transfer only through
TransferHost (the submission implements it), and the agent's collaborators
(membership, rails, submission, peer table, memory, our metadata, the etcd
hand-off, engine events) know nothing of the Agent class: they get narrow
constructor arguments, and the agent never hands them itself."""

from __future__ import annotations

import ast
import asyncio
import inspect
import re
from types import ModuleType

import pytest

from aioxfer import (
    agent,
    cluster,
    connector,
    descriptors,
    dialing,
    events,
    file_transport,
    localmeta,
    members,
    metrics,
    peer,
    peertable,
    progress,
    rails,
    registration,
    serving,
    staging,
    stats,
    submission,
    tags,
    transfer,
)
from aioxfer.backends import base as backends_base
from aioxfer.backends import host as backends_host
from aioxfer.backends import objects as backends_objects
from aioxfer.backends import registry as backends_registry
from aioxfer.backends import testing as backends_testing
from aioxfer.peer import PeerHost
from aioxfer.transfer import TransferHost


def _tree(module: ModuleType) -> ast.Module:
    return ast.parse(inspect.getsource(module))


def _protocol_members(proto: type) -> set[str]:
    return {
        name for name in vars(proto)
        if not (name.startswith("__") and name.endswith("__")) and name != "_is_protocol"
        and not name.startswith("_abc_")
    }


def _self_attr_calls(module: ModuleType, attr: str) -> set[str]:
    """Names used as self.<attr>.<name> in module."""
    used: set[str] = set()
    for node in ast.walk(_tree(module)):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                and node.value.attr == attr
                and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"):
            used.add(node.attr)
    return used


def test_peer_reaches_its_agent_only_through_peer_host() -> None:
    allowed = _protocol_members(PeerHost)
    assert {"refresh", "notify", "close", "error", "rails"} == allowed
    used = _self_attr_calls(peer, "_host")
    assert used, "peer.py no longer calls its host at all?"
    assert used <= allowed, f"Peer uses its agent beyond PeerHost: {sorted(used - allowed)}"
    assert "_agent" not in peer.Peer.__slots__


def test_peer_table_implements_peer_host() -> None:
    for name in _protocol_members(PeerHost):
        assert hasattr(peertable.PeerTable, name), name
        assert inspect.iscoroutinefunction(getattr(peertable.PeerTable, name)) == (
            inspect.iscoroutinefunction(getattr(PeerHost, name))
        ), name


def test_no_cyx_code_writes_peer_fields() -> None:
    # The drain settles a PeerCounters record; the Peer itself has no counters.
    assert not {"_inflight", "_completed", "_bytes", "_latency", "_bandwidth"} & set(
        peer.Peer.__slots__
    )
    # (A compiled class: its counts are C integers behind properties.)
    assert set(dir(stats.PeerCounters)) >= {
        "inflight", "inflight_bytes", "completed", "bytes", "latency", "bandwidth"
    }


def test_transfer_reaches_its_host_only_through_transfer_host() -> None:
    allowed = _protocol_members(TransferHost)
    assert allowed == {"eager", "cancel", "busy", "settled"}
    used = _self_attr_calls(transfer, "_host")
    assert used and used <= allowed, sorted(used - allowed)
    for name in allowed:  # Submission implements it
        assert callable(getattr(submission.Submission, name)), name


COLLABORATORS = (members, rails, stats, peer, transfer, submission, progress, peertable,
                 serving, dialing, connector, tags, descriptors, backends_host, registration,
                 localmeta, cluster, events)


def test_collaborators_do_not_know_the_agent() -> None:
    for module in COLLABORATORS:
        for node in ast.walk(_tree(module)):
            if isinstance(node, ast.ImportFrom):
                assert node.module != "aioxfer.agent", f"{module.__name__} imports aioxfer.agent"
                names = {a.name for a in node.names}
                assert "Agent" not in names, f"{module.__name__} imports Agent"
            if isinstance(node, ast.Import):
                assert all(a.name != "aioxfer.agent" for a in node.names), module.__name__


def test_collaborator_constructors_are_narrow() -> None:
    # Keyword arguments naming what each needs, never a whole agent.
    for cls in (members.Members, rails.Rails, submission.Submission, peertable.PeerTable,
                serving.Server, dialing.Dialer, connector.Connector, registration.Memory,
                localmeta.LocalMeta, cluster.Cluster, events.EngineEvents):
        params = inspect.signature(cls).parameters
        assert "agent" in params and params["agent"].annotation in ("str", str), cls
        assert all(p.kind is p.KEYWORD_ONLY for name, p in params.items() if name != "agent")
        for name, p in params.items():
            assert not re.search(r"\bAgent\b", str(p.annotation)), (cls, name, p.annotation)
    for cls in (registration.Memory, localmeta.LocalMeta, cluster.Cluster, events.EngineEvents):
        assert len(inspect.signature(cls).parameters) <= 11, cls


def _collaborator_calls() -> list[ast.Call]:
    """The calls in agent.py that build a collaborator (a class of COLLABORATORS)."""
    names = {
        n.name for m in COLLABORATORS for n in ast.walk(_tree(m)) if isinstance(n, ast.ClassDef)
    }
    return [
        node for node in ast.walk(_tree(agent))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        and node.func.id in names and node.func.id not in ("Peer", "Transfer")
    ]


def test_agent_never_hands_itself_to_a_collaborator() -> None:
    # The one place the agent passes itself is the owner of a Region it makes
    # (functools.partial(Region, self), Region's public ``agent``).
    calls = _collaborator_calls()
    built = {c.func.id for c in calls}  # type: ignore[attr-defined]
    assert {"Memory", "LocalMeta", "Cluster", "EngineEvents", "Members", "Submission",
            "PeerTable", "BackendHost", "Connector", "Rails", "Server"} <= built, built
    for call in calls:
        for arg in [*call.args, *(k.value for k in call.keywords)]:
            assert not (isinstance(arg, ast.Name) and arg.id == "self"), (
                f"agent.py:{call.lineno} hands the agent to {call.func.id}"  # type: ignore[attr-defined]
            )
    partials = [
        node for node in ast.walk(_tree(agent))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr == "partial"
    ]
    assert [ast.unparse(p) for p in partials] == ["functools.partial(Region, self)"]


def test_agent_is_a_facade() -> None:
    # What moved out stays out: metadata (localmeta), registration and release
    # (registration), engine events (events), the etcd hand-off (cluster).
    methods = {
        f.name for node in ast.walk(_tree(agent)) if isinstance(node, ast.ClassDef)
        and node.name == "Agent" for f in node.body
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    moved = {"_meta", "_local_meta", "_meta_with", "_published_meta", "_meta_changed",
             "_register", "_register_pointer", "_release_all", "_held_regions",
             "_release_memory", "_release_future", "_on_event", "_start_discovery",
             "_connect_name", "_fence", "_emit"}
    assert not moved & methods, sorted(moved & methods)
    assert not {"_regions", "_freeing", "_session", "_members", "_subscribers"} & (
        _agent_privates()
    )
    # The facade's public methods that own nothing delegate in one statement.
    for name in ("register", "alloc", "register_file", "flush", "poll"):
        (fn,) = [f for node in ast.walk(_tree(agent)) if isinstance(node, ast.ClassDef)
                 and node.name == "Agent" for f in node.body
                 if isinstance(f, ast.FunctionDef) and f.name == name]
        body = [s for s in fn.body if not (isinstance(s, ast.Expr)
                                           and isinstance(s.value, ast.Constant))]
        assert len(body) == 1, name


async def test_memory_and_metadata_share_one_region_table(make_agent, tmp_path) -> None:  # type: ignore[no-untyped-def]
    a = await make_agent("house")
    shared = a.alloc(4096, name="shared")
    plain = a.register(bytearray(4096), name="plain")
    a.register_file(tmp_path / "f", size=4096, name="file")
    assert {r.name for r in a.regions} == {"shared", "plain", "file"}
    served = a._localmeta.meta()
    assert [r.name for r in served.regions] == ["shared", "plain"]  # file regions: ours alone
    assert all(r.memfd == -1 for r in served.regions) and served.pid > 0
    local, fds = a._localmeta.local()
    assert [r.memfd for r in local.regions] == [0, -1] and len(fds) == 1
    import msgspec

    from aioxfer.metadata import AgentMeta

    published = msgspec.json.decode(a._localmeta.published(), type=AgentMeta)
    assert [(r.name, r.key, r.addr) for r in published.regions] == [
        ("shared", 0, 0), ("plain", 0, 0)
    ]
    await a.deregister(plain)
    assert [r.name for r in a._localmeta.meta().regions] == ["shared"]
    assert a.region("shared") is shared and shared.agent is a


def test_transfer_counters() -> None:
    c = stats.TransferCounters(posted=5, completed=3, failed=1, bytes=100)
    assert c.in_flight == 1
    s = stats.agent_statistics("a", "h:1", regions=2, peers=1, counters=c,
                               native={"ops": 4, "frames_rejected": 2}, pinned_regions=3)
    assert (s.transfers_posted, s.in_flight, s.native_ops, s.frames_rejected,
            s.native_conns, s.pinned_regions) == (5, 1, 4, 2, 0, 3)


def test_submit_sets_what_transfer_init_sets() -> None:
    # Submission.submit makes its Transfer with _cyx.FutureMaker (no __init__
    # frame per transfer): it must set every field Transfer.__init__ sets, to
    # the same values, no more.
    from aioxfer import _cyx, submission

    init = set(re.findall(r"^\s+self\.(\w+)\b[^=\n]*= ",
                          inspect.getsource(transfer.Transfer.__init__), re.M))
    assert init == set(transfer.Transfer.__slots__)
    made = {*submission._MADE_GIVEN, submission._MADE_CLOCK, *submission._MADE_FIXED}
    assert made == init
    loop = asyncio.new_event_loop()
    try:
        host, peer = object(), object()
        a = transfer.Transfer(host, loop, 7, "write", peer, 4096, 1.5)  # type: ignore[arg-type]
        maker = _cyx.FutureMaker(transfer.Transfer, {"loop": loop}, submission._MADE_GIVEN,
                                 submission._MADE_CLOCK, submission._MADE_FIXED)
        b = maker.make(host, 7, "write", peer, 4096)
        assert type(b) is transfer.Transfer and b.get_loop() is loop and not b.done()
        for name in init - {"_t0"}:
            assert getattr(b, name) is getattr(a, name), name
        assert type(b._t0) is float and b._t0 > 0
        b.set_result(None)  # type: ignore[arg-type]  # a plain asyncio.Future underneath
        assert b.result() is None
        with pytest.raises(TypeError):  # a field that is not a plain slot
            _cyx.FutureMaker(transfer.Transfer, {"loop": loop}, ("_host", "req_id", "op",
                             "peer", "done"), "_t0", {})
    finally:
        loop.close()


def test_connector_config_is_frozen_and_small() -> None:
    # More than ~8 things the connector knows of its agent travel as one
    # frozen record; the callables and collaborators stay separate arguments.
    import dataclasses

    fields = {f.name for f in dataclasses.fields(connector.ConnectConfig)}
    assert len(fields) <= 12, sorted(fields)
    assert connector.ConnectConfig.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert len(inspect.signature(connector.Connector).parameters) <= 10


def test_tags_count_references() -> None:
    t = tags.Tags()
    a = t.ref("p", 1)
    assert t.ref("p", 1) == a and t.ref("p", 2) != a
    f = t.local("file")
    assert t.names[f] == "file" and t.names[a] == "p"
    assert len(t) == 2  # (p, 1) and (p, 2); local tags are not counted
    t.unref(a)
    assert t.names[a] == "p"  # one reference left
    t.unref(a)
    assert a not in t.names and len(t) == 1 and t.ref("p", 1) != a


def _agent_privates() -> set[str]:
    """The private attributes and methods an Agent has (self._x in agent.py)."""
    names: set[str] = set()
    for node in ast.walk(_tree(agent)):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "self" and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            names.add(node.attr)
    for node in ast.walk(_tree(agent)):
        if isinstance(node, ast.ClassDef) and node.name == "Agent":
            names |= {f.name for f in node.body
                      if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                      and f.name.startswith("_") and not f.name.startswith("__")}
    return names


LOCAL_SIDE = (file_transport, metrics, staging, backends_base, backends_registry, backends_host,
              backends_objects, backends_testing)


def test_local_side_touches_no_agent_privates() -> None:
    # The file transport, the backends, metrics and staging reach their agent
    # through its public API and LocalBackendHost (host_of), never its privates.
    privates = _agent_privates()
    assert {"_engine", "_memory", "_submit", "_check_open", "_peers"} <= privates
    for module in LOCAL_SIDE:
        for node in ast.walk(_tree(module)):
            if isinstance(node, ast.Attribute) and node.attr in privates:
                # x._name where x is "agent" or "self.agent": an Agent
                base = node.value
                who = (base.id if isinstance(base, ast.Name)
                       else base.attr if isinstance(base, ast.Attribute) else "")
                assert who not in ("agent", "_agent"), (
                    f"{module.__name__}:{node.lineno} uses {who}.{node.attr}"
                )
            if isinstance(node, ast.ImportFrom) and node.module == "aioxfer.agent":
                assert {a.name for a in node.names} == {"Agent"}, (
                    f"{module.__name__} imports {[a.name for a in node.names]} from the agent"
                )


def test_agent_implements_local_backend_host() -> None:
    hosted = backends_host.BackendHost
    for name in _protocol_members(backends_host.LocalBackendHost):
        assert name in hosted.__slots__ or callable(getattr(hosted, name, None)), name
    assert inspect.signature(agent.Agent.__aioxfer_host__).return_annotation in (
        "BackendHost", hosted
    )
    params = inspect.signature(hosted).parameters
    assert all(p.kind is p.KEYWORD_ONLY for name, p in params.items() if name != "agent")
    assert len(params) <= 10
