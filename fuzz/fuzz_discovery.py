#!/usr/bin/env python3
"""atheris (libFuzzer for Python) harness: what anyone who can write the
etcd prefix controls in discovery (aioxfer/discovery.py): the watch's
events, each a key under ``{prefix}/agents/`` and, for a PUT, its value,
as EtcdSession._on_event takes them, into a real Members (aioxfer/members.py:
the agent's view of the cluster and its membership() stream); and what
cluster.py then does with a member's address (_check_address, the dialling
parse of it and of its rails).

No etcd: the events are what a watch reply carries (key, value,
mod_revision), handed to the session the way its watch loop hands them.
The session is "joined" (our own key's events are judged as a joined
agent judges them), with a mod revision no event reaches (so a PUT of our
own incarnation is one of ours, never a reclaim that would call etcd).

An input is a sequence of events; each starts with one byte e:
  bit 0: PUT (1) or DELETE (0);
  bits 1-2: the key's name: 0 "alpha", 1 "beta", 2 our own ("fz-self"),
            3 raw: the next byte n, then n bytes (any bytes, UTF-8 or not);
  bits 3-4 (PUT): the value: 0 raw (a 2-byte little-endian length, then
            that many bytes: JSON text as etcd holds it, or not), 1 a real
            AgentMeta JSON named as the key (its bytes decoded with
            "replace": what a careless writer or a forger would put), 2 the
            same named "alpha" or "beta" (the other one's name: bit 5),
            3 a real AgentMeta with fields from the next 3 bytes
            (incarnation, address from a table of valid and invalid ones,
            regions from a table) named as the key.
Contract: no event raises out of _on_event (an error there ends the watch
and a re-list follows, every member's state in doubt); the members are
exactly the keys whose last PUT decoded to an AgentMeta naming that key's
name, the key's bytes being that name's UTF-8, ours excluded (a key whose
name is not UTF-8 is no member: two keys would be one name, and a DELETE of
one would remove the other's member); our key never makes us a member of
our own view, and a PUT there that is not our incarnation supersedes us;
the membership() stream tells a consistent story (PeerJoined for a name
not joined; PeerUpdated and PeerLeft only for the incarnation joined; what
it ends with is the snapshot); a re-list of what etcd then holds (as _list
reads it, into Members.reset) changes nothing; every member's address either passes
cluster's _check_address or raises ProtocolError, and one that passes, and
every rail, parses for dialling. Anything else raises out of check(),
unless it is a known, reported issue (fuzz/known_issues.py) and
AXF_FUZZ_TOLERATE_KNOWN=1.

Run: python fuzz/fuzz_discovery.py [libFuzzer flags] CORPUS_DIR   (see benchmarks/fuzz.sh)
"""

from __future__ import annotations

import asyncio
import sys
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402

PREFIX = "/fz"
SELF = "fz-self"
SELF_INC = 0x5E1F
NAMES = ("alpha", "beta", SELF)
ADDRESSES = ("127.0.0.1:5000", "127.0.0.1:5001", "[::1]:7", "host.example:65535", "h:0",
             "h:65536", "h:+1", "h: 1", "h:\u0661", "[::1]", ":1", "a" * 70 + ":1",
             "xn--:1", "h..x:1", "\u00e9t\u00e9:80", "h:1:2", "fz-self:1", "")
REGIONS = ((), ("kv",), ("kv", "gpu"), ("kv\nforged",))
_m: Any = None  # the modules and the live setup, once loaded


def load() -> None:
    global _m
    if _m is not None:
        return
    import msgspec

    import aioxfer.cluster as cluster
    import aioxfer.dialing as dialing
    import aioxfer.discovery as discovery
    import aioxfer.errors as errors
    import aioxfer.members as members
    import aioxfer.metadata as metadata

    _m = types.SimpleNamespace(
        msgspec=msgspec, cluster=cluster, dialing=dialing, discovery=discovery, errors=errors,
        members=members, metadata=metadata, loop=asyncio.new_event_loop(),
    )


