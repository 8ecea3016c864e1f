"""rev34: cuda.DeviceBuffer.close() never frees device memory that a region
still uses (the engine's copy in flight, a release not yet awaited). On the
software CUDA driver (native/tests/fakecuda.c: freed device memory is
unmapped, as a real driver may hand it to someone else), in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CHILD = r'''
import asyncio
import aioxfer
from aioxfer import cuda

N = 64 << 20


async def main():
    ok, why = cuda.status()
    if not ok:
        print("NOCUDA", why)
        return
    async with aioxfer.Agent("a") as a, aioxfer.Agent("b") as b:
        src = b.alloc(N, name="src")
        src.numpy()[:] = 7
        peer = await asyncio.wait_for(a.connect(b.address), 10)
        print("PATH", peer.path)
        for _ in range(3):
            buf = cuda.DeviceBuffer(N)
            ptr = buf.ptr
            g = a.register(buf)
            t = a.read(g[0:N], peer.region("src")[0:N])  # a copy into buf, in flight
            a._sub.post_pending()
            released = a.deregister(g)
            buf.close()  # before the copy ended: must not free it under the copy
            print("ALIVE", cuda.describe(ptr, N)[0])
            r = await asyncio.wait_for(t, 30)
            await asyncio.wait_for(released, 30)
            print("READ", r.nbytes)
            print("FREED", not cuda.describe(ptr, N)[0])
        try:
            a.register(buf)
            print("REREGISTER", "taken")
        except aioxfer.RegistrationError:
            print("REREGISTER", "refused")
        idle = cuda.DeviceBuffer(4096)  # never registered: freed at once
        p = idle.ptr
        idle.close()
        print("IDLE_FREED", not cuda.describe(p, 4096)[0])
    print("DONE")


asyncio.run(main())
'''


def test_closing_a_device_buffer_under_a_copy_frees_it_only_once_released(
    tmp_path: Path, fakecuda: Path
) -> None:
    """DeviceBuffer.close() freed at once: with a copy into it still running
    (deregistered, the release not awaited) the process died of SIGSEGV."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, AIOXFER_CUDA_DRIVER=str(fakecuda))
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                         text=True, timeout=180)
    assert "NOCUDA" not in out.stdout, out.stdout
    assert out.returncode == 0, f"rc {out.returncode}\n" + out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert "PATH cuda" in lines, out.stdout
    assert lines.count("ALIVE True") == 3, out.stdout
    assert lines.count(f"READ {64 << 20}") == 3, out.stdout
    assert lines.count("FREED True") == 3, out.stdout
    assert "REREGISTER refused" in lines and "IDLE_FREED True" in lines, out.stdout
    assert lines[-1] == "DONE", out.stdout
