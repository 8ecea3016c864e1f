#!/usr/bin/env python3
"""atheris (libFuzzer for Python) harness: what another KV store's peer tier
controls (aioxfer/kv/peer.py): its published meta (the JSON in its
"kvpeer.<group>.meta" region, read at its join) and the control messages it
sends (a notification: 2-byte length, JSON head, 48-byte entries).

Real agents on loopback, set up once: ours (a Store with a HostTier and a
PeerTier of group "fz") and the member's (its pool and index regions, the
names the seeds' metas give). Byte 0 of an input picks what the rest is (by its value mod 3):
  0:    a published meta, then (after a 0xFF byte, if any) a control head:
        PeerTier._member(peer, meta) decides whether it is a member; if it
        is, it joins for the length of the input (ours, not dialled), and the
        head, where _serve would take it as a placement from that member
        (op "put"; "from", "ctl", "region" strings; an int "req"), is
        judged as _serve and _ack judge it: _unvouched (whether we may dial
        its addresses, and, asked again before the ack, send the ack), for the
        member's store agent and its control agent as the sender;
  1:    a whole control notification, parsed as _serve parses it (length,
        JSON head, entries), judged the same way when it is a placement
        from the member as it joined with its real meta (seed "meta");
  2:    the real meta and a placement, each field kept or replaced by a
        JSON value the rest of the input makes (any type, nested): what
        byte-level mutation of JSON text rarely reaches while the text
        stays JSON.
Contract: _member returns a member or None (a broken or hostile meta is no
member, never an error out of join); _unvouched returns a reason or None
(before the ack, from no member: vouched only for the sender found at its
own "from" with "ctl" the same); a placement from a known member
whose addresses are its own is vouched for, one naming others is not; none
of them raises (an error in _serve ends the tier's serving loop for good:
every placement after it is dropped). Nothing is dialled. Anything else
raises out of check(), unless it is a known, reported issue
(fuzz/known_issues.py) and AXF_FUZZ_TOLERATE_KNOWN=1.

Run: python fuzz/fuzz_kv_peer.py [libFuzzer flags] CORPUS_DIR   (see benchmarks/fuzz.sh)
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402

BB = 64 << 10
GROUP = "fz"
SEP = b"\xff"  # between a meta and a head (no JSON text holds it)
# In an input, this JSON string stands for the member's real address (its
# port differs from run to run): seeds reach the paths of a member's own.
SELF = b'"@self"'
_m: Any = None  # modules and the live setup, once loaded


def load() -> None:
    global _m
    if _m is not None:
        return
    import types

    import aioxfer
    import aioxfer.kv as kv
    import aioxfer.kv.peer as peer

    loop = asyncio.new_event_loop()
    ns = types.SimpleNamespace(mod=peer, kv=kv, loop=loop)

    async def setup() -> None:
        ns.ours = aioxfer.Agent("fz-kv-ours")
        await ns.ours.__aenter__()
        ns.theirs = aioxfer.Agent("fz-kv-theirs")
        await ns.theirs.__aenter__()
        ns.theirs.alloc(16 * BB, name="fzpool")
        ns.theirs.alloc(16 * peer.WAYS * peer.IENTRY, name="fzindex")
        ns.tier = kv.PeerTier(group=GROUP)
        ns.store = kv.Store.open(ns.ours, block_bytes=BB,
                                 tiers=[kv.HostTier(16 * BB), ns.tier])
        await ns.store.__aenter__()
        ns.member = await ns.ours.connect(ns.theirs.address)

    loop.run_until_complete(setup())
    _m = ns


def real_meta(address: str = "@self") -> dict[str, Any]:
    """A member's meta as PeerTier._open publishes it (kv/peer.py)."""
    return {"group": GROUP, "block_bytes": BB, "buckets": 16, "pool": "fzpool",
            "index": "fzindex", "slots": 16, "ctl": "127.0.0.1:2", "address": address,
            "pulls_per_peer": 8}


