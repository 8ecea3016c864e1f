"""obj24: the object backend's leads left by obj22 / rev23 (notes/s22.md).

6. An uncancelled ``ObjectRegion.aclose`` waited for the multipart uploads
   in flight, then closed the region: the write's own HEAD check (after the
   upload) then found the region closed (ClosedResourceError) although its
   object was stored.
4. A write through a ``credential_provider`` asked it twice (once through
   obstore's cache of credentials, once through ours).
1. With a provider, a 403 (stale keys: SignatureDoesNotMatch from rclone)
   kept the cached credentials: every request failed until they expired.
   Now they are dropped and the request sent again once with fresh ones.
2. Credentials expiring within 5 minutes were never cached: the provider
   was asked by every request of ours.
3. A naive ``expires_at`` was read as local time; obstore refuses it
   ("expected a datetime with non-None tzinfo"): so do we, by name.

All against rclone (tests/s3server.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import s3server
from conftest import pattern, within
from s3server import ACCESS_KEY, SECRET_KEY, S3Server

from aioxfer.errors import AccessDenied

s3 = s3server.s3  # the fixture, by name

MakeAgent = Callable[..., Awaitable[Any]]
MiB = 1 << 20


class Provider:
    """An S3CredentialProvider (obstore's callback) that counts its calls.
    Its first ``stale`` answers carry a wrong secret (rclone answers 403
    SignatureDoesNotMatch), the later ones the server's keys. ``expires``:
    how long after each call its answer expires (None: never);
    ``naive``: expires_at without a time zone."""

    def __init__(self, stale: int = 0, expires: float | None = None,
                 naive: bool = False, is_async: bool = False) -> None:
        self.calls = 0
        self.stale = stale
        self.expires = expires
        self.naive = naive
        self.is_async = is_async

    def answer(self) -> dict[str, Any]:
        self.calls += 1
        secret = "stale-secret" if self.calls <= self.stale else SECRET_KEY
        expires_at: datetime | None = None
        if self.expires is not None:
            expires_at = datetime.now(UTC) + timedelta(seconds=self.expires)
            if self.naive:
                expires_at = expires_at.replace(tzinfo=None)
        return {"access_key_id": ACCESS_KEY, "secret_access_key": secret, "token": None,
                "expires_at": expires_at}

    def __call__(self) -> Any:
        if self.is_async:
            async def later() -> dict[str, Any]:
                await asyncio.sleep(0)
                return self.answer()
            return later()
        return self.answer()


def provided(agent: Any, s3: S3Server, provider: Provider, **kw: Any) -> Any:
    bucket = s3.bucket("p")
    return agent.register_objects(f"s3://{bucket}/p", endpoint=s3.endpoint,
                                  region="us-east-1", part_size=5 * MiB,
                                  credential_provider=provider, **kw)


async def roundtrip(agent: Any, objs: Any, key: str, n: int) -> None:
    src = agent.alloc(n)
    src.numpy()[:] = pattern(n, n)
    await within(agent.write(src[:], objs[key]), 60)
    dst = agent.alloc(n)
    await within(agent.read(dst[:], objs[key]), 60)
    assert bytes(dst.numpy()) == bytes(src.numpy())
    assert (await within(objs.stat(key))).size == n


# --- 6. an uncancelled aclose during a multipart write ----------------------


@pytest.mark.parametrize("provider", [False, True])
async def test_write_returns_after_an_aclose_that_waited_for_it(
        make_agent: MakeAgent, s3: S3Server, provider: bool) -> None:
    # failed before: the write raised ClosedResourceError from its HEAD
    # check (objects.py _check_completed -> _http -> _check), though its
    # object was stored whole.
    bucket = s3.bucket("c")
    agent = await make_agent("o")
    kw: dict[str, Any] = (
        {"endpoint": s3.endpoint, "region": "us-east-1", "credential_provider": Provider()}
        if provider else s3.kwargs())
    objs = agent.register_objects(f"s3://{bucket}/c", **kw, part_size=5 * MiB)
    n = 24 * MiB
    src = agent.alloc(n)
    src.numpy()[:] = pattern(n, 6)
    t = agent.write(src[:], objs["k"])
    async with asyncio.timeout(20):
        while not objs._uploads:  # the multipart upload's task is made
            await asyncio.sleep(0)
    # (its first request may not have opened the session yet: it may still)
    await within(objs.aclose(), 60)  # waits for the write in flight
    await within(t)  # its result: done, the check made
    assert s3.file(bucket, "c/k").read_bytes() == bytes(src.numpy())
    assert objs._session is None


# --- 4. one call of the provider per write ----------------------------------


@pytest.mark.parametrize("is_async", [False, True])
async def test_provider_asked_once(make_agent: MakeAgent, s3: S3Server,
                                   is_async: bool) -> None:
    # failed before: 2 calls (obstore's cache of credentials and ours each
    # asked it once)
    agent = await make_agent("o")
    p = Provider(is_async=is_async)
    objs = provided(agent, s3, p)
    await roundtrip(agent, objs, "big", 12 * MiB)  # our multipart upload
    await roundtrip(agent, objs, "small", 64 << 10)  # one PUT (obstore's)
    await within(objs.delete(["big", "small"]))
    assert p.calls == 1


# --- 1. a 403 drops the cached credentials, once -----------------------------


@pytest.mark.parametrize("n", [12 * MiB, 64 << 10], ids=["multipart", "single"])
async def test_stale_credentials_dropped_on_403(make_agent: MakeAgent, s3: S3Server,
                                                n: int) -> None:
    # failed before: AccessDenied (SignatureDoesNotMatch) for every request,
    # the stale keys cached for ever (expires_at None)
    agent = await make_agent("o")
    p = Provider(stale=1)
    objs = provided(agent, s3, p)
    await roundtrip(agent, objs, "k", n)
    assert p.calls == 2
    # the fresh keys stay cached: no further call
    await roundtrip(agent, objs, "k2", n)
    assert p.calls == 2


async def test_stale_credentials_dropped_on_403_of_a_read(make_agent: MakeAgent,
                                                          s3: S3Server) -> None:
    # the keys go stale after the write (the provider's second answer):
    # the read's 403 asks for new ones and reads
    agent = await make_agent("o")
    good = Provider()
    objs = provided(agent, s3, good)
    n = 64 << 10
    src = agent.alloc(n)
    src.numpy()[:] = pattern(n, 3)
    await within(agent.write(src[:], objs["r"]))
    # stale keys now cached (as after a rotation the provider had not seen)
    good.stale, good.calls = 1, 0
    objs._creds.drop((await objs._creds.get())[1])
    objs._signed.clear()
    dst = agent.alloc(n)
    await within(agent.read(dst[:], objs["r"]))
    assert bytes(dst.numpy()) == bytes(src.numpy())
    assert good.calls == 2


async def test_refused_credentials_asked_again_once(make_agent: MakeAgent,
                                                    s3: S3Server) -> None:
    # keys the server never takes: each request asks once more, then fails
    # (bounded: no loop)
    agent = await make_agent("o")
    p = Provider(stale=1000)
    objs = provided(agent, s3, p, max_retries=3)
    src = agent.alloc(12 * MiB)
    with pytest.raises(AccessDenied):
        await within(agent.write(src[:], objs["k"]), 30)
    assert p.calls == 2
    with pytest.raises(AccessDenied):
        await within(objs.stat("k"))
    assert p.calls == 3  # the cached (refused) keys dropped, asked once more


# --- 2. short-lived credentials are cached ------------------------------------


async def test_short_lived_credentials_cached(make_agent: MakeAgent, s3: S3Server) -> None:
    # failed before: the provider was asked by each request of ours (a
    # 12 MiB write: create, 3 parts, complete) while its credentials had
    # under 5 minutes left
    agent = await make_agent("o")
    p = Provider(expires=240.0)
    objs = provided(agent, s3, p)
    for i in range(3):
        await roundtrip(agent, objs, f"k{i}", 12 * MiB)
    assert p.calls == 1


async def test_short_lived_credentials_asked_again_before_expiry(
        make_agent: MakeAgent, s3: S3Server) -> None:
    # credentials living 2 s are used for half of that, then asked again
    agent = await make_agent("o")
    p = Provider(expires=2.0)
    objs = provided(agent, s3, p)
    await roundtrip(agent, objs, "a", 64 << 10)
    assert p.calls == 1
    await asyncio.sleep(1.2)
    await roundtrip(agent, objs, "b", 64 << 10)
    assert p.calls == 2


async def test_refresh_threshold_attribute_honoured(make_agent: MakeAgent,
                                                    s3: S3Server) -> None:
    # obstore's convention: a provider's ``refresh_threshold`` (a timedelta)
    # is how long before expiry it is asked again (default 5 minutes)
    agent = await make_agent("o")
    p = Provider(expires=3600.0)
    p.refresh_threshold = timedelta(seconds=3599.5)  # type: ignore[attr-defined]
    objs = provided(agent, s3, p)
    await roundtrip(agent, objs, "a", 64 << 10)
    calls = p.calls
    await asyncio.sleep(0.6)
    await roundtrip(agent, objs, "b", 64 << 10)
    assert p.calls == calls + 1


# --- 3. a naive expires_at ---------------------------------------------------


async def test_naive_expires_at_refused(make_agent: MakeAgent, s3: S3Server) -> None:
    # failed before: read as local time (the write succeeded through our
    # multipart upload, while obstore's own requests refuse such a credential)
    agent = await make_agent("o")
    objs = provided(agent, s3, Provider(expires=3600.0, naive=True))
    src = agent.alloc(12 * MiB)
    with pytest.raises(AccessDenied, match="time zone"):
        await within(agent.write(src[:], objs["k"]), 30)


async def test_failing_provider_is_access_denied(make_agent: MakeAgent, s3: S3Server) -> None:
    # its error typed as obstore types it (Unauthenticated: AccessDenied)
    # for every request, ours included; its text kept
    agent = await make_agent("o")

    def broken() -> Any:
        raise RuntimeError("no route to the credential service")

    objs = provided(agent, s3, broken)  # type: ignore[arg-type]
    with pytest.raises(AccessDenied, match="no route to the credential service"):
        await within(objs.stat("k"))
    src = agent.alloc(12 * MiB)
    with pytest.raises(AccessDenied, match="no route to the credential service"):
        await within(agent.write(src[:], objs["k"]), 30)
