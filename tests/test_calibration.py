"""The engine's start-up calibration (native/src/shm.c, cal_run): what it
derives from its two measurements (a thread wake-up, a memcpy rate) is a
function of those alone, bounded, and the same for every engine of a process
whichever API made it (aioxfer.Agent, aioxfer.nixl). Given the measurements
through $AIOXFER_WAKE_NS and $AIOXFER_COPY_MBPS, as the compat benchmark
gives its processes the driver's, every process derives the same. No timing
is asserted: only what follows from the numbers the engine reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from aioxfer import _cyx

LOOP_NS = 40_000  # CAL_LOOP_NS: the caller's loop iteration a handoff adds
WAKE_MAX = 1_000_000  # CAL_WAKE_MAX, ns
MBPS_MAX = 1_000_000  # CAL_MBPS_MAX


def derived(wake_ns: int, copy_mbps: int) -> tuple[int, int]:
    """inline_bytes and poll_us as cal_run derives them."""
    wake_ns, copy_mbps = min(wake_ns, WAKE_MAX), min(copy_mbps, MBPS_MAX)
    saved = 2 * wake_ns + LOOP_NS
    nbytes = min(2 * saved * copy_mbps // 1000, 16 << 20)
    p2 = 64 << 10
    while p2 < nbytes:
        p2 *= 2
    return p2, min(max(saved // 1000, 20), 200)


# A process that reports its calibration and what an aioxfer Agent and an
# aioxfer.nixl agent (the compat layer's own Agent underneath) run with.
_REPORT = """
import asyncio, json
import aioxfer
from aioxfer import _cyx
from aioxfer.nixl import nixl_agent, nixl_agent_config

async def native():
    async with aioxfer.Agent("cal-native") as a:
        return a.inline_bytes, a.poll_us

out = {"cal": _cyx.calibration(), "native": asyncio.run(native())}
n = nixl_agent("cal-compat", nixl_agent_config(backends=["UCX"]))
try:
    inner = n.agent._agent
    out["compat"] = (inner.inline_bytes, inner.poll_us)
finally:
    n.close()
print(json.dumps(out))
"""


def report(**env: str) -> dict:
    full = dict(os.environ, AIOXFER_LOG_LEVEL="warning")
    for k in ("AIOXFER_INLINE_BYTES", "AIOXFER_WAKE_NS", "AIOXFER_COPY_MBPS",
              "AIOXFER_NIXL_PROGRESS", "AIOXFER_NIXL_TRANSPORTS"):
        full.pop(k, None)
    full.update(env)
    # Not from the checkout's root: "-c" puts the working directory first on
    # sys.path, and the source tree's aioxfer has no built extension.
    out = subprocess.run([sys.executable, "-c", _REPORT], env=full, capture_output=True,
                         text=True, timeout=120, cwd=os.path.dirname(__file__))
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_derived_from_its_measurements() -> None:
    cal = _cyx.calibration()
    if os.environ.get("AIOXFER_INLINE_BYTES"):
        pytest.skip("$AIOXFER_INLINE_BYTES overrides the threshold")
    assert 0 < cal["wake_ns"] <= WAKE_MAX and 0 < cal["copy_mbps"] <= MBPS_MAX
    assert (cal["inline_bytes"], cal["poll_us"]) == derived(cal["wake_ns"], cal["copy_mbps"])


@pytest.mark.parametrize(("wake_ns", "copy_mbps", "inline_bytes", "poll_us"), [
    (2_500, 13_000, 2 << 20, 45),  # a thread switch on this VM's vCPU
    (3_000, 11_000, 1 << 20, 46),  # a slower copy: a power of two down
    (25_000, 14_000, 4 << 20, 90),  # a halted vCPU's wake-up
    (1, 1, 64 << 10, 40),  # the least threshold
    (10**12, 10**12, 16 << 20, 200),  # bounded: no overflow, the caps
])
def test_given_measurements_every_process_derives_the_same(
        wake_ns: int, copy_mbps: int, inline_bytes: int, poll_us: int) -> None:
    assert derived(wake_ns, copy_mbps) == (inline_bytes, poll_us)
    env = {"AIOXFER_WAKE_NS": str(wake_ns), "AIOXFER_COPY_MBPS": str(copy_mbps)}
    first, second = report(**env), report(**env)
    assert first == second
    cal = first["cal"]
    assert cal == {"wake_ns": min(wake_ns, WAKE_MAX), "copy_mbps": min(copy_mbps, MBPS_MAX),
                   "inline_bytes": inline_bytes, "poll_us": poll_us}
    # The native API and the compat layer run with the same decision.
    assert first["native"] == first["compat"] == [inline_bytes, poll_us]


def test_inline_override_and_malformed_measurements() -> None:
    # $AIOXFER_INLINE_BYTES wins over the derived threshold, not over poll_us;
    # a value that is not a positive integer is ignored (measured instead).
    got = report(AIOXFER_WAKE_NS="2500", AIOXFER_COPY_MBPS="13000",
                 AIOXFER_INLINE_BYTES="12345")
    assert got["cal"]["inline_bytes"] == 12345 and got["cal"]["poll_us"] == 45
    assert got["native"] == got["compat"] == [12345, 45]
    got = report(AIOXFER_WAKE_NS="2.5us", AIOXFER_COPY_MBPS="0")
    cal = got["cal"]
    assert cal["wake_ns"] > 0 and cal["copy_mbps"] > 0
    assert (cal["inline_bytes"], cal["poll_us"]) == derived(cal["wake_ns"], cal["copy_mbps"])
    assert got["native"] == got["compat"] == [cal["inline_bytes"], cal["poll_us"]]
