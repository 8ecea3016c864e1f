"""rev34: Agent.register's refusals are RegistrationErrors, also when the
object's own GPU-memory protocol raises (no GPU needed: these fail before
any driver is asked)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import aioxfer
from aioxfer import cuda


class GradTensor:
    """As a torch CUDA tensor that requires grad: its interface refuses."""

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        raise RuntimeError(
            "Can't get __cuda_array_interface__ on Variable that requires grad. "
            "Use var.detach().__cuda_array_interface__ instead."
        )


class GradCpuTensor:
    """As a torch CPU tensor that requires grad (no buffer protocol)."""

    def __dlpack_device__(self) -> tuple[int, int]:
        return (cuda.KDL_CPU, 0)

    def __dlpack__(self, stream: Any = None) -> Any:
        raise RuntimeError("Can't export tensors that require gradient, use tensor.detach()")


class NoTypestr:
    __cuda_array_interface__ = {"shape": (4,), "data": (0x1000, False), "version": 3}


class BadShape:
    __cuda_array_interface__ = {"shape": None, "typestr": "|u1", "data": (0x1000, False),
                                "version": 3}


@pytest.mark.parametrize("obj", [GradTensor(), GradCpuTensor(), NoTypestr(), BadShape()],
                         ids=["cai-raises", "dlpack-raises", "cai-no-typestr", "cai-bad-shape"])
async def test_register_refusals_of_the_objects_protocol_are_registration_errors(
    make_agent: Callable[..., Awaitable[Any]], obj: Any
) -> None:
    agent = await make_agent("refusals")
    with pytest.raises(aioxfer.RegistrationError, match=f"cannot register {type(obj).__name__}"):
        agent.register(obj)
    assert agent.regions == []


def _object_buffers() -> list[Any]:
    import ctypes

    import numpy as np

    return [
        np.empty(16, dtype=object),
        np.empty((4, 4), dtype=object)[::1],
        np.zeros(4, dtype=[("n", "<i8"), ("obj", "O")]),
        (ctypes.py_object * 4)(),
        memoryview(np.empty(8, dtype=object)),
    ]


@pytest.mark.parametrize("obj", _object_buffers(),
                         ids=["object", "object-2d", "object-field", "py_object", "view"])
async def test_buffers_of_python_object_references_are_refused(
    make_agent: Callable[..., Awaitable[Any]], obj: Any
) -> None:
    """An object array registered as writable host memory: a peer (or a file
    read) writing it plants PyObject pointers the process then follows (a
    crash, or worse); reading it leaks heap addresses."""
    agent = await make_agent("objects")
    with pytest.raises(aioxfer.RegistrationError, match="Python object references"):
        agent.register(obj)
    assert agent.regions == []


async def test_plain_records_named_like_the_object_code_still_register(
    make_agent: Callable[..., Awaitable[Any]]
) -> None:
    import numpy as np

    agent = await make_agent("records")
    rec = np.zeros(4, dtype=[("O", "<i4"), ("Ox", "<f8")])  # format T{<i:O:<d:Ox:}
    assert agent.register(rec).nbytes == rec.nbytes
    assert agent.register(bytearray(b"OOOO")).nbytes == 4
