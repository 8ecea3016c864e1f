"""GpuFileStager.aclose with moves under way (rev19 #7): it deregistered the
bounce buffer at once, while a move still copied through it and moves
queued for a slot then used a deregistered buffer. It now refuses new and
queued moves and waits for those moving.

GpuFileStager needs CUDA: without a GPU it runs on the software driver
(native/tests/fakecuda.c: device memory = shared memfd mappings, streams =
threads), in a fresh process (the driver is chosen when aioxfer loads it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CHILD = r'''
import asyncio, sys
import aioxfer
from aioxfer import cuda
from aioxfer.errors import ClosedResourceError
from aioxfer.staging import GpuFileStager

PAGE = 1 << 20


class GatedFile:
    """A file half (the FileSide protocol) that holds its first write until
    the test opens the gate, then copies the bounce bytes it was given."""

    def __init__(self):
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()
        self.data = {}

    async def write_from(self, src, offset):
        self.entered.set()
        await self.gate.wait()
        self.data[offset] = bytes(src.memoryview)

    async def read_into(self, dst, offset):
        raise AssertionError("not used")


async def main():
    ok, why = cuda.status()
    if not ok:
        print("NOCUDA", why)
        return
    async with aioxfer.Agent("stager") as agent:
        buf = cuda.DeviceBuffer(2 * PAGE)
        try:
            buf.upload(bytes(range(256)) * (2 * PAGE // 256))
            gpu = agent.register(buf, name="kv")
            side = GatedFile()
            stager = await GpuFileStager(agent, side, slot_bytes=PAGE, slots=1).start()
            bounce = stager._bounce
            moving = asyncio.ensure_future(stager.gpu_to_file(gpu[0:PAGE], 0))
            await asyncio.wait_for(side.entered.wait(), 10)
            queued = asyncio.ensure_future(stager.gpu_to_file(gpu[PAGE:2 * PAGE], PAGE))
            await asyncio.sleep(0.05)
            closing = asyncio.ensure_future(stager.aclose())
            await asyncio.sleep(0.2)
            # The move still uses the bounce buffer: it stays registered.
            print("CLOSE_WAITED", not closing.done())
            print("BOUNCE_KEPT", any(r is bounce for r in agent.regions) and not bounce.closed)
            side.gate.set()
            r = await asyncio.wait_for(moving, 10)
            want = bytes(range(256)) * (PAGE // 256)
            print("MOVED", r.nbytes == PAGE and side.data.get(0) == want)
            try:
                await asyncio.wait_for(queued, 10)
                print("QUEUED", "ran")
            except ClosedResourceError:
                print("QUEUED", "refused")
            except Exception as exc:
                print("QUEUED", type(exc).__name__, exc)
            await asyncio.wait_for(closing, 10)
            print("CLOSED", closing.done())
            agent.deregister(gpu)
        finally:
            await asyncio.sleep(0.1)
            buf.close()

asyncio.run(main())
'''


def test_aclose_waits_for_moves_and_refuses_queued_ones(fakecuda: Path, tmp_path: Path) -> None:
    from aioxfer import cuda

    env = dict(os.environ)
    if not cuda.status()[0]:
        env["AIOXFER_CUDA_DRIVER"] = str(fakecuda)
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                         text=True, timeout=120, cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = dict(ln.split(" ", 1) for ln in out.stdout.splitlines() if " " in ln)
    assert "NOCUDA" not in lines, lines
    assert lines == {"CLOSE_WAITED": "True", "BOUNCE_KEPT": "True", "MOVED": "True",
                     "QUEUED": "refused", "CLOSED": "True"}, out.stdout + out.stderr[-2000:]
