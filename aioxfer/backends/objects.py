"""Object storage (S3 API) as a local backend: region kind "object".

    objs = agent.register_objects("s3://bucket/prefix", endpoint="http://127.0.0.1:9000",
                                  access_key_id=..., secret_access_key=..., region=...)
    await agent.write(host[0:n], objs["a/key"])          # PUT (multipart above part_size)
    await agent.read(host[0:4096], objs["a/key"][8192:12288])   # ranged GET into host memory
    await agent.read(host_list, objs.segments(keys))     # many keys: one request
    await objs.stat(keys); await objs.delete(keys)

Credentials not given come from the standard AWS environment variables
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``AWS_REGION``/``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL``), as obstore reads them.

Reads fetch a presigned GET URL (obstore signs it) with aiohttp and copy
each received chunk straight into the registered destination: one copy per byte, no
intermediate object. That path exists because some S3 servers (rclone's)
answer a ranged GET with ``200`` and an exact ``Content-Range`` instead of
``206``, which obstore rejects; here a ``200`` is taken when its
``Content-Range`` and length are exactly what was asked, a ``206`` as usual.
A presigned URL is a bearer credential (for 15 minutes): a GET follows no
redirect (a 3xx fails the read), and error texts leave signed queries out.
A 403 to a URL reused from the cache of signed URLs signs it again, once.
``stat`` (HEAD) and ``delete`` (a DELETE per key) go the same way, presigned
and sent with aiohttp, following no redirect: obstore (reqwest) follows one,
to another host too, sending the session token (``x-amz-security-token``;
only Authorization is dropped) and taking that host's answer. Writes are
ours too: a single PUT (objects of up to ``part_size`` bytes, and
conditional creates of any size) of more than ``min_rate * read_timeout``
bytes (960 KiB by default) or with ``part_md5``, and a multipart upload
(objects above ``part_size``: its create, part, complete and abort
requests) are signed here (AWS Signature V4, aioxfer.backends.sigv4: obstore 0.12 neither
presigns a URL with a query such as ``?uploads`` nor has an option against
redirects) and sent with aiohttp, following no redirect
(tests/test_obj18b_redirects.py), each retried within the retry budget;
a body goes from the caller's memory (or the owned copy), a multipart
upload's parts up to 4 at once.
That needs credentials we can sign with: static ones (given, or from the
environment), or a ``credential_provider`` (below). With credentials
obstore finds itself (instance metadata, web identity: it keeps their
secret to itself) obstore's PUT and multipart upload are used (the
latter follows a redirect of its requests; ``part_md5`` and ``min_rate``
do not apply to them, and a single PUT must then reach the store within
``read_timeout``, its body's sending included); such a source can be
brought onto our own requests by wrapping it in a ``credential_provider``.
A multipart write ends with a HEAD of the key (presigned, no redirect; ``check_multipart``,
below): the object must be there with the written size (and the e-tag the
complete answered, where the store's e-tags compare), else the write
fails (ObjectRegion._check_completed): a complete answered by a host that
is not the store (obstore's upload), or answered 500 once it was done and
then no longer known when sent again, is then judged by the store itself.
Its cost: one HEAD per object of more than ``part_size`` bytes (a metadata
lookup on AWS S3; rclone serve s3 hashes the object's file to answer the
first HEAD after a write: 24 MiB took 47 ms).

Failures are typed: a missing key (or bucket) is ObjectNotFound, bad
credentials AccessDenied, a conditional create of an existing key
ObjectExists, an endpoint that is down or drops the connection TransportError
once the bounded retries (``max_retries``, within ``retry_timeout`` seconds,
exponential backoff with jitter) are spent. A PUT is sent again only once
the attempt before it is known to be over (refused, or answered, or reset
by a server that had closed the connection before any byte of it came:
its idle close racing the request's first write, sent again at once, once,
tests/test_obj31_idle_race.py); a PUT
whose outcome is unknown (its connection cut, a timeout) is checked with a
HEAD and otherwise fails, never sent twice at once (ObjectRegion._put_single),
unless ``resend_unknown_puts`` (below) says otherwise. A conditional
create whose outcome is unknown is never sent blindly: the HEAD finding
the key with our bytes means it landed; with other bytes, ObjectExists
(a store that ignores If-None-Match, as rclone does, would otherwise have
the resend replace another writer's object).

A single PUT of ours is bounded as our other requests: ``connect_timeout``,
``read_timeout`` for its answer once the store has taken its body (all
but ``min_rate * read_timeout / 2`` of its bytes acknowledged by the
store's kernel, not merely the last byte queued: up to a send buffer of
4 MiB may wait in ours, and over https up to a MiB more in the TLS
transport's buffers; while they drain, ``read_timeout`` without
progress), ``read_timeout`` for each read, and the whole attempt
``connect_timeout + read_timeout + bytes / min_rate``: a body the store
reads slowly but at ``min_rate`` or better is sent (a multipart upload's
parts alike). A smaller one (up to ``min_rate * read_timeout`` bytes, without
``part_md5``) is obstore's request, sorted by the same rules: obstore's
client counts ``read_timeout`` from the request's start, its body's
sending included, which for that size asks no more of the link than
``min_rate`` does, and it costs less CPU per request than ours (256 PUTs
of 64 KiB at once: ours went at 0.72-0.87x of obstore's). Before, every
single PUT was obstore's: an 8 MiB one to a server reading at 128 KiB/s
failed after 15 s.

Options of ``register_objects`` (beside the endpoint and credentials):

- ``part_size`` (8 MiB, at least 5 MiB): larger objects are multipart
  uploads of parts of this size, smaller ones one PUT;
- ``max_retries`` (4), ``retry_timeout`` (10 s): each request's retry budget
  (every request: GETs, HEADs, DELETEs, PUTs, each request of a multipart
  upload);
- ``connect_timeout`` (2 s), ``read_timeout`` (15 s): per connection and
  per read of an answer. Each attempt of a request of ours (GET, HEAD,
  DELETE, a single PUT, the multipart upload's) is also bounded as a whole:
  ``connect_timeout + read_timeout + bytes / min_rate`` seconds, from
  when it has one of the region's connections (its wait for one, behind
  our own requests, not counted: the bytes it sends or receives; a
  complete counts the whole object, as the store's work on it grows with
  it), so that a server trickling a byte now and then (each read in time)
  cannot hold a request for ever: it then fails as a timeout, retried
  within the budget, then TransportError. They also bound how long a cancel or
  ``agent.aclose()`` waits for a write in flight to a server that stopped
  answering: the upload reads from the caller's memory (or must be
  completed or aborted) until its request times out; a multipart one then
  sends its abort, which waits as long again (measured against a stopped
  rclone: 30 s for a 24 MiB write with the defaults);
- ``min_rate`` (64 KiB/s): the slowest a request's bytes may move (above);
  lower it for links where one connection's share is slower than that;
- ``check_multipart`` (True): whether a multipart write ends with a HEAD
  of the key (above). False skips it where the upload was ours (static
  credentials) and the endpoint itself answered its complete, as against
  a store trusted to mean its answers: one request less per object above
  ``part_size`` (rclone serve s3 hashes the file to answer it: 47 ms of a
  24 MiB write). Still made when it is needed to know: a complete sent
  again that finds no such upload (the first may have completed it), or
  obstore's upload (other credentials; it follows redirects);
- ``part_md5`` (False): each part of a multipart upload carries
  Content-MD5, which the store checks (AWS, MinIO, Ceph, rclone: 400
  BadDigest, the part is then sent again within the retry budget): bytes
  changed on the way (plain http through a faulty proxy) are refused
  instead of stored. Off by default, as obstore's uploads: parts go
  UNSIGNED-PAYLOAD, and the MD5 costs CPU (hashlib's MD5 ran at 0.26 GB/s
  per core here, hashed on a worker thread beside the sends; measured cost
  in benchmarks/object_bench.py --part-md5). Over https, TLS already
  protects the bytes on the way. A single PUT (objects of up to
  ``part_size`` bytes, and conditional creates) is then ours, whatever
  its size, and carries Content-MD5 too (BadDigest: sent again, the store
  refused it); only obstore's PUT and upload (credentials we cannot sign
  with, above) go without;
- ``credential_provider`` (None): obstore's S3CredentialProvider (a
  callable answering, or returning an awaitable of, a dict with
  access_key_id, secret_access_key, token, expires_at), instead of the
  keys: obstore signs with what it answers, and so does our own multipart
  upload (no redirect followed, the token sent only to the endpoint). One
  cache serves both (obstore is handed it as its provider: _Provided), so
  the provider is asked once per refresh: until ``refresh_threshold`` (the
  provider's attribute, a timedelta, as obstore reads it; else 5 minutes)
  before ``expires_at``, or for half of the time left of credentials that
  already expire within that threshold; ``expires_at`` None: until
  refused. A request refused with them (401/403: expired, rotated or
  revoked credentials) drops them and is sent once more with what the
  provider answers then (once: credentials that are refused again fail
  with AccessDenied). ``expires_at`` must be an aware datetime
  (``datetime.now(UTC) + ...``): a naive one is refused (AccessDenied), as
  obstore refuses it;
- ``resend_unknown_puts`` (False): a single PUT whose outcome is unknown (a
  reset or cut connection after the request went out, a read timeout, a
  gateway's 502 or 504) and whose object a HEAD then does not find with its
  bytes is sent again within the retry budget, as obstore's own retries
  would, instead of failing with TransportError. Off by default: the first
  attempt may still be running at the server when the second arrives (a
  timeout or a cut on the client's side says nothing of the server's side),
  and two PUTs of one key at once are what some S3 servers get wrong
  (rclone serve s3 1.75 then answers 500 to every GET of the key, or loses
  it after both PUTs returned 200: tests/repro_rclone_samekey.py). Turn it
  on against a store that applies overlapping PUTs of one key one after the
  other (AWS S3: the last one wins), where a transient network blip should
  cost a resend, not a failed write. A conditional create (``objs.create(key)``)
  sent again that finds the key taken counts as written when the key holds
  its bytes (the earlier attempt landed meanwhile);
- ``ca_bundle`` (None): a PEM file of CA certificates trusted for an https
  endpoint, beside the system's roots, by every request (obstore's
  ``root_certificate`` and our aiohttp session's context alike): a store
  whose certificate a private CA signed (tests/test_obj31_tls.py). Before,
  only SSL_CERT_FILE set before aiohttp's import reached our requests.
  ``AWS_CA_BUNDLE`` is not read (boto reads it; CI images set it to the
  system bundle, and a region would then not see a test's trust in
  aiohttp's default context): pass ``ca_bundle=os.environ["AWS_CA_BUNDLE"]``;
- ``ssl_context`` (None): an ``ssl.SSLContext`` used as is by our requests
  (a private CA, client certificates, pinning; a context that verifies
  nothing is the explicit opt-out, for tests). obstore's client cannot take
  one, so every request is then ours (single PUTs of any size too), and the
  credentials must be ones we sign with (keys or a ``credential_provider``;
  else RegistrationError). Not with ``ca_bundle``.
  A certificate that is not trusted fails the request at once
  (TransportError naming it), not retried: no later attempt would trust it.
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import email.utils
import errno
import fcntl
import hashlib
import html
import inspect
import os
import random
import re
import socket
import ssl
import sys
import termios
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload
from urllib.parse import parse_qsl, urlsplit
from xml.sax.saxutils import escape as xml_escape

import aiohttp
import obstore
import yarl
from obstore import exceptions as obx
from obstore.store import S3Store

from aioxfer._uncancelled import run_to_end
from aioxfer.backends import sigv4
from aioxfer.backends.base import BackendRegion, LocalBackend, Op
from aioxfer.errors import (
    AccessDenied,
    ObjectExists,
    ObjectNotFound,
    ProtocolError,
    RegistrationError,
    TransportError,
    XferError,
)

if TYPE_CHECKING:
    from aioxfer.agent import Agent

__all__ = ["ObjectBackend", "ObjectRegion", "ObjectSegment", "ObjectSegmentList", "ObjectStat"]

PART_SIZE = 8 << 20  # multipart part size (S3 minimum 5 MiB); larger objects go multipart
_READ_BUFSIZE = 1 << 20
# A PUT of up to this many bytes uploads from its own copy, so that a cancel
# is prompt (see ObjectRegion._put); larger ones go from the caller's buffer.
OWNED_MAX = 8 << 20
# The slowest a request's bytes may move (sent or received) before the
# request counts as stalled: its whole-request bound (_timeout_for).
MIN_RATE = 64 << 10
_SIGN_TTL = timedelta(minutes=15)
_SIGN_REUSE = 5 * 60.0  # a signed URL is reused while it has this long left
_SIGNED_MAX = 4096  # cached signed URLs per region
# (at most 20 digits: S3's 5 TiB objects need 13, and int() refuses a
# string of more than 4300 with ValueError)
_CONTENT_RANGE = re.compile(r"bytes (\d{1,20})-(\d{1,20})/(\d{1,20}|\*)")
# An entity-tag as RFC 9110 writes it (ASCII, no space or inner quote; a
# store's e-tags are MD5 hex, "-N" for multipart), or unquoted as some
# servers send it; anything else is a ProtocolError where it is read: it
# would be compared (a HEAD's, _landed, _check_completed) or sent back in a
# complete's XML (a part's).
_ETAG = re.compile(r'(?:W/)?"[\x21\x23-\x7e]{0,1024}"|[\x21\x23-\x7e]{1,1024}')
# An upload id as sent back in a query: printable ASCII (AWS's, MinIO's,
# Ceph's, rclone's are base64 or hex), bounded
_UPLOAD_ID = re.compile(r"[\x21-\x7e]{1,1024}")
_ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")
# Keys that obstore's path encoding (object_store: each segment
# percent-encoded but for alphanumerics and "-._~") leaves as they are
_PLAIN_KEY = re.compile(r"[A-Za-z0-9._/-]+")
_TRANSIENT_HTTP = frozenset({408, 429, 500, 502, 503, 504})
# A single PUT of ours of at least this many bytes would be sent with
# "Expect: 100-continue" (its body held until the server's 100): None, never.
# Measured (benchmarks/object_bench.py --expect-continue, rclone serve s3 on
# loopback, /dev/shm, off/on alternated in one process, medians of 8 rounds,
# 2 vCPUs): 64 KiB 1378 -> 1544 us (1.12x; CPU 578 -> 691 us), 1 MiB 6654 ->
# 6557 us (0.99x), 8 MiB 38.5 -> 38.4 ms (1.00x), 64 MiB 267 -> 266 ms
# (0.99x): a successful PUT only pays a round trip (here 0.17 ms at 64 KiB,
# lost in the noise above 1 MiB; a WAN's RTT per PUT elsewhere). What it
# saves is on a refused PUT only: 64 MiB signed with a wrong secret (403)
# failed in 2.51 -> 1.81 ms (0.72x), AccessDenied either way (the server
# answers at once and closes, the body cut after the kernels' buffers: a few
# MiB sent in vain, not 64). And a server or proxy that ignores Expect
# stalls the PUT: aiohttp waits for the 100 with no fallback (curl sends the
# body after 1 s) and no read timeout, until the server gives up (20 s
# against tests/test_rev33_idle_close.py's server, sock_read 3 s). Off: it
# pays at no size for PUTs that succeed, and risks a stall per PUT.
_EXPECT_CONTINUE_MIN: int | None = None
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class ObjectStat:
    """``await objs.stat(key)``: whether the key exists, its size in bytes and
    e-tag (None when it does not exist)."""

    key: str
    exists: bool
    size: int | None = None
    e_tag: str | None = None
    last_modified: datetime | None = None


class ObjectSegment:
    """``objs["key"]`` (the whole object) or ``objs["key"][a:b]`` (bytes
    [a, b) of it; ``[a:]``: from a, as many bytes as the host side has).
    Writes take whole objects only (S3 replaces objects, it does not patch
    them); ``objs.create("key")`` is a whole object written only if absent."""

    __slots__ = ("region", "key", "offset", "length", "create")

    def __init__(
        self,
        region: ObjectRegion,
        key: str,
        offset: int = 0,
        length: int | None = None,
        create: bool = False,
    ) -> None:
        self.region = region
        self.key = key
        self.offset = offset
        self.length = length
        self.create = create

    @property
    def whole(self) -> bool:
        return self.offset == 0 and self.length is None

    @property
    def nbytes(self) -> int | None:
        return self.length

    def __getitem__(self, key: slice) -> ObjectSegment:
        if not isinstance(key, slice) or key.step is not None:
            raise TypeError(f"object segments are sliced with [start:stop] (bytes), not {key!r}")
        start = 0 if key.start is None else key.start.__index__()
        stop = None if key.stop is None else key.stop.__index__()
        if start < 0 or (stop is not None and stop < start):
            raise IndexError(
                f"[{key.start}:{key.stop}] of object {self.key!r}: offsets are >= 0 and "
                f"stop >= start (an object's size is not known until read)"
            )
        if self.length is not None and (stop is None or stop > self.length):
            if stop is None:
                stop = self.length
            else:
                raise IndexError(
                    f"[{key.start}:{key.stop}] is out of bounds for a segment of "
                    f"{self.length} bytes"
                )
        length = None if stop is None else stop - start
        return ObjectSegment(self.region, self.key, self.offset + start, length)

    def __repr__(self) -> str:
        if self.whole:
            span = ""
        else:
            end = "" if self.length is None else self.offset + self.length
            span = f"[{self.offset}:{end}]"
        return f"<ObjectSegment {self.region.name!r}:{self.key!r}{span}>"


class ObjectSegmentList(Sequence[ObjectSegment]):
    """Many objects of one region (``objs.segments(keys, offsets, lengths)``):
    the far side of one batched request."""

    __slots__ = ("region", "_segs")

    def __init__(self, region: ObjectRegion, segs: list[ObjectSegment]) -> None:
        self.region = region
        self._segs = segs

    @overload
    def __getitem__(self, i: int) -> ObjectSegment: ...
    @overload
    def __getitem__(self, i: slice) -> ObjectSegmentList: ...
    def __getitem__(self, i: int | slice) -> ObjectSegment | ObjectSegmentList:
        if isinstance(i, slice):
            return ObjectSegmentList(self.region, self._segs[i])
        return self._segs[i]

    def __len__(self) -> int:
        return len(self._segs)

    def __iter__(self) -> Iterator[ObjectSegment]:
        return iter(self._segs)

    def __repr__(self) -> str:
        return f"<ObjectSegmentList {self.region.name!r} n={len(self._segs)}>"


def _check_key(key: object) -> str:
    if not isinstance(key, str):
        raise TypeError(f"object keys are str, not {type(key).__name__}")
    if not key or key.startswith("/") or "//" in key:
        raise ValueError(f"invalid object key {key!r}: non-empty, no leading '/' nor '//'")
    if key.endswith("/"):
        # obstore drops a trailing '/': "a/" would be the object "a"
        raise ValueError(
            f"invalid object key {key!r}: no trailing '/' (it would name {key.rstrip('/')!r})"
        )
    if any(part in (".", "..") for part in key.split("/")):
        # obstore cannot make a path of them (its PUT fails, its signer
        # raises TypeError), and a '..' would climb out of the prefix on
        # stores that map keys to files.
        raise ValueError(f"invalid object key {key!r}: no '.' or '..' segments")
    return key


@dataclass(frozen=True, slots=True)
class _Retry:
    max_retries: int
    retry_timeout: float
    initial: float = 0.1
    cap: float = 2.0

    def delay(self, attempt: int) -> float:
        # full jitter (AWS's "exponential backoff and jitter")
        return random.uniform(0.0, min(self.cap, self.initial * (2**attempt)))


class _Attempts:
    """One request's attempts under a _Retry: up to ``max_retries`` more
    after the first, all within ``retry_timeout`` seconds of its start."""

    __slots__ = ("_retry", "_note", "_deadline", "made")

    def __init__(self, retry: _Retry, note_retry: Callable[[], None]) -> None:
        self._retry = retry
        self._note = note_retry
        self._deadline = time.monotonic() + retry.retry_timeout
        self.made = 1  # attempts made so far

    async def another(self) -> bool:
        """After a failed attempt: False when the budget is spent; else the
        retry counted (note_retry) and its backoff waited (never past the
        deadline), True: make the next attempt."""
        retries = self.made - 1
        if retries >= self._retry.max_retries or time.monotonic() >= self._deadline:
            return False
        self._note()
        pause = self._retry.delay(retries)
        self.made += 1
        await asyncio.sleep(min(pause, max(0.0, self._deadline - time.monotonic())))
        return True


class ObjectRegion(BackendRegion):
    """A bucket (and key prefix) of an S3-compatible store: region kind
    "object". Made by ``agent.register_objects(url, ...)``."""

    kind = "object"

    def __init__(
        self,
        backend: ObjectBackend,
        name: str,
        url: str,
        store: S3Store,
        put_store: S3Store,
        retry: _Retry,
        part_size: int,
        connect_timeout: float,
        read_timeout: float,
        resend_unknown_puts: bool = False,
        static_keys: tuple[str, str] | None = None,
        check_multipart: bool = True,
        min_rate: float = MIN_RATE,
        part_md5: bool = False,
        credential_provider: _Provided | None = None,
        tls: ssl.SSLContext | None = None,
        all_ours: bool = False,
    ) -> None:
        super().__init__(backend, name)
        self.url = url
        self._store = store
        self._put_store = put_store  # no retries of its own: see _put_single
        self._retry = retry
        self._part_size = part_size
        self._resend_unknown = resend_unknown_puts
        # (access key id, secret) when the credentials are static (given, or
        # from the environment): our own requests are then signed here
        # (_own_target); else only obstore can sign.
        self._static_keys = static_keys
        self._check_multipart = check_multipart
        self._part_md5 = part_md5
        # What the credential_provider answers, cached for our requests and
        # obstore's alike (obstore is handed the cache as its provider).
        self._creds = credential_provider
        # our multipart writes in flight (the upload and its HEAD check):
        # aclose lets them end (they send through this region's HTTP
        # session) before closing it
        self._uploads: set[asyncio.Task[None]] = set()
        self._timeout = aiohttp.ClientTimeout(
            total=None,
            connect=connect_timeout,
            sock_connect=connect_timeout,
            sock_read=read_timeout,
        )
        # Each request of ours is bounded as a whole (_timeout_for): sock_read
        # alone lets a server that trickles a byte now and then (or reads
        # our body that slowly) hold a request for ever.
        self._base_total = connect_timeout + read_timeout
        # how long a request cut without an answer waits for the server's
        # reset of its bytes (a round trip: _Body.never_reached)
        self._rtt_wait = min(1.0, connect_timeout)
        # how long a body's bytes queued in the kernel may go unread, and
        # how many may be left queued when its answer wait starts (_Body):
        # taken at min_rate within half of read_timeout
        self._stall = read_timeout
        self._slack = int(min_rate * read_timeout / 2)
        self._min_rate = min_rate
        # A single PUT of up to this many bytes is obstore's (without
        # part_md5): its read_timeout, counted from the request's start, the
        # body's sending included, asks no more of the link than min_rate
        # does (n / read_timeout <= min_rate), and its client costs less
        # CPU per request than ours (aiohttp, signed in Python): 256 PUTs
        # of 64 KiB at once went at 0.72-0.87x of obstore's through ours.
        # Larger ones are ours: their bound is min_rate, not read_timeout.
        self._obstore_put_max = int(min_rate * read_timeout)
        if all_ours:
            # ssl_context: obstore's client cannot take it; every PUT is ours
            self._obstore_put_max = -1
        # the TLS context of our requests (ca_bundle, ssl_context), None:
        # aiohttp's default (the system's roots)
        self._tls = tls
        self._session: aiohttp.ClientSession | None = None
        # One per connection of the session's pool, taken before a request's
        # clock starts (_pooled): a request waiting for one of our own
        # connections is not timed out by that wait (aiohttp counts it in
        # ClientTimeout's connect and total), only by the server's pace.
        self._conns: asyncio.Semaphore | None = None
        # _own_target's answer less its key (the URL up to the key)
        self._target_base: _Target | None = None
        # presigned URLs: (url, good until, generation of the provided
        # credentials that signed it; 0 without a provider)
        self._signed: dict[tuple[str, str], tuple[str, float, int]] = {}

    # ------------------------------------------------------------ segments

    def __getitem__(self, key: str) -> ObjectSegment:
        self._check()
        return ObjectSegment(self, _check_key(key))

    def create(self, key: str) -> ObjectSegment:
        """The whole object ``key``, written only if it does not exist yet
        (a conditional create: If-None-Match; ObjectExists otherwise, on
        servers that implement it: AWS, MinIO, Ceph; rclone ignores it)."""
        self._check()
        return ObjectSegment(self, _check_key(key), create=True)

    def segments(
        self,
        keys: Iterable[str],
        offsets: Iterable[int] | None = None,
        lengths: Iterable[int] | None = None,
    ) -> ObjectSegmentList:
        """Many objects as one far side: whole objects, or with ``offsets``
        (and ``lengths``, else the host side's) ranges of them."""
        self._check()
        ks = [_check_key(k) for k in keys]
        offs = [0] * len(ks) if offsets is None else [int(o) for o in offsets]
        if lengths is None:
            lens: list[int | None] = [None] * len(ks)
        else:
            lens = [int(n) for n in lengths]
        if not len(ks) == len(offs) == len(lens):
            raise ValueError(
                f"{len(ks)} keys, {len(offs)} offsets and {len(lens)} lengths: one each"
            )
        for i, (o, n) in enumerate(zip(offs, lens, strict=True)):
            if o < 0 or (n is not None and n < 0):
                raise IndexError(f"segment {i}: offsets and lengths are >= 0")
        return ObjectSegmentList(
            self, [ObjectSegment(self, k, o, n) for k, o, n in zip(ks, offs, lens, strict=True)]
        )

    # ------------------------------------------------------------ metadata ops

    @overload
    async def stat(self, keys: str) -> ObjectStat: ...  # type: ignore[overload-overlap]
    @overload
    async def stat(self, keys: Iterable[str]) -> list[ObjectStat]: ...
    async def stat(self, keys: str | Iterable[str]) -> ObjectStat | list[ObjectStat]:
        """Existence, size and e-tag of one key (an ObjectStat) or of many (a
        list, in order; HEAD requests with the backend's bounded concurrency)."""
        self._check()
        if isinstance(keys, str):
            return await self._stat_one(_check_key(keys))
        ks = [_check_key(k) for k in keys]
        # Every HEAD runs to its end before we report (as delete's DELETEs):
        # a plain gather raises the first failure while the others go on
        # (retrying, signing again) after the caller was answered.
        done = await asyncio.gather(*(self._stat_one(k) for k in ks), return_exceptions=True)
        out: list[ObjectStat] = []
        for r in done:
            if isinstance(r, BaseException):
                raise r
            out.append(r)
        return out

    async def _stat_one(self, key: str) -> ObjectStat:
        async with self.backend._slots.held():
            found = await self._head(key, "stat")
        return found if found is not None else ObjectStat(key, False)

    async def delete(self, keys: str | Iterable[str]) -> None:
        """Deletes one key or many (missing keys are not an error, as in S3):
        a DELETE request per key, with the backend's bounded concurrency."""
        self._check()
        ks = [_check_key(keys)] if isinstance(keys, str) else [_check_key(k) for k in keys]
        # Every DELETE runs to its end before we report: a plain gather raises
        # the first failure while the others go on retrying, and one landing
        # later (the server back) deleted what the caller was told had failed.
        done = await asyncio.gather(*(self._delete_one(k) for k in dict.fromkeys(ks)),
                                    return_exceptions=True)
        for r in done:
            if isinstance(r, BaseException):
                raise r

    async def _delete_one(self, key: str) -> None:
        what = f"delete of object {key!r} in {self.url}"
        async with self.backend._slots.held():
            await self._signed_request("DELETE", key, what, partial(self._deleted, what))

    @staticmethod
    async def _deleted(what: str, resp: aiohttp.ClientResponse, code: str) -> None:
        if resp.status == 404 and code == "NoSuchBucket":
            raise ObjectNotFound(f"{what}: no such bucket ({code})")
        if resp.status not in (200, 202, 204, 404):
            # (a 400, 405, 409, 501...: not deleted; was taken as done,
            # tests/test_obj31_hostile.py)
            raise _failed(what, resp, code)
        # 200, 204; a 404 of the key: gone, as asked

    async def aclose(self) -> None:
        """Forgets the region and closes its HTTP connections: its reads in
        flight fail with ClosedResourceError, its writes in flight finish
        (every write from its start, signing included; a multipart one with
        its HEAD check: they end before the session closes); a write that
        starts once aclose began fails with ClosedResourceError.
        Idempotent. A cancel of aclose is not a way to leave the connections
        open: cancelled while multipart uploads still run (they send through
        the session, their abort too), the session is closed when the last
        of them ends; cancelled after that, its close still runs to its end
        (shielded) before the cancel is raised."""
        await super().aclose()
        try:
            if self._uploads:
                # (asyncio.wait: a cancel of aclose does not cancel them)
                await asyncio.wait(set(self._uploads))
        finally:
            if self._uploads:
                self._close_when_idle()
            else:
                await run_to_end(self._close_session())

    async def _close_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def _close_when_idle(self) -> None:
        """Closes the session once every upload in flight has ended (aclose
        was cancelled while they ran)."""
        def ended(_: object) -> None:
            if not self._uploads:
                _background(self._close_session())

        for task in set(self._uploads):
            # after _uploads.discard (added when the task was made)
            task.add_done_callback(ended)

    # ------------------------------------------------------------ data path

    async def _obstore(self, doing: str, key: str, call: Any) -> Any:
        try:
            return await call
        except (obx.BaseError, OSError) as exc:  # obstore raises FileNotFoundError too
            err = _obstore_error(exc, doing, key, self.url)
        raise err  # outside the except: obstore's error is not even its context

    async def _put(self, src: memoryview, seg: ObjectSegment) -> None:
        """PUTs ``src``. A request sending from the caller's buffer could
        still read it after our caller saw a cancel (aiohttp's writes in
        progress, obstore's threads: cancelling its future only asks them
        to stop). An object of up to ``OWNED_MAX`` bytes is therefore copied
        first and uploaded from the copy: a cancel of its single PUT is
        prompt (the request is abandoned; its object may still be written),
        the caller's buffer already let go. A larger one (the copy no
        longer cheap beside the upload) is uploaded from the caller's
        buffer, and a cancelled put waits for the request to end (its object
        may then be written) and raises CancelledError once it has let go
        of the buffer (else torn bytes under the key, or a read of freed
        memory).

        An object of up to ``part_size`` bytes (or a conditional create) is
        one PUT request, sent again only when the earlier attempt is known
        to be over (see _put_single); a larger one is a multipart upload of
        ours (_multipart; obstore's where we cannot sign: _own_target).

        A multipart upload is waited for to its end through a cancel, whatever
        its size, owned copy or not: it is completed, or aborted when it
        fails, but an upload dropped midway is neither (its parts
        stay stored, and billed, at the server until a lifecycle rule clears
        them). The cost: a cancelled write of more than ``part_size`` bytes
        raises CancelledError only once its upload is over, up to the time of
        the whole upload (each request bounded by ``read_timeout`` and the
        retry budget), and its object may then be written. A multipart
        upload reported complete is then checked with a HEAD
        (_check_completed)."""
        # A write that starts once aclose began fails as documented (the
        # session it would send through is closed, or closing).
        self._check()
        mode: Literal["create"] | None = "create" if seg.create else None
        owned = src.nbytes <= OWNED_MAX
        body = bytes(src) if owned else src
        single = src.nbytes <= self._part_size or mode == "create"
        # The whole write (where to send it, its requests, a multipart one's
        # HEAD check) is one task, which aclose waits for before it closes
        # the session: a write still signing (_own_target, a provider asked)
        # when aclose starts is then a write in flight like any other.
        task = asyncio.ensure_future(self._write(body, seg.key, mode, owned, single))
        self._uploads.add(task)
        task.add_done_callback(self._uploads.discard)
        if single:
            # a cancel reaches the task: an attempt of an owned body is
            # abandoned at once, one from the caller's buffer ends first
            # (_put_single), and no further attempt is made
            await task
        else:
            await self._upload(False, task)

    async def _write(self, body: bytes | memoryview, key: str,
                     mode: Literal["create"] | None, owned: bool, single: bool) -> None:
        """The task of one write (see _put): one PUT (_put_single: ours,
        or obstore's: see _obstore_put_max), else a multipart upload (ours,
        or obstore's) and its HEAD check."""
        _UPLOADING.set(self)  # (this task's context: its requests' tasks inherit it)
        size = memoryview(body).nbytes
        if single:
            # A conditional create is one PUT whatever its size (up to S3's
            # 5 GiB for one PUT), as obstore's put with a mode was.
            target = None
            if self._part_md5 or size > self._obstore_put_max:
                target = await self._own_target(key)
            await self._put_single(body, key, mode, owned, target)
            return
        target = await self._own_target(key)
        e_tag: str | None
        if target is not None:
            e_tag = await self._multipart(target, body, key)
            if e_tag is not None and not self._check_multipart:
                return  # the store itself answered the complete (no redirect followed)
        else:
            # Credentials we cannot sign with (obstore's other sources), or
            # a provider's whose signing by obstore failed: obstore's
            # multipart upload, which follows a redirect of its create,
            # complete and abort requests (the HEAD check below judges).
            # Refused with provided credentials: sent once more with fresh
            # ones, as our requests are (a refused upload was not completed).
            refusal = _Refusal()
            while True:
                generation = 0 if self._creds is None else (await self._creds.get())[1]
                try:
                    done = await self._obstore("write", key, obstore.put_async(
                        self._store, key, body, chunk_size=self._part_size,
                        max_concurrency=4))
                    break
                except AccessDenied:
                    if not self._send_again_refused(refusal, generation):
                        raise
            e_tag = done.get("e_tag")
        await self._check_completed(key, size, e_tag)

    async def _own_target(self, key: str) -> _Target | None:
        """_own_target_signed's answer; for a key of characters that no URL
        encoding changes (_PLAIN_KEY: kv's keys, most others) made from the
        first such answer's (its URL less its key, the same credentials and
        region): obstore's signing per write (~60 us here; with a provider
        a hop to its runtime and back) was a third of a lone 4 KiB PUT's
        own cost."""
        base = self._target_base
        plain = _PLAIN_KEY.fullmatch(key) is not None
        if base is not None and plain:
            return _Target(base.url + key, base.creds, base.region)
        target = await self._own_target_signed(key)
        if target is not None and plain and target.url.endswith("/" + key):
            self._target_base = _Target(target.url[:-len(key)], target.creds, target.region)
        return target

    async def _own_target_signed(self, key: str) -> _Target | None:
        """Where and how to send our own signed requests of ``key``: its URL
        (scheme, host and path exactly as obstore makes them, from a URL
        obstore presigns: endpoint, bucket, prefix, key encoding), the
        credentials and region obstore signs with. With a
        ``credential_provider`` the credentials are what it answers, asked
        for by each request (_provided). None when they are neither static
        nor provided (obstore's other sources: instance metadata, web
        identity) or not the ones we know the secret of."""
        if self._creds is not None:
            try:
                # (obstore signs with what our cache of the provider's
                # credentials answers: the provider is not asked again)
                signed = await obstore.sign_async(self._store, "PUT", key, _SIGN_TTL)
            except (obx.BaseError, OSError, ValueError, TypeError):
                return None
            parts = urlsplit(str(signed))
            scope = dict(parse_qsl(parts.query)).get("X-Amz-Credential", "").split("/")
            if len(scope) != 5:
                return None
            return _Target(f"{parts.scheme}://{parts.netloc}{parts.path}", None, scope[2])
        if self._static_keys is None:
            return None
        key_id, secret = self._static_keys
        try:
            # synchronous: with static credentials obstore signs locally (~20 us)
            signed = obstore.sign(self._store, "PUT", key, _SIGN_TTL)
        except (obx.BaseError, OSError, ValueError, TypeError):
            return None
        parts = urlsplit(str(signed))
        query = dict(parse_qsl(parts.query))
        scope = query.get("X-Amz-Credential", "").split("/")
        if len(scope) != 5 or scope[0] != key_id:
            return None
        creds = sigv4.Credentials(key_id, secret, query.get("X-Amz-Security-Token"))
        return _Target(f"{parts.scheme}://{parts.netloc}{parts.path}", creds, scope[2])

    async def _multipart(self, target: _Target, body: bytes | memoryview, key: str) -> str | None:
        """A multipart upload of ``body`` to ``key``, every request signed here
        and sent with aiohttp, following no redirect (_own_request): create
        (``POST ?uploads``), the parts (``PUT ?partNumber=&uploadId=``, up to
        4 at once, each retried on its own: a part sent again replaces
        itself), complete (``POST ?uploadId=``). Any failure aborts the
        upload (``DELETE ?uploadId=``; its own failure leaves the parts for
        the store's lifecycle rules, the first error is raised). The e-tag
        the complete answered ("" if none), or None when its outcome is not
        known (see _completed): the HEAD that follows then says."""
        what = f"multipart write of object {key!r} in {self.url}"
        upload_id = await self._own_request(
            target, "POST", [("uploads", "")], f"{what} (create)", _created)
        try:
            view = memoryview(body).cast("B")
            size = self._part_size
            count = -(-len(view) // size)
            tags: list[str] = [""] * count
            failures: list[BaseException] = []
            todo = iter(range(count))

            async def worker() -> None:
                for i in todo:
                    if failures:
                        return
                    try:
                        part = view[i * size:(i + 1) * size]
                        extra = None
                        if self._part_md5:
                            # The store refuses a part whose bytes changed on
                            # the way (BadDigest: sent again). Hashed on a
                            # worker thread (hashlib lets go of the GIL).
                            digest = await asyncio.to_thread(_md5_b64, part)
                            extra = {"Content-MD5": digest}
                        tags[i] = await self._own_request(
                            target, "PUT",
                            [("partNumber", str(i + 1)), ("uploadId", upload_id)],
                            f"{what} (part {i + 1} of {count})", _part_done,
                            body=part, payload_hash=sigv4.UNSIGNED_PAYLOAD,
                            headers=extra)
                    except BaseException as exc:
                        failures.append(exc)
                        return

            await asyncio.gather(*(worker() for _ in range(min(4, count))))
            if failures:
                raise failures[0]
            xml = "".join(
                f"<Part><PartNumber>{i + 1}</PartNumber><ETag>{xml_escape(t)}</ETag></Part>"
                for i, t in enumerate(tags))
            data = (
                '<CompleteMultipartUpload xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                f"{xml}</CompleteMultipartUpload>").encode()
            # (a complete may take the store a while, more for a larger
            # object: its bound grows with the object's size)
            return await self._own_request(
                target, "POST", [("uploadId", upload_id)], f"{what} (complete)", _completed,
                body=data, payload_hash=hashlib.sha256(data).hexdigest(), moves=len(view))
        except BaseException:
            try:
                await self._own_request(
                    target, "DELETE", [("uploadId", upload_id)], f"{what} (abort)", _aborted)
            except XferError:
                pass  # the first failure is the one to report
            raise

    async def _own_request(
        self,
        target: _Target,
        method: Literal["POST", "PUT", "DELETE"],
        params: list[tuple[str, str]],
        what: str,
        answer: Callable[[str, aiohttp.ClientResponse, str, str, int], Awaitable[_T]],
        body: bytes | memoryview | None = None,
        payload_hash: str = sigv4.EMPTY_SHA256,
        headers: dict[str, str] | None = None,
        moves: int | None = None,
    ) -> _T:
        """A request of ``target`` with query ``params``, signed here (SigV4,
        headers; ``headers`` signed too) and sent with aiohttp following no
        redirect (a 3xx fails it: the session token travels in a header, and
        another host's answer would count). Each attempt is bounded as a
        whole (_timeout_for ``moves`` bytes: the body's length unless
        given). Retried (5xx, 429, 408, a connection error or timeout,
        an S3 error in a 200's body, a _Transient from ``answer``) within the
        region's retry budget, signed again each time. 401 and 403 are
        AccessDenied. ``answer(what, resp, text, code, attempt)`` makes the result
        of any other status: ``text`` is the body (read for a POST and for an
        answer of 300 or more, else ""), ``code`` its S3 error code, ``attempt``
        the attempt's number (1 for the first)."""
        url = f"{target.url}?{sigv4.canonical_query(params)}"
        timeout = self._timeout_for(
            moves if moves is not None else 0 if body is None else len(body))
        attempts = _Attempts(self._retry, self.backend.note_retry)
        refusal = _Refusal()
        untrusted: TransportError | None = None
        stale_resent = False
        while True:
            failed: str
            creds = target.creds
            generation = 0
            if creds is None:
                assert self._creds is not None
                creds, generation = await self._creds.get()
            data: _Body | None = None
            cut = False  # failed without an answer: maybe none of it reached the server
            try:
                sent = sigv4.sign_headers(
                    method, url, creds, target.region, headers=headers,
                    payload_hash=payload_hash)
                if body is not None:
                    # Content-Length given and the body streamed: aiohttp
                    # sends it as is (not chunked), from the caller's memory
                    # a MiB at a time (the socket's flow control applies).
                    sent["Content-Length"] = str(len(body))
                    data = _Body(body, self._stall, self._slack)
                async with self._pooled(), self._http().request(
                    method, yarl.URL(url, encoded=True), headers=sent, data=data,
                    allow_redirects=False, timeout=timeout,
                ) as resp:
                    status = resp.status
                    text = ""
                    if status >= 300 or method == "POST":
                        # a POST's answer is small XML (create, complete);
                        # S3 may answer a complete 200 with an error in it
                        text = (await _answer_body(resp)).decode("utf-8", "replace")
                    code = _xml_code(text) if "<Error" in text else ""
                    if status == 200 and code:
                        raise _Transient(f"HTTP {status} {code}")
                    _refuse_status(what, resp, code)
                    return await answer(what, resp, text, code, attempts.made)
            except aiohttp.ClientConnectorCertificateError as exc:
                untrusted = _untrusted(what, exc)
                break
            except AccessDenied:
                if not self._send_again_refused(refusal, generation):
                    raise
                continue
            except aiohttp.ClientResponseError as exc:
                failed = _malformed(exc)
                break
            except (aiohttp.ClientError, TimeoutError, _Transient) as exc:
                failed = _describe(exc)
                cut = data is not None and not isinstance(exc, _Transient)
            finally:
                if data is not None and not cut:
                    data.release()
            if data is not None and cut:
                try:
                    unsent = await data.never_reached(self._rtt_wait)
                finally:
                    data.release()
                if unsent and not stale_resent:
                    # the server had closed the connection as it went out
                    # (_Body.never_reached): sent again at once, once, as
                    # a single PUT is (_put_single)
                    stale_resent = True
                    self.backend.note_retry()
                    continue
            if not await attempts.another():
                raise TransportError(f"{what} failed after {attempts.made} attempts: {failed}")
        if untrusted is not None:
            raise untrusted
        raise ProtocolError(f"{what}: {failed}")

    def _send_again_refused(self, refusal: _Refusal, generation: int,
                            stale_url: tuple[str, str] | None = None) -> bool:
        """After a request was refused (401/403, AccessDenied): whether to
        send it once more. Yes, once per request (``refusal``), when it was
        signed with provided credentials (they may have expired, been
        rotated or revoked before their expires_at: those of
        ``generation`` are dropped, and the next attempt signs with what
        the provider answers then) or with a presigned URL from the cache
        (``stale_url``: dropped and signed again). Static credentials
        refused are refused: AccessDenied."""
        if refusal.spent or (self._creds is None and stale_url is None):
            return False
        refusal.spent = True
        if stale_url is not None:
            self._signed.pop(stale_url, None)
        self._creds_refused(generation)
        return True

    def _creds_refused(self, generation: int) -> None:
        """A request signed with the provided credentials of ``generation``
        was refused (401/403): they are dropped from the cache (if still
        there), as are the URLs presigned with them."""
        if self._creds is not None:
            self._creds.drop(generation)
            for k in [k for k, v in self._signed.items() if v[2] == generation]:
                del self._signed[k]

    @property
    def _provided_creds(self) -> tuple[sigv4.Credentials, float | None] | None:
        """The provided credentials cached now and when they are asked for
        again (time.time(); None: never), or None."""
        return None if self._creds is None else self._creds.cached

    async def _check_completed(self, key: str, size: int, e_tag: str | None) -> None:
        """After a multipart upload obstore reported complete: a HEAD of
        ``key`` (presigned, following no redirect: _signed_request) must find
        the object with ``size`` bytes and the e-tag the complete answered
        (when both sides have one of one kind), else XferError. obstore follows a
        redirect of the upload's create, complete and abort requests (to
        another host too, with the session token: tests/test_obj18b_redirects.py),
        and takes that host's answer: a complete redirected there "succeeds"
        while the store never completed the upload (the object absent, or an
        older one). One HEAD per object of more than ``part_size`` bytes.
        Credentials allowed to write but not to read (the HEAD refused,
        AccessDenied) cannot check: the write counts as done, as obstore
        said. A failure of the HEAD itself (TransportError) fails the write:
        its outcome is not known. Another writer's PUT of the same key landing
        between the complete and the HEAD reads as a mismatch too (the
        caller's object is then not there anyway)."""
        what = f"multipart write of object {key!r} in {self.url}"
        try:
            found = await self._head(key, "check of the multipart write")
        except AccessDenied:
            return
        if found is None:
            raise XferError(
                f"{what}: the upload was answered as complete, but the store has no such "
                f"object (was the complete redirected to another host?)"
            )
        if found.size != size:
            raise XferError(
                f"{what}: the upload of {size} bytes was answered as complete, but the "
                f"store holds {found.size} bytes under the key"
            )
        want, got = _etag(e_tag), _etag(found.e_tag)
        # Compared only when both are of one kind: rclone answers the complete
        # with a multipart e-tag (MD5 of the parts' MD5s, "-<parts>") and a
        # HEAD with the MD5 of the whole object.
        if want and got and ("-" in want) == ("-" in got) and want != got:
            raise XferError(
                f"{what}: the upload was answered as complete with e-tag {want}, but the "
                f"store's object has {got}"
            )

    async def _upload(self, owned: bool, call: Awaitable[Any]) -> Any:
        """Awaits an upload; one not ``owned`` (from the caller's buffer, or
        any multipart upload) is waited for to its end through a cancel (see
        _put)."""
        if owned:
            return await call
        fut = asyncio.ensure_future(call)
        cancelled = False
        while not fut.done():
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            if not fut.cancelled():
                fut.exception()  # retrieved: the caller gets the cancel
            raise asyncio.CancelledError
        return fut.result()

    async def _put_single(self, body: bytes | memoryview, key: str,
                          mode: Literal["create"] | None, owned: bool,
                          target: _Target | None) -> None:
        """One PUT request: ours with a ``target`` (signed here, sent with
        aiohttp following no redirect, its bytes bound by ``min_rate`` as
        our other requests, Content-MD5 with ``part_md5``; _write gives one
        for a body of more than _obstore_put_max bytes, or with
        ``part_md5``, where we can sign), else obstore's, through a client
        that never retries by itself.
        A client's own retries send a PUT again when its answer was lost or
        timed out, while the first may still be running at the server: two
        PUTs of one key at once, which some servers get wrong (rclone serve
        s3 1.75 then answers 500 to every GET of the key, or loses it, after
        both PUTs returned 200; tests/repro_rclone_samekey.py). Our rule: an
        attempt is sent again only when it is known to be over: it never
        reached the server (no connection was made), or the server answered
        it (500, 503, 429, 408, a BadDigest; not 502 or 504, a gateway's
        answers while the server may still run it). When its outcome is
        unknown (the connection cut after the request went out, a timeout)
        the key is asked for with a HEAD: there with our bytes (size and MD5
        e-tag), the put succeeded; else it fails with TransportError and the
        object may still be written later (the caller puts it again if it
        must: by then the earlier attempt has had time to end). With
        ``resend_unknown_puts`` it is sent again instead, within the same
        retry budget (the store is trusted with two PUTs of one key at
        once); a conditional create is never sent blindly: after an unknown
        outcome the HEAD must not find the key (found with our bytes: it
        landed, done; with others: ObjectExists), and one sent again that
        finds the key taken succeeded when the key holds our bytes (the
        earlier attempt landed). A 401/403 with provided credentials is
        sent once more with fresh ones (_send_again_refused: refused, so
        over). An attempt from the caller's buffer (not ``owned``) runs to
        its end through a cancel (_upload)."""
        what = f"write of object {key!r} in {self.url}"
        headers: dict[str, str] = {}
        if mode == "create":
            headers["If-None-Match"] = "*"
        digest = _Digest(body, owned)
        if target is not None and self._part_md5:
            # (an object of up to part_size bytes, a create up to any size:
            # hashed on a worker thread, as a multipart upload's parts)
            headers["Content-MD5"] = await digest.b64(self)
        attempts = _Attempts(self._retry, self.backend.note_retry)
        refusal = _Refusal()
        unknown_before = False  # an earlier attempt's outcome is unknown
        stale_resent = False
        while True:
            generation = 0
            creds = None if target is None else target.creds
            if self._creds is not None:
                # cached now: we sign with these, and so does obstore (it
                # asks our cache)
                creds, generation = await self._creds.get()
            try:
                if target is None:
                    await self._upload(owned, self._obstore_put(body, key, mode))
                else:
                    assert creds is not None
                    await self._upload(owned, self._own_put(
                        target, creds, body, headers, mode, what))
                return
            except AccessDenied:
                if not self._send_again_refused(refusal, generation):
                    raise
                continue
            except ObjectExists:
                if unknown_before and await self._landed(key, digest):
                    return
                raise
            except _PutFailed as exc:
                outcome, why, err = exc.outcome, exc.why, exc.err
            if outcome == "refused":
                raise err
            if outcome == "stale" and not stale_resent:
                # None of it reached the server (_Body.never_reached): sent
                # again at once, once per write, outside the retry budget
                # (as aiohttp sends again a request refused unsent on a
                # pooled connection found closed); a second one is retried
                # within the budget, as a refused connection is.
                stale_resent = True
                self.backend.note_retry()
                continue
            if outcome == "unknown":
                found = await self._landed(key, digest, mode == "create")
                if found:
                    return
                unknown_before = True
                if not self._resend_unknown:
                    # (a malformed answer stays a ProtocolError)
                    raise (ProtocolError if isinstance(err, ProtocolError) else TransportError)(
                        f"{what}: the PUT's outcome is unknown "
                        f"({why}) and the object is not there with these bytes; not sent "
                        f"again while that PUT may still run at the server (it may yet store "
                        f"the object; register_objects(..., resend_unknown_puts=True) sends "
                        f"it again)"
                    )
                err = TransportError(
                    f"{what}: the PUT's outcome is unknown "
                    f"({why}) and the object is not there with these bytes; the retry "
                    f"budget is spent"
                )
            if not await attempts.another():
                raise err

    async def _obstore_put(self, body: bytes | memoryview, key: str,
                           mode: Literal["create"] | None) -> None:
        """One attempt of a single PUT through obstore (credentials we cannot
        sign with): its failures typed, a TransportError sorted (_PutFailed,
        _put_outcome)."""
        failed: _PutFailed
        try:
            await obstore.put_async(self._put_store, key, body, mode=mode, use_multipart=False)
            return
        except (obx.BaseError, OSError) as exc:  # obstore raises FileNotFoundError too
            err = _obstore_error(exc, "write", key, self.url)
            if not isinstance(err, TransportError):
                raise err from None
            failed = _PutFailed(_put_outcome(exc), _describe(exc), err)
        raise failed  # outside the except: obstore's error is not even its context

    async def _own_put(self, target: _Target, creds: sigv4.Credentials,
                       body: bytes | memoryview, headers: dict[str, str],
                       mode: Literal["create"] | None, what: str) -> None:
        """One attempt of a single PUT of ours: signed here (SigV4 headers,
        the body UNSIGNED-PAYLOAD as a multipart upload's parts), sent with
        aiohttp following no redirect, bound as a whole (_timeout_for the
        body's bytes). A final answer raises its typed error (AccessDenied,
        ObjectExists, ObjectNotFound, XferError); any other failure
        _PutFailed, sorted: "unsent" (no connection was made), "answered"
        (the server answered with a status worth another attempt),
        "unknown" (the request may have reached the server: a cut, a
        timeout, a gateway's 502 / 504).

        (aiohttp sends an idempotent method such as PUT once more by itself
        when a reused keep-alive connection turns out closed, but not once
        any of a streamed body went out: the server cannot have stored an
        object whose bytes it never got.)"""
        n = memoryview(body).nbytes
        sent = sigv4.sign_headers("PUT", target.url, creds, target.region, headers=headers,
                                  payload_hash=sigv4.UNSIGNED_PAYLOAD)
        sent["Content-Length"] = str(n)
        failed: _PutFailed
        stream = _Body(body, self._stall, self._slack)
        cut: TransportError | None = None
        try:
            async with self._pooled(), self._http().request(
                "PUT", yarl.URL(target.url, encoded=True), headers=sent, data=stream,
                allow_redirects=False, timeout=self._timeout_for(n),
                expect100=_EXPECT_CONTINUE_MIN is not None and n >= _EXPECT_CONTINUE_MIN,
            ) as resp:
                status = resp.status
                if status == 200:
                    return
                code = _xml_code((await _answer_body(resp)).decode("utf-8", "replace"))
                said = f"HTTP {status} {code}".strip()
                if status in (401, 403):
                    raise AccessDenied(f"{what}: access denied ({code or f'HTTP {status}'})")
                if 300 <= status < 400:
                    raise _redirected(what, status, resp)
                if mode == "create" and status == 412:
                    raise ObjectExists(f"{what}: the key exists (conditional create)")
                if (status in _ANSWERED_RETRY or (status == 400 and code == "BadDigest")
                        or (status == 409 and code == "ConditionalRequestConflict")):
                    # answered, so over: BadDigest (part_md5) says the bytes
                    # changed on the way; a conflict, that another
                    # conditional write of the key was under way
                    failed = _PutFailed("answered", said,
                                        TransportError(f"{what} failed: {said}"))
                elif status in (502, 504):
                    failed = _PutFailed("unknown", said, TransportError(f"{what} failed: {said}"))
                elif status == 404:
                    raise ObjectNotFound(f"{what}: no such bucket ({code or 'HTTP 404'})")
                else:
                    raise XferError(f"{what}: {said}")
        except aiohttp.ClientConnectorCertificateError as exc:
            # never sent, and not worth another attempt
            untrusted = _untrusted(what, exc)
            failed = _PutFailed("refused", str(untrusted), untrusted)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            # no connection was made: the request never left
            why = _describe(exc)
            failed = _PutFailed("unsent", why, TransportError(f"{what} failed: {why}"))
        except aiohttp.ClientResponseError as exc:
            # an answer came, one that cannot be read: whether it said the
            # object was stored is not known (the HEAD says)
            why = _malformed(exc)
            failed = _PutFailed("unknown", why, ProtocolError(f"{what}: {why}"))
        except (aiohttp.ClientError, TimeoutError) as exc:
            why = _describe(exc)
            failed = _PutFailed("unknown", why, TransportError(f"{what} failed: {why}"))
            cut = failed.err if isinstance(failed.err, TransportError) else None
        finally:
            if cut is None:
                stream.release()
        if cut is not None:
            try:
                if await stream.never_reached(self._rtt_wait):
                    # the server closed the connection (its idle close) as
                    # the request went out: none of it reached the server
                    why = (f"{failed.why}: the server had closed the connection, none of "
                           f"the request reached it")
                    failed = _PutFailed("stale", why, TransportError(f"{what} failed: {why}"))
            finally:
                stream.release()
        raise failed

    async def _landed(self, key: str, digest: _Digest, create: bool = False) -> bool:
        """Whether ``key`` holds ``body``, after a PUT of it whose outcome is
        unknown: its size and e-tag (the MD5 of a single-part object's bytes
        on AWS, MinIO, Ceph and rclone; an e-tag of another kind, as with
        SSE-KMS, cannot say, and the put counts as failed). Asked after a
        short pause, so that a PUT the server was finishing has landed; a
        HEAD is a read: retried as reads are (_head). For a conditional
        ``create``, a key found with other bytes (an MD5 e-tag that is not
        theirs, or another size) is ObjectExists: another writer's object,
        which no attempt of this create may replace. The body's MD5 is
        hashed off the event loop (_Digest: a create's body may be 5 GiB,
        seconds of hashing), once per write."""
        await asyncio.sleep(self._retry.initial)
        try:
            found = await self._head(key, "check of the write")
        except XferError:
            return False  # the server cannot say: not known written
        if found is None:
            return False
        e_tag = _etag(found.e_tag)
        size = digest.nbytes
        if found.size == size and e_tag == await digest.hex(self):
            return True
        if create and (found.size != size or re.fullmatch(r"[0-9a-f]{32}", e_tag)):
            raise ObjectExists(
                f"write of object {key!r} in {self.url}: the key exists with other bytes "
                f"(conditional create)")
        return False  # not with these bytes (or an e-tag that cannot say)

    async def _sign(self, key: str) -> str:
        """A presigned GET URL of ``key`` (see _presign)."""
        return (await self._presign(key))[0]

    async def _presign(
        self, key: str, method: Literal["GET", "HEAD", "DELETE"] = "GET"
    ) -> tuple[str, bool, int]:
        """A presigned ``method`` URL of ``key``, whether it came from the
        cache (reused while it has more than _SIGN_REUSE seconds left and,
        with a credential_provider, was signed with the credentials cached
        now) and the generation of the provided credentials that signed it
        (0 without a provider)."""
        now = time.monotonic()
        hit = self._signed.get((method, key))
        generation = 0
        if self._creds is not None:
            # the credentials obstore signs with now (it asks our cache)
            generation = (await self._creds.get())[1]
        if hit is not None and hit[1] - now > _SIGN_REUSE and hit[2] == generation:
            return hit[0], True, generation
        if self._static_keys is not None:
            # Static credentials: obstore signs locally (~15 us), so here at
            # once; sign_async's hop to obstore's runtime and back costs
            # ~190 us (much of an uncached 4 KiB GET). Our own signer
            # (sigv4.presign) would take ~30 us in Python.
            url = self._sign_now(method, key)
        else:
            signing = obstore.sign_async(self._store, method, key, _SIGN_TTL)
            url = str(await self._obstore("sign", key, signing))
        if len(self._signed) >= _SIGNED_MAX:
            self._signed.clear()
        self._signed[(method, key)] = (url, now + _SIGN_TTL.total_seconds(), generation)
        return url, False, generation

    def _sign_now(self, method: Literal["GET", "HEAD", "DELETE"], key: str) -> str:
        try:
            return str(obstore.sign(self._store, method, key, _SIGN_TTL))
        except (obx.BaseError, OSError) as exc:
            err = _obstore_error(exc, "sign", key, self.url)
        raise err  # outside the except: obstore's error is not even its context

    async def _head(self, key: str, doing: str) -> ObjectStat | None:
        """A HEAD of ``key`` through a presigned URL: its ObjectStat, or None
        when it does not exist."""
        what = f"{doing} of object {key!r} in {self.url}"
        return await self._signed_request("HEAD", key, what, partial(self._headed, key, what))

    @staticmethod
    async def _headed(
        key: str, what: str, resp: aiohttp.ClientResponse, code: str
    ) -> ObjectStat | None:
        if resp.status == 404:
            return None
        if resp.status != 200:
            raise XferError(f"{what}: HTTP {resp.status} {code}".rstrip())
        size = resp.headers.get("Content-Length", "")
        if not size.isdigit():
            raise ProtocolError(f"{what}: HTTP 200 to a HEAD without a Content-Length")
        e_tag = resp.headers.get("ETag")
        if e_tag is not None and _ETAG.fullmatch(e_tag) is None:
            raise ProtocolError(f"{what}: HTTP 200 with a malformed ETag {e_tag[:80]!r}")
        modified: datetime | None = None
        try:
            # (informative only: one that cannot be read is left out; a
            # year past 9999 is OverflowError, not ValueError)
            modified = email.utils.parsedate_to_datetime(resp.headers.get("Last-Modified", ""))
        except (TypeError, ValueError, OverflowError, IndexError):
            pass
        return ObjectStat(key, True, int(size), e_tag, modified)

    async def _signed_request(
        self,
        method: Literal["GET", "HEAD", "DELETE"],
        key: str,
        what: str,
        answer: Callable[[aiohttp.ClientResponse, str], Awaitable[_T]],
        headers: dict[str, str] | None = None,
        moves: int = 0,
    ) -> _T:
        """A request of ``key`` (GET, HEAD, DELETE) through a presigned URL,
        sent with aiohttp, not obstore: obstore (reqwest) follows a redirect,
        to another host too, and there sends the session token
        (``x-amz-security-token``; it drops only Authorization) and takes its
        answer (a HEAD found, a DELETE done, at a host that is not the
        store). Redirects are not followed (a 3xx fails the request): the URL
        carries its credentials in its query, and a redirect would hand them,
        or a loop of requests, to wherever it points. Retried (5xx, 429, 408,
        a connection error or timeout, a _Transient raised by ``answer``)
        within the region's retry budget. A 401 or 403 is AccessDenied; to a
        URL from the cache (signed up to _SIGN_TTL ago, with credentials
        since rotated), or to one signed with provided credentials (then
        dropped from their cache: _creds_refused), it drops the URL and
        signs again, once, first.
        ``answer(resp, code)`` makes the result of any other status
        (``code``: the S3 error code of the body of an answer of 300 or
        more, read whole up to _ANSWER_MAX bytes unless the request is a
        HEAD; else ""). Each attempt is bounded as a whole (_timeout_for
        ``moves``: the bytes a GET receives). Error texts leave
        the URL's query out (_describe); ``what`` names the request in them."""
        timeout = self._timeout_for(moves)
        attempts = _Attempts(self._retry, self.backend.note_retry)
        refusal = _Refusal()
        untrusted: TransportError | None = None
        while True:
            # The error is raised outside the except clause: aiohttp's
            # exception (whose text may hold the URL) is then not even the
            # new one's __context__.
            failed: str
            url, cached, generation = await self._presign(key, method)
            try:
                # read_until_eof=False for a HEAD: aiohttp's response parser
                # does not know the request's method, and would otherwise
                # take an answer without Content-Length (rclone's 404) as a
                # body read to EOF: the connection closed, a new one per miss.
                async with self._pooled(), self._http().request(
                    method, url, headers=headers, allow_redirects=False,
                    read_until_eof=method != "HEAD", timeout=timeout,
                ) as resp:
                    status = resp.status
                    code = ""
                    if status >= 300 and method != "HEAD":
                        # whole: one read returns what has arrived so far,
                        # and an error split across packets would lose its
                        # code (a DELETE's NoSuchBucket read as done)
                        body = (await _answer_body(resp)).decode("utf-8", "replace")
                        code = _xml_code(body)
                    _refuse_status(what, resp, code)
                    return await answer(resp, code)
            except aiohttp.ClientConnectorCertificateError as exc:
                untrusted = _untrusted(what, exc)
                break
            except AccessDenied:
                # A URL signed up to _SIGN_TTL ago (credentials since
                # rotated) is signed again, once, as are provided ones.
                if not self._send_again_refused(
                        refusal, generation, (method, key) if cached else None):
                    raise
                continue
            except aiohttp.ClientResponseError as exc:
                failed = _malformed(exc)
                break
            except (aiohttp.ClientError, TimeoutError, _Transient) as exc:
                failed = _describe(exc)
            if not await attempts.another():
                raise TransportError(f"{what} failed after {attempts.made} attempts: {failed}")
        if untrusted is not None:
            raise untrusted
        raise ProtocolError(f"{what}: {failed}")

    def _timeout_for(self, moves: int) -> aiohttp.ClientTimeout:
        """The bound of one attempt of a request that moves ``moves`` bytes
        (sent or received): connect_timeout + read_timeout + moves /
        min_rate seconds in all (from when it holds a connection of the
        pool: _pooled), beside the per-read bound: a server that answers (or
        reads our body) a byte now and then is not stuck on for ever."""
        return aiohttp.ClientTimeout(
            total=self._base_total + moves / self._min_rate,
            connect=self._timeout.connect,
            sock_connect=self._timeout.sock_connect,
            sock_read=self._timeout.sock_read,
        )

    def _pooled(self) -> asyncio.Semaphore:
        """A connection of the pool (its size: the connector's limit) held
        for one request, waited for before its timeouts start."""
        if self._conns is None:
            self._conns = asyncio.Semaphore(self.backend.max_concurrency)
        return self._conns

    def _http(self) -> aiohttp.ClientSession:
        session = self._session
        if session is None or session.closed:
            if _UPLOADING.get() is not self:
                # closed: no new session (nobody would close it). A write
                # aclose waits for (its task in _uploads) may still make
                # one: aclose closes it once the write is over.
                self._check()
            connector = aiohttp.TCPConnector(
                limit=self.backend.max_concurrency, enable_cleanup_closed=True,
                ssl=True if self._tls is None else self._tls,
            )
            session = self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=self._timeout,
                auto_decompress=False,
                # aiohttp pauses the socket once 2 x read_bufsize are buffered
                # (default 64 KiB): large GETs then stall on flow control
                # while we copy chunks out at once anyway.
                read_bufsize=_READ_BUFSIZE,
            )
        return session

    async def _get(self, dst: memoryview, seg: ObjectSegment) -> None:
        """A GET of ``seg`` through a presigned URL (_signed_request: no
        redirect followed, retries, a 403 to a cached URL signs again once),
        straight into ``dst``."""
        n = len(dst)
        ranged = not seg.whole
        headers = {"Range": f"bytes={seg.offset}-{seg.offset + n - 1}"} if ranged else None
        what = f"read of object {seg.key!r} from {self.url}"
        await self._signed_request(
            "GET", seg.key, what, partial(self._receive, dst, seg, ranged, what), headers, n
        )

    async def _receive(
        self,
        dst: memoryview,
        seg: ObjectSegment,
        ranged: bool,
        what: str,
        resp: aiohttp.ClientResponse,
        code: str,
    ) -> None:
        n = len(dst)
        status = resp.status
        if status not in (200, 206):
            # (_signed_request answered the transient, 401/403 and 3xx ones)
            if status < 300:  # its body not read for a code there
                body = (await _answer_body(resp)).decode("utf-8", "replace")
                code = _xml_code(body)
            if status == 404:
                raise ObjectNotFound(f"{what}: no such key ({code or 'HTTP 404'})")
            if status == 416:
                raise XferError(
                    f"{what}: bytes [{seg.offset}:{seg.offset + n}] are past the object's end"
                )
            raise XferError(f"{what}: HTTP {status} {code}".rstrip())
        length = resp.content_length
        if ranged:
            # 206, or 200 from servers that answer ranges so (rclone): either
            # way the Content-Range must be exactly what was asked.
            want = (seg.offset, seg.offset + n - 1)
            got = _CONTENT_RANGE.fullmatch(resp.headers.get("Content-Range", ""))
            if got is None or (int(got[1]), int(got[2])) != want:
                if status == 200 and got is None and seg.offset == 0 and length == n:
                    pass  # the whole object is exactly the range asked for
                else:
                    if got is not None and got[3] != "*" and int(got[3]) <= want[1]:
                        raise XferError(
                            f"read of object {seg.key!r}: bytes [{seg.offset}:"
                            f"{seg.offset + n}] are past its end ({got[3]} bytes)"
                        )
                    raise ProtocolError(
                        f"read of object {seg.key!r}: asked for bytes {want[0]}-{want[1]}, "
                        f"the server answered HTTP {status} with Content-Range "
                        f"{resp.headers.get('Content-Range')!r}"
                    )
        elif status != 200:
            raise ProtocolError(
                f"read of object {seg.key!r}: HTTP {status} to a GET of the whole object"
            )
        if length is not None and length != n:
            if ranged:
                raise ProtocolError(
                    f"read of object {seg.key!r}: {length} bytes in answer to a range of {n}"
                )
            raise XferError(
                f"read of object {seg.key!r}: the object is {length} bytes, the destination "
                f"{n}: read a range of it (objs[key][a:b]) or into {length} bytes"
            )
        pos = 0
        content = resp.content
        while pos < n:
            chunk = await content.readany()
            if not chunk:
                if length is None and "chunked" in resp.headers.get(
                    "Transfer-Encoding", ""
                ).lower():
                    # Its last chunk came: the body is whole, and short (a
                    # chunked body cut off raises ClientPayloadError
                    # instead, and is retried).
                    if ranged:
                        raise ProtocolError(
                            f"read of object {seg.key!r}: {pos} bytes in answer to a "
                            f"range of {n}"
                        )
                    raise XferError(
                        f"read of object {seg.key!r}: the object is {pos} bytes, the "
                        f"destination {n}: read a range of it (objs[key][a:b]) or into "
                        f"{pos} bytes"
                    )
                raise _Transient(f"connection ended after {pos} of {n} bytes")
            end = pos + len(chunk)
            if end > n:
                raise XferError(
                    f"read of object {seg.key!r}: the object is larger than the destination "
                    f"({n} bytes)"
                )
            dst[pos:end] = chunk
            pos = end
        if length is None and not content.at_eof() and await content.read(1):
            raise XferError(
                f"read of object {seg.key!r}: the object is larger than the destination "
                f"({n} bytes)"
            )


# How obstore (object_store) reports a failed request: the kind of an HTTP
# transport error (Connect: no connection was made, the request never left),
# or the status the server answered.
_HTTP_KIND = re.compile(r"HttpError \{\s*kind: (\w+)")
# hyper's connector failed (DNS, TCP, TLS, or its connect timeout, which
# object_store reports as kind Timeout): the request never left either.
_CONNECT_STAGE = re.compile(r"legacy::Error\(\s*Connect\b")
_HTTP_STATUS = re.compile(r"non-2xx status code: (\d{3})")
# rustls refused the server's certificate (hyper's connect stage): final
_BAD_CERT = re.compile(r"InvalidCertificate\(\s*(\w+)")
# Answers after which the server is done with the request; 502 and 504 come
# from a gateway that may have left the server still running it.
_ANSWERED_RETRY = frozenset({408, 429, 500, 503})


def _put_outcome(exc: BaseException) -> Literal["unsent", "answered", "refused", "unknown"]:
    """What a failed PUT attempt did at the server, from obstore's error:
    "unsent" (the connection was never made, a connect timeout included),
    "answered" (the server answered with a status worth another attempt),
    "refused" (it answered with a final status: nothing to wait or look for),
    "unknown" (the request may have reached the server and still be running
    there, or have stored the object: a cut connection, a timeout, a
    gateway's 502 / 504, anything not recognised)."""
    text = str(exc)
    if _BAD_CERT.search(text):
        return "refused"  # never sent, and no later attempt finds it trusted
    status = _HTTP_STATUS.search(text)
    if status is not None:
        code = int(status[1])
        if code in _ANSWERED_RETRY:
            return "answered"
        return "unknown" if code in (502, 504) else "refused"
    kind = _HTTP_KIND.search(text)
    if (kind is not None and kind[1] == "Connect") or _CONNECT_STAGE.search(text):
        return "unsent"
    return "unknown"


@dataclass(frozen=True, slots=True)
class _Target:
    """An object's URL (no query) and what signs requests of it (``creds``
    None: what the region's credential_provider answers, per request)."""

    url: str
    creds: sigv4.Credentials | None
    region: str


# A provider's credentials are asked for again this long before they expire
# (obstore's default; a provider's own ``refresh_threshold`` overrides it).
_REFRESH_THRESHOLD = 300.0


class _Provided:
    """The credentials a region's ``credential_provider`` answers, cached
    for every request of the region: those signed here (``get``) and
    obstore's, which is handed this object as its credential provider
    (``__call__``). One cache, so the provider is asked once per refresh
    (with obstore's cache beside ours it was asked twice), and a refusal
    (``drop``) reaches obstore's requests too: each answer we give obstore
    expires at once, so obstore asks this cache (no call of the provider
    while it holds credentials) for every request it signs.

    Cached until ``refresh_threshold`` (the provider's attribute, a
    timedelta, as obstore reads it; else 5 minutes) before ``expires_at``,
    or, for credentials that already expire within that threshold, for
    half of the time they have left (they were asked for again by every
    request: the threshold was already past). ``expires_at`` None: for
    ever (until refused). A naive ``expires_at`` is refused, as obstore
    refuses it ("expected a datetime with non-None tzinfo"): its time zone
    cannot be guessed (obstore's own providers make theirs aware before
    they answer)."""

    __slots__ = ("_provider", "_url", "_threshold", "cached", "_generation", "_lock", "config")

    def __init__(self, provider: Callable[[], Any], url: str) -> None:
        self._provider = provider
        self._url = url
        threshold = getattr(provider, "refresh_threshold", None)
        self._threshold = (_REFRESH_THRESHOLD if threshold is None
                           else float(threshold.total_seconds()))
        # (credentials, when to ask again: time.time(), None for never)
        self.cached: tuple[sigv4.Credentials, float | None] | None = None
        self._generation = 0  # counts the provider's answers
        self._lock: asyncio.Lock | None = None
        # obstore reads a provider's ``config`` (S3 options it brings):
        # passed on
        self.config = getattr(provider, "config", None)

    def _hit(self) -> tuple[sigv4.Credentials, int] | None:
        cached = self.cached
        if cached is None or (cached[1] is not None and time.time() >= cached[1]):
            return None
        return cached[0], self._generation

    async def get(self) -> tuple[sigv4.Credentials, int]:
        """The credentials to sign with and their generation (for ``drop``);
        the provider asked when none are cached, one call at a time."""
        hit = self._hit()
        if hit is not None:
            return hit
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            hit = self._hit()
            if hit is not None:
                return hit
            failed: str
            try:
                got = self._provider()
                if inspect.isawaitable(got):
                    got = await got
            except Exception as exc:
                # typed as obstore types it (UnauthenticatedError), for our
                # requests and obstore's alike
                failed = f"{type(exc).__name__}: {_describe(exc)}"
            else:
                failed = ""
            if failed:
                raise AccessDenied(f"{self._url}: the credential provider failed: {failed}")
            creds, expires = self._credential(got)
            refresh: float | None = None
            if expires is not None:
                left = expires - time.time()
                refresh = expires - (
                    self._threshold if left > self._threshold else max(0.0, left / 2))
            self._generation += 1
            self.cached = (creds, refresh)
            return creds, self._generation

    def drop(self, generation: int) -> None:
        """Forgets the cached credentials if they are still those of
        ``generation`` (refused by the store): the next request asks the
        provider."""
        if self.cached is not None and self._generation == generation:
            self.cached = None

    def _credential(self, got: Any) -> tuple[sigv4.Credentials, float | None]:
        try:
            creds = sigv4.Credentials(
                str(got["access_key_id"]), str(got["secret_access_key"]),
                None if got.get("token") is None else str(got["token"]))
            expires = got.get("expires_at")
        except (KeyError, TypeError, AttributeError, ValueError):
            raise AccessDenied(
                f"{self._url}: the credential provider answered no S3Credential "
                f"(access_key_id, secret_access_key, token, expires_at)") from None
        if expires is None:
            return creds, None
        if not isinstance(expires, datetime):
            raise AccessDenied(
                f"{self._url}: the credential provider's expires_at is a "
                f"{type(expires).__name__}, not a datetime")
        if expires.utcoffset() is None:
            raise AccessDenied(
                f"{self._url}: the credential provider's expires_at ({expires}) has no "
                f"time zone (obstore refuses such a credential too): answer an aware "
                f"datetime, such as datetime.now(UTC) + timedelta(hours=1)")
        return creds, expires.timestamp()

    def __call__(self) -> Any:
        """obstore's S3CredentialProvider: the cached credentials (a dict),
        or an awaitable of them when the provider must be asked."""
        hit = self._hit()
        if hit is not None:
            return self._for_obstore(hit[0])
        return self._later()

    async def _later(self) -> dict[str, Any]:
        return self._for_obstore((await self.get())[0])

    @staticmethod
    def _for_obstore(creds: sigv4.Credentials) -> dict[str, Any]:
        # expiring now: obstore keeps them for no further request, and asks
        # again (this cache) for its next one
        return {"access_key_id": creds.access_key_id,
                "secret_access_key": creds.secret_access_key,
                "token": creds.token, "expires_at": datetime.now(UTC)}


# The region whose write (_write, a task in its _uploads) the
# current task serves: its requests may open the region's session after
# aclose began (aclose waits for them, then closes it).
_UPLOADING: contextvars.ContextVar[ObjectRegion | None] = contextvars.ContextVar(
    "aioxfer_object_uploading", default=None)

_BACKGROUND: set[asyncio.Task[None]] = set()


def _background(call: Awaitable[None]) -> None:
    """Runs ``call`` to its end with nobody awaiting it (a session's close
    after a cancelled aclose), holding the task until then."""
    task = asyncio.ensure_future(call)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


class _Body(aiohttp.payload.Payload):
    """A request's body, sent from ``body`` (the caller's memory or the
    owned copy) a MiB at a time, no copies, once: consumed as its write
    starts. (aiohttp sends an idempotent request again by itself when a
    kept-alive connection turns out closed, but only while its body is not
    consumed, and a request's head is buffered until its body's first
    write: nothing of it had left. A bytes body would be sent again whole,
    tests/test_obj28_keepalive.py.)

    Its write ends once the kernel has handed all but ``slack`` bytes to
    the server (what the transports hold, the socket's send queue:
    _unsent, and the bytes the server's kernel has acknowledged since the
    request's start: over TLS a MiB of records may wait in a TCP transport
    no other count sees, tests/test_obj29_https.py; ``slack``: what
    min_rate moves in half of read_timeout), not when the last one is queued:
    aiohttp starts the answer's ``read_timeout`` when the write ends, and up
    to a send buffer (4 MiB here) was still queued then: a server reading
    those bytes at ``min_rate`` or better, but slower than 4 MiB per
    ``read_timeout``, timed out (tests/test_obj28_tail.py). (Waiting for
    the queue to be empty would hold each request's end, its connection,
    for a poll step.) The wait is bounded by progress: no byte taken by the
    server for ``stall`` seconds is a TimeoutError (the request's outcome
    unknown), as a read is."""

    _autoclose = True  # (nothing to close)

    def __init__(self, body: bytes | memoryview, stall: float, slack: int) -> None:
        view = memoryview(body)
        super().__init__(view, content_type="application/octet-stream")
        self._view = view
        self._stall = stall
        self._slack = slack
        # (a second descriptor of the request's socket, the bytes its peer
        # had acknowledged and the segments it had sent as the request
        # started): never_reached
        self._probe: socket.socket | None = None
        self._acked0: int | None = None
        self._segs0: int | None = None

    def release(self) -> None:
        """Lets go of the probe (a duplicate descriptor keeps the socket
        open: its FIN waits for this close). Idempotent."""
        probe, self._probe = self._probe, None
        if probe is not None:
            probe.close()

    async def never_reached(self, wait: float) -> bool:
        """After the request failed without an answer: whether it is proven
        that no byte of it reached the server. So when the peer reset the
        connection (TCP_CLOSE: its kernel refused our bytes, as a socket the
        server closed does) having acknowledged none of the request's
        bytes: a server's kernel acknowledges what it takes in, on every
        segment it sends after (its FIN, a close_notify, an answer), so
        a server that read any byte of the request would have acknowledged
        it. That is the race of a server's idle close with our request's
        first write, its FIN on the wire as the write went out
        (tests/test_obj31_idle_race.py): the server's socket was closed
        when our bytes came. The connection may still be half-closed
        (its FIN seen: CLOSE_WAIT) with our bytes on their way: the reset
        is waited for up to ``wait`` seconds.
        And only when a segment came before the reset (the server's FIN):
        a reset alone, with none of the request acknowledged, is also what
        a server (or a proxy) leaves that read the whole request, ran it
        and then reset the connection (SO_LINGER 0) within its delayed ACK
        (a small request on a kept-alive connection: the ACK waits for the
        answer, and a reset's acknowledgement is not taken in). Resent, a
        multipart complete found NoSuchUpload, a create ObjectExists, a PUT
        ran twice (tests/test_rv31c_reset_after_read.py). A server's idle
        close that meets our bytes unread in its kernel also resets alone:
        that PUT's outcome stays unknown (the HEAD says)."""
        probe = self._probe
        if probe is None or self._acked0 is None or self._segs0 is None:
            return False
        deadline = time.monotonic() + wait
        pause = 0.001
        while True:
            info = _tcp_info(probe)
            acked = _acked(info)
            if info is None or acked is None or acked != self._acked0:
                return False
            if info[0] == 7:  # TCP_CLOSE: reset (or closed) with nothing acknowledged
                # the reset and a segment before it (the FIN) came, none of
                # them acknowledging any of the request
                segs = _segs_in(info)
                return segs is not None and (segs - self._segs0) % (1 << 32) >= 2
            if info[0] != 8 or time.monotonic() >= deadline:  # not CLOSE_WAIT
                return False
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.05)

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        raise TypeError("a streamed request body is not decoded")

    async def write(self, writer: Any) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer: Any, content_length: int | None) -> None:
        transport = writer.transport
        sock = None if transport is None else transport.get_extra_info("socket")
        info = None if sock is None else _tcp_info(sock)
        if info is not None and info[0] in (7, 8):  # TCP_CLOSE, TCP_CLOSE_WAIT
            # A pooled connection the server closed (its idle timeout) as
            # we took it: its FIN is in, not yet seen by the loop (it is at
            # the next select; this task runs first). Nothing of this
            # request has left (its head waits for this first write), so
            # its body is not consumed: refused here, aiohttp sends it
            # again on a new connection, as it does a GET, instead of a
            # PUT failing as "outcome unknown" (tests/test_rev33_idle_close.py).
            raise ConnectionResetError(
                errno.ECONNRESET, "the server closed the kept-alive connection")
        # the bytes the server's kernel had acknowledged before this
        # request's first (its head is buffered until the body's first write)
        acked0 = _acked(info)
        self.release()  # (an earlier write's, on a connection aiohttp gave up)
        segs0 = _segs_in(info)
        if (sock is not None and acked0 is not None and segs0 is not None
                and info is not None and info[0] == 1):
            # (ESTABLISHED: a connection in use, pooled or new)
            try:
                self._probe = socket.socket(fileno=os.dup(sock.fileno()))
                self._acked0 = acked0
                self._segs0 = segs0
            except OSError:
                self._probe = None
        out0 = int(getattr(writer, "output_size", 0))
        self._consumed = True
        view = self._view
        for at in range(0, len(view), _READ_BUFSIZE):
            await writer.write(view[at:at + _READ_BUFSIZE])
        if transport is None or sock is None:
            return
        fd = sock.fileno()
        n = len(view)
        # What the acknowledged count holds besides the body: the head and,
        # over TLS, each record's header and tag (0.13% of a body over TLS
        # 1.3, 0.18% over 1.2: 88 and 116 KiB of 64 MiB, more than the
        # slack for a large body, which then ended that much early:
        # tests/test_rev37_tls_tail.py). Never more than the stream holds
        # (the wait could never end): a lower bound.
        extra = _overhead(transport, int(getattr(writer, "output_size", 0)) - out0, n)

        def queued() -> int:
            """The bytes of this request not yet taken by the server's
            kernel: what the transport holds, and the socket's send queue;
            over TLS also what the transport's own does not count, the
            records in the TCP transport beneath it (asyncio's and uvloop's
            alike: up to a MiB once the kernel's send buffer is full,
            tests/test_obj29_https.py), which the bytes the kernel saw
            acknowledged since the request's start tell (less ``extra``,
            the head and the records' overhead)."""
            left = int(transport.get_write_buffer_size()) + _unsent(fd)
            if acked0 is not None:
                acked = _acked(_tcp_info(sock))
                if acked is not None:
                    left = max(left, n - (acked - acked0 - extra))
            return left

        left = queued()
        pause = 0.001
        moved = time.monotonic()
        while left > self._slack:
            try:
                await asyncio.sleep(pause)
            except asyncio.CancelledError:
                # aiohttp cancels a body's writer task as the answer ends
                # (or the request is given up: then it closes the
                # connection itself). The answer may well come while we
                # sleep here: the server had the bytes, the queue drained
                # between two polls. Raised, the cancel made aiohttp close
                # a connection that is fine (write_bytes), a new one for
                # each such request (tests/test_rev33_body.py). Where the
                # server's kernel has acknowledged every byte (as it has
                # once it answered the whole body), the write ends as it
                # would have without this wait, but for the answer's read
                # timeout, which aiohttp starts next: there is no answer to
                # wait for any more, and a timer left running on a
                # connection back in the pool would fail its next request.
                # With bytes still queued (an early answer, a cancel) the
                # connection is closed, as before.
                if queued() > 0:
                    raise
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()
                protocol = writer.protocol
                if protocol is not None:
                    # (the next request on it sets its own)
                    protocol.read_timeout = None
                return
            pause = min(pause * 2, 0.05)
            now = queued()
            if now < left:
                moved = time.monotonic()
            elif time.monotonic() - moved > self._stall:
                raise TimeoutError(
                    f"the server took none of the body's last {now} bytes for "
                    f"{self._stall:g} s")
            left = now


