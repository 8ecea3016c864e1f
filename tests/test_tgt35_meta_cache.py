"""Our metadata made once per registration generation, never stale (tgt35).

serving.Server keeps the metadata it served (the snapshot, its memfds, its
frame) and serves it again while ``meta_version()`` (the agent's
registration.Memory.generation) is unchanged. A region deregistered and
another registered under its name must reach the next peer as the new one:
its rid and key (and on the unix socket its memfd), never the cached old
one's. Also the early answer's parts made ahead (protocol.AcceptAhead,
early_challenge): the same bytes as made on the way, a fresh nonce each.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

import aioxfer.serving as serving
from aioxfer import protocol
from aioxfer.metadata import Accept

MiB = 1 << 20
TOKEN = b"tgt35-meta-cache"


def _wire(agent: Any) -> None:
    """The agent's Server with its metadata version, as agent.py wires it
    (Server(meta_version=...)); set here where this build's agent.py does
    not pass it yet."""
    server = agent._server
    if server._meta_version is None:
        memory, local = agent._memory, agent._localmeta
        server._meta_version = lambda: (memory.generation, local.meta_with)


def _counting(monkeypatch: Any) -> dict[str, int]:
    """How many times a Server made our metadata anew (_snapshot's misses)."""
    made = {"n": 0}
    out = serving.Server._out

    def counted(self: Any, local: bool, head: bytes, *, meta: bool, go: bool) -> Any:
        if meta:
            version = self._meta_version
            cached = self._meta_made[local]
            if version is None or cached is None or cached[0][0] != version():
                made["n"] += 1
        return out(self, local, head, meta=meta, go=go)

    monkeypatch.setattr(serving.Server, "_out", counted)
    return made


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("token", [None, TOKEN])
async def test_a_replaced_region_reaches_the_next_peer_as_the_new_one(
    make_agent: Any, monkeypatch: Any, transport: str, token: bytes | None
) -> None:
    kw: dict[str, Any] = {"transports": ("tcp",)} if transport == "tcp" else {}
    target = await make_agent("target", token=token, **kw)
    _wire(target)
    made = _counting(monkeypatch)
    old = target.alloc(MiB, name="buf")
    old.numpy().fill(1)
    first = await make_agent("first", token=token, **kw)
    p1 = await first.connect(target.address)
    assert p1.path == transport
    assert (p1.region("buf").rid, p1.region("buf").key) == (old.rid, old.key)
    # Another peer while nothing changed: the same metadata, not made again.
    second = await make_agent("second", token=token, **kw)
    p2 = await second.connect(target.address)
    assert (p2.region("buf").rid, p2.region("buf").key) == (old.rid, old.key)
    assert made["n"] == 1, made

    await target.deregister(old)
    new = target.alloc(MiB, name="buf")
    new.numpy().fill(2)
    third = await make_agent("third", token=token, **kw)
    p3 = await third.connect(target.address)
    assert (p3.region("buf").rid, p3.region("buf").key) == (new.rid, new.key), (
        "the metadata served after a region was replaced names the old one")
    assert made["n"] == 2, made
    # What the new name reaches is the new region's memory (on the unix
    # socket: its memfd, not a number the old one's had).
    dst = third.alloc(MiB, name="dst")
    await third.read(dst[0:4096], p3.region("buf")[0:4096])
    assert bytes(dst.numpy()[0:4096]) == b"\x02" * 4096
    # A region only added (none replaced): the next peer sees it too.
    target.alloc(MiB, name="more")
    fourth = await make_agent("fourth", token=token, **kw)
    p4 = await fourth.connect(target.address)
    assert set(p4.regions) == {"buf", "more"}
    assert made["n"] == 3, made
    # A region only deregistered (none added): gone for the next peer, also
    # while its release still waits (third holds it: its memory not given
    # back yet, which changes the version too).
    fifth = await make_agent("fifth", token=token, **kw)
    released = target.deregister(new)
    p5 = await fifth.connect(target.address)
    assert set(p5.regions) == {"more"}, "a deregistered region served from the cache"
    await released


async def test_a_swapped_meta_maker_is_never_served_from_the_cache(make_agent: Any) -> None:
    """What the tests' hostile peers replace (LocalMeta.meta_with) is part
    of the version: the next connect is served what it makes."""
    target = await make_agent("target", transports=("tcp",))
    _wire(target)
    target.alloc(MiB, name="buf")
    first = await make_agent("first", transports=("tcp",))
    await first.connect(target.address)
    lm = target._localmeta
    made = lm.meta_with

    def renamed(memfd: Any) -> Any:
        meta = made(memfd)
        return msgspec.structs.replace(meta, regions=[
            msgspec.structs.replace(r, name="renamed") for r in meta.regions])

    lm.meta_with = renamed
    second = await make_agent("second", transports=("tcp",))
    peer = await second.connect(target.address)
    assert set(peer.regions) == {"renamed"}


def test_memory_generation_changes_with_the_table() -> None:
    """Every change of the region table changes the generation (the cache's
    key): register, alloc, deregister."""
    import asyncio

    import aioxfer

    async def run() -> None:
        async with aioxfer.Agent("gen") as agent:
            mem = agent._memory
            seen = [mem.generation]
            r = agent.register(bytearray(4096), name="a")
            seen.append(mem.generation)
            s = agent.alloc(MiB, name="b")
            seen.append(mem.generation)
            await agent.deregister(r)
            seen.append(mem.generation)
            await agent.deregister(s)
            seen.append(mem.generation)
            assert len(set(seen)) == len(seen), seen

    asyncio.run(run())


@pytest.mark.parametrize("name", ["a", "server-" + "x" * 50])
@pytest.mark.parametrize("local", ["", "/tmp/aioxfer-x.sock"])
def test_accept_ahead_frames_are_the_encoded_accept(name: str, local: str) -> None:
    accept = Accept(name=name, incarnation=(1 << 64) - 1, host_id="h" * 128, local=local)
    ahead = protocol.AcceptAhead(accept)
    for meta in (False, True):
        proof = bytes(range(32))
        want = protocol.encode_frame(msgspec.structs.replace(accept, meta=meta, proof=proof))
        assert ahead.frame(meta, proof) == want
        assert ahead._heads[meta] is not None  # (the fast way, not the fallback)


def test_early_challenges_are_fresh_and_early() -> None:
    seen = set()
    for _ in range(64):
        nonce, frame = protocol.early_challenge()
        msg = protocol.decode_body(memoryview(frame)[4:])
        assert msg.nonce == nonce and msg.early and len(nonce) == protocol.NONCE_BYTES
        seen.add(nonce)
    assert len(seen) == 64


async def test_an_early_challenge_made_ahead_is_used_once(make_agent: Any,
                                                         monkeypatch: Any) -> None:
    """The Challenge made ahead after an accepting step goes to one
    connection only: early connects get a nonce each."""
    target = await make_agent("target", token=TOKEN)
    nonces = []
    ahead = []
    take = serving.Server._take_early_challenge

    def spy(self: Any) -> tuple[bytes, bytes]:
        ahead.append(self._early_challenge is not None)
        got = take(self)
        nonces.append(got[0])
        assert self._early_challenge is None
        return got

    monkeypatch.setattr(serving.Server, "_take_early_challenge", spy)
    for i in range(3):
        a = await make_agent(f"c{i}", token=TOKEN)
        await a.connect(target.address)
    assert target._server.early.taken == 3
    assert len(nonces) == 3 and len(set(nonces)) == 3, nonces
    assert any(ahead), "no early Challenge was made ahead"
