"""rev28: a cancelled single PUT from the caller's buffer (over OWNED_MAX,
part_md5=True) raises CancelledError while its Content-MD5 thread still
reads that buffer (asyncio.to_thread is not waited for through a cancel):
the caller may free the memory under a running hash."""
from __future__ import annotations

import asyncio
import sys
import time

import s3server
from conftest import make_agent, within  # noqa: F401
from s3server import S3Server

s3 = s3server.s3


def _hashing() -> bool:
    for frame in sys._current_frames().values():
        f = frame
        while f is not None:
            if f.f_code.co_name == "_md5_b64":
                return True
            f = f.f_back
    return False


async def test_stopped_waits_for_the_md5_thread(make_agent, s3: S3Server) -> None:  # noqa: F811
    bucket = s3.bucket("d")
    agent = await make_agent("o")
    n = 512 << 20
    objs = agent.register_objects(f"s3://{bucket}/d", **s3.kwargs(), part_md5=True,
                                  part_size=n)
    src = agent.alloc(n)
    task = agent.write(src[:], objs["k"])
    t0 = time.monotonic()
    while not _hashing() and time.monotonic() - t0 < 10:
        await asyncio.sleep(0.001)
    assert _hashing()
    task.cancel()
    await task.stopped()  # "the caller may reuse them then"
    still = _hashing()
    while _hashing():
        await asyncio.sleep(0.01)
    assert not still, "CancelledError raised while the md5 thread still reads the buffer"