def meta(name: str, incarnation: int = 1, address: str = "127.0.0.1:5000",
         regions: tuple[str, ...] = ("kv",)) -> Any:
    md = _m.metadata
    return md.AgentMeta(
        version=md.PROTOCOL_VERSION, name=name, incarnation=incarnation, host_id="h", pid=1,
        address=address, transports=["tcp"], uid=0,
        regions=[md.RegionMeta(name=r, rid=i + 1, key=0, nbytes=4096, access=3, addr=0)
                 for i, r in enumerate(regions)],
        rails=[address] if address else [],
    )


def meta_json(name: str, incarnation: int = 1, address: str = "127.0.0.1:5000",
              regions: tuple[str, ...] = ("kv",)) -> bytes:
    """A published AgentMeta's JSON; one that would not validate (a name or an
    address the Struct refuses) written field by field, as a forger can."""
    ms = _m.msgspec
    try:
        return bytes(ms.json.encode(meta(name, incarnation, address, regions)))
    except (ValueError, TypeError):
        good = ms.json.decode(ms.json.encode(meta("x", incarnation, "127.0.0.1:1", regions)))
        good.update(name=name, address=address, rails=[address])
        return bytes(ms.json.encode(good))


class _KV:
    __slots__ = ("key", "value", "mod_revision")

    def __init__(self, key: bytes, value: bytes, rev: int) -> None:
        self.key, self.value, self.mod_revision = key, value, rev