def _tcp_info(sock: Any) -> bytes | None:
    """A connected TCP socket's TCP_INFO (Linux), None where that cannot be
    asked."""
    if sys.platform != "linux":
        return None
    try:
        got = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    except (OSError, AttributeError):
        return None
    return got if isinstance(got, bytes) else None


def _overhead(transport: Any, written: int, n: int) -> int:
    """The bytes other than the body's ``n`` that the request put on the
    wire after its start, at least: the head (``written``: what aiohttp's
    writer took since, head and body; 0 where it cannot tell) and, over TLS,
    what each record adds to its plaintext (every record carries at most
    16 KiB of it), taken at the least its version and cipher allow."""
    plain = max(written, n)
    extra = plain - n
    ssl_object = transport.get_extra_info("ssl_object")
    if ssl_object is None:
        return extra
    try:
        version = str(ssl_object.version())
        cipher = str((ssl_object.cipher() or ("",))[0]).upper()
    except (AttributeError, ValueError, TypeError):
        version, cipher = "", ""
    short_tag = "CCM8" in cipher or "CCM_8" in cipher  # an 8-byte AEAD tag
    if version == "TLSv1.3":
        # header 5, inner content type 1, tag 16 (8)
        per = 14 if short_tag else 22
    elif version == "TLSv1.2" and "GCM" in cipher:
        per = 29  # header 5, explicit nonce 8, tag 16
    elif version.startswith("TLSv1"):
        per = 21  # ChaCha20-Poly1305 (header 5, tag 16), CCM_8; CBC adds more
    else:
        per = 5  # a record header at least
    return extra + -(-plain // _TLS_RECORD) * per


_TLS_RECORD = 1 << 14  # a TLS record's most plaintext


# struct tcp_info: tcpi_bytes_acked, a u64 at this offset (Linux 4.1+);
# tcpi_segs_in, a u32 (Linux 4.2+: the segments received, resets too)
_BYTES_ACKED = 120
_SEGS_IN = 140
_TCP_INFO_LEN = _SEGS_IN + 4


def _acked(info: bytes | None) -> int | None:
    """The bytes the peer acknowledged on this connection (TCP_INFO's
    tcpi_bytes_acked), None where TCP_INFO has none (before Linux 4.1)."""
    if info is None or len(info) < _BYTES_ACKED + 8:
        return None
    return int.from_bytes(info[_BYTES_ACKED:_BYTES_ACKED + 8], sys.byteorder)


def _segs_in(info: bytes | None) -> int | None:
    """The segments the peer's side sent that this socket took in
    (TCP_INFO's tcpi_segs_in, a u32 that wraps), None before Linux 4.2."""
    if info is None or len(info) < _SEGS_IN + 4:
        return None
    return int.from_bytes(info[_SEGS_IN:_SEGS_IN + 4], sys.byteorder)


def _unsent(fd: int) -> int:
    """The bytes of a TCP socket's send queue the peer has not acknowledged
    (Linux's SIOCOUTQ); 0 where that cannot be asked (another system, a
    socket already closed): the write then ends as it always did."""
    if sys.platform != "linux" or fd < 0:
        return 0
    try:
        got = fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0\0\0\0")
    except OSError:
        return 0
    return int.from_bytes(got, sys.byteorder, signed=True)


def _xml_text(text: str, tag: str) -> str | None:
    """The text of the first element ``tag`` of an S3 answer, its XML
    references decoded (a complete's ETag comes as ``&quot;...&quot;``),
    without whitespace around it (an indented answer); None if none."""
    m = re.search(f"<{tag}>([^<]*)</{tag}>", text)
    return None if m is None else html.unescape(m[1]).strip()


def _failed(what: str, resp: aiohttp.ClientResponse, code: str) -> XferError:
    if resp.status == 404:
        return ObjectNotFound(f"{what}: not found ({code or 'HTTP 404'})")
    return XferError(f"{what}: HTTP {resp.status} {code}".rstrip())


_ANSWER_MAX = 1 << 16  # an S3 XML answer we read (create, complete, errors)


async def _answer_body(resp: aiohttp.ClientResponse) -> bytes:
    """The whole body of a small XML answer, up to _ANSWER_MAX bytes (the
    rest, if any, is not read): content.read(n) returns what has arrived so
    far, and S3 sends a complete's 200 with whitespace first, its outcome
    (result or <Error>) later in the same body (rev21 #1/#2)."""
    got = bytearray()
    while len(got) < _ANSWER_MAX:
        chunk = await resp.content.read(_ANSWER_MAX - len(got))
        if not chunk:
            break
        got += chunk
    return bytes(got)


async def _created(
    what: str, resp: aiohttp.ClientResponse, text: str, code: str, attempt: int
) -> str:
    if resp.status != 200:
        raise _failed(what, resp, code)
    upload_id = _xml_text(text, "UploadId")
    if not upload_id:
        raise ProtocolError(f"{what}: HTTP 200 without an UploadId")
    if _UPLOAD_ID.fullmatch(upload_id) is None:
        raise ProtocolError(f"{what}: HTTP 200 with a malformed UploadId {upload_id[:80]!r}")
    return upload_id


def _md5_b64(data: memoryview) -> str:
    """A Content-MD5 header's value: the base64 of the bytes' MD5."""
    return base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()


# Bodies up to this size are hashed on the loop's thread: a worker thread's
# hop costs more than their MD5 (~1.7 ms a MiB here, hashlib's 0.6 GB/s).
_MD5_INLINE = 256 << 10


class _Digest:
    """The MD5 of one write's body (a single PUT's), hashed at most once,
    when first asked for: for its Content-MD5 (``part_md5``) and for the
    check after an unknown outcome (_landed), which reuses it. A body over
    _MD5_INLINE bytes is hashed on a worker thread (hashlib lets go of the
    GIL), never on the event loop's thread: a create's body may be 5 GiB,
    seconds of a blocked loop. From the caller's buffer (not ``owned``) the
    hash is waited for through a cancel, as the upload (_upload): the
    thread reads that buffer, which the caller may reuse once the write
    returns."""

    __slots__ = ("_body", "_owned", "_b64")

    def __init__(self, body: bytes | memoryview, owned: bool) -> None:
        self._body = body
        self._owned = owned
        self._b64: str | None = None

    @property
    def nbytes(self) -> int:
        return memoryview(self._body).nbytes

    async def b64(self, region: ObjectRegion) -> str:
        """The MD5 as a Content-MD5 header's value (base64)."""
        if self._b64 is None:
            view = memoryview(self._body)
            if view.nbytes <= _MD5_INLINE:
                self._b64 = _md5_b64(view)
            else:
                self._b64 = await region._upload(
                    self._owned, asyncio.to_thread(_md5_b64, view))
        return self._b64

    async def hex(self, region: ObjectRegion) -> str:
        """The MD5 in hex, as an MD5 e-tag is."""
        return base64.b64decode(await self.b64(region)).hex()


async def _part_done(
    what: str, resp: aiohttp.ClientResponse, text: str, code: str, attempt: int
) -> str:
    if resp.status == 400 and code == "BadDigest":
        # Content-MD5 (part_md5) did not match what arrived: the bytes
        # changed on the way; the part is sent again.
        raise _Transient(f"HTTP 400 {code}")
    if resp.status != 200:
        raise _failed(what, resp, code)
    e_tag = resp.headers.get("ETag")
    if not e_tag:
        raise ProtocolError(f"{what}: HTTP 200 without an ETag")
    if _ETAG.fullmatch(e_tag) is None:
        # sent back in the complete's XML: a control character would make
        # it malformed XML, a non-ASCII one could not even be encoded
        raise ProtocolError(f"{what}: HTTP 200 with a malformed ETag {e_tag[:80]!r}")
    return e_tag


async def _completed(
    what: str, resp: aiohttp.ClientResponse, text: str, code: str, attempt: int
) -> str | None:
    if resp.status == 404 and code == "NoSuchUpload" and attempt > 1:
        # An earlier attempt (its answer lost) may have completed it: the
        # HEAD that follows every multipart write (_check_completed) says.
        return None
    if resp.status != 200:
        raise _failed(what, resp, code)
    if "<CompleteMultipartUploadResult" not in text:
        # Not an answer S3 gives to a complete that is done (a proxy's page,
        # a body cut short): its outcome is not known; sent again, it
        # completes or finds no such upload (then the HEAD says).
        raise _Transient("HTTP 200 without a CompleteMultipartUploadResult")
    e_tag = _xml_text(text, "ETag") or ""
    if e_tag and _ETAG.fullmatch(e_tag) is None:
        # compared with the HEAD's (_check_completed): the upload's outcome
        # is known (completed), the answer not to be trusted
        raise ProtocolError(f"{what}: HTTP 200 with a malformed ETag {e_tag[:80]!r}")
    return e_tag


async def _aborted(
    what: str, resp: aiohttp.ClientResponse, text: str, code: str, attempt: int
) -> None:
    if resp.status not in (200, 204, 404):
        raise _failed(what, resp, code)


def _refuse_status(what: str, resp: aiohttp.ClientResponse, code: str) -> None:
    """What our own requests (signed here or presigned) do with an answer's
    status before the caller reads it: transient ones are retried
    (_Transient), 401/403 are AccessDenied, a redirect fails (never
    followed)."""
    status = resp.status
    if status in _TRANSIENT_HTTP:
        raise _Transient(f"HTTP {status} {code}".strip())
    if status in (401, 403):
        raise AccessDenied(f"{what}: access denied ({code or f'HTTP {status}'})")
    if 300 <= status < 400:
        raise _redirected(what, status, resp)


def _redirected(what: str, status: int, resp: aiohttp.ClientResponse) -> XferError:
    try:
        where = urlsplit(resp.headers.get("Location", ""))
        to = f" to {where.scheme}://{where.netloc}" if where.netloc else ""
    except ValueError:  # ("http://[x": an IPv6 literal unclosed) only not named
        to = " to a malformed Location"
    return XferError(
        f"{what}: the server redirected (HTTP {status}{to}) a signed request; "
        f"redirects are not followed (is the endpoint or region right?)"
    )


def _etag(e_tag: str | None) -> str:
    """An e-tag as compared: without its quotes and weak marker, lower case."""
    e = (e_tag or "").strip()
    if e.startswith("W/"):
        e = e[2:]
    return e.strip('"').lower()


class _Transient(Exception):
    """A failure worth retrying (5xx, 429, a connection cut short)."""


class _Refusal:
    """Whether a request was already sent once more after a 401/403
    (ObjectRegion._send_again_refused): at most once per request."""

    __slots__ = ("spent",)

    def __init__(self) -> None:
        self.spent = False


class _PutFailed(Exception):
    """A PUT attempt that failed for a reason other than a final answer:
    ``outcome`` as _put_outcome sorts it, ``why`` its description (signed
    queries left out), ``err`` the error to raise if no attempt follows."""

    def __init__(self, outcome: Literal["unsent", "answered", "refused", "unknown", "stale"],
                 why: str, err: XferError) -> None:
        super().__init__(why)
        self.outcome = outcome
        self.why = why
        self.err = err


def _malformed(exc: aiohttp.ClientResponseError) -> str:
    """What aiohttp's parser refused in an answer (a malformed status line
    or header, e.g. a Content-Length it cannot read: aiohttp raises
    ClientResponseError for those, and for nothing else we ask of it, with
    neither raise_for_status nor redirects): a ProtocolError's text, not a
    transport failure to retry."""
    return f"the server's answer is malformed ({_describe(exc)})"


def _xml_code(body: str) -> str:
    """An S3 error body's <Code> ("" if none). It goes into error texts and
    is compared with known codes: one that is not a code (S3's are short
    words, letters, digits and dots: NoSuchKey, XAmzContentSHA256Mismatch),
    such as a hostile or broken server's 60 KiB, or one with a newline and
    terminal escapes (a forged log line), is named, not quoted
    (tests/test_obj31_hostile.py)."""
    m = re.search(r"<Code>([^<]*)</Code>", body)
    if m is None:
        return ""
    code = m[1].strip()
    return code if _S3_CODE.fullmatch(code) else f"(malformed error code of {len(code)} chars)"


_S3_CODE = re.compile(r"[A-Za-z][A-Za-z0-9.]{0,99}")


# A presigned URL is a bearer credential for its lifetime (_SIGN_TTL): its
# query (X-Amz-Credential, -Security-Token, -Signature) must reach no error
# text, log line or metric. aiohttp puts whole request URLs in some errors
# ("Connection timeout to host <url>", redirect and response errors).
_URL_QUERY = re.compile(r"((?:https?|s3a?)://[^\s?#'\"<>]*)\?[^\s'\"<>]*")
_SIGNED_PARAM = re.compile(
    r"(X-Amz-(?:Signature|Credential|Security-Token)|Signature|AWSAccessKeyId)"
    r"=[^&\s'\"<>]*",
    re.IGNORECASE,
)


_SIGNING = re.compile(r"x-amz-|signature=|awsaccesskeyid=", re.IGNORECASE)


def _unsigned(text: str) -> str:
    """``text`` with the query of every presigned URL left out (one with
    any signing parameter: ``X-Amz-*``, ``Signature``, ``AWSAccessKeyId``;
    others, such as an ``uploadId``, stay) and, anywhere else, the value of
    every secret signing parameter."""
    text = _URL_QUERY.sub(
        lambda m: f"{m[1]}?(signed query omitted)" if _SIGNING.search(m[0]) else m[0], text
    )
    return _SIGNED_PARAM.sub(r"\1=(omitted)", text)


def _describe(exc: BaseException) -> str:
    """The first line of an error's text, signed queries left out (_unsigned)."""
    text = str(exc) or type(exc).__name__
    first = text.splitlines()[0] if text else type(exc).__name__
    return _unsigned(first)


async def _typed(move: Awaitable[None], doing: str, seg: ObjectSegment) -> None:
    """Awaits a put or get; an error other than an XferError (from aiohttp,
    obstore or a bug of ours) becomes an XferError whose text leaves signed
    queries out, the original neither its cause nor its context (the base
    backend would keep it as the cause: its text, or its request's URL, could
    carry a presigned URL into a traceback or a log)."""
    failed: str
    try:
        await move
        return
    except XferError:
        raise
    except Exception as exc:
        failed = f"{type(exc).__name__}: {_describe(exc)}"
    raise XferError(f"{doing} of object {seg.key!r} in {seg.region.url} failed: {failed}")


def _untrusted(what: str, exc: BaseException | str) -> TransportError:
    """The error of a request whose TLS handshake found the server's
    certificate not trusted (or not for its host): final, not retried (no
    later attempt finds it trusted)."""
    return TransportError(
        f"{what} failed: the server's certificate is not trusted "
        f"({exc if isinstance(exc, str) else _describe(exc)}); a "
        f"private CA is trusted through register_objects(..., ca_bundle=...) (AWS_CA_BUNDLE "
        f"is not read: ca_bundle=os.environ['AWS_CA_BUNDLE'])")


def _obstore_error(exc: BaseException, doing: str, key: str, url: str) -> XferError:
    what = f"{doing} of object {key!r} in {url}"
    first = _describe(exc)
    if isinstance(exc, obx.NotFoundError | FileNotFoundError):
        return ObjectNotFound(f"{what}: no such key or bucket ({first})")
    if isinstance(exc, obx.PermissionDeniedError | obx.UnauthenticatedError | PermissionError):
        return AccessDenied(f"{what}: access denied ({first})")
    if isinstance(exc, obx.AlreadyExistsError | obx.PreconditionError | FileExistsError):
        return ObjectExists(f"{what}: the key exists (conditional create)")
    if isinstance(exc, obx.InvalidPathError):
        return XferError(f"{what}: invalid key ({first})")
    cert = _BAD_CERT.search(str(exc))
    if cert is not None:
        return _untrusted(what, f"{first}: InvalidCertificate({cert[1]})")
    return TransportError(f"{what} failed: {first}")


class ObjectBackend(LocalBackend):
    """The built-in "object" backend: S3-compatible object storage."""

    name = "object"
    kind = "object"

    def far_segments(self, far: Any, op: Op) -> Sequence[Any]:
        if isinstance(far, ObjectSegment):
            return (far,)
        if isinstance(far, ObjectSegmentList):
            return far._segs
        if isinstance(far, Sequence) and not isinstance(far, str | bytes):
            for i, seg in enumerate(far):
                if not isinstance(seg, ObjectSegment):
                    raise TypeError(
                        f"far segment {i} is a {type(seg).__name__}, not an ObjectSegment"
                    )
            return far
        raise TypeError(f"not object segments: {type(far).__name__}")

    def check_pair(self, seg: ObjectSegment, local_length: int, op: Op, i: int) -> None:
        if op == "write":
            if not seg.whole:
                raise ValueError(
                    f"segment {i}: writes replace whole objects: write objs[key], not {seg!r}"
                )
        elif seg.length is not None and seg.length != local_length:
            raise ValueError(
                f"segment {i}: local length {local_length} != object range length {seg.length}"
            )

    async def put(self, src: memoryview, far: ObjectSegment) -> None:
        await _typed(far.region._put(src, far), "write", far)

    async def get(self, dst: memoryview, far: ObjectSegment) -> None:
        await _typed(far.region._get(dst, far), "read", far)

    def register(
        self,
        url: str,
        *,
        endpoint: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        region: str | None = None,
        name: str | None = None,
        part_size: int = PART_SIZE,
        max_retries: int = 4,
        retry_timeout: float = 10.0,
        connect_timeout: float = 2.0,
        read_timeout: float = 15.0,
        resend_unknown_puts: bool = False,
        check_multipart: bool = True,
        min_rate: float = MIN_RATE,
        part_md5: bool = False,
        credential_provider: Callable[[], Any] | None = None,
        ca_bundle: str | os.PathLike[str] | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> ObjectRegion:
        """See ``Agent.register_objects`` and this module's docstring (the
        options)."""
        parts = urlsplit(url)
        if parts.scheme not in ("s3", "s3a") or not parts.netloc:
            raise RegistrationError(f"cannot register {url!r}: expected s3://bucket[/prefix]")
        if part_size < 5 << 20:
            raise RegistrationError("part_size must be at least 5 MiB (the S3 minimum)")
        if max_retries < 0 or not retry_timeout > 0 or not connect_timeout > 0:
            raise RegistrationError("max_retries >= 0; retry_timeout, connect_timeout > 0")
        if not min_rate > 0:
            raise RegistrationError("min_rate > 0 (bytes per second)")
        if credential_provider is not None and not callable(credential_provider):
            raise RegistrationError("credential_provider is a callable (obstore's)")
        if not isinstance(getattr(credential_provider, "refresh_threshold", None),
                          timedelta | None):
            raise RegistrationError("credential_provider.refresh_threshold is a timedelta")
        bucket = parts.netloc
        prefix = parts.path.strip("/") or None
        provided = None if credential_provider is None else _Provided(credential_provider, url)
        if endpoint is None:  # as obstore would find it, to know whether it is plain HTTP
            endpoint = next(
                (os.environ[v] for v in _ENDPOINT_VARS if os.environ.get(v)), None
            )
        config: dict[str, Any] = {}
        for key, value in (
            ("endpoint", endpoint),
            ("access_key_id", access_key_id),
            ("secret_access_key", secret_access_key),
            ("session_token", session_token),
            ("region", region),
            ("credential_provider", provided),
        ):
            if value is not None:
                config[key] = value
        client: dict[str, Any] = {
            "connect_timeout": timedelta(seconds=connect_timeout),
            "read_timeout": timedelta(seconds=read_timeout),
        }
        if (endpoint or "").startswith("http://"):
            client["allow_http"] = True
        tls = _tls(url, ca_bundle, ssl_context, client)
        # obstore's own retries (HEAD, DELETE, multipart uploads) bounded like
        # ours: its default retries a dead endpoint for three minutes. A
        # single PUT goes through a second client without them (_put_single).
        retry_config: dict[str, Any] = {
            "max_retries": max_retries,
            "retry_timeout": timedelta(seconds=retry_timeout),
            "backoff": {
                "init_backoff": timedelta(milliseconds=100),
                "max_backoff": timedelta(seconds=2),
                "base": 2,
            },
        }
        try:
            store, put_store = (
                S3Store(
                    bucket,
                    prefix=prefix,
                    client_options=client,  # type: ignore[arg-type]
                    retry_config=retries,  # type: ignore[arg-type]
                    **config,
                )
                for retries in (retry_config, {**retry_config, "max_retries": 0})
            )
        except (obx.BaseError, ValueError, TypeError) as exc:
            raise RegistrationError(f"cannot register {url!r}: {_describe(exc)}") from None
        if name is None:
            name, k = url, 1
            while name in self._regions:
                name, k = f"{url}#{k}", k + 1
        # Static credentials (given, or from the environment as obstore reads
        # them): the multipart upload's requests are then signed here.
        key_id = access_key_id or os.environ.get("AWS_ACCESS_KEY_ID")
        secret = secret_access_key or os.environ.get("AWS_SECRET_ACCESS_KEY")
        if credential_provider is not None:
            key_id = secret = None  # the provider's, asked for per request
        elif ssl_context is not None and not (key_id and secret):
            raise RegistrationError(
                f"cannot register {url!r}: ssl_context needs credentials that aioxfer signs "
                f"with (access keys or a credential_provider): obstore's client, which "
                f"cannot take the context, would send requests")
        objs = ObjectRegion(
            self,
            name,
            url,
            store,
            put_store,
            _Retry(max_retries, retry_timeout),
            part_size,
            connect_timeout,
            read_timeout,
            bool(resend_unknown_puts),
            (key_id, secret) if key_id and secret else None,
            bool(check_multipart),
            float(min_rate),
            bool(part_md5),
            provided,
            tls,
            ssl_context is not None,
        )
        self._add_region(objs)
        return objs


def _tls(url: str, ca_bundle: str | os.PathLike[str] | None,
         ssl_context: ssl.SSLContext | None, client: dict[str, Any]) -> ssl.SSLContext | None:
    """The TLS context of our requests (None: aiohttp's default, the
    system's roots); a ``ca_bundle`` is also given to obstore's ``client``
    options: its CAs trusted by both clients, beside the system's (obstore
    adds them to its roots)."""
    if ssl_context is not None:
        if not isinstance(ssl_context, ssl.SSLContext):
            raise RegistrationError(
                f"cannot register {url!r}: ssl_context is an ssl.SSLContext, "
                f"not {type(ssl_context).__name__}")
        if ca_bundle is not None:
            raise RegistrationError(
                f"cannot register {url!r}: give either ca_bundle or ssl_context (a context "
                f"loads its own CAs), not both")
        return ssl_context
    if ca_bundle is None:
        return None
    path = Path(ca_bundle)
    try:
        pem = path.read_bytes()
        ctx = ssl.create_default_context()
        ctx.load_verify_locations(cafile=str(path))
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise RegistrationError(
            f"cannot register {url!r}: ca_bundle {str(path)!r} is not a readable PEM file of "
            f"CA certificates ({_describe(exc)})") from None
    client["root_certificate"] = pem
    return ctx


def register_objects(agent: Agent, url: str, **kwargs: Any) -> ObjectRegion:
    """``agent.register_objects``: an ObjectRegion of the agent's "object" backend."""
    from aioxfer.backends import registry

    backend = registry.instance(agent, "object")
    assert isinstance(backend, ObjectBackend)
    return backend.register(url, **kwargs)
