#!/usr/bin/env python3
"""atheris (libFuzzer for Python) harness: what aioxfer.nixl decodes from
the outside (aioxfer/nixl/_wire.py, and the listener's framing and the
descriptor-list decoding built on it).

Byte 0 of an input picks the decoder (bits 0-2) and its options (bits 3-7),
the rest is what a peer controls:
  0: a metadata blob, as add_remote_agent / loadRemoteMD, a
     listener Push, a Fetch reply or the central store hand it to decode_md
     (bit 3: MD_MAGIC is put in front, so mutations reach the msgpack);
  1: a serialized descriptor list for deserialize_descs (bit 3: DL_MAGIC in
     front);
  2: a listener request body (request_decoder; a Push's md as in 0);
  3: a listener reply body (reply_decoder; an ok reply's md as in 0);
  4: a listener request stream as a client sends it after the nonce, read
     by the listener's _read_authenticated (token TOKEN, nonce NONCE): the
     4-byte length, then the rest; bit 3: the harness puts the genuine
     length MAC after the length (else the input's bytes are the MAC),
     bit 4: and the genuine body MAC after the announced body; bit 5:
     read as well through the listener's own connection (_ListenConn, fed
     by a stand-in transport in pieces of 1 + (bits 6-7) * 13 bytes, each
     at most what its read still needs): it must end as the stream reader
     did and never take a byte the read did not ask for;
  6: a reply as a listener sends it (its 4-byte length, then the rest),
     read as a client request reads it (_read_reply over _ReplyConn, fed
     as in 4 in pieces of 1 + (bits 6-7) * 13 bytes); bit 3: the reply to
     a Fetch (bound MAX_FRAME), else to a Push (MAX_ACK): a body only when
     the length is within the bound and the stream has it, ValueError
     (nothing past the length read) over it, ConnectionError or
     IncompleteReadError when the stream ends first; it never takes a
     byte past the reply, and never holds a buffer bigger than what came
     of the body (or _REPLY_PART); bit 4 (wire version 3): the reply's MAC
     read with it and checked (_read_proved_reply, the request's body MAC
     REQ_MAC), bit 5: the harness puts the genuine MAC there (else the
     input's bytes are the MAC): a body only with the genuine MAC, else
     ValueError with the whole reply read and nothing past it;
  7: the listener wire's versions (WIRE_VERSION): bit 3 clear, the rest
     read as a listener greeting (greeting_version: 1 without the magic,
     else the version it says) and, after NOTICE_MAGIC, as a client's
     version notice read by _read_authenticated: ListenerVersionError
     naming the notice's version, nothing past its LISTEN_HEAD bytes
     read; bit 3 set, a version-1 client's request (the 4-byte length,
     then the rest; the genuine version-1 length MAC put after the length,
     bit 4: and the genuine version-1 body MAC after the announced body),
     read by _read_authenticated (bit 5: through _ListenConn too, in
     pieces as in 4): never a body; the version-1 refusal only once the
     announced body and its MAC were read whole, over MAX_FRAME refused
     with nothing of the body read, IncompleteReadError when the stream
     ends first;
  5: notification frames from two senders into a NotifAssembler (bounds
     shrunk so the drop paths run; see _frames for the record format); bit
     3: the rest, repeated 1 + (bits 4-7) times, is a message a sender
     frames (notif_frames) and the assembler must give back whole.
Contract: every input decodes or raises the documented error: ValueError
from decode_md / decode_dlist (loadRemoteMD turns it into
NIXL_ERR_INVALID_PARAM), msgspec.DecodeError from the listener's decoders
(the listener logs it and closes that connection), nixlInvalidParamError from
deserialize_descs, ValueError or asyncio.IncompleteReadError from the
listener's framing; whatever decodes re-encodes to something that decodes
equal and can be used as the agent uses it (a peer's address dialled, its
regions put in the uint64 range tables); the framing returns a body only
when both MACs were made with the token and reads no more than the length
and its MAC from a client without it; the assembler never hands over a
message that is not what its sender framed (never a truncated one while its
id is remembered), and stays within its bounds. Anything else raises out of
check() (atheris reports it and saves the input), unless it is a known,
reported issue (fuzz/known_issues.py) and AXF_FUZZ_TOLERATE_KNOWN=1.
(Mode 7 was an alias of 0 until the listener wire's version 2: the nine
committed inputs that started with it now feed the version checks.)

Run: python fuzz/fuzz_nixl_wire.py [libFuzzer flags] CORPUS_DIR
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402

TOKEN = b"fuzz-token-nixl-wire"  # (16 bytes or more: no auth.short_token line)
NONCE = b"N" * 16
_m: Any = None
_loop: asyncio.AbstractEventLoop | None = None


def load() -> None:
    global _m, _loop
    if _m is not None:
        return
    import hmac
    import types

    import msgspec
    import numpy as np

    import aioxfer.auth as auth
    import aioxfer.dialing as dialing
    import aioxfer.metadata as metadata
    from aioxfer.nixl import _api, _bindings, _wire

    _m = types.SimpleNamespace(msgspec=msgspec, np=np, dialing=dialing, metadata=metadata,
                               api=_api, bindings=_bindings, wire=_wire, auth=auth,
                               hmac=hmac)
    _loop = asyncio.new_event_loop()


# ---------------------------------------------------------------- metadata


def _md(blob: bytes) -> None:
    w = _m.wire
    try:
        md = w.decode_md(blob)
    except ValueError:
        return
    if not isinstance(md, w.AgentMD) or not md.name:
        raise AssertionError(f"decode_md returned {md!r}")
    again = w.decode_md(w.encode_md(md))
    if again != md:
        raise AssertionError(f"metadata round trip changed it: {md!r} -> {again!r}")
    md.name.encode()  # loadRemoteMD returns it encoded
    if md.address:
        _m.dialing.parse_address(md.address)  # what loadRemoteMD's connect dials
    # As the agent uses a peer's ranges: a table of them (uint64 arrays),
    # each range found by a descriptor spanning it.
    table = _m.bindings._Table([(r.mem, r.addr, r.nbytes, r.dev, r.name) for r in md.regions])
    np = _m.np
    for r in md.regions[:8]:
        descs = np.array([[r.addr, r.nbytes, r.dev]], dtype=np.uint64)
        at = table.locate(r.mem, descs)
        if at is None:
            raise AssertionError(f"a range of the metadata is not found in its table: {r!r}")


# ---------------------------------------------------------------- descriptor lists


def _dlist(blob: bytes) -> None:
    api, b = _m.api, _m.bindings
    try:
        dl = api.nixl_agent.deserialize_descs(None, blob)  # (uses nothing of the agent)
    except b.nixlInvalidParamError:
        return
    if not isinstance(dl, b.nixlXferDList | b.nixlRegDList):
        raise AssertionError(f"deserialize_descs returned {dl!r}")
    again = api.nixl_agent.deserialize_descs(None, api.nixl_agent.get_serialized_descs(None, dl))
    if type(again) is not type(dl) or again.getType() != dl.getType() or not (
            again._a == dl._a).all() or getattr(again, "_metas", None) != getattr(
            dl, "_metas", None):
        raise AssertionError("descriptor list round trip changed it")
    dl.descCount()
    for i in range(min(dl.descCount(), 4)):
        dl[i]


# ---------------------------------------------------------------- listener messages


def _request(body: bytes) -> None:
    w, ms = _m.wire, _m.msgspec
    try:
        req = w.request_decoder.decode(body)
    except ms.DecodeError:
        return
    if w.request_decoder.decode(w.encoder.encode(req)) != req:
        raise AssertionError(f"request round trip changed it: {req!r}")
    if isinstance(req, w.Push):
        _md(req.md)
    elif isinstance(req, w.Fetch | w.Invalidate):
        req.name.encode()
    else:
        raise AssertionError(f"request_decoder returned {req!r}")


def _reply(body: bytes) -> None:
    w, ms = _m.wire, _m.msgspec
    try:
        rep = w.reply_decoder.decode(body)
    except ms.DecodeError:
        return
    if w.reply_decoder.decode(w.encoder.encode(rep)) != rep:
        raise AssertionError(f"reply round trip changed it: {rep!r}")
    if rep.ok:
        _md(rep.md)


async def _body(reader: Any) -> bytes:
    """_read_authenticated's body; the MAC it returns with it must be the
    body's (what the listener's reply MAC covers)."""
    body, mac = await _m.bindings._read_authenticated(reader, TOKEN, NONCE)
    if mac != _m.wire.listen_body_mac(TOKEN, NONCE, body):
        raise AssertionError(f"_read_authenticated returned {mac!r}, not the body's MAC")
    return body


async def _read(stream: bytes) -> bytes:
    reader = asyncio.StreamReader()
    reader.feed_data(stream)
    reader.feed_eof()
    try:
        return await _body(reader)
    except ValueError as exc:
        if "without this agent's token" in str(exc):
            # (Refused on the length's MAC: nothing past it was read.)
            left = len(reader._buffer)  # type: ignore[attr-defined]
            if left != max(len(stream) - 4 - _m.wire.LISTEN_MAC, 0):
                raise AssertionError(f"read {len(stream) - left} bytes of a client "
                                     "without the token") from None
        raise


class _Transport:
    """What _ListenConn uses of its transport, and whether it reads."""

    def __init__(self) -> None:
        self.reading = True  # (as a real one, until connection_made pauses it)
        self.closed = False

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = not self.closed

    def abort(self) -> None:
        self.closed, self.reading = True, False

    close = abort

    def is_closing(self) -> bool:
        return self.closed


async def _read_conn(stream: bytes, piece: int) -> tuple[bytes | BaseException, int]:
    """The listener's framing over a _ListenConn given stream in pieces:
    (the body or the exception, bytes it took from the stream)."""
    conn = _m.bindings._ListenConn(None)
    return await _feed(conn, _body(conn), stream, piece)


async def _feed(conn: Any, coro: Any, stream: bytes, piece: int,
                buffer_bound: Any = None) -> tuple[bytes | BaseException, int]:
    """Runs coro, which reads from conn (a _ListenConn), feeding it stream
    as a transport would, in pieces of at most ``piece`` bytes, then the
    stream's end: (what coro returned or raised, bytes it took).
    ``buffer_bound(taken)``: the biggest buffer a read may have then."""
    t = _Transport()
    conn.transport = t
    t.pause_reading()
    task = asyncio.ensure_future(coro)
    pos = 0
    ended = False
    while not task.done():
        await asyncio.sleep(0)
        if task.done() or not t.reading:
            continue
        if pos < len(stream):
            buf = conn.get_buffer(-1)
            if not len(buf):
                raise AssertionError("an empty buffer while reading (the transport's fatal error)")
            if buffer_bound is not None and len(conn._buf) > buffer_bound(pos):
                raise AssertionError(f"a buffer of {len(conn._buf)} bytes after {pos} came")
            k = min(piece, len(buf), len(stream) - pos)
            buf[:k] = stream[pos:pos + k]
            del buf
            pos += k
            conn.buffer_updated(k)
        elif not ended:
            ended = True
            conn.eof_received()
            conn.connection_lost(None)
    # (The task's exception as it is, not raised here: raised, its
    # traceback would take this frame, which holds the task, which holds
    # the exception: a cycle pinning the read's buffers until a full
    # collection: the harness's RSS grew 75 -> 1,033 MB in 95 k runs.)
    exc = task.exception()
    if exc is None:
        return task.result(), pos
    if isinstance(exc, ValueError | ConnectionError | asyncio.IncompleteReadError
                  | _m.wire.ListenerVersionError):
        return exc, pos
    raise exc


def _framing_conn(stream: bytes, piece: int, n: int) -> None:
    assert _loop is not None
    w = _m.wire
    want: bytes | BaseException
    try:
        want = _loop.run_until_complete(_read(stream))
    except (ValueError, asyncio.IncompleteReadError, _m.wire.ListenerVersionError) as exc:
        # (Kept without its traceback: that holds this frame, which holds
        # want: a cycle, as above.)
        want = exc.with_traceback(None)
    try:
        got, took = _loop.run_until_complete(asyncio.wait_for(_read_conn(stream, piece), 5))
    except TimeoutError:
        raise AssertionError("_ListenConn's read still waiting 5 s after the stream ended"
                             ) from None
    if type(got) is not type(want) or (isinstance(got, bytes) and got != want) or \
            str(got) != str(want):
        raise AssertionError(f"_ListenConn read {got!r}, the stream reader {want!r}")
    # Bytes asked for: the length and its MAC, then (proved) the body and its.
    proved = len(stream) >= 4 + w.LISTEN_MAC and not (
        isinstance(got, ValueError) and "without this agent's token" in str(got))
    asked = 4 + w.LISTEN_MAC + (n + w.LISTEN_MAC if proved and n <= w.MAX_FRAME else 0)
    if took != min(asked, len(stream)):
        raise AssertionError(f"_ListenConn took {took} bytes of {len(stream)}, "
                             f"{asked} asked for")


def _framing(opts: int, data: bytes) -> None:
    assert _loop is not None
    w = _m.wire
    head, rest = data[:4], data[4:]
    stream = head
    n = int.from_bytes(head, "big") if len(head) == 4 else -1
    genuine = False
    if opts & 8 and len(head) == 4:
        stream += w.listen_len_mac(TOKEN, NONCE, head)
        if opts & 16 and n <= len(rest):
            stream += rest[:n] + w.listen_body_mac(TOKEN, NONCE, rest[:n]) + rest[n:]
            genuine = True
        else:
            stream += rest
    else:
        stream += rest
    if opts & 32:
        _framing_conn(stream, 1 + (opts >> 6) * 13, n)
    try:
        body = _loop.run_until_complete(asyncio.wait_for(_read(stream), 5))
    except (ValueError, asyncio.IncompleteReadError, w.ListenerVersionError) as exc:
        if genuine and n <= w.MAX_FRAME:
            raise AssertionError("a genuine request refused") from None
        if isinstance(exc, w.ListenerVersionError) and w.notice_version(stream) is None:
            raise AssertionError(f"{exc!r} for a stream that is no version notice") from None
        return
    except TimeoutError:
        raise AssertionError("the listener's framing waits 5 s after the client hung up"
                             ) from None
    if not genuine or body != rest[:n]:
        raise AssertionError(f"a request without the token's proofs read: {body!r}")


def _reply_framing(opts: int, stream: bytes) -> None:
    """Mode 6: a listener's reply as _request reads it."""
    assert _loop is not None
    b, w = _m.bindings, _m.wire
    bound = w.MAX_FRAME if opts & 8 else w.MAX_ACK
    n = int.from_bytes(stream[:4], "big") if len(stream) >= 4 else -1
    if opts & 16:
        _proved_reply(opts, stream, bound, n)
        return
    conn = b._ReplyConn()
    part = b._REPLY_PART
    try:
        got, took = _loop.run_until_complete(asyncio.wait_for(_feed(
            conn, b._read_reply(conn, bound, "listener"), stream, 1 + (opts >> 6) * 13,
            lambda pos: max(part, pos - 4)), 5))
    except TimeoutError:
        raise AssertionError("_read_reply still waiting 5 s after the stream ended") from None
    except (ValueError, ConnectionError, asyncio.IncompleteReadError) as exc:
        raise AssertionError(f"{exc!r} raised out of the feeding") from None
    if n < 0:
        want: Any = asyncio.IncompleteReadError
        want_took = len(stream)
    elif n > bound:
        want, want_took = ValueError, 4
    elif len(stream) - 4 < n:
        want, want_took = ConnectionError, len(stream)
    else:
        want, want_took = bytes, 4 + n
    if type(got) is not want and not (want is bytes and isinstance(got, bytes | bytearray)):
        raise AssertionError(f"_read_reply gave {got!r} for a length of {n} "
                             f"(bound {bound}), {len(stream)} bytes sent")
    if want is bytes and got != stream[4:4 + n]:
        raise AssertionError("_read_reply's body is not the one sent")
    if took != want_took:
        raise AssertionError(f"_read_reply took {took} bytes of {len(stream)}, "
                             f"{want_took} were its")