def _placement(head: Any) -> bool:
    """Whether _serve takes ``head`` for a placement (its checks, in order)."""
    return (isinstance(head, dict) and type(head.get("req")) is int and head.get("op") == "put"
            and all(isinstance(head.get(f), str) for f in ("from", "ctl", "region")))


def _judge(member: Any, head: Any) -> None:
    t = _m.tier
    name = member.name
    old = t.members.get(name)
    t.members[name] = member
    try:
        for sender in (name, name + _m.mod._CTL):
            why = t._unvouched(sender, head)
            if why is not None and not isinstance(why, str):
                raise AssertionError(f"_unvouched gave {why!r}")
            # (compared one by one: the harness must not fail where the tier does)
            own = (head["from"] == member.peer.address
                   or head["from"] == member.meta.get("address")) \
                and head["ctl"] == member.meta["ctl"]
            if (why is None) != own:
                raise AssertionError(f"placement {head!r} from {sender!r}: vouched={why is None}, "
                                     f"its addresses the member's: {own}")
        # Asked again before the ack (ack=True): from a sender that is no
        # member we know (embedded, no discovery) the ack goes only to the
        # sender itself, found at "from", with "ctl" that same address.
        stranger = "stranger-" + name
        for reached in (stranger, None, name):
            why = t._unvouched(stranger, head, ack=True, reached=reached)
            want = stranger.isprintable() and reached == stranger \
                and head["ctl"] == head["from"]
            if (why is None) != want:
                raise AssertionError(f"placement {head!r} from {stranger!r} reaching "
                                     f"{reached!r}: ack vouched={why is None}, not {want}")
    finally:
        if old is None:
            t.members.pop(name, None)
        else:
            t.members[name] = old


def _meta_then_head(data: bytes) -> None:
    raw, _, rest = data.partition(SEP)
    raw = raw.replace(SELF, json.dumps(_m.theirs.address).encode())
    rest = rest.replace(SELF, json.dumps(_m.theirs.address).encode())
    member = _m.tier._member(_m.member, raw)
    if member is None:
        return
    if not isinstance(member, _m.mod._Member):
        raise AssertionError(f"_member gave {member!r}")
    head: Any = None
    if rest:
        try:
            head = json.loads(rest)
        except (ValueError, RecursionError):  # what _serve drops
            head = None
    if not _placement(head):
        head = {"op": "put", "req": 1, "from": _m.theirs.address,
                "ctl": str(member.meta["ctl"]), "region": "x"}
    _judge(member, head)


def _notification(p: bytes) -> None:
    # _serve's parse, as it is there
    n = int.from_bytes(p[:2], "little")
    try:
        head = json.loads(p[2:2 + n].replace(SELF, json.dumps(_m.theirs.address).encode()))
    except (ValueError, RecursionError):
        return
    if not _placement(head):
        return
    member = _m.tier._member(_m.member, json.dumps(real_meta(_m.theirs.address)).encode())
    if member is None:
        raise AssertionError("the real meta is no member")
    _judge(member, head)


