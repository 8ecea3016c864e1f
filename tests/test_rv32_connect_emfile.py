"""Agent.connect out of file descriptors raises TransportError, as before cxc32.

Connector.predial (cxc32) dials the attempt's first connection inside
Agent.connect itself, before the attempt's task runs, outside the
control-plane wrapper (Dialer.control_errors) that names the peer and turns
an OSError into TransportError. A socket() that fails there (EMFILE: the
process is out of descriptors, ENFILE, ENOBUFS) escaped Agent.connect as a
bare OSError on 9eb5b8e8, where 1ada9db1 raised TransportError("cannot
connect to ADDRESS: [Errno 24] ..."): an application catching XferError
for a failed connect missed it. Run in a process of its own, since it
lowers RLIMIT_NOFILE and fills every descriptor left.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from conftest import within

_SCRIPT = r'''
import asyncio, os, resource, sys
import aioxfer

async def main():
    kw = {"transports": tuple(sys.argv[1].split(","))}
    b = aioxfer.Agent("b-emfile", **kw)
    a = aioxfer.Agent("a-emfile", **kw)
    await b.__aenter__()
    await a.__aenter__()
    a._start()  # (its engine and loop set up: connect's own sockets come next)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = max(int(x) for x in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (top + 1, hard))
    filler = []
    try:
        while True:
            filler.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    try:
        await asyncio.wait_for(a.connect(b.address), 20)
        print("connected")
    except BaseException as exc:
        print(type(exc).__name__, exc)
    for fd in filler:
        os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    await a.aclose()
    await b.aclose()

asyncio.run(main())
'''


@pytest.mark.parametrize("transports", ["tcp", "shm,tcp"])
async def test_connect_out_of_fds_raises_transport_error(transports: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _SCRIPT, transports,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/",
    )
    out, err = await within(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()[-2000:]
    line = out.decode().strip().splitlines()[-1]
    assert line.startswith("TransportError ") and "Errno 24" in line, line