REQ_MAC = b"R" * 32  # (mode 6, bit 4: the request's body MAC a reply answers)


def _proved_reply(opts: int, stream: bytes, bound: int, n: int) -> None:
    """Mode 6 with bit 4: the reply read and its MAC checked, as _request
    does (_read_proved_reply); bit 5: the harness puts the genuine MAC
    after the announced body (else the input's bytes are the MAC). A body
    only with the genuine MAC; ValueError for a whole reply with another
    (everything of it read, nothing past it), as for a length over the
    bound (nothing past the length); ConnectionError when the stream ends
    within the body or the MAC, IncompleteReadError within the length."""
    assert _loop is not None
    b, w = _m.bindings, _m.wire
    genuine = None
    if 0 <= n <= bound and len(stream) - 4 >= n:
        genuine = w.reply_mac(TOKEN, NONCE, REQ_MAC, stream[:4], stream[4:4 + n])
        if opts & 32:
            stream = stream[:4 + n] + genuine + stream[4 + n:]
    conn = b._ReplyConn()
    part = b._REPLY_PART
    try:
        got, took = _loop.run_until_complete(asyncio.wait_for(_feed(
            conn, b._read_proved_reply(conn, bound, "listener", TOKEN, NONCE, REQ_MAC), stream,
            1 + (opts >> 6) * 13, lambda pos: max(part, pos - 4)), 5))
    except TimeoutError:
        raise AssertionError("_read_proved_reply still waiting 5 s after the stream ended"
                             ) from None
    if n < 0:
        want: Any = asyncio.IncompleteReadError
        want_took = len(stream)
    elif n > bound:
        want, want_took = ValueError, 4
    elif len(stream) - 4 < n:
        want, want_took = ConnectionError, len(stream)
    elif len(stream) - 4 - n < w.LISTEN_MAC:
        want, want_took = ConnectionError, len(stream)
    elif stream[4 + n:4 + n + w.LISTEN_MAC] == genuine:
        want, want_took = bytes, 4 + n + w.LISTEN_MAC
    else:
        want, want_took = ValueError, 4 + n + w.LISTEN_MAC
    if type(got) is not want and not (want is bytes and isinstance(got, memoryview)):
        raise AssertionError(f"_read_proved_reply gave {got!r} for a length of {n} "
                             f"(bound {bound}), {len(stream)} bytes sent")
    if want is bytes and bytes(got) != stream[4:4 + n]:
        raise AssertionError("_read_proved_reply's body is not the one sent")
    if want is ValueError and n <= bound and "without this agent's token" not in str(got):
        raise AssertionError(f"a reply with another MAC refused as {got!r}")
    if took != want_took:
        raise AssertionError(f"_read_proved_reply took {took} bytes of {len(stream)}, "
                             f"{want_took} were its")