class _Bytes:
    """The input's bytes as choices (atheris' FuzzedDataProvider's role,
    without atheris: the corpus replay runs where it is not installed);
    past the end, every choice is 0."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def ConsumeIntInRange(self, lo: int, hi: int) -> int:  # noqa: N802 (atheris' names)
        span = hi - lo + 1
        n = (span.bit_length() + 7) // 8
        raw = self.data[self.at:self.at + n]
        self.at += n
        return lo + int.from_bytes(raw, "little") % span

    def ConsumeBool(self) -> bool:  # noqa: N802
        return bool(self.ConsumeIntInRange(0, 1))

    def ConsumeRegularFloat(self) -> float:  # noqa: N802
        return self.ConsumeIntInRange(-(1 << 20), 1 << 20) / 7.0

    def ConsumeUnicodeNoSurrogates(self, n: int) -> str:  # noqa: N802
        n = self.ConsumeIntInRange(0, n)
        raw = self.data[self.at:self.at + n]
        self.at += n
        return raw.decode("latin-1")


def _value(fdp: Any, depth: int = 0) -> Any:
    """A JSON value of any type, from the fuzzer's bytes."""
    kind = fdp.ConsumeIntInRange(0, 7 if depth < 3 else 4)
    if kind == 0:
        return None
    if kind == 1:
        return fdp.ConsumeBool()
    if kind == 2:
        return fdp.ConsumeIntInRange(-(1 << 40), 1 << 40)
    if kind == 3:
        return fdp.ConsumeRegularFloat()
    if kind == 4:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 24))
    if kind == 5:
        return [_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 3))]
    if kind == 6:
        return {fdp.ConsumeUnicodeNoSurrogates(8): _value(fdp, depth + 1)
                for _ in range(fdp.ConsumeIntInRange(0, 3))}
    return "@self"


def _fields(fdp: Any, base: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in base.items():
        how = fdp.ConsumeIntInRange(0, 3)
        if how == 0:
            out[k] = v
        elif how == 1:
            out[k] = _value(fdp)
        # how == 2: left out
        elif how == 3:
            out[k] = v
            out[fdp.ConsumeUnicodeNoSurrogates(8)] = _value(fdp)
    return out


def _structured(data: bytes) -> None:
    fdp = _Bytes(data)
    meta = _fields(fdp, real_meta())
    head = _fields(fdp, {"op": "put", "req": 7, "from": "@self", "ctl": "127.0.0.1:2",
                         "region": "fz.kvpeer.stage"})
    _meta_then_head(json.dumps(meta).encode() + SEP + json.dumps(head).encode())


def _run(data: bytes) -> None:
    mode = data[0] % 3
    if mode == 0:
        _meta_then_head(data[1:])
    elif mode == 1:
        _notification(data[1:])
    else:
        _structured(data[1:])


def check(data: bytes) -> str | None:
    """Runs one input (fuzz/_harness.py guarded: None, a known issue's name,
    or raises on a new finding)."""
    return _harness.guarded(load, _run, data)


def seeds() -> dict[str, bytes]:
    """Metas as members publish them and placements as they send them."""
    meta = real_meta()
    head = {"op": "put", "req": 7, "from": "@self", "ctl": "127.0.0.1:2",
            "region": "fz.kvpeer.stage"}
    ack = {"op": "ack", "req": 7}

    def note(h: dict[str, Any], entries: int = 1) -> bytes:
        b = json.dumps(h).encode()
        return len(b).to_bytes(2, "little") + b + bytes(48 * entries)

    enc = json.dumps
    return {
        "meta": b"\0" + enc(meta).encode(),
        "meta-head": b"\0" + enc(meta).encode() + SEP + enc(head).encode(),
        "meta-other-ctl": b"\0" + enc(meta).encode() + SEP
        + enc({**head, "ctl": "10.1.2.3:4"}).encode(),
        "meta-no-address": b"\0" + enc({k: v for k, v in meta.items() if k != "address"}).encode()
        + SEP + enc(head).encode(),
        "meta-other-bb": b"\0" + enc({**meta, "block_bytes": 4096}).encode(),
        "meta-bad-buckets": b"\0" + enc({**meta, "buckets": 3}).encode(),
        "put": b"\1" + note(head, 2),
        "put-other-from": b"\1" + note({**head, "from": "127.0.0.9:9"}),
        "ack": b"\1" + note(ack, 0) + b"\1\1",
        "structured-as-is": b"\2" + bytes(64),
    }


def main() -> None:
    # The harness too: its structured mode's choices (the JSON types it
    # makes) count as coverage, so inputs of every shape stay in the corpus.
    _harness.main(check, load, lambda: (_m.mod, sys.modules[__name__]), quiet=True)


if __name__ == "__main__":
    main()