class _Events:
    """Reads an input as events: (put, key name bytes, value)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def byte(self) -> int:
        if self.at >= len(self.data):
            return 0
        self.at += 1
        return self.data[self.at - 1]

    def take(self, n: int) -> bytes:
        got = self.data[self.at:self.at + n]
        self.at += len(got)
        return got

    def __iter__(self) -> Any:
        while self.at < len(self.data):
            e = self.byte()
            which = (e >> 1) & 3
            raw = self.take(self.byte()) if which == 3 else NAMES[which].encode()
            if not e & 1:
                yield False, raw, b""
                continue
            kind = (e >> 3) & 3
            keyname = raw.decode("utf-8", "replace")
            if kind == 0:
                n = self.byte() | self.byte() << 8
                value = self.take(n)
            elif kind == 1:
                value = meta_json(keyname)
            elif kind == 2:
                value = meta_json(NAMES[(e >> 5) & 1])
            else:
                inc, a, r = self.byte(), self.byte(), self.byte()
                inc = SELF_INC if inc == 0xFF else inc
                value = meta_json(keyname, inc, ADDRESSES[a % len(ADDRESSES)],
                                  REGIONS[r % len(REGIONS)])
            yield True, raw, value


def _member_of(raw: bytes, value: bytes) -> Any:
    """What the contract says a PUT of ``value`` at the key named ``raw``
    makes: its AgentMeta when it is a member, else None."""
    try:
        name = raw.decode()
    except UnicodeDecodeError:
        return None
    try:
        m = _m.discovery._decode(value)
    except _m.msgspec.DecodeError:
        return None
    return m if m.name == name else None


async def _run_async(data: bytes) -> None:
    d, mem = _m.discovery, _m.members
    stream_events: list[Any] = []
    members = mem.Members(SELF, peers_by_name={}, refresh_peer=_no_refresh,
                          drop_peer=_no_drop, closed=lambda: False)
    stream = members.subscribe([])
    config = d.Etcd(["127.0.0.1:1"], prefix=PREFIX)
    session = d.EtcdSession(config, SELF, SELF_INC, members)
    session._state = "joined"
    session._mod_rev = 1 << 62
    agents = f"{PREFIX}/agents/".encode()
    model: dict[bytes, Any] = {}
    values: dict[bytes, bytes] = {}  # what etcd holds now, key by key
    superseded = False
    for rev, (put, raw, value) in enumerate(_Events(data), start=2):
        kv = _KV(agents + raw, value, rev)
        await session._on_event(put, kv)
        if raw == SELF.encode():
            if put and not superseded:
                m = _member_of(raw, value)
                superseded = m is None or m.incarnation != SELF_INC
        elif put:
            model[raw] = _member_of(raw, value)
        else:
            model.pop(raw, None)
        if put:
            values[raw] = value
        else:
            values.pop(raw, None)
        want = {m.name: m for m in model.values() if m is not None}
        if members._members != want:
            raise AssertionError(
                f"after {'PUT' if put else 'DELETE'} {raw!r}: members "
                f"{sorted(members._members)}, the keys say {sorted(want)}")
        if (session._state == "superseded") != superseded:
            raise AssertionError(f"session {session._state!r}, superseded: {superseded}")
    # A re-list (a watch restarted) of what etcd holds now, as _list reads
    # it: nothing changes, since the watch already told all of it.
    want = dict(members._members)
    listed = {}
    for raw, value in values.items():
        m = session._decode(agents + raw, value)
        if m is not None and m.name != SELF:
            listed[m.name] = m
    await members.reset(listed, 0.0)
    if members._members != want:
        raise AssertionError(f"a re-list changed the members: {sorted(want)} -> "
                             f"{sorted(members._members)}")
    while stream._events:
        stream_events.append(stream._events.popleft())
    _story(stream_events, members)
    for m in members._members.values():
        _addresses(m)
    members.close()


async def _no_refresh(peer: Any) -> None:
    raise AssertionError(f"refreshed {peer!r}: there are no peers")


def _no_drop(peer: Any, why: str) -> None:
    raise AssertionError(f"dropped {peer!r} ({why}): there are no peers")


def _story(events: list[Any], members: Any) -> None:
    d = _m.discovery
    joined: dict[str, int] = {}
    for ev in events:
        if isinstance(ev, d.PeerJoined):
            if ev.name in joined:
                raise AssertionError(f"{ev!r} while {ev.name!r} is joined")
            joined[ev.name] = ev.incarnation
        elif joined.get(ev.name) != ev.incarnation:
            raise AssertionError(f"{ev!r} for an incarnation not joined ({joined})")
        elif isinstance(ev, d.PeerLeft):
            del joined[ev.name]
    snap = {ev.name: ev.incarnation for ev in members.snapshot()}
    if snap != joined:
        raise AssertionError(f"the stream says {joined}, the snapshot {snap}")


def _addresses(m: Any) -> None:
    try:
        _m.cluster._check_address(m.name, m.address)
    except _m.errors.ProtocolError:
        pass
    else:
        _dial_parse(m.address)
    for rail in m.rails:
        _dial_parse(rail)


def _dial_parse(address: str) -> None:
    host, port = _m.dialing.parse_address(address)
    if not 0 <= port <= 65535:
        raise AssertionError(f"{address!r} parsed to port {port}")
    host.encode("idna")


def _run(data: bytes) -> None:
    _m.loop.run_until_complete(_run_async(data))


def check(data: bytes) -> str | None:
    """Runs one input (fuzz/_harness.py guarded: None, a known issue's name,
    or raises on a new finding)."""
    return _harness.guarded(load, _run, data)


def seeds() -> dict[str, bytes]:
    """A member joins, updates, restarts and leaves; our key rewritten;
    a forged value; a raw key."""
    return {
        "join-leave": bytes([0b01, 0b00]),
        "join-update-restart": bytes([0b11001, 1, 0, 1, 0b11001, 1, 1, 2, 0b11001, 2, 0, 1]),
        "wrong-name": bytes([0b10001, 0b110001]),
        "own-key": bytes([0b11101, 0xFF, 0, 1, 0b01101]),
        "own-key-taken": bytes([0b11101, 3, 0, 1]),
        "raw-json": bytes([0b00001]) + len(b'{"type":"meta"}').to_bytes(2, "little")
        + b'{"type":"meta"}',
        "raw-key": bytes([0b01111, 5]) + b"gamma" + bytes([0b00110, 5]) + b"gamma",
        "raw-key-not-utf8": bytes([0b01111, 2, 0x61, 0xFF, 0b00110, 2, 0x61, 0xFE]),
        "bad-address": bytes([0b11001, 1, 6, 0, 0b11011, 2, 9, 3]),
    }


def main() -> None:
    _harness.main(check, load, lambda: (_m.discovery, _m.members, _m.cluster, _m.dialing),
                  quiet=True)


if __name__ == "__main__":
    main()