# ---------------------------------------------------------------- notifications


def _frames(data: bytes) -> list[tuple[str, bytes]]:
    """Records: a header byte (sender: bit 0; kind: bits 1-3; message id:
    bits 4-7, more ids than _MAX_PARTIAL), a length byte, that many payload
    bytes. Kinds: 0 the payload as the frame, 1 whole (W), 2 fragment (F),
    3 last fragment (L), 4 the magic then the payload (any kind byte, any
    length), 5-7 F, L, F."""
    w = _m.wire
    out = []
    i = 0
    while i + 2 <= len(data):
        h, n = data[i], data[i + 1]
        pay = data[i + 2:i + 2 + n]
        i += 2 + n
        sender, kind, mid = f"s{h & 1}", (h >> 1) & 7, bytes([h >> 4]) * w._ID
        if kind == 0:
            frame = pay
        elif kind == 1:
            frame = w.NOTIF_MAGIC + b"W" + pay
        elif kind == 4:
            frame = w.NOTIF_MAGIC + pay
        else:
            frame = w.NOTIF_MAGIC + (b"L" if kind in (3, 6) else b"F") + mid + pay
        out.append((sender, frame))
    return out


def _notifs(opts: int, data: bytes) -> None:
    w = _m.wire
    if opts & 8:
        msg = data * (1 + (opts >> 4))
        asm = w.NotifAssembler()
        frames = w.notif_frames(msg)
        if any(not 0 < len(f) <= w.NOTIF_MAX for f in frames):
            raise AssertionError(f"a frame of a size aioxfer does not carry: {len(msg)} bytes")
        got = [m for f in frames if (m := asm.feed("s", f)) is not None]
        if got != [msg] or asm.held():
            raise AssertionError(f"{len(msg)} bytes framed, {list(map(len, got))} given back")
        return
    saved = w._MAX_PARTIAL_BYTES, w._MAX_DROPPED, w._MAX_HELD_BYTES
    # Small bounds (the real ones take 64 MiB of fragments): every drop path runs.
    w._MAX_PARTIAL_BYTES, w._MAX_DROPPED, w._MAX_HELD_BYTES = 600, 3, 1000
    try:
        _assemble(_frames(data))
    finally:
        w._MAX_PARTIAL_BYTES, w._MAX_DROPPED, w._MAX_HELD_BYTES = saved


