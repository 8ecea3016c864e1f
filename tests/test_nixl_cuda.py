"""GPU memory through aioxfer.nixl (NIXL's ``VRAM`` segments), between two processes.

What a NIXL user on one GPU host does: each side registers device memory as
``"VRAM"`` descriptors (address, length, device id), the metadata goes over a
pipe, the initiator prepares both pools as block lists and moves blocks by
index, GPU -> peer GPU with a notification, then peer GPU -> local host
memory, and finally meets a peer killed mid-way (nixlRemoteDisconnectError,
never a hang). Same-host agents that both have CUDA move these over the
"cuda" path (CUDA IPC mappings, copies on the engine's streams).

Marked ``gpu``: skips without a CUDA driver and device. On machines without a
GPU, test_cuda.test_gpu_tests_on_the_software_driver runs this file against
native/tests/fakecuda.c; on a lent GPU machine it runs on the real driver, and
the torch test registers CUDA tensors as NIXL users pass them.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from typing import Any

import numpy as np
import pytest
from conftest import PipeChild, digest, pattern

from aioxfer import cuda

CUDA_OK, CUDA_WHY = cuda.status()
gpu = pytest.mark.skipif(not CUDA_OK, reason=f"no CUDA driver/device ({CUDA_WHY})")

BLOCK = 64 << 10
NBLOCKS = 16
STEP = 30.0


def _blocks(base: int, dev: int = 0) -> np.ndarray:
    """NBLOCKS rows of (address, BLOCK, device id): NIXL's Nx3 descriptor array."""
    rows = np.zeros((NBLOCKS, 3), dtype=np.uint64)
    rows[:, 0] = base + np.arange(NBLOCKS, dtype=np.uint64) * BLOCK
    rows[:, 1] = BLOCK
    rows[:, 2] = dev
    return rows


def target_main(conn: Any) -> None:
    """The remote side: a VRAM pool registered through NIXL's API, then commands."""
    from aioxfer.nixl import nixl_agent

    agent = nixl_agent(str(uuid.uuid4()))
    buf = cuda.DeviceBuffer(NBLOCKS * BLOCK)
    buf.upload(pattern(NBLOCKS * BLOCK, 11))
    descs = agent.get_reg_descs([(buf.ptr, buf.nbytes, 0, "")], "VRAM")
    agent.register_memory(descs, backends=["UCX"])
    conn.send((agent.name, agent.get_agent_metadata(), buf.ptr, os.getpid()))
    while True:
        cmd = conn.recv()
        if cmd == "notifs":
            got: list[bytes] = []
            deadline = time.monotonic() + STEP
            while not got and time.monotonic() < deadline:
                for msgs in agent.get_new_notifs().values():
                    got += msgs
            conn.send(got)
        elif cmd[0] == "digest":  # ("digest", block)
            conn.send(digest(buf.download(cmd[1] * BLOCK, BLOCK)))
        elif cmd == "quit":
            agent.deregister_memory(descs)
            agent.close()
            buf.close()
            conn.send("bye")
            return


class Target(PipeChild):
    def __init__(self) -> None:
        super().__init__(target_main, seconds=STEP * 2)
        self.name, self.md, self.ptr, self.pid = self.hello


def _wait_done(agent: Any, handle: Any) -> str:
    deadline = time.monotonic() + STEP
    while (state := agent.check_xfer_state(handle)) == "PROC":
        if time.monotonic() > deadline:
            raise TimeoutError("transfer still in progress")
    return state


