"""make_agent's teardown still catches the loop errors an agent's close
leaves behind (tests/conftest.py settle(): it waits for the loop's queued
callbacks and soon-due timers instead of a fixed 0.05 s sleep).

The cases run in an inner pytest (a child process, cwd outside the checkout)
with the suite's conftest as a plugin: each must *fail* at make_agent's
teardown; the control must pass."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

TESTS = os.path.dirname(os.path.abspath(__file__))

INNER = textwrap.dedent('''
    import asyncio

    import aioxfer

    _keep = []


    def _orphan(agent, late):
        """A consumer of agent's notifications the test forgot: the close
        wakes it (ClosedResourceError), then late() runs and raises;
        nobody retrieves that exception, so asyncio reports it when the
        task is freed."""

        async def consume():
            try:
                await agent.notifications.receive()
            except aioxfer.ClosedResourceError:
                await late()
                raise

        asyncio.get_running_loop().create_task(consume())


    async def test_woken_at_close(make_agent):
        agent = await make_agent("a")

        async def late():
            pass

        _orphan(agent, late)


    async def test_chain_after_close(make_agent):
        agent = await make_agent("a")

        async def late():
            for _ in range(20):  # a chain of callbacks, each queued by the one before
                await asyncio.sleep(0)

        _orphan(agent, late)


    async def test_timer_after_close(make_agent):
        agent = await make_agent("a")

        async def late():
            await asyncio.sleep(0.01)  # a timer due well inside the old 0.05 s

        _orphan(agent, late)


    async def test_control_clean(make_agent):
        agent = await make_agent("a")
        task = asyncio.get_running_loop().create_task(agent.notifications.receive())
        _keep.append(task)
        await asyncio.sleep(0)
''')


def test_make_agent_catches_late_loop_errors(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(INNER)
    report = tmp_path / "report.xml"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [TESTS, *filter(None, [os.environ.get("PYTHONPATH")])]))
    env["AIOXFER_TEST_LOOPS"] = "all"  # asyncio's settle() and uvloop's sleep both
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
         "-o", "asyncio_mode=auto", "--rootdir", str(tmp_path), f"--junitxml={report}",
         "test_inner.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    outcomes: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        bad = [c for c in case if c.tag in ("failure", "error")]
        outcomes[case.get("name", "")] = (
            "error: " + (bad[0].get("message") or "") if bad else "passed")
    out = proc.stdout + proc.stderr
    loops = ["asyncio", "uvloop"] if importlib.util.find_spec("uvloop") else ["asyncio"]
    for loop in loops:
        assert outcomes.get(f"test_control_clean[{loop}]") == "passed", out
        for name in ("test_woken_at_close", "test_chain_after_close",
                     "test_timer_after_close"):
            got = outcomes.get(f"{name}[{loop}]", "missing")
            assert got.startswith("error") and "loop exception handler called" in got, (
                f"{name}[{loop}]: make_agent's teardown missed the late loop error "
                f"({got})\n{out}")
