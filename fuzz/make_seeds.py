"""Writes the hand-made seed inputs of every fuzz harness into OUTDIR/<harness>/
(default build-fuzz/seeds, next to the work corpora: seeds are made, not committed).

Seeds are well-formed conversations (a WRITE that lands, a READ answered in
chunks, a handshake with and without a token, the metadata of a real agent),
so the fuzzer starts from the accepted paths and mutates from there. The
committed corpora under fuzz/corpus/ are what fuzzing grew from them
(minimized with -merge=1); benchmarks/fuzz.sh regenerates the seeds each run.

After a protocol version bump the committed handshake and metadata inputs
still name the old version, so they stop at the version check; with
--reversion DIR (benchmarks/fuzz.sh runs it on its work corpora) each input
naming an older version (msgpack "version" as a positive fixint) gets a copy
naming the current one beside it, and the minimizing merge keeps those that
reach further (the regrowth for protocol 5: 136 of 449 handshake inputs).

Run: python fuzz/make_seeds.py [OUTDIR]
     python fuzz/make_seeds.py --reversion CORPUS_DIR
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The native wire header (native/src/internal.h, wire_hdr): 64 bytes, little-endian.
_HDR = struct.Struct("<IHHiIQQQQQQ")
MAGIC = 0x31465841
FR_WRITE, FR_WRITE_ACK, FR_READ_REQ, FR_READ_RESP, FR_NOTIFY = 1, 2, 3, 4, 5
FR_NOTIFY_ACK, FR_PING, FR_REVOKE, FR_REVOKE_ACK, FR_BYE = 6, 7, 8, 9, 10
FL_LAST, FL_ABORT = 1, 2


def hdr(
    type_: int,
    *,
    flags: int = 0,
    status: int = 0,
    op: int = 1,
    index: int = 0,
    rid: int = 0,
    key: int = 0,
    off: int = 0,
    length: int = 0,
) -> bytes:
    assert _HDR.size == 64
    return _HDR.pack(MAGIC, type_, flags, status, 0, op, index, rid, key, off, length)


def target_seeds() -> dict[str, bytes]:
    """fuzz_target_frames: option byte, then what an initiator sends.
    rid 1 read-write (4096 B), rid 2 read-only (1024 B), rid 3 the revoked
    region (option bit 0); key 0 = the region's real key."""
    pay = bytes(range(64))
    return {
        "write": b"\0" + hdr(FR_WRITE, flags=FL_LAST, rid=1, off=0, length=16) + pay[:16],
        "write-group": b"\0"
        + hdr(FR_WRITE, op=5, rid=1, off=100, length=32)
        + pay[:32]
        + hdr(FR_WRITE, op=5, flags=FL_LAST, index=1, rid=1, off=132, length=8)
        + pay[:8],
        "write-readonly": b"\0" + hdr(FR_WRITE, flags=FL_LAST, rid=2, length=8) + pay[:8],
        "write-aborted": b"\0"
        + hdr(FR_PING)
        + hdr(FR_WRITE, flags=FL_LAST | FL_ABORT, rid=1),
        "read": b"\0" + hdr(FR_READ_REQ, flags=FL_LAST, rid=1, off=8, length=32),
        "read-readonly": b"\0"
        + hdr(FR_READ_REQ, rid=2, off=0, length=512)
        + hdr(FR_READ_REQ, flags=FL_LAST, rid=2, off=512, length=512),
        "read-aborted": b"\0" + hdr(FR_READ_REQ, flags=FL_LAST | FL_ABORT, rid=1),
        "notify": b"\0" + hdr(FR_NOTIFY, op=9, length=5) + b"hello",
        "revoke-ack": b"\1" + hdr(FR_REVOKE_ACK, rid=3),
        "bye": b"\1" + hdr(FR_WRITE, flags=FL_LAST, rid=1, length=2) + b"hi" + hdr(FR_BYE),
        "revoked-write": b"\1"
        + hdr(FR_WRITE, flags=FL_LAST, rid=3, length=4)
        + b"boom"
        + hdr(FR_REVOKE_ACK, rid=3),
    }


