"""A same-host peer's memfd is mapped only once the engine checked it (ini36).

Connector._apply_regions no longer checks a memfd's seals and size in
Python before the import: the engine checks them (shm.c map_fd) before it
maps it. A memfd that fails (unsealed, smaller than the region) is never
mapped: the region is reached by cross-memory attach, and the warning names
the reason as before.
"""

from __future__ import annotations

import fcntl
import os
from typing import Any

import pytest
from conftest import within

from aioxfer import _cyx
from aioxfer.local import REQUIRED_SEALS
from aioxfer.metadata import RegionMeta

MiB = 1 << 20


def _memfd(size: int, *, sealed: bool) -> int:
    fd = os.memfd_create("ini36-sealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS)
    return fd


def test_engine_refuses_a_memfd_smaller_than_its_region() -> None:
    """The engine's own check: sealed but shorter than the region claims."""
    eng = _cyx.Engine()
    fd = _memfd(MiB, sealed=True)
    try:
        ep = eng.endpoint_create(_cyx.EP_SHM, 3, os.getpid())
        with pytest.raises(_cyx.NativeError) as err:
            eng.endpoint_import(ep, 1, 7, 2 * MiB, 3, 0, fd)
        assert err.value.status == _cyx.E_ACCESS
        eng.endpoint_import(ep, 2, 7, MiB, 3, 0, fd)  # its length: mapped
    finally:
        os.close(fd)
        eng.shutdown()
        eng.close()


@pytest.mark.parametrize(
    ("size", "sealed", "reason"),
    [(MiB, False, "not sealed"), (MiB // 2, True, "smaller"), (MiB, True, None)],
)
async def test_apply_regions_maps_only_checked_memfds(
    make_agent: Any, capsys: Any, size: int, sealed: bool, reason: str | None
) -> None:
    target = await make_agent("target")
    target.alloc(MiB, name="dst")
    init = await make_agent("init")
    peer = await within(init.connect(target.address))
    if peer.path != "shm":
        pytest.skip(f"no same-host path here ({peer.path})")
    fd = _memfd(size, sealed=sealed)
    try:
        capsys.readouterr()
        m = RegionMeta(name="extra", rid=1 << 40, key=99, nbytes=MiB, access=3, addr=4096,
                       memfd=0)
        init._connector._apply_regions(peer, [m], [fd])
        rr = peer._regions["extra"]
        err = capsys.readouterr().err
        if reason is None:
            assert rr.memfd == fd and "region.memfd_refused" not in err
        else:
            assert rr.memfd == -1  # never mapped: cross-memory attach
            lines = [ln for ln in err.splitlines() if "region.memfd_refused" in ln]
            assert len(lines) == 1 and reason in lines[0], err
    finally:
        os.close(fd)
