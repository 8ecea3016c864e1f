"""AWS Signature Version 4 for S3 requests: signed headers and presigned URLs.

The object backend signs the requests it sends itself (with aiohttp, never
following a redirect) where obstore cannot sign them: obstore presigns a URL
of a path only, not one with a query such as a multipart upload's
``?uploads`` or ``?uploadId=``, and the requests it sends itself follow a
redirect to another host with the session token.

Only hmac and hashlib. The canonical request, string to sign and signing
key are AWS's ("Authenticating Requests (AWS Signature Version 4)", Amazon
S3 API reference); tests/test_obj20_sigv4.py checks them against AWS's
published test-suite vectors and a server that verifies signatures. S3
specifics: the canonical URI is the request's path as sent (already
percent-encoded, not normalised nor encoded twice), and a session token is
signed (a header ``x-amz-security-token``, or in a presigned URL the query
parameter ``X-Amz-Security-Token``).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from urllib.parse import quote, unquote, urlsplit

__all__ = [
    "EMPTY_SHA256",
    "UNSIGNED_PAYLOAD",
    "Credentials",
    "canonical_query",
    "presign",
    "sign_headers",
    "signature",
    "uri_encode",
]

ALGORITHM = "AWS4-HMAC-SHA256"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"


@dataclass(frozen=True)
class Credentials:
    """Static credentials; ``token`` is the session token of temporary ones."""

    access_key_id: str
    secret_access_key: str = field(repr=False)
    token: str | None = field(default=None, repr=False)


def uri_encode(text: str) -> str:
    """AWS's UriEncode of a query name or value: every byte but the
    unreserved ``A-Z a-z 0-9 - _ . ~`` as %XY (upper case hex)."""
    return quote(text, safe="-_.~")


def canonical_query(params: Iterable[tuple[str, str]]) -> str:
    """The canonical query string: names and values UriEncoded, sorted by
    name, then value; ``name=`` for an empty value."""
    pairs = sorted((uri_encode(k), uri_encode(v)) for k, v in params)
    return "&".join(f"{k}={v}" for k, v in pairs)


_HOSTS: dict[str, str] = {}


def _host(url: str) -> tuple[str, str, str]:
    """(host header value, path, query) of ``url``; the host without a
    default port, as HTTP clients send it. The host of a URL's
    ``scheme://authority`` is cached (a region signs for one endpoint:
    urlsplit's host and port parsing was a quarter of a signature's cost),
    its path and query split here; URLs whose start is not that plain
    shape go the whole way."""
    start = url.find("://")
    end = url.find("/", start + 3) if start > 0 else -1
    if end > 0 and "#" not in url and "@" not in url[:end]:
        host = _HOSTS.get(url[:end])
        if host is not None:
            path, _, query = url[end:].partition("?")
            return host, path, query
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    port = parts.port
    if port is not None and (parts.scheme, port) not in (("http", 80), ("https", 443)):
        host = f"{host}:{port}"
    if end > 0 and "#" not in url and "@" not in url[:end] and parts.path:
        if len(_HOSTS) > 64:
            _HOSTS.clear()
        _HOSTS[url[:end]] = host
    return host, parts.path or "/", parts.query


def _query_pairs(query: str) -> list[tuple[str, str]]:
    """The name/value pairs of a query as written in a URL (percent-decoded:
    canonical_query encodes them again, one way)."""
    out = []
    for item in query.split("&") if query else ():
        k, _, v = item.partition("=")
        out.append((unquote(k), unquote(v)))
    return out


_KEYS: dict[tuple[str, str, str, str], bytes] = {}


def _signing_key(secret: str, day: str, region: str, service: str) -> bytes:
    # The same for a day: cached (a handful of HMACs saved per request).
    ck = (secret, day, region, service)
    key = _KEYS.get(ck)
    if key is None:
        key = hmac.digest(f"AWS4{secret}".encode(), day.encode(), "sha256")
        for part in (region, service, "aws4_request"):
            key = hmac.digest(key, part.encode(), "sha256")
        if len(_KEYS) > 64:
            _KEYS.clear()
        _KEYS[ck] = key
    return key


def signature(
    secret: str,
    amz_date: str,
    region: str,
    service: str,
    method: str,
    path: str,
    query: str,
    headers: Mapping[str, str],
    payload_hash: str,
) -> tuple[str, str]:
    """(signature hex, signed header names) of a request: ``path`` as sent
    (percent-encoded), ``query`` canonical (canonical_query), ``headers``
    those signed, by lower-case name (their values trimmed, inner runs of
    spaces made one)."""
    names = sorted(headers)
    canon_headers = "".join(f"{n}:{' '.join(headers[n].split())}\n" for n in names)
    signed = ";".join(names)
    canonical = "\n".join((method, path, query, canon_headers, signed, payload_hash))
    day = amz_date[:8]
    scope = f"{day}/{region}/{service}/aws4_request"
    to_sign = "\n".join(
        (ALGORITHM, amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest())
    )
    key = _signing_key(secret, day, region, service)
    return hmac.new(key, to_sign.encode(), "sha256").hexdigest(), signed


# (second, its X-Amz-Date): formatted once a second, replaced whole (a
# thread reading it sees one pair)
_DATE: tuple[int, str] = (-1, "")


def _amz_date(now: datetime | None) -> str:
    global _DATE
    if now is None:
        second = int(time.time())
        cached = _DATE
        if cached[0] == second:
            return cached[1]
        text = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(second))
        _DATE = (second, text)
        return text
    return now.astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")


def sign_headers(
    method: str,
    url: str,
    creds: Credentials,
    region: str,
    *,
    headers: Mapping[str, str] | None = None,
    payload_hash: str = EMPTY_SHA256,
    service: str = "s3",
    now: datetime | None = None,
    content_sha256: bool = True,
) -> dict[str, str]:
    """The headers to send ``method url`` with, signed in the Authorization
    header: ``headers`` (all signed) and Host, X-Amz-Date,
    X-Amz-Content-Sha256 (``payload_hash``: the body's SHA-256 hex, or
    UNSIGNED_PAYLOAD; left out with ``content_sha256=False``, for services
    other than S3) and X-Amz-Security-Token (a session token) added."""
    host, path, query = _host(url)
    amz_date = _amz_date(now)
    out = dict(headers or {})
    out["Host"] = host
    out["X-Amz-Date"] = amz_date
    if content_sha256:
        out["X-Amz-Content-Sha256"] = payload_hash
    if creds.token is not None:
        out["X-Amz-Security-Token"] = creds.token
    sig, signed = signature(
        creds.secret_access_key, amz_date, region, service, method, path,
        canonical_query(_query_pairs(query)), {k.lower(): v for k, v in out.items()},
        payload_hash,
    )
    out["Authorization"] = (
        f"{ALGORITHM} Credential={creds.access_key_id}/{amz_date[:8]}/{region}/{service}/"
        f"aws4_request, SignedHeaders={signed}, Signature={sig}"
    )
    return out


def presign(
    method: str,
    url: str,
    creds: Credentials,
    region: str,
    expires: int,
    *,
    service: str = "s3",
    now: datetime | None = None,
) -> str:
    """``url`` presigned for ``method`` for ``expires`` seconds: its query
    (kept) and the signing parameters, canonically encoded and ordered, the
    signature last; only Host signed, the payload UNSIGNED-PAYLOAD (S3's
    rule for presigned URLs)."""
    host, path, query = _host(url)
    amz_date = _amz_date(now)
    params = _query_pairs(query)
    scope = f"{amz_date[:8]}/{region}/{service}/aws4_request"
    params += [
        ("X-Amz-Algorithm", ALGORITHM),
        ("X-Amz-Credential", f"{creds.access_key_id}/{scope}"),
        ("X-Amz-Date", amz_date),
        ("X-Amz-Expires", str(expires)),
        ("X-Amz-SignedHeaders", "host"),
    ]
    if creds.token is not None:
        params.append(("X-Amz-Security-Token", creds.token))
    canon = canonical_query(params)
    sig, _ = signature(
        creds.secret_access_key, amz_date, region, service, method, path, canon,
        {"host": host}, UNSIGNED_PAYLOAD,
    )
    base = url.split("?", 1)[0].split("#", 1)[0]
    return f"{base}?{canon}&X-Amz-Signature={sig}"