def _plan(*ops: tuple[int, list[tuple[int, int, int]]]) -> bytes:
    """fuzz_initiator_frames' plan: op count, then per op its kind byte
    (0 READ, 1 WRITE, 2 WRITE + notification, 3 NOTIFY; +4: two descriptors)
    and per descriptor (local offset, remote offset, length - 1) as u16."""
    out = bytes([len(ops) - 1])
    for kind, descs in ops:
        out += bytes([kind | (4 if len(descs) == 2 else 0)])
        for loff, roff, len_1 in descs:
            out += struct.pack("<HHH", loff, roff, len_1)
    return out


def initiator_seeds() -> dict[str, bytes]:
    """fuzz_initiator_frames: the plan, then what the fake target answers.
    The remote region is rid 7, key 0x1234; requests are ops 1..n; chunks are
    512 bytes."""
    data = bytes(i % 251 for i in range(2048))
    return {
        "read": _plan((0, [(0, 0, 99)]))
        + hdr(FR_READ_RESP, flags=FL_LAST, rid=7, off=0, length=100)
        + data[:100],
        "read-chunks": _plan((0, [(10, 20, 1499)]))
        + hdr(FR_READ_RESP, rid=7, off=20, length=512)
        + data[:512]
        + hdr(FR_READ_RESP, rid=7, off=532, length=512)
        + data[:512]
        + hdr(FR_READ_RESP, flags=FL_LAST, rid=7, off=1044, length=476)
        + data[:476],
        "read-two-desc": _plan((0, [(0, 0, 9), (100, 200, 9)]))
        + hdr(FR_READ_RESP, rid=7, off=0, length=10)
        + data[:10]
        + hdr(FR_READ_RESP, flags=FL_LAST, index=1, rid=7, off=200, length=10)
        + data[:10],
        "read-denied": _plan((0, [(0, 0, 15)]))
        + hdr(FR_READ_RESP, flags=FL_LAST, status=-3, rid=7),
        "write": _plan((1, [(0, 0, 99)])) + hdr(FR_WRITE_ACK, length=100),
        "write-notify": _plan((2, [(0, 0, 99)]))
        + hdr(FR_WRITE_ACK, length=100)
        + hdr(FR_NOTIFY_ACK),
        "notify": _plan((3, [])) + hdr(FR_NOTIFY_ACK),
        "mixed": _plan((1, [(0, 0, 9)]), (0, [(64, 0, 9)]), (3, []))
        + hdr(FR_WRITE_ACK, op=1, length=10)
        + hdr(FR_READ_RESP, op=2, flags=FL_LAST, rid=7, off=0, length=10)
        + data[:10]
        + hdr(FR_NOTIFY_ACK, op=3),
        "revoke": _plan((0, [(0, 0, 9)]))
        + hdr(FR_REVOKE, op=0, rid=7, key=0x1234)
        + hdr(FR_READ_RESP, flags=FL_LAST, rid=7, off=0, length=10)
        + data[:10],
        "ping": _plan((1, [(0, 0, 0)])) + hdr(FR_PING, op=0) + hdr(FR_WRITE_ACK, length=1),
        # Two rails: chunks alternate between them; rail 0 (ours) answers its
        # first chunk, then hangs up, and the rest moves to rail 1.
        "two-rails": bytes([0x80]) + _plan((1, [(0, 0, 2047)]))[1:]
        + hdr(FR_WRITE_ACK, length=512),
        "two-rails-silent": bytes([0x81]) + _plan((0, [(0, 0, 2047)]), (2, [(0, 0, 99)]))[1:],
    }