def _assemble(frames: list[tuple[str, bytes]]) -> None:
    w = _m.wire
    drops: list[tuple[str, int]] = []
    asm = w.NotifAssembler(lambda s, n: drops.append((s, n)))
    magic, idn = w.NOTIF_MAGIC, w._ID
    sent: dict[tuple[str, bytes], list[bytes]] = {}  # fragments since the id's last L
    # Ids dropped (some of their fragments lost): the sender's drop count
    # when it went. Its rest must be ignored while fewer than _MAX_DROPPED
    # of that sender's messages were dropped after it (it is remembered).
    tainted: dict[tuple[str, bytes], int] = {}
    ndropped: dict[str, int] = {}

    def partials() -> set[tuple[str, bytes]]:
        return {(s, mid) for s, st in asm._senders.items() for mid in st.partial}

    for sender, frame in frames:
        st = asm._senders.get(sender)
        before = partials()
        kind = frame[len(magic):len(magic) + 1]
        mid = frame[len(magic) + 1:len(magic) + 1 + idn]
        remembered = st is not None and mid in st.dropped
        ndrops = len(drops)
        out = asm.feed(sender, frame)
        key = (sender, mid)
        if not frame.startswith(magic):
            want: Any = frame
        elif kind == b"W":
            want = frame[len(magic) + 1:]
        elif kind not in (b"F", b"L") or len(frame) < len(magic) + 1 + idn:
            want = frame
        else:
            body = frame[len(magic) + 1 + idn:]
            if kind == b"F":
                sent.setdefault(key, []).append(body)
                want = None
            else:
                full = b"".join(sent.pop(key, [])) + body
                if key in tainted:
                    must = ndropped[sender] - tainted.pop(key) < w._MAX_DROPPED
                    if must or remembered:
                        want = None  # the rest of a dropped message: ignored
                    elif out is not None and not full.endswith(out):
                        raise AssertionError(f"{sender}: a message not of its fragments: "
                                             f"{out!r}, sent {full!r}")
                    else:
                        want = out  # forgotten id: its tail, as documented
                else:
                    want = full
        if out != want:
            raise AssertionError(f"{sender} frame {frame!r}: got {out!r}, want {want!r}")
        # Messages dropped at a bound: gone from the partial ones without
        # their last fragment (an F may drop its own message, new or not).
        after = partials()
        framed = frame.startswith(magic) and kind in (b"F", b"L") and len(mid) == idn
        if framed and kind == b"F":
            lost = (before - after) | ({key} if key not in after and not remembered else set())
        else:
            lost = before - after - {key}
        if len(drops) - ndrops != len(lost):
            raise AssertionError(f"{len(drops) - ndrops} drops told, {len(lost)} messages "
                                 f"dropped")
        # (The all-senders bound may drop another sender's message.)
        for s in {k[0] for k in lost}:
            mine = [k for k in lost if k[0] == s]
            first = ndropped.get(s, 0) + 1  # (the order within one feed unknown)
            ndropped[s] = first - 1 + len(mine)
            tainted.update((k, first) for k in mine)
        total = 0
        for s, stt in asm._senders.items():
            held = sum(len(p) for parts in stt.partial.values() for p in parts)
            if held != stt.held or held > w._MAX_PARTIAL_BYTES:
                raise AssertionError(f"{s}: holds {held}, counted {stt.held}")
            if len(stt.partial) > w._MAX_PARTIAL or len(stt.dropped) > w._MAX_DROPPED:
                raise AssertionError(f"{s}: {len(stt.partial)} partial, {len(stt.dropped)} "
                                     f"dropped ids")
            if stt.partial.keys() & stt.dropped.keys():
                raise AssertionError(f"{s}: an id both partial and dropped")
            total += held
        if asm.held() != total or total > w._MAX_HELD_BYTES:
            raise AssertionError(f"held() {asm.held()}, fragments {total}")


