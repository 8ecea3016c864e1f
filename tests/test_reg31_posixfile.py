"""reg31: staging.PosixFile(size=N) never shrinks a file.

PosixFile(path, size=N) truncated an existing, longer file to N bytes,
silently dropping what other users had stored past N (agent.register_file
only ever grows a file). Now it grows a shorter file (sparse) and leaves a
longer one as it is."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from conftest import within

from aioxfer.staging import PosixFile

KiB = 1 << 10


def test_a_longer_file_keeps_its_bytes(tmp_path: Path) -> None:
    path = tmp_path / "pages.bin"
    data = bytes(range(256)) * 64  # 16 KiB
    path.write_bytes(data)
    pf = PosixFile(path, size=4 * KiB)
    pf.close()
    assert path.read_bytes() == data


def test_a_shorter_or_missing_file_grows_to_size(tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(b"abc")
    PosixFile(path, size=8 * KiB).close()
    assert path.read_bytes() == b"abc" + bytes(8 * KiB - 3)
    fresh = tmp_path / "fresh.bin"
    PosixFile(fresh, size=4 * KiB).close()
    assert os.stat(fresh).st_size == 4 * KiB
    PosixFile(fresh).close()  # no size: as it is
    assert os.stat(fresh).st_size == 4 * KiB


async def test_pages_past_size_stay_readable(make_agent: Any, tmp_path: Path) -> None:
    """A stager's file opened with a size smaller than what is stored: the
    page past it is still read back."""
    path = tmp_path / "kv.bin"
    page = bytes([7]) * (4 * KiB)
    path.write_bytes(bytes(4 * KiB) + page)
    agent = await make_agent("a")
    dst = agent.register(bytearray(4 * KiB))
    pf = PosixFile(path, size=4 * KiB)
    try:
        await within(pf.read_into(dst[:], 4 * KiB))
    finally:
        pf.close()
    assert bytes(dst.memoryview) == page
