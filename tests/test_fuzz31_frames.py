"""The target-side frame-parser corpus over real sockets (fuzz31).

tests/test_fuzz_replay.py replays fuzz/corpus/target_frames/ through the
libFuzzer harness's engine on a socketpair; here every input (and seed) is
sent instead, after a real handshake, on a TCP data connection to a real
agent, as a hostile initiator would: the harness's rid 1 is the agent's
read-write region and rid 2 its read-only one, and a key is an XOR with the
real key of the region its rid names, as the harness reads them
(native/fuzz/fuzz_target_frames.c fix_up). The standards: a malformed frame
closes that connection only, with its reason logged (one "closing
connection: malformed frame" line per frame counted rejected); the process
survives; nothing is written outside the read-write region or into the
read-only one; an honest peer's transfers keep working throughout.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import pattern, wait_until, within
from test_security import closed_by_peer, data_connection, region_meta

ROOT = Path(__file__).resolve().parent.parent
FUZZ = ROOT / "fuzz"
# native/src/internal.h: wire_hdr (magic, type, flags, status, nseg, op,
# index, rid, key, off, len), wire_seg (index, rid, key, off, len), the
# frame types, FL_ABORT, AXF_MAX_SEGS.
HDR = struct.Struct("<IHHiIQQQQQQ")
HDR_RID = 32
SEG = struct.Struct("<QQQQQ")
SEG_RID = 8
FR_WRITE, FR_NOTIFY, FR_WRITEV, FR_READV = 1, 5, 11, 12
FL_ABORT = 2
MAX_SEGS = 64
RW, RO, GUARD = 4096, 1024, 64


def _inputs() -> list[tuple[str, bytes]]:
    if str(FUZZ) not in sys.path:
        sys.path.insert(0, str(FUZZ))
    import make_seeds

    out = [(f"seed-{k}", v) for k, v in make_seeds.target_seeds().items()]
    d = FUZZ / "corpus" / "target_frames"
    out += [(p.name, p.read_bytes()) for p in sorted(d.iterdir()) if p.is_file()]
    return out


def fix_up(stream: bytes, keys: dict[int, tuple[int, int]]) -> bytes:
    """fuzz_target_frames.c fix_up: each header's (and vectored segment's)
    rid names a harness region (1, 2), given the agent's real id, and its key
    is XORed with that region's real key; walks payloads as the parser does
    on the accepted paths."""
    p = bytearray(stream)
    pos, n = 0, len(p)

    def fix(at: int, rid_at: int) -> None:
        rid, key = struct.unpack_from("<QQ", p, at + rid_at)
        if rid in keys:
            real, rkey = keys[rid]
            struct.pack_into("<QQ", p, at + rid_at, real, key ^ rkey)

    while pos + HDR.size <= n:
        h = HDR.unpack_from(p, pos)
        typ, flags, nseg, length = h[1], h[2], h[4], h[10]
        fix(pos, HDR_RID)
        pos += HDR.size
        if typ in (FR_WRITEV, FR_READV) and not flags & FL_ABORT and 0 < nseg <= MAX_SEGS:
            for _ in range(nseg):
                if pos + SEG.size > n:
                    break
                fix(pos, SEG_RID)
                pos += SEG.size
        if (typ in (FR_WRITE, FR_WRITEV) and not flags & FL_ABORT) or typ == FR_NOTIFY:
            pos += min(length, n - pos)
    return bytes(p)


async def _send(address: str, stream: bytes) -> bool:
    """One hostile connection: the stream, then our half closed; whether the
    agent closed it (within 10 s)."""
    loop = asyncio.get_running_loop()
    sock = await data_connection(address)
    with sock:
        try:
            await within(loop.sock_sendall(sock, stream))
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            return True  # it closed already, mid-stream
        return await closed_by_peer(sock)


async def test_target_corpus_over_real_connections(make_agent: Any, capsys: Any) -> None:
    target = await make_agent("target", transports=("tcp",))
    outer = np.full(RW + 2 * GUARD, 0x5A, dtype=np.uint8)
    rw = target.register(outer[GUARD:GUARD + RW], name="rw")
    ro_bytes = bytes(pattern(RO, seed=11))
    target.register(ro_bytes, name="ro")
    metas = {r: await region_meta(target.address, r) for r in ("rw", "ro")}
    keys = {1: (metas["rw"].rid, metas["rw"].key), 2: (metas["ro"].rid, metas["ro"].key)}
    assert metas["ro"].access == 1, "the read-only region must be read-only"
    honest = await make_agent("honest", transports=("tcp",))
    hpeer = await within(honest.connect(target.address))
    src = honest.register(pattern(RW, seed=3))
    before = target.statistics().frames_rejected
    inputs = _inputs()
    assert len(inputs) > 100, "the target_frames corpus is missing"
    not_closed = []
    for i, (name, data) in enumerate(inputs):
        if not data:
            continue
        if not await _send(target.address, fix_up(data[1:], keys)):
            not_closed.append(name)
        if name == "seed-write":  # the translation reaches the region: a WRITE lands
            assert rw.numpy()[:16].tobytes() == bytes(range(16))
        if i % 50 == 0:  # the honest peer is served throughout
            await within(honest.write(src[0:RW], hpeer.region("rw")[0:RW]))
    assert not not_closed, f"connections left open by the agent: {not_closed[:10]}"
    assert bytes(outer[:GUARD]) == b"\x5a" * GUARD and bytes(outer[-GUARD:]) == b"\x5a" * GUARD
    assert ro_bytes == bytes(pattern(RO, seed=11))
    await within(honest.write(src[0:RW], hpeer.region("rw")[0:RW]))
    assert np.array_equal(rw.numpy(), src.numpy())
    assert not hpeer.lost
    rejected = target.statistics().frames_rejected - before
    with capsys.disabled():
        print(f"{len(inputs)} inputs, {rejected} closed as malformed frames")
    assert rejected > 10, f"only {rejected} inputs were malformed frames: fix_up is off"
    err: list[str] = []

    def logged() -> bool:
        err.append(capsys.readouterr().err)
        return "".join(err).count("closing connection: malformed frame") >= rejected

    await wait_until(logged, what=f"{rejected} malformed-frame reasons logged")
    assert "".join(err).count("closing connection: malformed frame") == rejected


@pytest.mark.parametrize("seed", ["write", "write-group", "read"])
def test_fix_up_reaches_the_region(seed: str) -> None:
    """The translation is the harness's: a seed's first header names rid 1
    with key 0, which must become the real rid and key."""
    if str(FUZZ) not in sys.path:
        sys.path.insert(0, str(FUZZ))
    import make_seeds

    data = make_seeds.target_seeds()[seed][1:]
    out = fix_up(data, {1: (77, 0xABC)})
    assert struct.unpack_from("<QQ", out, HDR_RID) == (77, 0xABC)