# ---------------------------------------------------------------- wire versions


async def _read_left(stream: bytes) -> tuple[bytes | BaseException, int]:
    """_read_authenticated over a stream reader: (the body or the
    exception, bytes it took)."""
    reader = asyncio.StreamReader()
    reader.feed_data(stream)
    reader.feed_eof()
    try:
        got: bytes | BaseException = await _body(reader)
    except (ValueError, asyncio.IncompleteReadError, _m.wire.ListenerVersionError) as exc:
        got = exc.with_traceback(None)
    return got, len(stream) - len(reader._buffer)  # type: ignore[attr-defined]


def _versions(opts: int, rest: bytes) -> None:
    assert _loop is not None
    w = _m.wire
    if not opts & 8:
        g = rest[:w.LISTEN_NONCE]
        v = w.greeting_version(g)
        if len(g) != w.LISTEN_NONCE or not g.startswith(w.GREETING_MAGIC):
            if v != 1:
                raise AssertionError(f"greeting {g!r} read as version {v}, not 1")
        elif v != int.from_bytes(g[4:6], "big"):
            raise AssertionError(f"greeting {g!r} read as version {v}")
        stream = w.NOTICE_MAGIC + rest
        got, took = _loop.run_until_complete(asyncio.wait_for(_read_left(stream), 5))
        if len(stream) < w.LISTEN_HEAD:
            ok = isinstance(got, asyncio.IncompleteReadError) and took == len(stream)
        else:
            ok = (type(got) is w.ListenerVersionError and took == w.LISTEN_HEAD
                  and f"version {w.notice_version(stream)} " in str(got))
        if not ok:
            raise AssertionError(f"a version notice read as {got!r}, {took} bytes taken")
        return
    head, body = rest[:4], rest[4:]
    stream = head
    n = int.from_bytes(head, "big") if len(head) == 4 else -1
    if len(head) == 4:
        stream += w.v1_len_mac(TOKEN, NONCE, head)
        if opts & 16 and 0 <= n <= len(body):
            key = _m.auth.hmac_key(TOKEN)
            stream += body[:n] + _m.hmac.new(key, w._V1_BODY_CTX + NONCE + body[:n],
                                             "sha256").digest() + body[n:]
        else:
            stream += body
    else:
        stream += body
    got, took = _loop.run_until_complete(asyncio.wait_for(_read_left(stream), 5))
    whole = w.LISTEN_HEAD + n + w.LISTEN_MAC
    if n < 0 or len(stream) < w.LISTEN_HEAD:
        ok = isinstance(got, asyncio.IncompleteReadError)
    elif n > w.MAX_FRAME:
        ok = isinstance(got, ValueError) and "over the limit" in str(got) \
            and took == w.LISTEN_HEAD
    elif len(stream) < whole:
        ok = isinstance(got, asyncio.IncompleteReadError) and took == len(stream)
    else:
        ok = type(got) is _m.bindings._OlderClient and took == whole
    if not ok:
        raise AssertionError(f"a version-1 request ({n} bytes announced, {len(stream)} sent) "
                             f"read as {got!r}, {took} bytes taken")
    if opts & 32:
        conn_got, conn_took = _loop.run_until_complete(asyncio.wait_for(
            _read_conn(stream, 1 + (opts >> 6) * 13), 5))
        if type(conn_got) is not type(got) or str(conn_got) != str(got) or conn_took != took:
            raise AssertionError(f"_ListenConn read {conn_got!r} ({conn_took} bytes), the "
                                 f"stream reader {got!r} ({took})")


