"""rev34: a SegmentList batch of GPU memory over verbs (GPUDirect RDMA), as a
list of segments and post_arrays already moved it. Runs here on the software
CUDA driver and the software verbs provider, in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import within

import aioxfer
from aioxfer import cuda

CUDA_OK, CUDA_WHY = cuda.status()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason=f"no CUDA driver/device ({CUDA_WHY})")
async def test_gpu_segment_lists_travel_over_verbs(make_agent: Any, verbs_provider: str) -> None:
    """descriptors.from_vectors allowed GPU memory only on the "cuda" path:
    the same batch that moved as a list of segments over verbs was refused
    as SegmentLists (TransportError "cannot reach")."""
    a = await make_agent("a", transports=("verbs",))
    b = await make_agent("b", transports=("verbs",))
    size = 1 << 16
    buf_a, buf_b = cuda.DeviceBuffer(size), cuda.DeviceBuffer(size)
    try:
        a.register(buf_a, name="ga")
        gb = b.register(buf_b, name="gb")
        peer = await within(b.connect(a.address))
        assert peer.path == "verbs"
        ga = peer.region("ga")
        if not os.environ.get("AIOXFER_CUDA_DRIVER"):
            pytest.skip("softverbs cannot map a real GPU's dmabuf")
        src = np.arange(size, dtype=np.uint8) * 7
        buf_b.upload(src.tobytes())
        offs = np.arange(0, size, 4096, dtype=np.uint64)
        lens = np.full(offs.shape, 4096, dtype=np.uint64)
        r = await within(b.write(gb.segments(offs, lens), ga.segments(offs[::-1].copy(), lens)))
        assert (r.nbytes, r.path) == (size, "verbs")
        got = np.frombuffer(buf_a.download(), dtype=np.uint8).reshape(-1, 4096)
        assert np.array_equal(got[::-1], src.reshape(-1, 4096))
        # and host memory on one side, a GPU region on the other
        host = b.register(bytearray(size))
        await within(b.read(host.segments(offs, lens), ga.segments(offs, lens)))
        assert bytes(host.memoryview) == buf_a.download()
    finally:
        a.poll()
        b.poll()
        await within(a.aclose())
        await within(b.aclose())
        buf_a.close()
        buf_b.close()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason=f"no CUDA driver/device ({CUDA_WHY})")
async def test_gpu_offset_arrays_over_tcp_are_refused_at_the_call(make_agent: Any) -> None:
    """descriptors.from_arrays checked memory kind against path only when the
    two regions' kinds differed: GPU regions on both sides over tcp were
    posted, and failed later as a bare XferError "invalid argument" (lists
    and SegmentLists raise TransportError at the call, naming the path)."""
    a = await make_agent("a")
    b = await make_agent("b", transports=("tcp",))
    buf_a, buf_b = cuda.DeviceBuffer(1 << 16), cuda.DeviceBuffer(1 << 16)
    try:
        a.register(buf_a, name="ga")
        gb = b.register(buf_b, name="gb")
        peer = await within(b.connect(a.address))
        assert peer.path == "tcp"
        offs = np.zeros(1, dtype=np.uint64)
        with pytest.raises(aioxfer.TransportError, match="which path 'tcp'"):
            b.post_arrays("write", gb, peer.region("ga"), offs, offs, 4096)
        with pytest.raises(aioxfer.TransportError, match="which path 'tcp'"):
            b.write(gb.segments(offs, [4096]), peer.region("ga").segments(offs, [4096]))
        # One segment each (the lead, rev34's lead): the write/read fast paths
        # (agent.write's inlined check, _descs_one, the compiled poster) passed
        # GPU regions of one kind on both sides without asking whether the path
        # reaches GPU memory, and the transfer failed later, untyped.
        with pytest.raises(aioxfer.TransportError, match="which path 'tcp'"):
            b.write(gb[0:4096], peer.region("ga")[0:4096])
        with pytest.raises(aioxfer.TransportError, match="which path 'tcp'"):
            b.read(gb[0:4096], peer.region("ga")[0:4096])
        with pytest.raises(aioxfer.TransportError, match="which path 'tcp'"):
            b.write(gb[0:4096], peer.region("ga")[0:4096], notify=b"x")
    finally:
        await within(a.aclose())
        await within(b.aclose())
        buf_a.close()
        buf_b.close()


def test_on_the_software_cuda_driver(tmp_path: Path, fakecuda: Path,
                                     softverbs_provider: str) -> None:
    env = dict(os.environ, AIOXFER_CUDA_DRIVER=str(fakecuda))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
         os.path.abspath(__file__)],
        env=env, capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout, out.stdout[-2000:]
