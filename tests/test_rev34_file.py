"""rev34: the file transport's registration (aioxfer.file_transport), with
real files."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aioxfer


@pytest.mark.parametrize("size", [True, False, 1.0, "4096"])
async def test_register_file_refuses_sizes_that_are_not_integers(
    make_agent: Callable[..., Awaitable[Any]], tmp_path: Path, size: Any
) -> None:
    """size=True made a 1-byte file and a region whose nbytes was True."""
    agent = await make_agent("sizes")
    with pytest.raises(aioxfer.RegistrationError, match="size must be a positive int"):
        agent.register_file(tmp_path / "b.bin", size=size)
    assert not os.path.exists(tmp_path / "b.bin")
    assert not any(r.kind == "file" for r in agent.regions)


async def test_register_file_takes_numpy_integer_sizes(
    make_agent: Callable[..., Awaitable[Any]], tmp_path: Path
) -> None:
    """As alloc does (any operator.index): np.int64(4096) was refused."""
    agent = await make_agent("np-size")
    f = agent.register_file(tmp_path / "n.bin", size=np.int64(4096))
    assert f.nbytes == 4096 and type(f.nbytes) is int
    assert os.path.getsize(tmp_path / "n.bin") == 4096