# ---------------------------------------------------------------- entry points


def _run(data: bytes) -> None:
    w = _m.wire
    opts, rest = data[0], data[1:]
    mode = opts & 7
    if mode == 1:
        _dlist((w.DL_MAGIC if opts & 8 else b"") + rest)
    elif mode == 2:
        _request(rest)
    elif mode == 3:
        _reply(rest)
    elif mode == 4:
        _framing(opts, rest)
    elif mode == 5:
        _notifs(opts, rest)
    elif mode == 6:
        _reply_framing(opts, rest)
    elif mode == 7:
        _versions(opts, rest)
    else:
        _md((w.MD_MAGIC if opts & 8 else b"") + rest)


def check(data: bytes) -> str | None:
    """Runs one input (fuzz/_harness.py guarded: None, a known issue's name,
    or raises on a new finding)."""
    return _harness.guarded(load, _run, data)


def seeds() -> dict[str, bytes]:
    """Well-formed inputs of every mode: the metadata of an agent (whole,
    partial, descriptors only), descriptor lists, each listener request and
    reply, a genuine framed request, notifications whole and in fragments."""
    import numpy as np

    from aioxfer.nixl import _bindings as b
    from aioxfer.nixl import _wire as w

    regions = [w.RegionMD("r0", 0, 0x7F0000000000, 4096, 0),
               w.RegionMD("r1", 1, 0x10000, 1 << 20, 3)]
    md = w.AgentMD("worker-0", "127.0.0.1:5000", 0xABCDEF, regions)
    partial = w.AgentMD("worker-0", "", 0, regions[:1], True)
    blob = w.encode_md(md)
    arr = np.array([[0x1000, 64, 0], [0x2000, 128, 1]], dtype=np.uint64)
    xfer = w.encode_dlist(w.DListBlob("xfer", 0, arr.tobytes()))
    reg = w.encode_dlist(w.DListBlob("reg", 1, arr.tobytes(), [b"", b"m"]))
    enc = w.encoder.encode
    push = enc(w.Push(md=blob))
    reply_md = enc(w.Reply(ok=True, md=blob))
    ack = enc(w.Reply(ok=True))
    out = {
        "md": b"\x08" + blob[len(w.MD_MAGIC):],
        "md-raw": b"\0" + blob,
        "md-partial": b"\x08" + w.encode_md(partial)[len(w.MD_MAGIC):],
        "md-ipv6": b"\x08" + w.encode_md(w.AgentMD("a", "[::1]:7", 1))[len(w.MD_MAGIC):],
        "dlist-xfer": b"\x09" + xfer[len(w.DL_MAGIC):],
        "dlist-reg": b"\x09" + reg[len(w.DL_MAGIC):],
        "dlist-raw": b"\x01" + xfer,
        "push": b"\2" + push,
        "fetch": b"\2" + enc(w.Fetch(name="worker-0", label="l")),
        "invalidate": b"\2" + enc(w.Invalidate(name="worker-0")),
        "reply-md": b"\3" + enc(w.Reply(ok=True, md=blob)),
        "reply-error": b"\3" + enc(w.Reply(ok=False, error="no")),
        "framed-genuine": bytes([4 | 8 | 16]) + len(push).to_bytes(4, "big") + push,
        "framed-forged-body": bytes([4 | 8]) + len(push).to_bytes(4, "big") + push + b"m" * 32,
        "framed-forged": bytes([4]) + (1 << 20).to_bytes(4, "big") + b"m" * 32,
        # the same three through the listener's connection, in 1- and 40-byte pieces
        "conn-genuine": bytes([4 | 8 | 16 | 32]) + len(push).to_bytes(4, "big") + push
        + b"more",
        "conn-forged-body": bytes([4 | 8 | 32 | 3 << 6]) + len(push).to_bytes(4, "big") + push
        + b"m" * 32,
        "conn-forged": bytes([4 | 32 | 3 << 6]) + (1 << 20).to_bytes(4, "big") + b"m" * 80,
        # replies as a client reads them: whole (with bytes after), cut
        # short, over an acknowledgement's bound, in 1- and 40-byte pieces
        "reply-framed": bytes([6 | 8]) + len(reply_md).to_bytes(4, "big") + reply_md + b"more",
        "reply-framed-ack": bytes([6 | 3 << 6]) + len(ack).to_bytes(4, "big") + ack,
        "reply-framed-cut": bytes([6 | 8 | 3 << 6]) + (1 << 20).to_bytes(4, "big") + b"c" * 90,
        "reply-framed-over": bytes([6]) + (1 << 20).to_bytes(4, "big") + b"o" * 90,
        # replies with their MAC (wire version 3): genuine (bytes after
        # it), forged, cut within the MAC, in 1- and 40-byte pieces
        "reply-proved": bytes([6 | 8 | 16 | 32]) + len(reply_md).to_bytes(4, "big") + reply_md
        + b"more",
        "reply-proved-ack": bytes([6 | 16 | 32 | 3 << 6]) + len(ack).to_bytes(4, "big") + ack,
        "reply-proved-forged": bytes([6 | 8 | 16]) + len(reply_md).to_bytes(4, "big") + reply_md
        + b"f" * 32,
        "reply-proved-cut": bytes([6 | 16 | 3 << 6]) + len(ack).to_bytes(4, "big") + ack
        + b"c" * 20,
    }
    del b
    msg = bytes(range(200))

    def rec(sender: int, kind: int, mid: int, pay: bytes) -> bytes:
        return bytes([sender | kind << 1 | mid << 4, len(pay)]) + pay

    out["notif-plain"] = b"\5" + rec(0, 0, 0, b"hello") + rec(1, 1, 0, b"")
    out["notif-fragments"] = (b"\5" + rec(0, 2, 1, msg) + rec(0, 2, 1, msg)
                              + rec(1, 2, 2, msg) + rec(0, 3, 1, msg) + rec(1, 3, 2, b"x"))
    out["notif-bounds"] = b"\5" + b"".join(rec(0, 2, i, msg) for i in range(8)) + b"".join(
        rec(0, 3, i, b"end") for i in range(8))
    out["notif-many-ids"] = b"\5" + b"".join(rec(1, 2, i, b"ab") for i in range(16)) + b"".join(
        rec(1, 3, i, b"end") for i in range(16))
    out["notif-framed-small"] = bytes([5 | 8]) + b"a message"
    out["notif-framed-large"] = bytes([5 | 8 | 15 << 4]) + bytes(range(256)) * 2
    out["notif-framed-magic"] = bytes([5 | 8]) + w.NOTIF_MAGIC + b"L" + b"x" * 20
    # the listener wire's versions (mode 7): greetings of version 1 (no
    # magic), 2 and a later one, with the notice after them; version-1
    # requests whole (answered with a refusal), cut short, over the limit,
    # and through the listener's connection in 1- and 40-byte pieces
    fetch = enc(w.Fetch(name="worker-0"))
    out["version-greeting-v1"] = b"\7" + b"r" * w.LISTEN_NONCE
    out["version-greeting-v2"] = b"\7" + w.greeting()[:6] + b"g" * 10 + w.version_notice()[4:]
    out["version-notice-v3"] = (b"\7" + w.GREETING_MAGIC + (3).to_bytes(2, "big") + b"n" * 10
                                + b"\0" * 20)
    out["version-notice-short"] = b"\7" + b"\0\3"
    out["v1-request"] = bytes([7 | 8 | 16]) + len(fetch).to_bytes(4, "big") + fetch + b"more"
    out["v1-request-cut"] = bytes([7 | 8 | 16]) + (1 << 10).to_bytes(4, "big") + fetch
    out["v1-request-over"] = bytes([7 | 8]) + (w.MAX_FRAME + 1).to_bytes(4, "big") + b"o" * 40
    out["v1-request-conn"] = bytes([7 | 8 | 16 | 32]) + len(fetch).to_bytes(4, "big") + fetch
    out["v1-request-conn-40"] = (bytes([7 | 8 | 16 | 32 | 3 << 6]) + len(push).to_bytes(4, "big")
                                 + push)
    out["md-no-name"] = b"\x08" + w.encode_md(w.AgentMD(""))[len(w.MD_MAGIC):]
    return out


def main() -> None:
    _harness.main(check, load, lambda: (_m.wire, _m.bindings, _m.api, _m.metadata))


if __name__ == "__main__":
    main()
