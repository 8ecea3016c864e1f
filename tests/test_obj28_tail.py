"""obj28: a request's body still in kernel buffers when its answer wait starts.

aiohttp starts a request's per-read timeout (``read_timeout``) when its
body's write ends, i.e. once the last byte is queued in the kernel: up to a
send buffer (4 MiB here) may still be on its way then. A store reading the
body at ``min_rate`` or better, but slower than that buffer per
``read_timeout``, timed out with no fault of its own (default: between
64 KiB/s and ~280 KiB/s; a multipart part, or a single PUT of ours). The
documented bound is ``min_rate`` for the bytes. Now the write ends once the
kernel's send queue is empty (objects._Body), the stall bounded by progress.

Against rclone serve s3 (tests/s3server.py), through test_obj26's Relay,
which reads from the client at a set rate.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import s3server
from conftest import pattern, within
from s3server import S3Server
from test_obj26_puts import relay_factory

pytest.importorskip("obstore")
pytest.importorskip("aiohttp")

s3 = s3server.s3
__all__ = ["relay_factory"]

MakeAgent = Callable[..., Awaitable[Any]]
MiB = 1 << 20


@pytest.mark.parametrize("multipart", [False, True], ids=["single", "multipart"])
async def test_tail_in_kernel_buffers(make_agent: MakeAgent, s3: S3Server,
                                      relay_factory: Any, multipart: bool) -> None:
    # failed before (both): TransportError "... Timeout on reading data from
    # socket" (single: "the PUT's outcome is unknown"): the body read at
    # 1 MiB/s, twice min_rate, its last ~2.5 MiB queued in the kernel when
    # the 2 s answer wait began. Now written in ~5 s.
    relay = await relay_factory(rate=1 * MiB)
    bucket = s3.bucket("t")
    agent = await make_agent("o")
    objs = agent.register_objects(f"s3://{bucket}/t", **relay.kwargs(), part_size=5 * MiB,
                                  read_timeout=2.0, min_rate=512 << 10, max_retries=0)
    n = 6 * MiB if multipart else 5 * MiB
    src = agent.alloc(n)
    src.numpy()[:] = pattern(n, 28)
    t0 = time.monotonic()
    await within(agent.write(src[:], objs["k"]), 60)
    print(f"took {time.monotonic() - t0:.1f} s")
    assert s3.file(bucket, "t/k").read_bytes() == bytes(src.numpy())