def _round_trip(agent: Any, target: Target, local_vram: int,
                upload: Any, host: np.ndarray) -> None:
    """GPU -> peer GPU by index with a notification, then peer GPU -> host."""
    remote_name = agent.add_remote_agent(target.md)
    assert remote_name == target.name.encode()
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(_blocks(local_vram),
                                                                            "VRAM"))
    remote = agent.prep_xfer_dlist(remote_name, agent.get_xfer_descs(_blocks(target.ptr),
                                                                      "VRAM"))
    host_list = agent.prep_xfer_dlist(
        "NIXL_INIT_AGENT", agent.get_xfer_descs(_blocks(host.ctypes.data), "DRAM"))

    src = pattern(NBLOCKS * BLOCK, 5)
    upload(src)
    local_ids = np.array([1, 4, 9, 15], dtype=np.int64)
    remote_ids = np.array([0, 2, 3, 14], dtype=np.int64)
    w = agent.make_prepped_xfer("WRITE", local, local_ids, remote, remote_ids,
                                notif_msg=b"layer-0")
    assert agent.transfer(w) in ("DONE", "PROC")
    assert _wait_done(agent, w) == "DONE"
    # the notification comes after the data: once seen, the blocks are there
    assert b"layer-0" in target.call("notifs")
    # it went over the "cuda" path (IPC mappings), not a host staging path
    (peer,) = agent.agent._agent.peers
    assert peer.path == "cuda"
    blocks = src.reshape(NBLOCKS, BLOCK)
    for lid, rid in zip(local_ids.tolist(), remote_ids.tolist(), strict=True):
        assert target.call(("digest", rid)) == digest(blocks[lid])

    # peer GPU -> local host memory (DRAM descriptors on our side)
    r = agent.make_prepped_xfer("READ", host_list, [0, 1], remote, [2, 5])
    assert agent.transfer(r) in ("DONE", "PROC")
    assert _wait_done(agent, r) == "DONE"
    assert digest(host[:BLOCK]) == digest(blocks[4])  # remote 2 <- local 4
    original = pattern(NBLOCKS * BLOCK, 11).reshape(NBLOCKS, BLOCK)
    assert digest(host[BLOCK:2 * BLOCK]) == digest(original[5])  # never written

    # a peer killed mid-way: the next transfer fails typed, promptly
    from aioxfer.nixl import nixlRemoteDisconnectError

    os.kill(target.pid, signal.SIGKILL)
    target.proc.join(10)
    t0 = time.monotonic()
    with pytest.raises(nixlRemoteDisconnectError):
        for _ in range(1000):  # until the engine has seen the death
            agent.transfer(agent.make_prepped_xfer("WRITE", local, [0], remote, [0]))
            time.sleep(0.01)
    assert time.monotonic() - t0 < STEP
    for h in (w, r):
        agent.release_xfer_handle(h)


@gpu
@pytest.mark.gpu
def test_vram_blocks_between_processes() -> None:
    from aioxfer.nixl import nixl_agent

    target = Target()
    agent = nixl_agent(str(uuid.uuid4()))
    buf = cuda.DeviceBuffer(NBLOCKS * BLOCK)
    host = np.zeros(NBLOCKS * BLOCK, dtype=np.uint8)
    vram = agent.get_reg_descs([(buf.ptr, buf.nbytes, 0, "")], "VRAM")
    dram = agent.get_reg_descs([(host.ctypes.data, host.nbytes, 0, "")], "DRAM")
    try:
        agent.register_memory(vram, backends=["UCX"])
        agent.register_memory(dram, backends=["UCX"])
        _round_trip(agent, target, buf.ptr, buf.upload, host)
    finally:
        target.close()
        agent.close()
        buf.close()


def _torch_cuda() -> Any:
    if "torch" not in sys.modules:
        try:
            import torch  # noqa: F401
        except ImportError:
            return None
    torch = sys.modules["torch"]
    return torch if torch.cuda.is_available() else None


@gpu
@pytest.mark.gpu
def test_torch_cuda_tensors_as_nixl_users_register_them() -> None:
    """vLLM registers its KV cache tensors themselves (``get_reg_descs(tensor)``)."""
    torch = _torch_cuda()
    if torch is None:
        pytest.skip("torch with CUDA is not installed here")
    from aioxfer.nixl import nixl_agent

    target = Target()
    agent = nixl_agent(str(uuid.uuid4()))
    kv = torch.zeros(NBLOCKS * BLOCK, dtype=torch.uint8, device="cuda")
    host = np.zeros(NBLOCKS * BLOCK, dtype=np.uint8)
    reg = agent.get_reg_descs(kv)  # mem type and device from the tensor
    dram = agent.get_reg_descs([(host.ctypes.data, host.nbytes, 0, "")], "DRAM")
    try:
        agent.register_memory(reg, backends=["UCX"])
        agent.register_memory(dram, backends=["UCX"])

        def upload(src: np.ndarray) -> None:
            kv.copy_(torch.from_numpy(src).to("cuda"))
            torch.cuda.synchronize()

        _round_trip(agent, target, kv.data_ptr(), upload, host)
    finally:
        target.close()
        agent.close()
