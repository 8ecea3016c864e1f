"""A verbs provider library whose table leaves out entries the transport calls
(hw19): an Agent asked for verbs is refused with the missing entry named,
rather than running with it and crashing the process at the first call of it
(dereg_mr at a region's release, destroy_qp at teardown, close_device in a
probe). Each case in a child process: a crash there is a failure here."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Loads the provider the engine will load (same path: the same library), has
# it leave `omit` out of the tables it fills, then makes an Agent that needs
# verbs, registers and releases a region, and closes it.
CHILD = r"""
import asyncio, ctypes, gc, sys
import aioxfer
from aioxfer import TransportError

provider, omit = sys.argv[1], sys.argv[2]
ctypes.CDLL(provider).axf_softverbs_omit(omit.encode())
try:
    agent = aioxfer.Agent("omitting", transports=("verbs",))
except TransportError as e:
    print("REFUSED", e, flush=True)
    sys.exit(0)
print("STARTED", agent.transports, flush=True)


async def main():
    region = agent.register(bytearray(1 << 16), name="r")
    await agent.deregister(region)
    await agent.aclose()


asyncio.run(main())
gc.collect()
print("CLOSED", flush=True)
"""


def _run(provider: str, omit: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, AIOXFER_VERBS_PROVIDER=provider)
    return subprocess.run(
        [sys.executable, "-c", CHILD, provider, omit],
        cwd="/",  # not the checkout: its unbuilt aioxfer/ would shadow the installed one
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("omit", ["dereg_mr", "destroy_qp", "close_device", "destroy_cq"])
def test_agent_refuses_a_provider_missing_an_entry(softverbs_provider: str, omit: str) -> None:
    r = _run(softverbs_provider, omit)
    assert r.returncode == 0, f"child exit {r.returncode}\n{r.stdout}\n{r.stderr[-2000:]}"
    assert "REFUSED" in r.stdout, r.stdout
    assert f"table entry {omit} missing" in r.stdout, r.stdout


def test_agent_takes_a_provider_without_optional_entries(softverbs_provider: str) -> None:
    # The entries verbs.c looks at before calling (dmabuf registration, the
    # GID type, the asynchronous events as a pair): the provider still serves.
    r = _run(softverbs_provider, "reg_dmabuf_mr,query_gid_type,get_async_event,ack_async_event")
    assert r.returncode == 0, f"child exit {r.returncode}\n{r.stdout}\n{r.stderr[-2000:]}"
    assert "STARTED" in r.stdout and "verbs" in r.stdout and "CLOSED" in r.stdout, r.stdout