def lone_seeds() -> dict[str, bytes]:
    """fuzz_lone_frames (fuzz_initiator_frames built with FZ_LONE): the plan,
    then per request how many bytes of the stream follow its post, then the
    stream. Requests go one at a time, each awaited by a spinning thread: a
    receiver that read a reply parks, and the spinner reads the next READ
    response (up to 16 KiB, its payload all there) or WRITE acknowledgement
    (conn.c help_read)."""
    data = bytes(i % 251 for i in range(2048))

    def resp(op: int, off: int, n: int, **kw: int) -> bytes:
        return hdr(FR_READ_RESP, op=op, flags=FL_LAST, rid=7, off=off, length=n, **kw) + data[:n]

    def lens(*n: int) -> bytes:
        return b"".join(struct.pack("<H", k) for k in n)

    r = [resp(i, 0, 100) for i in range(1, 5)]
    return {
        "reads": _plan(*[(0, [(0, 0, 99)])] * 4) + lens(*map(len, r)) + b"".join(r),
        "writes": _plan(*[(1, [(0, 0, 99)])] * 3) + lens(64, 64, 64)
        + b"".join(hdr(FR_WRITE_ACK, op=i, length=100) for i in (1, 2, 3)),
        "read-write-read": _plan((0, [(0, 0, 99)]), (1, [(0, 0, 99)]), (0, [(200, 10, 99)]))
        + lens(164, 64, 164) + r[0] + hdr(FR_WRITE_ACK, op=2, length=100) + resp(3, 10, 100),
        # the second response's payload split: the spinner takes the header
        # and waits for the rest (help_more), which comes after the third post
        "read-short": _plan(*[(0, [(0, 0, 499)])] * 3) + lens(564, 100, 0)
        + resp(1, 0, 500) + resp(2, 0, 500) + resp(3, 0, 500),
        # a response longer than asked, one of another op, one past the
        # descriptor: the spinner leaves them to the receiver, which refuses
        "read-hostile": _plan(*[(0, [(0, 0, 99)])] * 4) + lens(164, 164, 164, 164)
        + r[0] + resp(2, 0, 101) + resp(9, 0, 100) + resp(4, 2000, 100),
    }


def handshake_seeds() -> dict[str, bytes]:
    from fuzz_handshake import seeds

    return seeds()


def metadata_seeds() -> dict[str, bytes]:
    from fuzz_metadata import seeds

    return seeds()


def nixl_wire_seeds() -> dict[str, bytes]:
    from fuzz_nixl_wire import seeds

    return seeds()


def kv_peer_seeds() -> dict[str, bytes]:
    from fuzz_kv_peer import seeds

    return seeds()


def kv_disk_seeds() -> dict[str, bytes]:
    from fuzz_kv_disk import seeds

    return seeds()


def objects_seeds() -> dict[str, bytes]:
    from fuzz_objects import seeds

    return seeds()


def discovery_seeds() -> dict[str, bytes]:
    from fuzz_discovery import seeds

    return seeds()


def reversion(corpus: Path) -> int:
    """Beside each input of ``corpus`` naming an older protocol version, a
    copy naming the current one (see the module doc); returns how many were
    written."""
    import hashlib
    import re

    sys.path.insert(0, str(ROOT))
    from aioxfer.metadata import PROTOCOL_VERSION

    older = re.compile(rb"\xa7version[\x00-\x%02x]" % (PROTOCOL_VERSION - 1))
    now = b"\xa7version" + bytes((PROTOCOL_VERSION,))
    made = 0
    for f in sorted(corpus.iterdir()):
        data = f.read_bytes()
        new = older.sub(now, data)
        name = corpus / f"v{PROTOCOL_VERSION}-{hashlib.sha1(new).hexdigest()}"
        if new != data and not name.exists():
            name.write_bytes(new)
            made += 1
    return made


def main() -> None:
    if sys.argv[1:2] == ["--reversion"]:
        print(f"{sys.argv[2]}: {reversion(Path(sys.argv[2]))} inputs re-versioned")
        return
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "build-fuzz" / "seeds"
    sys.path.insert(0, str(Path(__file__).parent))
    for harness, make in [
        ("target_frames", target_seeds),
        ("initiator_frames", initiator_seeds),
        ("lone_frames", lone_seeds),
        ("handshake", handshake_seeds),
        ("metadata", metadata_seeds),
        ("nixl_wire", nixl_wire_seeds),
        ("kv_peer", kv_peer_seeds),
        ("kv_disk", kv_disk_seeds),
        ("objects", objects_seeds),
        ("discovery", discovery_seeds),
    ]:
        d = out / harness
        d.mkdir(parents=True, exist_ok=True)
        for name, blob in make().items():
            (d / f"seed-{name}").write_bytes(blob)
        print(f"{d}: {len(list(d.iterdir()))} seeds")


if __name__ == "__main__":
    main()
