#!/usr/bin/env python3
"""atheris (libFuzzer for Python) harness: the control-plane metadata decoders.

Byte 0 of an input picks the decoder, the rest is what a peer controls:
  even: a frame body for protocol.decode_body (msgpack, the Frame union of
        aioxfer.metadata Structs: what arrives on every connection, pre-auth);
  odd:  an etcd value for discovery's JSON decoder of AgentMeta (what any
        writer to the etcd prefix controls).
Contract: decode_body returns a Frame or raises ProtocolError (then
protocol 5's lenient version read of that body names exactly the integer
"version" of a msgpack map, when not ours, and never raises); the JSON
decoder returns an AgentMeta or raises msgspec.DecodeError (what discovery
catches); whatever decodes re-encodes to something that decodes equal; the
discovery helpers that read a member's regions accept whatever decoded.
Anything else raises out of check() (atheris reports it and saves the input),
unless it is a known, reported issue (fuzz/known_issues.py) and
AXF_FUZZ_TOLERATE_KNOWN=1.

Run: python fuzz/fuzz_metadata.py [libFuzzer flags] CORPUS_DIR   (see benchmarks/fuzz.sh)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402

_m: Any = None  # the aioxfer modules, once loaded (under atheris: instrumented)


def load() -> None:
    global _m
    if _m is not None:
        return
    import types

    import msgspec

    import aioxfer.discovery as discovery
    import aioxfer.errors as errors
    import aioxfer.metadata as metadata
    import aioxfer.protocol as protocol

    _m = types.SimpleNamespace(
        msgspec=msgspec, discovery=discovery, errors=errors, metadata=metadata, protocol=protocol
    )


def _msgpack(body: bytes) -> None:
    p = _m.protocol
    try:
        frame = p.decode_body(body)
    except _m.errors.ProtocolError:
        _lenient_version(body)
        return
    again = p.decode_body(p.encode_frame(frame)[4:])
    if again != frame:
        raise AssertionError(f"msgpack round trip changed the frame: {frame!r} -> {again!r}")
    if isinstance(frame, _m.metadata.AgentMeta):
        _members(frame)


def _lenient_version(body: bytes) -> None:
    """Protocol 5's lenient read of a handshake frame none of ours decodes
    (protocol._other_version): the integer "version" of any msgpack map when
    it is not ours, else None; never an error (it runs on bytes from a peer
    that has proved nothing)."""
    ms, md = _m.msgspec, _m.metadata
    got = _m.protocol._other_version(body)
    try:
        obj = ms.msgpack.decode(body)
    except (ms.DecodeError, RecursionError):
        obj = None
    v = obj.get("version") if isinstance(obj, dict) else None
    want = v if type(v) is int and v != md.PROTOCOL_VERSION else None
    if got != want or type(got) is not type(want):
        raise AssertionError(f"lenient version read {got!r}, the frame names {v!r}")


def _json(value: bytes) -> None:
    ms = _m.msgspec
    decode = _m.discovery._decode  # the decoder discovery applies to etcd values
    try:
        meta = decode(value)
    except ms.DecodeError:  # ValidationError is one: what discovery catches
        return
    again = decode(ms.json.encode(meta))
    if again != meta:
        raise AssertionError(f"JSON round trip changed the metadata: {meta!r} -> {again!r}")
    _members(meta)


def _members(meta: Any) -> None:
    d = _m.discovery
    names = d.region_names(meta)
    added, removed = d.diff_regions(meta, meta)
    if added or removed:
        raise AssertionError(f"a member differs from itself: +{added} -{removed}")
    if len(names) != len(meta.regions):
        raise AssertionError("region_names lost regions")


def _run(data: bytes) -> None:
    if data[0] % 2 == 0:
        _msgpack(data[1:])
    else:
        _json(data[1:])


def check(data: bytes) -> str | None:
    """Runs one input (fuzz/_harness.py guarded: None, a known issue's name,
    or raises on a new finding)."""
    return _harness.guarded(load, _run, data)


def seeds() -> dict[str, bytes]:
    """Well-formed bodies of every message, msgpack and JSON."""
    import msgspec

    from aioxfer.metadata import (
        PROTOCOL_VERSION,
        Accept,
        AgentMeta,
        Challenge,
        CudaExport,
        Hello,
        Proof,
        RegionMeta,
        Reject,
        VerbsAccept,
        VerbsConnect,
        VerbsQP,
    )

    region = RegionMeta(
        name="kv", rid=3, key=0xDEADBEEF, nbytes=1 << 20, access=3, addr=0x7F0000000000,
        memfd=0, verbs=[(0x7F0000000000, 42)],
    )
    gpu = RegionMeta(
        name="gpu", rid=4, key=1, nbytes=4096, access=1, addr=0x10000, kind="cuda",
        cuda=CudaExport(handle=b"h" * 64, offset=0, device=b"u" * 16),
    )
    meta = AgentMeta(
        version=PROTOCOL_VERSION, name="worker-0", incarnation=5, host_id="h", pid=1234,
        address="127.0.0.1:5000", transports=["tcp", "shm"], regions=[region, gpu], uid=0,
        rails=["127.0.0.1:5000", "127.0.0.2:5000"], verbs_devices=["mlx5_0 fe80::1"],
        local="aioxfer-worker-0",
    )
    qp = VerbsQP(qpn=1, psn=2, mtu=4096, lid=0, port=1, gid_index=0, gid=b"g" * 16)
    frames = {
        "hello": Hello(
            version=PROTOCOL_VERSION, name="a", incarnation=1, purpose="data", nonce=b"n" * 16
        ),
        "challenge": Challenge(version=4, nonce=b"n" * 16),
        "proof": Proof(proof=b"p" * 32),
        "accept": Accept(name="b", incarnation=2, host_id="h", local="aioxfer-b"),
        "reject": Reject(reason="bad token"),
        "meta": meta,
        "verbs-connect": VerbsConnect(qps=[qp]),
        "verbs-accept": VerbsAccept(qps=[qp, qp]),
    }
    enc = msgspec.msgpack.Encoder()
    out = {f"msgpack-{k}": b"\0" + enc.encode(v) for k, v in frames.items()}
    out["json-meta"] = b"\1" + msgspec.json.encode(meta)
    # frames of another version whose shape changed: protocol 5's lenient
    # read names their version (a map of any keys; "version" a bool is none)
    out["msgpack-other-shape"] = b"\0" + enc.encode(
        {"type": "hello", "version": PROTOCOL_VERSION + 1, "name": 7})
    out["msgpack-bool-version"] = b"\0" + enc.encode({"version": True, 1: [2.5]})
    return out


def main() -> None:
    _harness.main(check, load, lambda: (_m.protocol, _m.metadata, _m.discovery, _m.errors))


if __name__ == "__main__":
    main()
